"""The dtype gradients are reduced in (`Precision.reduce_dtype`), apart from the compute dtype.

Under ``precision="bf16"`` the gradients are reduced over the batch axes in float32 by default,
as PyTorch FSDP's ``reduce_dtype=float32``: ZeRO-3's gather casts its cotangent to float32
before the reduce-scatter in its backward (`shardlib.model.hooks.gather_dim`), zero1's Reducer
reduce-scatters the float32 gradient. ``reduce_dtype=bf16`` is the explicit option that halves
those bytes: both reduce-scatters run in bf16. Here on XLA:CPU the pre-optimisation program says
which dtype each reduction was written in (XLA:CPU widens bf16 collectives to float32 when it
compiles them, and the step compiles without its AllReducePromotion pass, which aborts on them:
`shardlib.backend.BackendPolicy.narrow_reduce_options`); both train like a plain ``jax.jit`` +
optax step of the same bf16 model.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from shardlib import build, make_layout, make_mesh
from shardlib.models import GPT, next_token_loss, trainable
from shardlib.step.precision import Precision, get_precision
from tests import zoo
from tests.helpers import TINY, batches, optimizer

BF16 = dataclasses.replace(TINY, compute_dtype="bfloat16")
MESH = {"zero3": {"fsdp": 8}, "zero1": {"data": 8}}
STEPS = 6
# Both sides compute in bf16 with their own reduction orders: the losses stay within one bf16
# rounding (2**-9) of each other (measured: at most 6.5e-4 over these steps, either reduce dtype),
# where a wrong gradient (a missing or doubled reduction) moves them by far more.
RTOL = 2.0**-9


def _precision(reduce_dtype: str) -> Precision:
    return dataclasses.replace(get_precision("bf16"), reduce_dtype=reduce_dtype)


@functools.lru_cache(maxsize=None)
def _program(strategy: str, reduce_dtype: str):
    model = trainable(BF16)
    return build(model, optimizer(), make_layout(model, strategy, make_mesh(MESH[strategy])),
                 precision=_precision(reduce_dtype))


@functools.lru_cache(maxsize=None)
def reference() -> np.ndarray:
    """Per-step losses of the same model (bf16 compute, float32 parameters) on one device with no
    shardlib code in the step: ``jax.jit(jax.value_and_grad)`` and optax AdamW."""
    params, _, loss = zoo.nnx_functional(lambda rngs: GPT(BF16, rngs=rngs), lambda m, b: next_token_loss(m, b)[0],
                                         seed=jax.random.key(0))

    @jax.jit
    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(lambda p: loss(p, None, batch)[0])(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    tx = optimizer()
    opt_state, losses = tx.init(params), []
    for batch in batches(STEPS):
        params, opt_state, value = step(params, opt_state, batch)
        losses.append(float(value))
    return np.array(losses)


def _reduce_scatter_dtypes(program) -> set[str]:
    """The element types of the reduce-scatters in the step's pre-optimisation HLO."""
    batch = program.abstract_batch({k: ((16, 32), jnp.int32) for k in ("inputs", "targets")})
    hlo = program.step.lower(program.abstract_state(), batch).compiler_ir("hlo").as_hlo_text()
    return set(re.findall(r"= (\w+)\[[^\]]*\]\S* reduce-scatter\(", hlo))


@pytest.mark.parametrize("strategy", ["zero3", "zero1"])
@pytest.mark.parametrize("reduce_dtype", ["f32", "bf16"])
def test_bf16_step_reduces_in_its_reduce_dtype_and_trains(strategy, reduce_dtype):
    program = _program(strategy, reduce_dtype)
    assert _reduce_scatter_dtypes(program) == {reduce_dtype}
    state = _program(strategy, "f32").init(jax.random.key(0))  # the reduce dtype changes the step, not the state
    losses = []
    for batch in batches(STEPS):
        state, metrics = program.step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, reference(), rtol=RTOL)
    assert losses[-1] < losses[0]
    assert {leaf.dtype for leaf in jax.tree.leaves(state.params)} == {np.dtype("float32")}


def test_reduce_dtype_names_and_dtypes():
    assert Precision("bf16", compute_dtype=jnp.bfloat16).reduce_dtype == np.dtype("float32")
    assert _precision("bf16") == dataclasses.replace(get_precision("bf16"), reduce_dtype=jnp.bfloat16)
    assert _precision("bf16").reduce_dtype == jnp.dtype(jnp.bfloat16)
    with pytest.raises(ValueError, match="reduce_dtype='int8' is not a floating dtype"):
        _precision("int8")


def test_bf16_reduce_contradicts_compressed_reductions():
    """grad_compression's methods sum in float32: beside them a bf16 reduce dtype is refused."""
    model = trainable(BF16)
    layout = make_layout(model, "zero1", make_mesh(MESH["zero1"]))
    with pytest.raises(ValueError, match="grad_compression='bf16' .*reduce_dtype=bfloat16.*pick one"):
        build(model, optimizer(), layout, precision=_precision("bf16"), grad_compression="bf16")
    build(model, optimizer(), layout, precision="bf16", grad_compression="bf16")  # float32 sums: consistent
