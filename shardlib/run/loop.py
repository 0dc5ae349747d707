"""The step loop: dispatch a step, record the one before it, run the actions.

One step stays in flight while the previous one is recorded, which keeps the device busy: a
step's metrics are read (blocking) only after the next step has been dispatched. A step whose
record reads the state (a validation) is recorded at once instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from shardlib.run.actions import Action, StepClock


class Recorder:
    """Turns a step's metrics into its record, once they are ready, and hands it to the actions in order."""

    def __init__(self, actions: Sequence[Action], clock: StepClock, *, tokens_per_step: int,
                 at_once: Callable[[int], bool]) -> None:
        self.actions, self.clock, self.tokens_per_step, self.at_once = actions, clock, tokens_per_step, at_once

    def __call__(self, step: int, metrics: dict[str, Any], state: Any) -> None:
        import jax

        with self.clock.waiting():
            values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        step_time = self.clock.lap()
        record = {"step": step, "loss": values["loss"], "lr": values.get("lr"), "grad_norm": values["grad_norm"],
                  "accuracy": values.get("accuracy"), "skipped": int(values["skipped"]),
                  "tokens_per_s": self.tokens_per_step / step_time, "step_time_s": step_time,
                  **({"loss_scale": values["loss_scale"]} if "loss_scale" in values else {})}
        for action in self.actions:
            action(step, state, record)


def run_steps(state: Any, first: int, last: int, step: Callable, load: Callable[[int], Any], *,
              record: Recorder, after_step: Sequence[Callable[[int, Any, Any], None]] = (),
              preemption: Any | None = None) -> Any:
    """Steps ``first + 1`` .. ``last`` (1-based); returns the final state.

    ``step(k, state, batch)`` runs step k; ``load(i)`` is the 0-based batch i. ``after_step``
    actions (checkpoint saves) see each dispatched step's state and metrics. ``preemption``
    (or None) is asked after every step whether to stop; on a stop the steps still held are
    recorded first, then it saves the step.
    """
    batch = load(first) if first < last else None
    pending: tuple[int, Any] | None = None
    record.clock.restart()
    for k in range(first + 1, last + 1):
        with record.clock.waiting():  # dispatch may block until the peers reach this step (CPU collectives)
            state, metrics = step(k, state, batch)
        batch = load(k) if k < last else None
        if pending is not None:
            record(*pending, state)
            pending = None
        if record.at_once(k):
            record(k, metrics, state)
        else:
            pending = (k, metrics)
        with record.clock.waiting():  # a save waits for the step, and so for its slowest process
            for action in after_step:
                action(k, state, metrics)
        if preemption is not None and preemption.should_stop(k):
            if pending is not None:
                record(*pending, state)
            preemption(k, state, metrics)
            return state
    if pending is not None:
        record(*pending, state)
    return state
