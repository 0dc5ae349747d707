"""Steps in flight: where the step and the training loop block, under the CPU and the accelerator policy.

The bound is `shardlib.backend.BackendPolicy.steps_in_flight` (1 on XLA:CPU, 2 on GPU/TPU),
read by the step when `build` makes it. ``shardlib.backend.forced("tpu")`` around `build` gives
the accelerator's bound on the CPU devices here. The events are logged from the real code path:
the step's jitted call (dispatch), ``jax.block_until_ready`` (wait: the step's queue),
``jax.device_get`` (read: the loop's `Recorder`), ``shardlib.step.batch.place`` and an action
(record); nothing of the queue or the loop is re-implemented here.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import jax
import numpy as np
import pytest

import shardlib.backend
from shardlib import build, make_layout, make_mesh
from shardlib.run.actions import Evaluate, Every, StepClock
from shardlib.run.loop import Recorder, run_steps
from shardlib.step import batch as batch_lib
from tests.helpers import batches, optimizer, tiny_model

STEPS = 6


def _program(platform: str | None):
    """The tiny GPT under dp on 2 devices, f32, built under ``platform``'s policy (None: the devices')."""
    model = tiny_model()
    layout = make_layout(model, "dp", make_mesh({"data": 2}, devices=jax.devices()[:2]))
    with shardlib.backend.forced(platform) if platform else contextlib.nullcontext():
        return build(model, optimizer(), layout)


@pytest.fixture(scope="module")
def programs():
    return {"cpu": _program(None), "tpu": _program("tpu")}


def _logged_run(program, monkeypatch, steps: int = STEPS, *, validate_every: int = 0):
    """Run ``program.step`` through `run_steps` as `shardlib train` does; returns (events, records, state)."""
    events: list[tuple] = []
    step_of: dict[int, int] = {}
    keep: list = []  # the logged arrays stay alive, so their ids are not reused
    jitted = program.step._jitted
    dispatched = iter(range(1, steps + 1))

    def dispatch(state, batch):
        out_state, metrics = jitted(state, batch)
        k = next(dispatched)
        step_of[id(metrics["loss"])] = k
        keep.append(metrics["loss"])
        events.append(("dispatch", k))
        return out_state, metrics

    def steps_in(tree) -> list[int]:
        return sorted({step_of[id(leaf)] for leaf in jax.tree.leaves(tree) if id(leaf) in step_of})

    real_wait, real_get, real_place = jax.block_until_ready, jax.device_get, batch_lib.place

    def wait(tree):
        events.extend(("wait", k) for k in steps_in(tree))
        return real_wait(tree)

    def get(tree):
        events.extend(("read", k) for k in steps_in(tree))
        return real_get(tree)

    def place(layout, batch):
        events.append(("place",))
        return real_place(layout, batch)

    monkeypatch.setattr(program.step, "_jitted", dispatch)
    monkeypatch.setattr(jax, "block_until_ready", wait)
    monkeypatch.setattr(jax, "device_get", get)
    monkeypatch.setattr(batch_lib, "place", place)

    rows = batches(steps)
    records = []

    def note(k, state, record):
        events.append(("record", k))
        records.append(record)

    clock = StepClock()
    validation = Evaluate(lambda state: 0.0, Every(validate_every), clock)
    recorder = Recorder([validation, note], clock, tokens_per_step=1, at_once=validation.due)
    try:
        state = run_steps(program.init(jax.random.key(0)), 0, steps, lambda k, state, batch: program.step(state, batch),
                          lambda i: rows[i], record=recorder, steps_in_flight=program.step.steps_in_flight)
    finally:
        monkeypatch.undo()
    return events, records, state


def _outstanding(events) -> int:
    """The most steps dispatched and not yet waited for or read, at any point."""
    live, most = set(), 0
    for event in events:
        if event[0] == "dispatch":
            live.add(event[1])
        elif event[0] in ("wait", "read"):
            live.discard(event[1])
        most = max(most, len(live))
    return most


def test_the_policy_sets_the_bound_when_the_step_is_built(programs):
    assert programs["cpu"].step.steps_in_flight == 1
    assert programs["tpu"].step.steps_in_flight == shardlib.backend.POLICIES["tpu"].steps_in_flight == 2
    # Read once, at build: leaving the forced block later changes nothing.
    assert shardlib.backend.policy_for(jax.devices()[:2]).steps_in_flight == 1


def test_cpu_policy_waits_for_each_step_before_the_next_as_before(programs, monkeypatch):
    events, records, _ = _logged_run(programs["cpu"], monkeypatch)
    # Step k's batch is placed, step k-1 waited for, step k dispatched, then step k-1 read and recorded.
    expected = [("place",), ("dispatch", 1)]
    for k in range(2, STEPS + 1):
        expected += [("place",), ("wait", k - 1), ("dispatch", k), ("read", k - 1), ("record", k - 1)]
    expected += [("read", STEPS), ("record", STEPS)]
    assert events == expected
    assert _outstanding(events) == 1
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))


def test_accelerator_policy_dispatches_the_next_step_before_waiting(programs, monkeypatch):
    events, records, _ = _logged_run(programs["tpu"], monkeypatch)
    # Step k's batch is placed before the step waits (its copy overlaps the steps running), step
    # k-2 is waited for only once two are queued, and recorded after step k is dispatched.
    expected = [("place",), ("dispatch", 1), ("place",), ("dispatch", 2)]
    for k in range(3, STEPS + 1):
        expected += [("place",), ("wait", k - 2), ("dispatch", k), ("read", k - 2), ("record", k - 2)]
    expected += [("read", STEPS - 1), ("record", STEPS - 1), ("read", STEPS), ("record", STEPS)]
    assert events == expected
    at = {event: i for i, event in enumerate(events)}
    for t in range(1, STEPS):
        assert at[("dispatch", t + 1)] < at.get(("wait", t), at[("read", t)])
    assert _outstanding(events) == 2
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))


def test_a_validation_records_the_held_steps_first(programs, monkeypatch):
    events, records, _ = _logged_run(programs["tpu"], monkeypatch, validate_every=3)
    recorded = [e[1] for e in events if e[0] == "record"]
    assert recorded == list(range(1, STEPS + 1))
    at = {event: i for i, event in enumerate(events)}
    # Steps 2 and 3 are recorded right after step 3 is dispatched, before step 4 is.
    assert at[("dispatch", 3)] < at[("record", 2)] < at[("record", 3)] < at[("dispatch", 4)]
    assert [r["step"] for r in records if "val_loss" in r] == [3, 6]


def test_two_steps_in_flight_train_bitwise_as_one(programs, monkeypatch):
    """The queue changes when the host waits, not what the step computes: the same program (the CPU
    policy's; the accelerator policy also drops XLA:CPU's matmul-order transposes, which changes
    rounding) with two steps in flight trains bit for bit as with one. One build, its bound set
    to two for the second run: the same executable, so only the queue differs."""
    program = programs["cpu"]
    events, one, state_one = _logged_run(program, monkeypatch)
    assert _outstanding(events) == 1
    program.step.steps_in_flight = 2  # the queue's bound alone changes: the very same compiled step
    try:
        events, two, state_two = _logged_run(program, monkeypatch)
    finally:
        program.step.steps_in_flight = 1
    assert _outstanding(events) == 2
    assert [r["loss"] for r in one] == [r["loss"] for r in two]
    assert [r["grad_norm"] for r in one] == [r["grad_norm"] for r in two]
    for a, b in zip(jax.tree.leaves(state_one.params), jax.tree.leaves(state_two.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_loop_holds_steps_in_flight_records_in_step_order():
    """Fake steps whose state counts updates, two in flight: a record runs two steps late, except at
    a validation (every 3 steps and the last), which records the steps held first; saves see every
    dispatched step; a stop records the steps still held before the stop action saves."""
    seen, saved, order = [], [], []

    def step(k, state, batch):
        assert batch == k - 1  # step k's batch (0-based index) was loaded before it ran
        order.append(("dispatch", k))
        return SimpleNamespace(params=state.params + 1), {"loss": 1.0 / k, "grad_norm": 1.0, "skipped": 0.0}

    def note(k, state, record):
        order.append(("record", k))
        seen.append((k, state.params, record.get("val_loss")))

    class Stop:
        def should_stop(self, k):
            return k == 5

        def __call__(self, k, state, metrics):
            seen.append(("stop", k, state.params))

    clock = StepClock()
    validation = Evaluate(lambda state: float(state.params), Every(3, last=6), clock)
    record = Recorder([validation, note], clock, tokens_per_step=1, at_once=validation.due)
    final = run_steps(SimpleNamespace(params=0), 0, 6, step, lambda i: i, record=record, steps_in_flight=2,
                      after_step=[lambda k, state, metrics: saved.append((k, state.params))], preemption=Stop())
    assert final.params == 5 and saved == [(k, k) for k in range(1, 6)]
    assert seen == [(1, 3, None), (2, 3, None), (3, 3, 3.0), (4, 5, None), (5, 5, None), ("stop", 5, 5)]
    assert order == [("dispatch", 1), ("dispatch", 2), ("dispatch", 3), ("record", 1), ("record", 2), ("record", 3),
                     ("dispatch", 4), ("dispatch", 5), ("record", 4), ("record", 5)]


def test_train_runs_its_loop_with_the_programs_bound(monkeypatch, tmp_path):
    """`shardlib train` hands the loop the bound its program's step was built with, and its batches
    are on the devices, in the step's batch sharding, when the loop loads them (a step ahead)."""
    import shardlib.run.loop as loop_lib
    from shardlib.run.train import TrainConfig, train

    seen = {}
    real = loop_lib.run_steps

    def spy(state, first, last, step, load, **kwargs):
        seen["steps_in_flight"] = kwargs["steps_in_flight"]
        loaded = load(first)
        seen["placed"] = all(isinstance(x, jax.Array) for x in jax.tree.leaves(loaded))
        return real(state, first, last, step, load, **kwargs)

    monkeypatch.setattr(loop_lib, "run_steps", spy)
    config = TrainConfig(model="tiny", strategy="dp", cpu_devices=None, batch_size=16, seq_len=32,
                         steps=3, eval_every=0, sample_tokens=0, progress=False, verbose=False, tensorboard=False,
                         out=str(tmp_path / "run"))
    with shardlib.backend.forced("tpu"):
        result = train(config)
    assert seen == {"steps_in_flight": 2, "placed": True}
    assert [r["step"] for r in result.records] == [1, 2, 3]
