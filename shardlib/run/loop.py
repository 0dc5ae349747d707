"""The step loop: dispatch a step, place the next batch, record the oldest step held, run the actions.

Reading a step's metrics blocks until the step is done, so the loop reads them only after later
steps are dispatched: step k is recorded after step ``k + steps_in_flight`` is dispatched, and the
device always has the next step queued while the host reads, logs and saves. The next batch is
loaded onto the devices right after a step is dispatched, so its host-to-device copy overlaps
that step. ``steps_in_flight`` is the backend policy's (`shardlib.backend`), as the program's
step read it when it was built: 1 on XLA:CPU, whose simulated collectives deadlock with long
queues (one step held while the next runs, two on the devices at most); 2 on GPU and TPU,
where a record (and a host that falls behind for a step) never leaves the device idle. A step
whose record reads the state (a validation) is recorded at once instead, after the steps held
before it: records reach the actions in step order.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

from shardlib.run.actions import Action, StepClock


class Recorder:
    """Turns a step's metrics into its record, once they are ready, and hands it to the actions in order."""

    def __init__(self, actions: Sequence[Action], clock: StepClock, *, tokens_per_step: int,
                 at_once: Callable[[int], bool], devices: int = 1,
                 pad_fraction: Callable[[int], float | None] | None = None) -> None:
        """``pad_fraction(i)``: the padding positions over all positions of batch ``i`` (0-based;
        the loader's, None where it cannot say), recorded as ``pad_fraction``."""
        self.actions, self.clock, self.tokens_per_step, self.at_once = actions, clock, tokens_per_step, at_once
        self.devices, self.pad_fraction = devices, pad_fraction

    def __call__(self, step: int, metrics: dict[str, Any], state: Any) -> None:
        import jax

        with self.clock.waiting():
            values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        step_time = self.clock.lap()
        record = {"step": step, "loss": values["loss"], "lr": values.get("lr"), "grad_norm": values["grad_norm"],
                  "accuracy": values.get("accuracy"), "skipped": int(values["skipped"]),
                  "tokens_per_s": self.tokens_per_step / step_time,
                  "tokens_per_s_per_device": self.tokens_per_step / step_time / self.devices, "step_time_s": step_time,
                  **({"loss_scale": values["loss_scale"]} if "loss_scale" in values else {}),
                  **_padding(self.pad_fraction, step),
                  **device_memory(), **model_metrics(values)}
        for action in self.actions:
            action(step, state, record)


def _padding(pad_fraction: Callable[[int], float | None] | None, step: int) -> dict[str, float]:
    fraction = None if pad_fraction is None else pad_fraction(step - 1)
    return {} if fraction is None else {"pad_fraction": fraction}


def device_memory() -> dict[str, int]:
    """The largest ``bytes_in_use`` and ``peak_bytes_in_use`` over this process's devices, as the
    backend reports them (GPU, TPU); XLA:CPU reports none, and the record then has neither."""
    import jax

    stats = [s for s in (d.memory_stats() for d in jax.local_devices()) if s]
    fields = (("memory_in_use_bytes", "bytes_in_use"), ("memory_peak_bytes", "peak_bytes_in_use"))
    return {name: max(s[key] for s in stats) for name, key in fields if stats and all(key in s for s in stats)}


# What the step reports besides the model's own aux metrics (`shardlib.step.update.Update.metrics`).
STEP_METRICS = ("loss", "grad_norm", "skipped", "loss_scale", "accuracy")


def model_metrics(values: dict[str, float]) -> dict[str, float]:
    """The model's own scalar metrics (its loss's aux beyond accuracy: an MoE model's routing
    balance, `models.moe`), written into the record under their names; learning rates excluded."""
    return {k: v for k, v in values.items() if k not in STEP_METRICS and k != "lr" and not k.startswith("lr/")}


def run_steps(state: Any, first: int, last: int, step: Callable, load: Callable[[int], Any], *,
              record: Recorder, after_step: Sequence[Callable[[int, Any, Any], None]] = (),
              preemption: Any | None = None, steps_in_flight: int = 1) -> Any:
    """Steps ``first + 1`` .. ``last`` (1-based); returns the final state.

    ``step(k, state, batch)`` runs step k; ``load(i)`` is the 0-based batch i, on the devices
    (it is called right after the step before it is dispatched, so its copy overlaps that step).
    Step k is recorded after step ``k + steps_in_flight`` is dispatched (at once when
    ``record.at_once(k)``, after the steps held before it), so records reach the actions in
    step order. ``after_step`` actions (checkpoint saves) see each dispatched step's state and
    metrics. ``preemption`` (or None) is asked after every step whether to stop; on a stop the
    steps still held are recorded first, then it saves the step.
    """
    if steps_in_flight < 1:
        raise ValueError(f"steps_in_flight must be at least 1, got {steps_in_flight}")
    batch = load(first) if first < last else None
    pending: collections.deque[tuple[int, Any]] = collections.deque()  # dispatched, not yet recorded, oldest first
    record.clock.restart()
    for k in range(first + 1, last + 1):
        with record.clock.waiting():  # dispatch may block until the peers reach this step (CPU collectives)
            state, metrics = step(k, state, batch)
        batch = load(k) if k < last else None
        while len(pending) >= steps_in_flight:
            record(*pending.popleft(), state)
        if record.at_once(k):
            while pending:
                record(*pending.popleft(), state)
            record(k, metrics, state)
        else:
            pending.append((k, metrics))
        with record.clock.waiting():  # a save waits for the step, and so for its slowest process
            for action in after_step:
                action(k, state, metrics)
        if preemption is not None and preemption.should_stop(k):
            while pending:
                record(*pending.popleft(), state)
            preemption(k, state, metrics)
            return state
    while pending:
        record(*pending.popleft(), state)
    return state
