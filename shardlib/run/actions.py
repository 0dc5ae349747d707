"""Periodic actions of the training loop: small objects called with each step's record.

An action is ``action(step, state, record)`` plus ``close()``; ``step`` is 1-based (the state
after that many updates), ``record`` the step's numbers as host floats, in the order
``metrics.jsonl`` writes them. `Every` says when a periodic action is due. The other actions
live with their concern: `shardlib.run.metrics_io.MetricsLog`, `shardlib.run.examples.ExampleLog`,
`shardlib.run.nonfinite.NonFiniteGuard`, `shardlib.run.checkpointing.SaveCheckpoint`.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol


class Action(Protocol):
    def __call__(self, step: int, state: Any, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class Every:
    """Due every ``n`` steps (never when ``n`` is 0), and at step ``last`` when given."""

    def __init__(self, n: int, *, last: int | None = None) -> None:
        self.n, self.last = n, last

    def __call__(self, step: int) -> bool:
        return bool(self.n and step % self.n == 0) or step == self.last


class StepClock:
    """The time between consecutive steps' metrics, less the time spent validating.

    The loop records a step only after later ones are dispatched (`shardlib.run.loop`), so host
    work on a record (logs, files) overlaps the steps queued on the device and is part of their
    time; a validation is not. ``last_wait`` is the part of the last lap spent blocked on the
    device (`waiting`), which straggler detection (`shardlib.run.stragglers`) tells apart from
    the process's own work.
    """

    def __init__(self) -> None:
        self._since = time.perf_counter()
        self._waiting = 0.0
        self.last_wait = 0.0

    def restart(self) -> None:
        self._since = time.perf_counter()
        self._waiting = 0.0

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Count the time inside as spent waiting for the device (and, through it, for the other processes)."""
        since = time.perf_counter()
        try:
            yield
        finally:
            self._waiting += time.perf_counter() - since

    def lap(self) -> float:
        """Seconds since the last lap (or restart), and starts the next."""
        now = time.perf_counter()
        elapsed, self._since = now - self._since, now
        self.last_wait, self._waiting = self._waiting, 0.0
        return elapsed


class Evaluate:
    """Action: the validation loss of the step's state, as ``val_loss``, when ``due``.

    It reads the state, so the loop records a due step at once (after the steps it still holds)
    instead of ``steps_in_flight`` steps later.
    """

    def __init__(self, evaluate: Callable[[Any], float], due: Callable[[int], bool], clock: StepClock) -> None:
        self.evaluate, self.due, self.clock = evaluate, due, clock

    def __call__(self, step: int, state: Any, record: dict[str, Any]) -> None:
        if self.due(step):
            record["val_loss"] = self.evaluate(state)
            self.clock.restart()  # validation time is not charged to the next step

    def close(self) -> None:
        pass


class Tally:
    """Action: what the summary needs, each step's time and the latest losses."""

    def __init__(self) -> None:
        self.step_times: list[float] = []
        self.last_loss = math.nan
        self.last_val: float | None = None

    def __call__(self, step: int, state: Any, record: dict[str, Any]) -> None:
        self.step_times.append(record["step_time_s"])
        self.last_loss = record["loss"]
        self.last_val = record.get("val_loss", self.last_val)

    def close(self) -> None:
        pass


# Model metrics the progress line shows when the step reports them: (record key, label, format).
# An MoE model's routing balance (`models.moe.balance_metrics`).
PROGRESS_EXTRAS = (
    ("expert_max_over_mean", "experts max/mean", ".2f"),
    ("expert_min_over_mean", "min/mean", ".2f"),
    ("expert_cv", "cv", ".2f"),
    ("tokens_dropped", "dropped", ".0f"),
    ("aux_loss", "aux", ".3f"),
)


def interactive() -> bool:
    """Whether a progress bar can redraw in place: a terminal on both streams, or a notebook. In a
    file its carriage returns make one line of every refresh (20 kB over 100 steps)."""
    import sys

    return "ipykernel" in sys.modules or all(getattr(s, "isatty", lambda: False)() for s in (sys.stdout, sys.stderr))


class Progress:
    """Action: a tqdm bar, whose numbers refresh every ``log_every`` steps, at each validation
    and at the last step; with the bar off, those numbers as printed lines instead, with the
    learning rate, gradient norm and the time left."""

    def __init__(self, *, total: int, initial: int, log_every: int, bar: bool, lines: bool) -> None:
        from tqdm import tqdm  # plain text bar: works in terminals, logs and notebooks without ipywidgets

        self.bar = tqdm(total=total, initial=initial, disable=not bar, desc="train", unit="step", dynamic_ncols=True)
        self.total, self.log_every, self.lines = total, log_every, lines
        self.last_val: float | None = None
        self.started, self.initial = time.perf_counter(), initial

    def __call__(self, step: int, state: Any, record: dict[str, Any]) -> None:
        self.bar.update(1)
        self.last_val = record.get("val_loss", self.last_val)
        if step % self.log_every and "val_loss" not in record and step != self.total:
            return
        shown = {"loss": f"{record['loss']:.3f}", "tok/s": f"{record['tokens_per_s']:.0f}",
                 "step": f"{record['step_time_s']:.2f}s"}
        if self.last_val is not None:
            shown["val"] = f"{self.last_val:.3f}"
        shown.update({label: f"{record[key]:{fmt}}" for key, label, fmt in PROGRESS_EXTRAS if key in record})
        self.bar.set_postfix(shown, refresh=True)
        if self.lines:
            print(f"step {step}/{self.total}: " + " ".join(f"{k} {v}" for k, v in self._line(step, record, shown)),
                  flush=True)

    def _line(self, step: int, record: dict[str, Any], shown: dict[str, str]) -> list[tuple[str, str]]:
        """The printed line's numbers: the bar's, with lr and grad_norm, and the time left at the pace so far."""
        pace = (time.perf_counter() - self.started) / max(step - self.initial, 1)
        left = round(pace * (self.total - step))
        extra = [(key, f"{record[key]:.3g}") for key in ("lr", "grad_norm") if record.get(key) is not None]
        return [("loss", shown.pop("loss")), *extra, *shown.items(), ("left", f"{left // 60}:{left % 60:02d}")]

    def close(self) -> None:
        self.bar.close()
