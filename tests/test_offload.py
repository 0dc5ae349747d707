"""ZeRO-Offload (`build(offload="opt_state")`): the optimizer state lives in pinned host memory.

Checked against independent references: the losses of the same zero3 step without offload (rtol
1e-6) and of a plain one-device ``jax.jit`` + optax step (rtol 1e-5, as tests/test_parity.py);
the host and device bytes of the compiled step against Adam's 8 Psi / N (two float32 moments per
parameter, sharded over N devices, + its int32 step count); a checkpoint round trip bit for bit.
"""

from __future__ import annotations

import argparse
import types

import jax
import numpy as np
import pytest

from shardlib import build, make_layout, make_mesh
from shardlib.models import param_count
from shardlib.run.config import add_arguments, from_args
from shardlib.run.setup import build_program, lr_schedule
from shardlib.runtime.checkpoint import Checkpointer
from shardlib.step import offload as offload_lib
from shardlib.tools import plan as plan_lib
from shardlib.tools import plan_report
from shardlib.tools.memory import memory_stats, peak_bytes
from tests import helpers

N, STEPS = 8, 3
HOST = offload_lib.HOST_MEMORY


@pytest.fixture(scope="module")
def programs():
    model = helpers.tiny_model()
    layout = make_layout(model, "zero3", make_mesh({"fsdp": N}))
    return {name: build(model, helpers.optimizer(), layout, offload=name) for name in ("none", "opt_state")}


@pytest.fixture(scope="module")
def compiled(programs):
    """One compiled step per offload setting: measured, and run for training (no second compile)."""
    shape = ((helpers.BATCH, helpers.SEQ), np.int32)
    batch = programs["none"].abstract_batch({"inputs": shape, "targets": shape})
    return {name: p.compile_step(p.abstract_state(), batch) for name, p in programs.items()}


@pytest.fixture(scope="module")
def memory(compiled):
    return {name: memory_stats(step) for name, step in compiled.items()}


@pytest.fixture(scope="module")
def trained(programs, compiled):
    """(per-step losses, final state) of STEPS steps of each compiled step."""
    out = {}
    for name, step in compiled.items():
        state, losses = programs[name].init(jax.random.key(0)), []
        for rows in helpers.batches(STEPS):
            state, metrics = step(state, rows)
            losses.append(float(metrics["loss"]))
        out[name] = (np.array(losses), state)
    return out


def _kinds(tree) -> set[str]:
    return {leaf.sharding.memory_kind for leaf in jax.tree.leaves(tree)}


def test_offloaded_zero3_trains_like_no_offload_and_a_plain_jit_step(trained):
    losses, state = trained["opt_state"]
    np.testing.assert_allclose(losses, trained["none"][0], rtol=1e-6)
    reference_losses, _ = helpers.reference(STEPS)
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-5)
    assert _kinds(state.opt_state) == {HOST} and _kinds(state.params) == {"device"}


def test_device_bytes_drop_by_the_optimizer_state_and_host_bytes_rise_to_match(programs, memory):
    psi = param_count(helpers.TINY)
    opt_state = 8 * psi // N + 4  # Adam's two f32 moments, 1/N each, and its int32 count
    plain, offloaded = memory["none"], memory["opt_state"]
    assert plain.host_argument_bytes == 0
    assert offloaded.host_argument_bytes == offloaded.host_output_bytes == offloaded.host_alias_bytes == opt_state
    shards = sum(np.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                 for x in jax.tree.leaves(programs["opt_state"].abstract_state().opt_state))
    assert shards == opt_state  # the compiled layout agrees with the shardings asked for
    assert plain.device_bytes("argument") - offloaded.device_bytes("argument") == opt_state
    held_by_update = max(0, offloaded.temp_bytes - plain.temp_bytes)
    assert peak_bytes(plain) - peak_bytes(offloaded) >= opt_state - held_by_update


