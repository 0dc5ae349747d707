"""Pipeline parallelism over the ``pipe`` axis (`shardlib.step.pipeline`) against one device.

The model is the tiny GPT with 4 layers (so that 4 stages have one layer each). Parity uses the
same tolerances as tests/test_parity.py: the pipelined step sums the microbatches' gradients in
a different order than one device, which changes float32 results in the last bits only.

Batches have 32 rows, so a microbatch has at least 2 rows on 4 data-parallel devices. With
1-row microbatches one element of ``wo`` ends 1.3e-6 away from the one-device run after 5 AdamW
steps, *without* any pipeline too (dp over 4 devices with grad_accum=4 gives the same -1.27e-6):
Adam's m / (sqrt(v) + eps) amplifies the summation order of a near-zero gradient (see
tests/helpers.optimizer).
"""

from __future__ import annotations

import dataclasses
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardlib.models import trainable
from shardlib import build, make_layout, make_mesh
from shardlib.step import pipeline
from shardlib.tools import report
from shardlib.runtime.checkpoint import Checkpointer
from shardlib.sharding.rules import RuleError
from tests.helpers import TINY, batches, optimizer, train

FOUR_LAYERS = dataclasses.replace(TINY, n_layers=4)
MICROBATCHES = 4
ROWS = 32


@pytest.fixture(scope="module")
def model():
    return trainable(FOUR_LAYERS)


PROGRAMS: dict = {}  # one program (so one compile of its init and step) per configuration, across tests


def _program(model, strategy, sizes, microbatches=MICROBATCHES, schedule="1f1b"):
    """Built once per configuration: tests that train, restore into or compile the same one share
    its compiled init and step."""
    key = (id(model), strategy, tuple(sizes.items()), microbatches, schedule)
    if key not in PROGRAMS:
        n = int(np.prod(list(sizes.values())))
        layout = make_layout(model, strategy, make_mesh(sizes, devices=jax.devices()[:n]))
        pipelined = layout.pipeline_stages > 1
        PROGRAMS[key] = model, build(model, optimizer(), layout, microbatches=microbatches if pipelined else None,
                                     schedule=schedule)
    return PROGRAMS[key][1]


def _train(program, steps=5):
    return train(program, steps, ROWS)


@pytest.fixture(scope="module")
def single_device(model):
    losses, params, _ = _train(_program(model, "dp", {"data": 1}))
    return losses, params


# Each mesh once, and each schedule with 2 and 4 stages, with and without fsdp and data (the
# schedules' tick tables themselves are checked for every S, M below).
CASES = [
    ("dp", {"pipe": 2}, "gpipe"), ("dp", {"pipe": 4}, "1f1b"),
    ("zero3", {"pipe": 2, "fsdp": 4}, "1f1b"), ("zero3", {"pipe": 4, "fsdp": 2}, "gpipe"),
    ("dp", {"data": 4, "pipe": 2}, "1f1b"), ("dp", {"data": 2, "pipe": 4}, "gpipe"),
]


@pytest.mark.parametrize("strategy,sizes,schedule", CASES,
                         ids=[f"{s}-{'x'.join(f'{k}{v}' for k, v in m.items())}-{q}" for s, m, q in CASES])
def test_pipeline_matches_single_device(model, single_device, strategy, sizes, schedule):
    program = _program(model, strategy, sizes, schedule=schedule)
    losses, params, state = _train(program)
    ref_losses, ref_params = single_device
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for (path, got), ref in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    # Each stage stores only its layers: the stack's leading axis is split over 'pipe'.
    for leaf in jax.tree.leaves(state.params["blocks"]):
        assert leaf.sharding.spec[0] == "pipe"
        assert leaf.addressable_shards[0].data.shape[0] == FOUR_LAYERS.n_layers // sizes["pipe"]


@pytest.mark.parametrize("strategy,sizes", [("zero1", {"data": 4, "pipe": 2}),
                                            ("fsdp_tp", {"pipe": 2, "fsdp": 2, "tensor": 2})])
