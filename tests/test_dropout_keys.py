"""Dropout keys come from the steps taken (`TrainState.steps_taken`), not the updates applied:
a skipped step's successor and every step under staleness draw their own masks, and a restored
checkpoint goes on with the same key sequence."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from shardlib import Checkpointer, build, from_functions, make_layout, make_mesh

DEVICES = 8


def _init(key):
    return {"w": jax.random.normal(key, (4,))}


def _loss(params, batch, call):
    """A loss scaled by the batch's ``bad`` (NaN skips the step) whose aux is this step's draw."""
    draw = jax.random.uniform(call.key, batch["bad"].shape)  # a dropout mask over this device's rows
    loss = jnp.mean((batch["x"] @ params["w"] * (draw > 0.5)) ** 2) * batch["bad"][0]
    return loss, {"draw": draw.mean()}


def _batch(bad=False):
    return {"x": np.ones((16, 4), np.float32), "bad": np.full((16,), np.nan if bad else 1.0, np.float32)}


def _program(**options):
    model = from_functions(_init, _loss, takes_call=True)
    return build(model, optax.sgd(0.1), make_layout(model, "dp", make_mesh({"data": DEVICES})), **options)


def _draws(program, state, batches):
    draws = []
    for batch in batches:
        state, metrics = program.step(state, batch)
        draws.append(float(metrics["draw"]))
    return state, draws


@pytest.fixture(scope="module")
def program():
    return _program()


def test_the_step_after_a_skipped_one_draws_new_masks(program):
    state, draws = _draws(program, program.init(jax.random.key(0)), [_batch(), _batch(bad=True), _batch()])
    assert int(state.step) == 2 and int(state.steps_taken) == 3  # one update skipped, three steps taken
    assert len(set(draws)) == 3, draws


def test_staleness_gives_every_step_its_own_masks():
    """staleness=1: the first step applies nothing and the NaN gradient of step 1 is dropped at
    step 2, so two of the four steps apply an update; all four draw their own masks."""
    program = _program(staleness=1)
    batches = [_batch(), _batch(bad=True), _batch(), _batch()]
    state, draws = _draws(program, program.init(jax.random.key(0)), batches)
    assert int(state.step) == 2 and int(state.steps_taken) == 4
    assert len(set(draws)) == 4, draws


def test_a_restored_checkpoint_goes_on_with_the_same_keys(program, tmp_path):
    batches = [_batch(), _batch(bad=True), _batch(), _batch()]
    _, uninterrupted = _draws(program, program.init(jax.random.key(0)), batches)
    state, _ = _draws(program, program.init(jax.random.key(0)), batches[:2])
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(2, state, data_state={"step": 2, "seed": 0}, force=True)
        ckpt.wait()
        restored, _, _ = ckpt.restore(program.abstract_state())
    assert int(restored.steps_taken) == 2 and int(restored.step) == 1
    _, resumed = _draws(program, restored, batches[2:])
    assert resumed == uninterrupted[2:]


def test_a_checkpoint_without_the_counter_goes_on_from_its_step(program, tmp_path, caplog):
    """Saved by a shardlib whose keys folded in the step number: the counter starts there."""
    state, _ = _draws(program, program.init(jax.random.key(0)), [_batch(), _batch()])
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(2, dataclasses.replace(state, steps_taken=None), data_state={"step": 2, "seed": 0}, force=True)
        ckpt.wait()
        restored, _, _ = ckpt.restore(program.abstract_state())
    assert int(restored.steps_taken) == int(restored.step) == 2
    assert "holds no steps_taken" in caplog.text
    assert restored.steps_taken.sharding == program.abstract_state().steps_taken.sharding
