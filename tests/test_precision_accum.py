"""Mixed precision, fp16 loss scaling and gradient accumulation, each against a reference."""

import collections
import dataclasses
import functools
import re

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


@functools.lru_cache(maxsize=None)
def _compiled(strategy, grad_accum):
    """The tiny GPT's step for 32 rows of 32 tokens and its program, compiled once for both tests
    below (the accumulation runs it, the collective and memory test reads it). Default bucketing, as
    users run: the bucketed all-gather of the new parameters adds up to one bucket of transient
    memory to zero2's peak at the step's end, which only narrows the zero1 - zero2 difference that
    test bounds from below (measured 616 KB with buckets, 625 KB without, against 322 KB asserted);
    bucketing keeps the collective bytes (tests/test_bucketing.py)."""
    model = tiny_model()
    program = build(model, optimizer(), make_layout(model, strategy, make_mesh(MESH[strategy])), grad_accum=grad_accum)
    shapes = {k: ((32, 32), jnp.int32) for k in ("inputs", "targets")}
    return program.compile_step(program.abstract_state(), program.abstract_batch(shapes)), program


def _train(strategy, *, grad_accum=1, steps=2):
    """Losses and final state of ``steps`` steps from the init of the grad_accum=1 program: the
    microbatches change the step, not the state, so one init program (compiled once, run once a
    run: the step donates its state) starts both runs of a strategy."""
    step, _ = _compiled(strategy, grad_accum)
    state = _compiled(strategy, 1)[1].init(jax.random.key(0))
    losses = []
    for rows in batches(steps, batch=32):
        state, metrics = step(state, rows)
        losses.append(float(metrics["loss"]))
    return np.array(losses), state


