"""Preemption: SIGTERM or Ctrl-C (SIGINT) means "finish this step, record it, save it, exit 0".

`shardlib.runtime.checkpoint.PreemptionGuard` catches the signal (or asks JAX's preemption
service); `Preemption` is the loop's side of it. Without checkpointing nothing catches them:
SIGTERM ends the process and Ctrl-C raises KeyboardInterrupt.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

from shardlib.run.checkpointing import SaveCheckpoint


@contextlib.contextmanager
def preemption_guard(enabled: bool) -> Iterator[Any]:
    """A `shardlib.runtime.checkpoint.PreemptionGuard`, or None when disabled or off the main thread.

    Python delivers signals to the main thread only; a loop running elsewhere (a notebook
    thread) keeps SIGTERM's default behaviour unless JAX's preemption service handles it.
    With that service (multi-process jobs) only SIGTERM is caught there; Ctrl-C interrupts.
    """
    if not enabled:
        yield None
        return
    from shardlib.runtime.checkpoint import PreemptionGuard

    with contextlib.ExitStack() as stack:
        try:
            guard = stack.enter_context(PreemptionGuard(signals=STOP_SIGNALS))
        except RuntimeError:  # the guard refuses a thread signals never reach, unless JAX's service holds them
            if threading.current_thread() is threading.main_thread():
                raise
            guard = None
        yield guard


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # a scheduler's preemption notice, and Ctrl-C


def stop_line(step: int, saved: int | None, directory: str, *, signal_name: str = "SIGTERM",
              resume: str = "run the same command again to resume") -> str:
    """The one line a stopped run prints before exiting 0; ``resume`` says how to continue."""
    where = f"checkpoint step {saved} in {directory}" if saved is not None else f"no checkpoint could be saved in {directory}"
    heading = "stopped  " if signal_name.startswith("Ctrl-C") else "preempted"
    return f"{heading}  {signal_name} received: stopped after step {step}; {where}; {resume}"


class Preemption:
    """Asked after every step but the last whether to stop; on a stop, saves that step.

    The loop records the steps it still holds before calling it, so the metrics of every saved
    step are logged. A step already saved on the checkpoint schedule is not saved twice.
    """

    def __init__(self, guard: Any, saver: SaveCheckpoint, last_step: int, resume: str) -> None:
        self.guard, self.saver, self.last_step, self.resume = guard, saver, last_step, resume
        self.stopped_at: int | None = None

    def should_stop(self, step: int) -> bool:
        return step < self.last_step and self.guard.should_stop(step)

    def __call__(self, step: int, state: Any, metrics: Any) -> None:
        if self.saver.saved != step:
            self.saver.save(step, state, metrics)
        self.stopped_at = step

    def stop_line(self) -> str:
        received = getattr(self.guard, "received", None)  # None: JAX's preemption service (SIGTERM)
        name = "Ctrl-C (SIGINT)" if received == signal.SIGINT else "SIGTERM"
        return stop_line(self.stopped_at, self.saver.ckpt.latest_step(), self.saver.ckpt.directory,
                         signal_name=name, resume=self.resume)


@contextlib.contextmanager
def preemption(saver: SaveCheckpoint | None, last_step: int, resume: str) -> Iterator[Preemption | None]:
    """A `Preemption` for the loop while SIGTERM and Ctrl-C are caught; None when the run does not checkpoint."""
    with preemption_guard(saver is not None) as guard:
        yield None if guard is None else Preemption(guard, saver, last_step, resume)
