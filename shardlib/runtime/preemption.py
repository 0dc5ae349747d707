"""Preemption: SIGTERM (the usual notice) becomes a step at which every process stops.

`shardlib.runtime.checkpoint` re-exports `PreemptionGuard`, where users import it from; the
training loop's side of it is `shardlib.run.preemption`.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

log = logging.getLogger("shardlib.runtime.preemption")


def preemption_sync_available() -> bool:
    """True when jax.distributed runs a preemption sync manager (which owns SIGTERM)."""
    from shardlib.compat import distributed_state

    state = distributed_state()
    return state.client is not None and getattr(state, "preemption_sync_manager", None) is not None


class PreemptionGuard:
    """Turns SIGTERM (the usual preemption notice) into a step at which every process stops.

    Single process: a handler sets a flag, and ``should_stop(step)`` returns it. Multi-process
    without JAX's preemption service: the flag is or-ed over processes (one tiny all-gather per
    call). Multi-process with ``jax.distributed`` initialised: JAX's preemption service
    already catches SIGTERM on each host and agrees on a sync step over the coordinator, so no
    Python handler is installed (it would replace JAX's) and ``should_stop`` asks
    ``multihost_utils.reached_preemption_sync_point(step)``; it is True on the same step on all
    processes. That protocol needs every process to call ``should_stop`` at every step.

    How a training loop uses it (``step`` counts completed steps, as the loader state does)::

        with PreemptionGuard() as guard, Checkpointer(dir, every=k) as ckpt:
            for step in range(start + 1, total + 1):
                state, metrics = program.step(state, next(batches))
                if ckpt.should_save(step):
                    ckpt.save(step, state, data_state=batches.state(), config=cfg, metrics=metrics)
                if guard.should_stop(step):                       # finish the current step, then
                    ckpt.save(step, state, data_state=batches.state(), config=cfg, force=True)
                    ckpt.wait()                                   # the save must commit
                    return 0                                      # exit 0: a clean stop, resumable
    """

    def __init__(self, signals: Sequence[int] = (signal.SIGTERM,)) -> None:
        self.signals = tuple(signals)
        self._event = threading.Event()
        self._previous: dict[int, Any] = {}
        self.synced = False
        self._logged = False
        self.received: int | None = None  # the signal that asked to stop (None: none, or JAX's service holds it)

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = signum
        self._event.set()  # nothing else: a handler must not take locks (logging) the loop may hold

    def __enter__(self) -> PreemptionGuard:
        self.synced = preemption_sync_available()
        if self.synced:
            return self
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionGuard must be entered on the main thread (Python delivers signals there)")
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    @property
    def requested(self) -> bool:
        """A stop signal arrived on this process (always False in synced mode: JAX holds it)."""
        return self._event.is_set()

    def should_stop(self, step: int) -> bool:
        """True on the step at which the loop should save (force=True), wait and exit 0."""
        from jax.experimental import multihost_utils

        if self.synced:
            stop = bool(multihost_utils.reached_preemption_sync_point(int(step)))
        elif jax.process_count() > 1:  # no preemption service: agree with one tiny all-gather
            stop = bool(np.asarray(multihost_utils.process_allgather(np.array([self.requested], np.int32))).any())
        else:
            stop = self.requested
        if stop and not self._logged:
            self._logged = True
            log.warning("preemption requested: saving a checkpoint and stopping after step %d", step)
        return stop