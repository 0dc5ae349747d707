"""Bounded staleness (``build(..., staleness=tau)``) and streaming DiLoCo (``outer_delay``).

References: tau=0 against the synchronous step bitwise; tau=1 against a plain ``jax.jit`` +
optax loop that delays the gradient by hand; the overlap from the optimised HLO's dependencies;
streaming DiLoCo's delayed merge against numpy + optax applied to the program's own local steps.
"""

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardlib
from shardlib import build, make_layout, make_mesh
from shardlib.models import GPT, next_token_loss
from shardlib.run.config import TrainConfigError, add_arguments, from_args
from shardlib.run.setup import build_program, lr_schedule
from shardlib.runtime.checkpoint import Checkpointer
from shardlib.step.local_sgd import build_local_sgd
from shardlib.tools.hlo import reductions_waiting
from tests import zoo
from tests.helpers import BATCH, SEQ, TINY, batches, tiny_model

LR = 0.5
SHAPES = {"inputs": ((BATCH, SEQ), jnp.int32), "targets": ((BATCH, SEQ), jnp.int32)}


def _compiled(program):
    step = program.compile_step(program.abstract_state(), program.abstract_batch(SHAPES))
    return program, step


@pytest.fixture(scope="module")
def dp8():
    """dp over 8 devices, plain SGD: the synchronous step, tau=0 and tau=1, each compiled once."""
    model = tiny_model()
    layout = make_layout(model, "dp", make_mesh({"data": 8}))
    programs = {tau: build(model, optax.sgd(LR), layout, **kw)
                for tau, kw in (("sync", {}), (0, {"staleness": 0}), (1, {"staleness": 1}))}
    return layout, {tau: _compiled(programs[tau]) for tau in ("sync", 1)} | {0: programs[0]}


def _run(program, step, steps):
    state, losses = program.init(jax.random.key(0)), []
    for rows in batches(steps):
        state, metrics = step(state, jax.device_put(rows, program.layout.batch_sharding(rows)))
        losses.append(metrics)
    return state, [{k: float(v) for k, v in m.items()} for m in losses]


def _same_program(a, b, *args) -> bool:
    """Two jitted functions lower to the same StableHLO: they compute the same bits."""
    return a.lower(*args).as_text() == b.lower(*args).as_text()


def test_staleness_zero_is_data_parallel_bitwise(dp8):
    """tau=0 carries no queue and lowers to the very program of the synchronous step."""
    _, programs = dp8
    sync, stale = programs["sync"][0], programs[0]
    assert stale.abstract_state() == sync.abstract_state() and stale.abstract_state().pending is None
    assert _same_program(stale.step, sync.step, sync.abstract_state(), sync.abstract_batch(SHAPES))
    assert _same_program(jax.jit(stale.init), jax.jit(sync.init), jax.random.key(0))


def _delayed_reference(steps: int, tau: int):
    """One device, no shardlib: step t computes g_t and applies g_{t - tau} (nothing before)."""
    params, _, loss = zoo.nnx_functional(lambda rngs: GPT(TINY, rngs=rngs), lambda m, b: next_token_loss(m, b)[0],
                                         seed=jax.random.key(0))
    grad_fn = jax.jit(jax.value_and_grad(lambda p, b: loss(p, None, b)[0]))
    tx = optax.sgd(LR)
    opt_state, queue, losses = tx.init(params), [], []
    for rows in batches(steps):
        value, grads = grad_fn(params, rows)
        queue.append(grads)
        losses.append(float(value))
        if len(queue) > tau:
            updates, opt_state = tx.update(queue.pop(0), opt_state, params)
            params = optax.apply_updates(params, updates)
    return losses, params, queue


def test_staleness_one_applies_the_previous_steps_gradient(dp8):
    """Against the hand-delayed reference. Tolerance: both sides sum the same gradients in a
    different order (8 devices vs one), float32 noise of ~1e-7 relative per gradient, carried by
    lr 0.5 over 3 applied steps; 2e-6 relative / 1e-7 absolute bounds it with margin."""
    _, programs = dp8
    steps = 4
    state, metrics = _run(*programs[1], steps)
    ref_losses, ref_params, ref_queue = _delayed_reference(steps, tau=1)
    assert [m["applied"] for m in metrics] == [0, 1, 1, 1] and int(state.step) == steps - 1
    assert all(m["skipped"] == 0 for m in metrics)
    np.testing.assert_allclose([m["loss"] for m in metrics], ref_losses, rtol=2e-6)
    for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=1e-7)
    # The queue holds the last step's local gradients, one per device, not yet reduced: their sum
    # is the reference's g_4, still queued there too.
    assert bool(state.pending[0]["ready"])
    np.testing.assert_allclose(float(state.pending[0]["loss"]), ref_losses[-1], rtol=2e-6)
    for got, want in zip(jax.tree.leaves(state.pending[0]["grads"]), jax.tree.leaves(ref_queue[0]), strict=True):
        np.testing.assert_allclose(np.asarray(got).sum(axis=0), np.asarray(want), rtol=2e-6, atol=1e-7)


