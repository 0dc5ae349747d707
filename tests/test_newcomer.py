"""What a newcomer porting a Flax script needs that the earlier tests do not pin: a loss whose
terms are weighted by a schedule of the step, read from the loss's ``step`` argument (linen and
NNX) or ``call.step`` (``from_functions``), against the script's own one-device loop reading
``TrainState.step`` / ``nnx.Optimizer.step``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from flax.training import train_state

import shardlib

STEPS = 3


def _batches():
    rng = np.random.default_rng(0)
    return [{"x": rng.normal(size=(16, 8)).astype(np.float32), "y": rng.normal(size=(16, 2)).astype(np.float32)}
            for _ in range(STEPS)]


def _weighted(pred, batch, step):
    """Two losses, the second ramped in over two steps (weight 0 at step 0: the step must be exact)."""
    first = jnp.mean((pred[:, 0] - batch["y"][:, 0]) ** 2)
    second = jnp.mean((pred[:, 1] - batch["y"][:, 1]) ** 2)
    return first + jnp.minimum(step / 2.0, 1.0) * second


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(nn.relu(nn.Dense(16)(x)))


def _linen_reference(module, params, tx, batches):
    state = train_state.TrainState.create(apply_fn=module.apply, params=params, tx=tx)
    step = jax.jit(lambda s, b: s.apply_gradients(grads=jax.grad(
        lambda p: _weighted(s.apply_fn({"params": p}, b["x"]), b, s.step))(s.params)))
    losses = []
    for batch in batches:
        losses.append(float(_weighted(module.apply({"params": state.params}, batch["x"]), batch, state.step)))
        state = step(state, batch)
    return losses


@pytest.mark.parametrize("adapter", ["linen", "functions"])
def test_linen_and_functions_losses_read_the_step(adapter):
    batches, tx, module = _batches(), optax.adam(1e-2), _Net()
    params = module.init(jax.random.key(0), batches[0]["x"])["params"]
    if adapter == "linen":
        model = shardlib.from_linen(module, lambda out, batch, step: _weighted(out, batch, step), batches[0],
                                    inputs=lambda b, train: ((b["x"],), {}), rng_streams=())
    else:
        model = shardlib.from_functions(
            lambda key: params, lambda p, batch, call: _weighted(module.apply({"params": p}, batch["x"]), batch, call.step),
            takes_call=True)
    program = shardlib.build(model, tx, shardlib.make_layout(model, "zero2", shardlib.make_mesh({"data": 8})))
    state, losses = program.init_from(params), []
    for batch in batches:
        state, metrics = program.step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, _linen_reference(module, params, tx, batches), rtol=1e-5)
    # the step by hand in the batch is the donated state's own array: XLA:CPU would end the process
    with pytest.raises(ValueError, match=r"batch 'step' is the state's own 'step', which program.step donates"):
        program.step(state, {**batches[0], "step": state.step})


class _NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.up, self.down = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.relu(self.up(x)))


def test_nnx_loss_reads_the_step_under_grad_accum():
    batches, tx = _batches(), optax.adam(1e-2)

    def loss_fn(model, batch, step):
        return _weighted(model(batch["x"]), batch, step)

    reference, losses = _NnxNet(nnx.Rngs(0)), []
    optimizer = nnx.Optimizer(reference, tx, wrt=nnx.Param)
    for batch in batches:
        loss, grads = nnx.value_and_grad(loss_fn)(reference, batch, optimizer.step[...])
        optimizer.update(reference, grads)
        losses.append(float(loss))

    model = shardlib.from_nnx(_NnxNet(nnx.Rngs(0)), loss_fn)
    mesh = shardlib.make_mesh({"fsdp": 4}, devices=jax.devices()[:4])
    program = shardlib.build(model, tx, shardlib.make_layout(model, "zero3", mesh), grad_accum=2)
    state, got = program.init(jax.random.key(0)), []
    for batch in batches:
        state, metrics = program.step(state, batch)
        got.append(float(metrics["loss"]))
    np.testing.assert_allclose(got, losses, rtol=1e-5)