def _restored(state, program, directory):
    with Checkpointer(directory) as ckpt:
        assert ckpt.save(STEPS, state, data_state={"step": STEPS}, config={}, force=True)
        ckpt.wait()
        return ckpt.restore(program.abstract_state())[0]


def _assert_bitwise(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(jax.device_get(a)), np.asarray(jax.device_get(b)))


def test_checkpoint_round_trip_is_bitwise_and_restores_to_host(trained, programs, tmp_path):
    _, state = trained["opt_state"]
    restored = _restored(state, programs["opt_state"], tmp_path / "offloaded")
    _assert_bitwise(restored, state)
    assert jax.tree.leaves(jax.tree.map(lambda a, b: a.sharding == b.sharding, restored, state)) == [True] * len(
        jax.tree.leaves(state))
    # A checkpoint saved without offload restores onto the offloaded program: the same values, on the host.
    _, plain = trained["none"]
    moved = _restored(plain, programs["opt_state"], tmp_path / "plain")
    _assert_bitwise(moved, plain)
    assert _kinds(moved.opt_state) == {HOST} and _kinds(moved.params) == {"device"}


def test_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"offload='params' \(--offload\).*stream"):
        offload_lib.get_offload("params")
    with pytest.raises(ValueError, match=r"unknown offload 'disk'.*none, opt_state"):
        offload_lib.get_offload("disk")
    memories = [types.SimpleNamespace(kind="device")]
    device_only = types.SimpleNamespace(platform="fake", addressable_memories=lambda: memories)
    with pytest.raises(ValueError, match=r"needs 'pinned_host' memory.*offers only \['device'\]"):
        offload_lib.check_backend(offload_lib.get_offload("opt_state"), [device_only])


def test_train_flag_places_the_optimizer_state_on_the_host(programs):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = from_args(parser.parse_args(["--model", "tiny", "--offload", "opt_state"]))
    assert config.offload == "opt_state"
    layout = programs["none"].layout
    program = build_program(config, helpers.tiny_model(), layout, lr_schedule(config))
    memory_kinds = lambda tree: {s.memory_kind for s in jax.tree.leaves(tree)}  # noqa: E731
    assert memory_kinds(program.state_sharding.opt_state) == {HOST}
    assert memory_kinds(program.state_sharding.params) == {"device"}


def test_plan_shows_host_bytes_and_says_offload_makes_it_fit(tmp_path):
    """Without offload one byte short of HBM: the plan suggests offload (measured), and the offloaded
    candidate fits, with its host bytes in their own column and a note that offload is why. Both
    planners share a plan cache: the offloaded planner's candidate is the program the advice
    compiled (the cache key is the lowered text), so it reads back that compile's facts, host
    bytes included, instead of compiling it again."""
    planner = plan_lib.Planner(helpers.TINY, N, batch_size=N, seq_len=helpers.SEQ, cache_dir=str(tmp_path))
    row = planner.candidate("zero3")
    planner.decide([row], hbm=row.peak_bytes - 1)
    advice = planner._offloaded(row)
    psi = param_count(helpers.TINY)
    assert advice["fits"] and advice["host_bytes"] == 8 * psi // N + 4
    assert advice["peak_bytes"] <= row.peak_bytes - advice["host_bytes"]
    offloaded = plan_lib.Planner(helpers.TINY, N, batch_size=N, seq_len=helpers.SEQ, offload="opt_state",
                                 cache_dir=str(tmp_path))
    rows = offloaded.decide([offloaded.candidate("zero3")], hbm=row.peak_bytes - 1)
    assert len(list(tmp_path.iterdir())) == 2  # one entry a program: the offloaded candidate was read back
    assert rows[0].fits and rows[0].fits_by_offload and rows[0].host_bytes == advice["host_bytes"]
    text = plan_report.render(offloaded, rows, [advice])
    header = next(line for line in text.splitlines() if "strategy" in line and "peak" in line)
    assert "host" in header and "fits because of --offload opt_state" in text and advice["text"] in text
