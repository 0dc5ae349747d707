"""Mixed precision, fp16 loss scaling and gradient accumulation, each against a reference."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from shardlib.models import trainable
from shardlib import build, from_functions, make_layout, make_mesh
from shardlib.step.precision import Precision
from shardlib.tools.report import collective_stats, memory_stats
from tests.helpers import TINY, batches, optimizer, tiny_model

MESH = {"dp": {"data": 8}, "zero1": {"data": 8}, "zero2": {"data": 8}, "zero3": {"fsdp": 8}}


def _train(strategy, *, grad_accum=1, precision="f32", steps=3, batch=32, model=None):
    model = model or tiny_model()
    program = build(model, optimizer(), make_layout(model, strategy, make_mesh(MESH[strategy])),
                    grad_accum=grad_accum, precision=precision)
    state = program.init(jax.random.key(0))
    losses = []
    for rows in batches(steps, batch=batch):
        state, metrics = program.step(state, rows)
        losses.append(float(metrics["loss"]))
    return np.array(losses), state, program


@pytest.mark.parametrize("strategy", ["dp", "zero2", "zero3"])
def test_accumulated_microbatches_equal_one_large_batch(strategy):
    whole, state_whole, _ = _train(strategy, steps=2)
    accumulated, state_accum, _ = _train(strategy, grad_accum=4, steps=2)
    np.testing.assert_allclose(accumulated, whole, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(state_accum.params), jax.tree.leaves(state_whole.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@functools.lru_cache(maxsize=None)
def _compiled(strategy, grad_accum):
    model = tiny_model()
    program = build(model, optimizer(), make_layout(model, strategy, make_mesh(MESH[strategy])), grad_accum=grad_accum)
    shapes = {k: ((32, 32), jnp.int32) for k in ("inputs", "targets")}
    return program.compile_step(program.abstract_state(), program.abstract_batch(shapes))


def test_dp_and_zero1_reduce_once_per_step_zero2_keeps_a_sharded_buffer():
    psi_bytes = sum(x.size for x in jax.tree.leaves(tiny_model().abstract())) * 4
    for strategy in ("dp", "zero1"):  # accumulating 4 microbatches moves the same bytes as 1
        once, accumulated = (collective_stats(_compiled(strategy, k)).total_bytes for k in (1, 4))
        assert accumulated == pytest.approx(once, rel=1e-3), strategy
    zero2 = collective_stats(_compiled("zero2", 4)).bytes_by_kind()
    assert zero2["reduce-scatter"] == pytest.approx(4 * psi_bytes * 7 / 8, rel=0.01)  # one per microbatch
    # Working memory: zero1 accumulates the full gradient on every device, zero2 only 1/N of it.
    temp1 = memory_stats(_compiled("zero1", 4)).temp_bytes
    temp2 = memory_stats(_compiled("zero2", 4)).temp_bytes
    assert temp1 - temp2 >= 0.8 * psi_bytes * (1 - 1 / 8)


def test_bf16_tracks_float32_and_keeps_float32_master_state():
    f32, _, _ = _train("zero3", steps=50, batch=16)
    bf16_model = trainable(dataclasses.replace(TINY, compute_dtype="bfloat16"))
    bf16, state, _ = _train("zero3", steps=50, batch=16, precision="bf16", model=bf16_model)
    assert np.all(np.isfinite(bf16)) and bf16.max() <= bf16[0] + 0.05  # never diverges
    assert bf16[-1] == pytest.approx(f32[-1], rel=0.02)
    for leaf in jax.tree.leaves((state.params, state.opt_state)):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            assert leaf.dtype == jnp.float32


def test_fp16_overflow_skips_the_update_halves_the_scale_and_grows_back():
    model = from_functions(
        lambda key: {"w": jax.random.normal(key, (8, 8)) * 0.1},
        lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2) * b["boost"][0, 0],
        logical_axes={"w": ("embed", "mlp")},
    )
    policy = Precision("fp16", compute_dtype=jnp.float16, dynamic_loss_scale=True, initial_scale=1024.0, growth_interval=3)
    program = build(model, optax.adam(1e-2), make_layout(model, "zero3", make_mesh({"fsdp": 8})), precision=policy)
    state = program.init(jax.random.key(0))
    x = np.random.default_rng(0).normal(size=(8, 8)).astype(np.float32)
    batch = lambda boost: {"x": x, "y": np.sin(x), "boost": np.full((8, 1), boost, np.float32)}

    state, metrics = program.step(state, batch(1.0))
    assert int(metrics["skipped"]) == 0 and float(state.loss_scale["scale"]) == 1024.0
    before = jax.tree.map(np.asarray, (state.params, state.opt_state))
    state, metrics = program.step(state, batch(60000.0))  # loss * scale overflows float16
    assert int(metrics["skipped"]) == 1
    assert float(state.loss_scale["scale"]) == 512.0
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves((state.params, state.opt_state))):
        np.testing.assert_array_equal(a, np.asarray(b))
    scales = []
    for _ in range(4):
        state, metrics = program.step(state, batch(1.0))
        assert int(metrics["skipped"]) == 0
        scales.append(float(state.loss_scale["scale"]))
    assert scales == [512.0, 512.0, 1024.0, 1024.0]
    assert state.params["w"].dtype == jnp.float32