def test_gradient_reduction_does_not_wait_for_this_steps_compute(dp8):
    """The overlap, read from the optimised HLO: under tau=1 the gradient all-reduce depends on
    the state only (the queued local gradient), not on the batch, so nothing orders it after this
    step's forward and backward; the synchronous step's all-reduce depends on the batch."""
    _, programs = dp8
    first_batch_input = len(jax.tree.leaves(programs[1][0].abstract_state()))  # entry parameters: state, then batch
    sync_reductions, sync_waiting = reductions_waiting(programs["sync"][1].as_text(),
                                                       len(jax.tree.leaves(programs["sync"][0].abstract_state())))
    stale_reductions, stale_waiting = reductions_waiting(programs[1][1].as_text(), first_batch_input)
    assert sync_reductions and sync_waiting == sync_reductions
    assert stale_reductions and stale_waiting == []


def test_queue_checkpoints_bitwise(dp8, tmp_path):
    _, programs = dp8
    program, step = programs[1]
    state, _ = _run(program, step, 2)  # the queue holds step 2's gradient
    saved = [np.asarray(x) for x in jax.tree.leaves(state)]
    with Checkpointer(tmp_path / "ckpt", async_save=False) as ckpt:
        ckpt.save(2, state, data_state={"step": 2, "seed": 0}, config={}, force=True)
    restored, _, _ = Checkpointer(tmp_path / "ckpt", create=False).restore(program.abstract_state())
    assert len(restored.pending) == 1 and bool(restored.pending[0]["ready"])
    for want, got, sharding in zip(saved, jax.tree.leaves(restored), jax.tree.leaves(program.state_sharding),
                                   strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
        assert got.sharding.spec == sharding.spec


def test_refuses_staleness_it_cannot_apply():
    model = tiny_model()
    dp = make_layout(model, "dp", make_mesh({"data": 8}))
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="staleness must be a non-negative integer"):
            build(model, optax.sgd(LR), dp, staleness=bad)
    with pytest.raises(ValueError, match="staleness=1 cannot run with precision='fp16'.*'bf16'"):
        build(model, optax.sgd(LR), dp, staleness=1, precision="fp16")
    tp = make_layout(model, "tp", make_mesh({"tensor": 4}, devices=jax.devices()[:4]))
    with pytest.raises(ValueError, match="'tp' on mesh .* no batch axis has more than one device.*staleness=0"):
        build(model, optax.sgd(LR), tp, staleness=1)
    zero3 = make_layout(model, "zero3", make_mesh({"fsdp": 8}))
    with pytest.raises(ValueError, match="'zero3': it stores parameters over the batch axes.*use 'dp', 'zero1'"):
        build(model, optax.sgd(LR), zero3, staleness=1)
    with pytest.raises(ValueError, match="grad_accum=2 under 'zero2'.*use grad_accum=1"):
        build(model, optax.sgd(LR), make_layout(model, "zero2", make_mesh({"data": 8})), staleness=1, grad_accum=2)


# ---- streaming DiLoCo: the outer sync overlapping the next inner steps

NESTEROV = optax.sgd(0.7, momentum=0.9, nesterov=True)


@pytest.fixture(scope="module")
def diloco_layout():
    model = tiny_model()
    return model, make_layout(model, "dp", make_mesh({"data": 4, "fsdp": 2}))


def test_outer_delay_zero_is_diloco_bitwise(diloco_layout):
    """D=0 keeps no snapshot, and its local step, sync and init lower to DiLoCo's own programs."""
    model, layout = diloco_layout
    want = build_local_sgd(model, optax.sgd(LR), layout, sync_every=2, outer_tx=NESTEROV)
    got = build_local_sgd(model, optax.sgd(LR), layout, sync_every=2, outer_tx=NESTEROV, outer_delay=0)
    state, batch = want.abstract_state(), want.abstract_batch(SHAPES)
    assert got.abstract_state() == state and state.snapshot is None and got.merge_step is None
    assert _same_program(got.local_step, want.local_step, state, batch)
    assert _same_program(got.sync, want.sync, state)
    assert _same_program(got.init, want.init, jax.random.key(0))


