"""Remat policies of the reference decoder (`GPTConfig.remat_policy`, `--remat`): each gives the
gradients of no rematerialisation, and keeps what it names: the compiled step's temporaries fall
from none (everything kept) through save_dots and save_dots_except_mlp_in to full (nothing kept).
The reference is plain ``jax.jit(jax.value_and_grad)`` of the module without remat."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from shardlib.models import get_config
from shardlib.models.gpt import GPT, next_token_loss

CONFIG = dataclasses.replace(get_config("tiny"), n_layers=4)
POLICIES = ("none", "save_dots", "save_dots_except_mlp_in", "full")  # most kept first


def _compiled(policy: str):
    config = dataclasses.replace(CONFIG, remat=policy != "none", remat_policy="full" if policy == "none" else policy)
    with nnx.use_eager_sharding(False):
        graphdef, params = nnx.split(GPT(config, rngs=nnx.Rngs(0)))
    tokens = np.random.RandomState(0).randint(0, CONFIG.vocab_size, (8, CONFIG.max_seq_len)).astype(np.int32)
    batch = {"inputs": tokens, "targets": np.roll(tokens, -1, axis=1)}
    grad = jax.jit(jax.value_and_grad(lambda p, b: next_token_loss(nnx.merge(graphdef, p), b)[0]))
    compiled = grad.lower(params, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes, compiled(params, batch)


@pytest.mark.xla_defaults
def test_each_policy_gives_the_same_gradients_and_keeps_less_than_the_one_before():
    results = {policy: _compiled(policy) for policy in POLICIES}
    (_, (loss, grads)) = results["none"]
    for policy in POLICIES[1:]:
        other_loss, other = results[policy][1]
        np.testing.assert_allclose(float(other_loss), float(loss), rtol=1e-6)
        for a, b in zip(jax.tree.leaves(other), jax.tree.leaves(grads)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    temps = [results[policy][0] for policy in POLICIES]
    assert temps == sorted(temps, reverse=True) and len(set(temps)) == len(temps), dict(zip(POLICIES, temps))


def test_an_unknown_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="remat_policy='save_all'.*full"):
        dataclasses.replace(CONFIG, remat_policy="save_all")
