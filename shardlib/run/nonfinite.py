"""Non-finite steps: the action that stops a run after too many in a row.

A step whose loss or gradient norm is NaN/Inf is skipped by the step itself (parameters and
optimizer state stay as they were, ``metrics["skipped"] == 1``) and `Checkpointer.save`
refuses to save it. `NonFiniteGuard` ends the run after ``max_skips`` skipped steps in a row,
because by then the run is not going to recover on its own; the last good checkpoint stays.
Light at import: `shardlib train` reads `DivergedError` before JAX starts.
"""

from __future__ import annotations

from typing import Any


class DivergedError(RuntimeError):
    """``max_skips`` consecutive steps had a non-finite loss or gradient: the run cannot go on."""

    def __init__(self, step: int, skips: int, last_good: int | None, directory: str | None) -> None:
        self.step, self.skips, self.last_good = step, skips, last_good
        where = (f"the last good checkpoint is step {last_good} in {directory}; resume from it with a lower --lr"
                 if last_good is not None else "no checkpoint was saved (pass --ckpt-every to keep good states)")
        super().__init__(
            f"stopped after step {step}: {skips} consecutive steps had a non-finite loss or gradient norm and were "
            f"skipped (--max-skips {skips}); {where}"
        )


class SkipCounter:
    """Counts consecutive skipped steps; ``max_skips=0`` never stops the run."""

    def __init__(self, max_skips: int) -> None:
        self.max_skips = int(max_skips)
        self.consecutive = 0

    def record(self, skipped: bool) -> bool:
        """Count one step; True when the run must stop (``max_skips`` skipped steps in a row)."""
        self.consecutive = self.consecutive + 1 if skipped else 0
        return self.max_skips > 0 and self.consecutive >= self.max_skips


class NonFiniteGuard:
    """Action: raise `DivergedError` at the ``max_skips``-th skipped step in a row.

    The last action of a step's record, so that step is logged first. ``ckpt`` (or None) names
    the last good checkpoint in the error; a save still in flight is waited for, as it is the
    one to name. The steps after it already in flight (`BackendPolicy.steps_in_flight`) may be
    saved before this record is read; a save refuses a state whose step's loss was not finite
    (`shardlib.runtime.checkpoint`), so none of them can replace the good checkpoint.
    """

    def __init__(self, max_skips: int, ckpt: Any | None) -> None:
        self.skips = SkipCounter(max_skips)
        self.ckpt = ckpt

    def __call__(self, step: int, state: Any, record: dict[str, Any]) -> None:
        if not self.skips.record(bool(record["skipped"])):
            return
        if self.ckpt is not None:
            self.ckpt.wait()
        raise DivergedError(step, self.skips.consecutive, self.ckpt.latest_step() if self.ckpt else None,
                            self.ckpt.directory if self.ckpt else None)

    def close(self) -> None:
        pass

