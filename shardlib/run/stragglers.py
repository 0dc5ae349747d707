"""Straggler detection: which process makes every step of a multi-process job wait.

In a synchronous job every process's step takes as long as the slowest one's: the others wait
for it inside the step's collectives. So each process splits its step time (the
`shardlib.run.actions.StepClock` lap) into the part it spent blocked on the device (dispatching
the step, reading its metrics, saving it: ``StepClock.last_wait``) and the rest, its own host
work. Every ``--straggler-every`` steps one small collective gathers each process's means over
that window, and process 0 works out each process's *own* step time: its host work plus the
least any process waited, which is the device's share of a step (the slowest process waits
least, for the computation alone). A process whose own time exceeds ``--straggler-factor`` x the
median of the other processes' for the window is named (process index and host) in a warning;
every window's own times go into ``metrics.jsonl`` as ``process_step_time_s`` on that step's
record.

Limits: this sees time a process spends on the host (input pipeline, Python, GC, a busy or
throttled CPU). A slow accelerator inside one step shows up as waiting on
every process alike, so it is not attributed to one process.
"""

from __future__ import annotations

import socket
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

from shardlib.run.config import TrainConfig

DEFAULT_EVERY = 50  # steps per window when several processes run and --straggler-every is not given
HOSTNAME_BYTES = 64


def own_step_times(laps: Sequence[float], waits: Sequence[float]) -> list[float]:
    """Each process's host work (lap less its wait) plus the least wait of any process (the device's share)."""
    least = min(waits)
    return [lap - (wait - least) for lap, wait in zip(laps, waits)]


def stragglers(own: Sequence[float], factor: float) -> list[tuple[int, float, float]]:
    """(process, its own time, the median of the others') for each process slower than ``factor`` x that median."""
    found = []
    for index, mine in enumerate(own):
        others = statistics.median(own[:index] + own[index + 1:]) if len(own) > 1 else mine
        if mine > factor * others:
            found.append((index, mine, others))
    return found


def _allgather(values: Any) -> Any:
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(values)


class Stragglers:
    """Action: gather the window's step and wait times every ``every`` steps; process 0 records and warns.

    The first step this process runs (compilation) is left out of the windows.
    """

    def __init__(self, every: int, factor: float, clock: Any, *, process_index: int,
                 gather: Callable[[Any], Any] = _allgather) -> None:
        self.every, self.factor, self.clock, self.gather = every, factor, clock, gather
        self.is_main = process_index == 0
        self.laps: list[float] = []
        self.waits: list[float] = []
        self.first: int | None = None
        self.hosts: list[str] | None = None

    def __call__(self, step: int, state: Any, record: dict[str, Any]) -> None:
        if self.first is None:
            self.first = step  # compilation: not a measure of the process
        else:
            self.laps.append(record["step_time_s"])
            self.waits.append(self.clock.last_wait)
        if step % self.every == 0 and self.laps:
            self._report(step, record)

    def _report(self, step: int, record: dict[str, Any]) -> None:
        import numpy as np

        if self.hosts is None:
            self.hosts = _gather_hostnames(self.gather)
        table = np.asarray(self.gather(np.array([np.mean(self.laps), np.mean(self.waits)])))
        own = own_step_times(table[:, 0].tolist(), table[:, 1].tolist())
        record["process_step_time_s"] = own
        window = f"steps {step - len(self.laps) + 1}-{step}"
        self.laps, self.waits = [], []
        if not self.is_main:
            return
        for index, mine, median in stragglers(own, self.factor):
            print(f"warning: straggler: process {index} (host {self.hosts[index]}) took {mine:.3f} s a step over "
                  f"{window}, {mine / median:.1f}x the median of the other processes ({median:.3f} s; "
                  f"--straggler-factor {self.factor:g})", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


class Off:
    """Action that does nothing: one process, or ``--straggler-every 0``."""

    def __call__(self, step: int, state: Any, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def straggler_action(config: TrainConfig, clock: Any) -> Stragglers | Off:
    """The run's straggler action from ``--straggler-every`` / ``--straggler-factor``."""
    import jax

    every, factor = config.straggler_every, config.straggler_factor  # in range: `check_numbers`
    if jax.process_count() == 1:
        if every and jax.process_index() == 0:
            print(f"note: --straggler-every {every} ignored: one process, no other to compare it with",
                  file=sys.stderr, flush=True)
        return Off()
    every = DEFAULT_EVERY if every is None else every
    return Stragglers(every, factor, clock, process_index=jax.process_index()) if every else Off()


def _gather_hostnames(gather: Callable[[Any], Any]) -> list[str]:
    """Every process's hostname, through the same gather (fixed-size UTF-8 bytes)."""
    import numpy as np

    mine = socket.gethostname().encode()[:HOSTNAME_BYTES].ljust(HOSTNAME_BYTES, b"\0")
    table = np.asarray(gather(np.frombuffer(mine, dtype=np.uint8)))
    return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in table.astype(np.uint8)]