def test_other_strategies_compose_with_a_pipeline(model, single_device, strategy, sizes):
    """Optimizer-state sharding over data, and tensor parallelism (GSPMD inside each stage; fsdp_tp
    splits tp's tensors over ``tensor`` as tp does, and shards over fsdp as well)."""
    losses, params, _ = _train(_program(model, strategy, sizes))
    np.testing.assert_allclose(losses, single_device[0], rtol=1e-5)
    for got, ref in zip(jax.tree.leaves(params), jax.tree.leaves(single_device[1])):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_bf16_pipeline_tracks_float32_with_float32_state(single_device):
    """bf16 activations and cotangents between stages; master weights and Adam state stay float32."""
    model = trainable(dataclasses.replace(FOUR_LAYERS, compute_dtype="bfloat16"))
    mesh = make_mesh({"pipe": 2, "fsdp": 4}, devices=jax.devices()[:8])
    program = build(model, optimizer(), make_layout(model, "zero3", mesh), precision="bf16", microbatches=MICROBATCHES)
    losses, _, state = _train(program)
    np.testing.assert_allclose(losses, single_device[0], rtol=0.02)
    batch = program.abstract_batch({"inputs": ((ROWS, 32), jnp.int32), "targets": ((ROWS, 32), jnp.int32)})
    permutes = report.collective_stats(program.step.lower(program.abstract_state(), batch)).of_kind("collective-permute")
    assert permutes and {r.dtype for r in permutes} == {"bf16"}  # half the bytes between stages
    assert {leaf.dtype for leaf in jax.tree.leaves((state.params, state.opt_state)) if leaf.ndim} == {np.dtype("float32")}