@pytest.mark.parametrize("strategy", ["dp", "zero2", "zero3"])
def test_accumulated_microbatches_equal_one_large_batch(strategy):
    whole, state_whole = _train(strategy)
    accumulated, state_accum = _train(strategy, grad_accum=4)
    np.testing.assert_allclose(accumulated, whole, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(state_accum.params), jax.tree.leaves(state_whole.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_dp_and_zero1_reduce_once_per_step_zero2_keeps_a_sharded_buffer():
    psi_bytes = sum(x.size for x in jax.tree.leaves(tiny_model().abstract())) * 4
    for strategy in ("dp", "zero1"):  # accumulating 4 microbatches moves the same bytes as 1
        once, accumulated = (collective_stats(_compiled(strategy, k)[0]).total_bytes for k in (1, 4))
        assert accumulated == pytest.approx(once, rel=1e-3), strategy
    zero2 = collective_stats(_compiled("zero2", 4)[0]).bytes_by_kind()
    assert zero2["reduce-scatter"] == pytest.approx(4 * psi_bytes * 7 / 8, rel=0.01)  # one per microbatch
    # Working memory: zero1 accumulates the full gradient on every device, zero2 only 1/N of it.
    temp1 = memory_stats(_compiled("zero1", 4)[0]).temp_bytes
    temp2 = memory_stats(_compiled("zero2", 4)[0]).temp_bytes
    assert temp1 - temp2 >= 0.8 * psi_bytes * (1 - 1 / 8)


# ---------------------------------------------------------------- bf16 on a float32 model

# XLA:CPU's AllReducePromotion pass (it widens bf16 all-reduces and reduce-scatters to f32) aborts
# the process on the bf16 reduce-scatters that cast-before-gather produces; without the pass
# XLA:CPU compiles and runs them in bf16 (docs/design.md, "bf16 reduce-scatters on XLA:CPU").
CPU_BF16_REDUCTIONS = {"xla_disable_hlo_passes": "all-reduce-promotion"}
CAST_BEFORE_GATHER = Precision("bf16", compute_dtype=jnp.bfloat16, cast_before_gather=True)
BF16_STEPS = 50
# bf16 keeps 8 significant bits: one rounding moves a value by up to 2**-9 (0.2%) of itself. The
# loss averages 16 x 32 token losses, each a function of many independently rounded weights and
# activations, so over these 50 steps it stays well inside one bf16 rounding of the float32 run
# (measured: at most 5.2e-4), while a step that computed in float32 would give the float32 losses
# to the last bit (same program, same reduction order).
BF16_RTOL = 2.0**-9


@functools.lru_cache(maxsize=None)
def _zero3(precision, compute_dtype="float32"):
    """The zero3 program of the tiny GPT configured with ``compute_dtype``, built once per file."""
    model = trainable(dataclasses.replace(TINY, compute_dtype=compute_dtype))
    return build(model, optimizer(), make_layout(model, "zero3", make_mesh(MESH["zero3"])), precision=precision)


def _lowered(program):
    shapes = {k: ((16, 32), jnp.int32) for k in ("inputs", "targets")}
    return program.step.lower(program.abstract_state(), program.abstract_batch(shapes))


@functools.lru_cache(maxsize=None)
def _zero3_lowered(precision):
    """`_zero3(precision)`'s step lowered for 16 rows, once per file: read by the dtype tests and
    compiled by `_zero3_losses` (abstract arguments with the concrete state's shardings)."""
    return _lowered(_zero3(precision))


def _dot_operand_dtypes(lowered) -> collections.Counter:
    """(lhs, rhs) element types of every dot_general in the lowered (pre-optimisation) module."""
    dots = re.findall(r"stablehlo\.dot_general .*: \(tensor<[^>]*x(\w+)>, tensor<[^>]*x(\w+)>\)", lowered.as_text())
    return collections.Counter(dots)


@functools.lru_cache(maxsize=None)
def _zero3_losses(precision, compiler_options: tuple = ()):
    """Per-step losses and the final state of BF16_STEPS zero3 steps of the float32-configured
    tiny GPT, the step compiled with ``compiler_options``."""
    state = _zero3("f32").init(jax.random.key(0))  # the precision changes the step, not the float32 state
    rows = batches(BF16_STEPS, batch=16)
    step = _zero3_lowered(precision).compile(compiler_options=dict(compiler_options))
    losses = []
    for batch in rows:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses), state


def test_bf16_policy_computes_a_float32_model_in_bf16():
    """``precision="bf16"`` alone (the model's config says float32) runs the matmuls in bf16:
    the same dot_generals, operand for operand, as a model configured for bf16; float32 none."""
    assert TINY.compute_dtype == "float32"
    policy_only = _dot_operand_dtypes(_zero3_lowered("bf16"))
    configured = _dot_operand_dtypes(_lowered(_zero3("bf16", "bfloat16")))
    assert policy_only == configured
    assert policy_only[("bf16", "bf16")] >= len(policy_only) // 2, policy_only  # weights x activations, both passes
    assert not any("bf16" in pair for pair in _dot_operand_dtypes(_zero3_lowered("f32")))


def test_bf16_tracks_float32_and_keeps_float32_master_state():
    f32, _ = _zero3_losses("f32")
    bf16, state = _zero3_losses("bf16")
    np.testing.assert_allclose(bf16, f32, rtol=BF16_RTOL)
    assert np.abs(bf16 / f32 - 1).max() > 1e-5  # it really computed in bf16 (float32 would match exactly)
    for leaf in jax.tree.leaves((state.params, state.opt_state)):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            assert leaf.dtype == jnp.float32


def test_cast_before_gather_gathers_bf16_and_trains_on_cpu():
    """The GPU/TPU path, forced on CPU: zero3 gathers the bf16 shards (half the bytes) and
    reduce-scatters f32 gradients (reduce_dtype), bf16 ones when asked; on CPU the default keeps
    the gathers float32."""
    assert not Precision("bf16").casts_before_gather("cpu") and Precision("bf16").casts_before_gather("gpu")
    kinds = lambda policy, kind: {r.dtype for r in collective_stats(_zero3_lowered(policy)).of_kind(kind)}
    assert kinds(CAST_BEFORE_GATHER, "all-gather") == {"bf16"} and kinds("bf16", "all-gather") == {"f32"}
    assert kinds(CAST_BEFORE_GATHER, "reduce-scatter") == {"f32"}
    assert kinds(dataclasses.replace(CAST_BEFORE_GATHER, reduce_dtype="bf16"), "reduce-scatter") == {"bf16"}

    f32, _ = _zero3_losses("f32")
    cast_first, state = _zero3_losses(CAST_BEFORE_GATHER, tuple(CPU_BF16_REDUCTIONS.items()))
    np.testing.assert_allclose(cast_first, f32, rtol=BF16_RTOL)
    # Casting commutes with gathering, so the first forward pass is the cast-after-gather one exactly.
    assert cast_first[0] == _zero3_losses("bf16")[0][0]
    assert {leaf.dtype for leaf in jax.tree.leaves((state.params, state.opt_state)) if leaf.ndim} == {np.dtype("float32")}


def test_plan_compiles_the_step_in_the_plans_precision(monkeypatch):
    """``shardlib plan --precision bf16`` builds its candidates with ``precision="bf16"``, as
    ``shardlib train`` does, and their compiled steps compute in bf16 (f32 plans: no bf16 dot)."""
    from shardlib.step import program as program_lib
    from shardlib.tools.plan import plan

    built, real_build = [], program_lib.build

    def recording_build(*args, **kwargs):
        program = real_build(*args, **kwargs)
        built.append((kwargs.get("precision"), program))
        return program

    monkeypatch.setattr(program_lib, "build", recording_build)
    for precision in ("f32", "bf16"):
        assert plan("tiny", 8, ["zero3"], batch_size=16, seq_len=32, precision=precision)[0].error is None
    assert [precision for precision, _ in built] == ["f32", "bf16"]
    f32_dots, bf16_dots = (_dot_operand_dtypes(_lowered(program)) for _, program in built)
    assert not any("bf16" in pair for pair in f32_dots) and bf16_dots[("bf16", "bf16")] > 0


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
