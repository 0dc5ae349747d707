"""Each pattern of `shardlib.step.shape_errors` against the error the installed JAX really raises."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from shardlib.step.shape_errors import SHAPE_MISMATCHES, is_shape_mismatch

# What a model computing with a parameter shard runs into: a (2, 8) activation and a weight of
# the wrong size, one producer a table entry (traced, as inside the step).
PRODUCERS = {
    "a matmul / dot_general": lambda: jnp.ones((2, 8)) @ jnp.ones((1, 8)),
    "an elementwise lax op": lambda: jnp.ones((2, 8)) + jnp.ones((2, 3)),
    "numpy-style broadcasting": lambda: jnp.where(jnp.ones((2, 8)) > 0, jnp.ones((2, 3)), 0.0),
    "a reshape": lambda: jnp.ones((8,)).reshape(4, 4),
    "a concatenate": lambda: jnp.concatenate([jnp.ones((2, 8)), jnp.ones((2, 3))], axis=0),
    "an einsum": lambda: jnp.einsum("bd,dh->bh", jnp.ones((2, 8)), jnp.ones((2, 8))),
    "a convolution": lambda: jax.lax.conv(jnp.ones((1, 3, 8, 8)), jnp.ones((4, 2, 3, 3)), (1, 1), "SAME"),
}


def test_every_entry_has_a_producer():
    assert [name for name, _, _ in SHAPE_MISMATCHES] == list(PRODUCERS)


@pytest.mark.parametrize("name, kind, pattern", SHAPE_MISMATCHES, ids=[row[0] for row in SHAPE_MISMATCHES])
def test_each_pattern_matches_the_real_error_and_no_other_entry(name, kind, pattern):
    with pytest.raises(Exception) as raised:
        jax.jit(PRODUCERS[name])()
    err = raised.value
    assert type(err) is kind, f"{name}: JAX raised {type(err).__name__}: {err}"
    assert is_shape_mismatch(err), f"{name}: no entry matches JAX's message: {err}"
    matching = [row[0] for row in SHAPE_MISMATCHES if isinstance(err, row[1]) and re.search(row[2], str(err))]
    assert matching == [name]


@pytest.mark.parametrize("err", [KeyError("image"), AssertionError("x.shape must be (8, 8)"),
                                 ValueError("the batch's shape (4,) is not what the loss reads")])
def test_a_models_own_error_is_not_a_shape_mismatch(err):
    # The model's own checks, however worded, propagate as they are (the step adds a note only).
    assert not is_shape_mismatch(err)
