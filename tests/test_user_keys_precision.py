"""Keys of a user's loss under gradient accumulation and evaluation: a Flax-docs-style MLP with
``nn.Dropout`` trained through ``from_functions(..., takes_call=True)``.

The one-device reference (plain ``jax.jit`` + optax) computes each microbatch of each device with
the key docs/dropout-and-batchnorm.md "Keys" documents: ``fold_in(fold_in(fold_in(seed, step), i), d)`` for
microbatch ``i`` of device ``d``, and averages them."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

from shardlib import build, from_functions, make_layout, make_mesh
from tests import zoo

DEVICES, MICRO, FEATURES, CLASSES = 8, 2, 8, 4


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dropout(0.5, deterministic=not train)(nn.relu(nn.Dense(16)(x)))
        return nn.Dense(CLASSES)(x)


def _init(key):
    return MLP().init(key, jnp.zeros((2, FEATURES)), False)["params"]


def dropout_loss(params, batch, call):
    """The documented form: draw only in training."""
    logits = MLP().apply({"params": params}, batch["x"], train=call.train,
                         rngs={"dropout": call.key} if call.train else None)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def _always_draws(params, batch, call):
    """A loss written for training only: it hands call.key to apply in evaluation too."""
    logits = MLP().apply({"params": params}, batch["x"], train=True, rngs={"dropout": call.key})
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def _batches(n=2, rows=32):
    rng = np.random.default_rng(0)
    return [{"x": rng.normal(size=(rows, FEATURES)).astype(np.float32),
             "y": rng.integers(0, CLASSES, rows).astype(np.int32)} for _ in range(n)]


def _microbatch_reference(params, batch):
    """Device d holds rows [d*R, (d+1)*R); its microbatch i is the i-th slice of those."""
    rows = jax.tree.map(lambda x: x.reshape(DEVICES, MICRO, -1, *x.shape[1:]), batch["rows"])

    def microbatch(d, i, r):
        key = jax.random.fold_in(jax.random.fold_in(batch["key"], i), d)
        return dropout_loss(params, r, types.SimpleNamespace(key=key, train=True))

    per_device = lambda d, r: jax.vmap(lambda i, rr: microbatch(d, i, rr))(jnp.arange(MICRO), r).mean()
    return jax.vmap(per_device)(jnp.arange(DEVICES), rows).mean()


def test_accumulated_microbatches_draw_their_documented_keys_and_evaluate_draws_none():
    tx, batches = optax.sgd(0.1), _batches()
    model = from_functions(_init, dropout_loss, takes_call=True)
    program = build(model, tx, make_layout(model, "dp", make_mesh({"data": DEVICES})), grad_accum=MICRO)
    state = program.init(jax.random.key(0))
    seed, start = jax.random.wrap_key_data(np.asarray(state.rng)), jax.tree.map(np.asarray, state.params)
    state, losses = zoo.program_steps(program, state, batches)
    keyed = [{"rows": b, "key": jax.random.fold_in(seed, s)} for s, b in enumerate(batches)]
    expected, expected_losses = zoo.plain_steps(_microbatch_reference, start, tx, keyed)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=1e-6), state.params, expected)

    # Evaluation is the module's eval mode on one device: no key, no dropout, the same twice.
    params = jax.tree.map(np.asarray, state.params)
    eval_mode = dropout_loss(params, batches[0], types.SimpleNamespace(key=None, train=False))
    evaluated = [float(program.evaluate(state.params, batches[0])["loss"]) for _ in range(2)]
    assert evaluated[0] == evaluated[1]
    np.testing.assert_allclose(evaluated[0], eval_mode, rtol=1e-5)

    drawing = from_functions(_init, _always_draws, takes_call=True)
    drawing_program = build(drawing, tx, make_layout(drawing, "dp", make_mesh({"data": DEVICES})))
    with pytest.raises(ValueError) as raised:
        drawing_program.evaluate(state.params, batches[0])
    assert "call.key is None" in str(raised.value.__notes__) and "if call.train else None" in str(raised.value.__notes__)