def test_evaluation_matches_the_unpipelined_loss(model):
    flat, piped = _program(model, "dp", {"data": 1}), _program(model, "dp", {"pipe": 4})
    params = flat.init(jax.random.key(0)).params
    batch = batches(1, batch=ROWS)[0]
    expected = flat.evaluate(params, batch)
    got = piped.evaluate(jax.device_put(params, piped.state_sharding.params), batch)
    np.testing.assert_allclose(float(got["loss"]), float(expected["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(got["accuracy"]), float(expected["accuracy"]), rtol=1e-6)


# ---------------------------------------------------------------- memory and collectives


COMPILED: dict = {}  # (strategy, mesh, M, schedule) -> `_compiled`'s result: tests below ask for some twice


def _compiled(model, strategy, sizes, microbatches, schedule):
    key = (strategy, tuple(sizes.items()), microbatches, schedule)
    if key not in COMPILED:
        COMPILED[key] = _compile(model, strategy, sizes, microbatches, schedule)
    return COMPILED[key]


def _compile(model, strategy, sizes, microbatches, schedule, rows_per_microbatch=2, seq=32):
    program = _program(model, strategy, sizes, microbatches, schedule)
    rows = rows_per_microbatch * microbatches * program.layout.batch_size_multiple
    batch = program.abstract_batch({"inputs": ((rows, seq), jnp.int32), "targets": ((rows, seq), jnp.int32)})
    return program, program.compile_step(program.abstract_state(), batch), rows * seq * 4 * 2


def _sizes(model):
    abstract = model.abstract()
    stack = sum(x.size for x in jax.tree.leaves(abstract["blocks"]))
    return stack, sum(x.size for x in jax.tree.leaves(abstract)) - stack


@pytest.mark.parametrize("strategy,sizes", [("dp", {"pipe": 2}), ("dp", {"pipe": 4}), ("zero3", {"pipe": 2, "fsdp": 4})])
def test_each_stage_stores_its_share_of_the_layers(model, strategy, sizes):
    """Arguments = 12 bytes (param + 2 Adam moments) x (stack / stages + embedding and head), / fsdp."""
    program, compiled, batch_bytes = _compiled(model, strategy, sizes, MICROBATCHES, "1f1b")
    stack, rest = _sizes(model)
    expected = 12 * (stack / sizes["pipe"] + rest) / sizes.get("fsdp", 1)
    per_device_batch = batch_bytes / program.layout.batch_size_multiple
    persistent = report.memory_stats(compiled).argument_bytes - per_device_batch
    assert persistent == pytest.approx(expected, abs=64)  # + the step counter and Adam's counts


def test_1f1b_activation_memory_stays_bounded_as_microbatches_grow(model):
    """Same microbatch size, 4 then 16 microbatches: 1F1B's temporaries do not grow; GPipe's grow
    by exactly the 12 extra microbatches' stage inputs and output cotangents it keeps."""
    temp = {(schedule, m): report.memory_stats(_compiled(model, "dp", {"pipe": 2}, m, schedule)[1]).temp_bytes
            for schedule in ("1f1b", "gpipe") for m in (4, 16)}
    activation = 2 * 32 * FOUR_LAYERS.d_model * 4  # one microbatch's residual stream, float32
    assert temp[("1f1b", 16)] == temp[("1f1b", 4)]
    kept = 2 * 12 * activation
    assert kept <= temp[("gpipe", 16)] - temp[("gpipe", 4)] <= kept + 1024  # (+ a few scalars per microbatch)


def test_stages_exchange_activations_and_gather_only_their_own_weights(model):
    sizes = {"pipe": 2, "fsdp": 4}
    _, compiled, _ = _compiled(model, "zero3", sizes, MICROBATCHES, "1f1b")
    stats = report.collective_stats(compiled)
    activation = 2 * 32 * FOUR_LAYERS.d_model * 4
    permutes = stats.of_kind("collective-permute")
    assert permutes and all(r.buffer_bytes == activation for r in permutes)
    # Forward sends + backward sends: (M + S - 1) each, less the last tick's unused one.
    assert sum(r.multiplicity for r in permutes) >= 2 * (MICROBATCHES + 1) - 2
    gathers = stats.of_kind("all-gather")
    assert gathers and all(r.group_size == sizes["fsdp"] for r in gathers)  # within a stage, never across
    # No collective inside a branch that some stages take and others skip (the embedding / head
    # under ZeRO-3 are computed on every stage instead): XLA:CPU deadlocked on that.
    assert not any(r.in_conditional for r in stats.records)


def test_bubble_fraction():
    assert pipeline.bubble_fraction(2, 8) == pytest.approx(1 / 9)
    assert pipeline.bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert pipeline.bubble_fraction(1, 8) == 0.0


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("S,M", [(2, 1), (2, 8), (4, 3), (4, 16)])
def test_schedules_run_every_forward_and_backward_once_in_order(name, S, M):
    """Replay a schedule: each (stage, microbatch) forward and backward happens exactly once, a
    forward after the previous stage's, a backward after the next stage's, and within the kept
    buffer (no microbatch's input overwritten before its backward)."""
    schedule = pipeline.get_schedule(name)
    fwd, bwd, tick = {}, {}, 0
    for phase in schedule.phases(S, M):
        for t in range(phase.ticks):
            for s in range(S):
                if phase.forward_from is not None and 0 <= phase.forward_from + t - s < M:
                    fwd[(s, phase.forward_from + t - s)] = tick
                if phase.backward_from is not None and 0 <= phase.backward_from + t - (S - 1 - s) < M:
                    bwd[(s, phase.backward_from + t - (S - 1 - s))] = tick
            tick += 1
    assert set(fwd) == set(bwd) == {(s, m) for s in range(S) for m in range(M)}
    assert tick == 2 * (M + S - 1) if name == "gpipe" else tick == M + 2 * (S - 1)
    for (s, m), t in fwd.items():
        assert s == 0 or fwd[(s - 1, m)] == t - 1
        assert s == S - 1 or bwd[(s + 1, m)] == bwd[(s, m)] - 1
        assert bwd[(s, m)] >= t
        # Inputs (every stage) and output cotangents (last stage) of later microbatches, stored
        # before this microbatch's backward, must not reuse its slot.
        later = [m2 for (s2, m2), t2 in fwd.items() if s2 == s and m < m2 and t2 <= bwd[(s, m)]]
        assert all((m2 - m) % schedule.kept_inputs(S, M) for m2 in later)
        if s == S - 1:
            assert all((m2 - m) % schedule.kept_cotangents(S, M) for m2 in later)


# ---------------------------------------------------------------- errors


def test_layers_that_do_not_divide_into_stages_are_refused():
    with pytest.raises(RuleError, match=r"blocks.*4 layers.*pipe=3.*\[1, 2, 4\]"):
        make_layout(trainable(FOUR_LAYERS), "dp", make_mesh({"pipe": 3}, devices=jax.devices()[:3]))


def test_pipeline_refuses_grad_accum_and_needs_stages(model):
    layout = make_layout(model, "dp", make_mesh({"pipe": 2}, devices=jax.devices()[:2]))
    with pytest.raises(ValueError, match="microbatches=K, not grad_accum"):
        build(model, optimizer(), layout, grad_accum=2)
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zigzag'"):
        build(model, optimizer(), layout, schedule="zigzag")
    without = dataclasses.replace(model, pipeline=None)
    with pytest.raises(ValueError, match="does not say how to cut it into stages"):
        build(without, optimizer(), make_layout(without, "dp", layout.mesh))


def test_rows_that_do_not_split_into_microbatches_name_the_fix(model):
    program = _program(model, "dp", {"data": 2, "pipe": 2}, microbatches=4)
    bad = {k: v[:12] for k, v in batches(1)[0].items()}  # 12 rows: 6 per replica, not 4 microbatches
    with pytest.raises(ValueError, match="times 4 microbatches.*multiple of 8"):
        program.step(program.init(jax.random.key(0)), bad)


# ---------------------------------------------------------------- checkpoints


def _round_trip(state, target, directory):
    """Save ``state``, restore it in ``target``'s layout, check every leaf bit for bit."""
    host = jax.tree.map(lambda x: np.array(x, copy=True), state)
    with Checkpointer(directory) as ckpt:
        ckpt.save(int(state.step), state, data_state={}, config={}, force=True)
        ckpt.wait()
        restored, _, _ = ckpt.restore(target.abstract_state())
    for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(restored)):
        assert np.array_equal(a, np.asarray(b))
    return restored


def test_pipelined_checkpoint_restores_unpipelined_and_back(model, tmp_path):
    piped = _program(model, "zero3", {"pipe": 2, "fsdp": 4})  # the parity test's program: compiled once
    flat = _program(model, "zero3", {"fsdp": 8})
    state = piped.init(jax.random.key(0))
    data = batches(4, batch=ROWS)
    for batch in data[:2]:
        state, _ = piped.step(state, batch)
    restored = _round_trip(state, flat, tmp_path / "a")
    assert restored.params["blocks"]["attn"]["wq"].sharding.spec[0] is None  # really the flat layout

    # Training continues identically in either layout, and the flat state restores back.
    flat_state, flat_metrics = flat.step(restored, data[2])
    piped_state, piped_metrics = piped.step(state, data[2])
    np.testing.assert_allclose(float(flat_metrics["loss"]), float(piped_metrics["loss"]), rtol=1e-5)
    back = _round_trip(flat_state, piped, tmp_path / "b")
    assert back.params["blocks"]["attn"]["wq"].sharding.spec[0] == "pipe"


def test_train_cli_run_resumes_without_the_pipeline(tmp_path):
    """`shardlib train --pipeline-stages 2` checkpoints; the same run resumed unpipelined continues
    exactly as the uninterrupted pipelined run does."""
    from shardlib.run.train import TrainConfig, train

    common = dict(model="tiny", strategy="zero3", batch_size=16, seq_len=32, eval_every=0, ckpt_every=2,
                  warmup_steps=0, min_lr_ratio=1.0,
                  progress=False, tensorboard=False, sample_tokens=0, verbose=False)
    straight = train(TrainConfig(**common, steps=6, pipeline_stages=2, microbatches=4, out=str(tmp_path / "a")))
    # Its step-4 checkpoint alone, as if the run had stopped there (the checkpoint holds the data state).
    shutil.copytree(tmp_path / "a" / "checkpoints" / "4", tmp_path / "b" / "checkpoints" / "4")
    resumed = train(TrainConfig(**common, steps=6, resume_from=str(tmp_path / "b")))
    assert resumed.program.layout.pipeline_stages == 1
    losses = lambda result: [r["loss"] for r in result.records if r["step"] > 4]
    assert len(losses(resumed)) == 2
    np.testing.assert_allclose(losses(resumed), losses(straight), rtol=1e-5)