def test_outer_delay_lands_the_outer_update_later_and_trains(diloco_layout):
    """H=3, D=1: step 3 keeps a snapshot, step 4 is a local step plus the outer update of the
    snapshot's mean, mixed 0.5 / 0.5; checked against numpy + optax on the program's own local step."""
    model, layout = diloco_layout
    program = build_local_sgd(model, optax.sgd(LR), layout, sync_every=3, outer_tx=NESTEROV, outer_delay=1)
    abstract, batch = program.abstract_state(), program.abstract_batch(SHAPES)
    compiled = {name: getattr(program, name).lower(abstract, batch).compile() for name in ("local_step", "merge_step")}
    program = dataclasses.replace(program, **compiled)
    # The overlap: the merge step's parameter all-reduce over data reads the snapshot (state), not
    # the batch; every reduction of a plain local step (the gradient sum over fsdp) waits for it.
    first_batch_input = len(jax.tree.leaves(abstract))
    local_reductions, local_waiting = reductions_waiting(compiled["local_step"].as_text(), first_batch_input)
    merge_reductions, merge_waiting = reductions_waiting(compiled["merge_step"].as_text(), first_batch_input)
    assert local_waiting == local_reductions
    assert len(set(merge_reductions) - set(merge_waiting)) == 1 and len(merge_waiting) == len(local_waiting)
    rows = [jax.device_put(b, layout.batch_sharding(b)) for b in batches(6)]
    state, losses = program.init(jax.random.key(0)), []
    for step in range(3):
        state, metrics = program.step(state, rows[step])
        losses.append(float(metrics["loss"]))
    assert [int(metrics["synced"]), int(metrics["merged"])] == [1, 0]
    for snap, params in zip(jax.tree.leaves(state.snapshot), jax.tree.leaves(state.params), strict=True):
        np.testing.assert_array_equal(np.asarray(snap), np.asarray(params))
    # The first outer Nesterov step from zero momentum: anchor - 0.7 * (1 + 0.9) * (anchor - mean).
    new_anchor = jax.tree.map(lambda a, s: np.asarray(a) - 0.7 * 1.9 * (np.asarray(a) - np.asarray(s).mean(axis=0)),
                              state.anchor, state.snapshot)
    local, _ = program.local_step(jax.tree.map(jnp.copy, state), rows[3])
    want = jax.tree.map(lambda p, a: 0.5 * np.asarray(p) + 0.5 * np.asarray(a)[None], local.params, new_anchor)
    state, metrics = program.step(state, rows[3])
    assert [int(metrics["synced"]), int(metrics["merged"])] == [0, 1]
    for got, ref in zip(jax.tree.leaves(state.params), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-6)
    for got, ref in zip(jax.tree.leaves(state.anchor), jax.tree.leaves(new_anchor), strict=True):
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-6)
    losses.append(float(metrics["loss"]))
    for step in range(4, 6):
        state, metrics = program.step(state, rows[step])
        losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses)) and np.mean(losses[-2:]) < losses[0] - 0.5, losses


def test_refuses_outer_delays_it_cannot_stream(diloco_layout):
    model, layout = diloco_layout
    cases = [({"outer_delay": -1, "outer_tx": NESTEROV}, "outer_delay must be a non-negative integer"),
             ({"outer_delay": 1}, "outer_tx is None; pass outer_tx"),
             ({"outer_delay": 3, "outer_tx": NESTEROV}, "must be smaller than sync_every=3"),
             ({"outer_delay": 1, "outer_tx": NESTEROV, "outer_mix": 1.5}, r"outer_mix must be in \[0, 1\]")]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            build_local_sgd(model, optax.sgd(LR), layout, sync_every=3, **kwargs)


def test_train_flag_builds_a_queue_and_names_itself_when_refused(dp8):
    layout, _ = dp8
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = from_args(parser.parse_args(["--model", "tiny", "--staleness", "2"]))
    program = build_program(config, tiny_model(), layout, lr_schedule(config))
    assert len(program.state_sharding.pending) == 2
    bad = from_args(parser.parse_args(["--model", "tiny", "--staleness", "-1"]))
    with pytest.raises(TrainConfigError, match="--staleness: staleness must be a non-negative integer"):
        build_program(bad, tiny_model(), layout, lr_schedule(bad))


def test_the_first_tau_steps_draw_their_own_dropout_masks():
    """Nothing is applied during the first tau steps, so ``state.step`` stays 0; the dropout key
    counts steps taken instead. The same rows twice at tau=1 run on the same parameters: only a
    new mask can make the two losses differ."""
    module = zoo.LinenTransformer(dropout_rate=0.5)
    inputs = lambda batch, train: ((batch["tokens"], batch["positions"]), {"train": train})
    model = shardlib.from_linen(module, zoo.linen_transformer_loss, zoo.token_batch(0), inputs=inputs)
    program = build(model, optax.sgd(LR), make_layout(model, "dp", make_mesh({"data": 8})), staleness=1)
    state, rows, losses = program.init(jax.random.key(0)), zoo.token_batch(0), []
    for _ in range(2):
        state, metrics = program.step(state, rows)
        losses.append(float(metrics["loss"]))
    assert int(state.step) == 1 and losses[0] != losses[1]
