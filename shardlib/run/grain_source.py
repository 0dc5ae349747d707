"""A Grain pipeline as the train loop's loader: batches read in order, and the data state of each step to save.

The loop (`shardlib.run.loop.run_steps`) loads batch k right after dispatching step k, before
step k's checkpoint is saved, so the live iterator is one batch past what step k trained on.
A checkpoint of step k must hold the state *before batch k was read* (after batch k-1): this
loader keeps that snapshot as it reads, and `state_at(k)` hands it to the save. A resume then
reads batch k first: no example lost or read twice.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shardlib.runtime.grain_data import GrainBatches

BATCH_KEYS = ("inputs", "targets")


class GrainLoader:
    """``batch(i)`` (0-based, in order) and ``state_at(step)`` over a `GrainBatches`; ``seed`` is the run's."""

    def __init__(self, batches: GrainBatches, *, seed: int) -> None:
        self.batches, self.seed, self.rows = batches, seed, batches.rows
        self._before: dict[int, dict[str, Any]] = {}  # batch index -> the data state just before it was read

    @property
    def step(self) -> int:
        """Batches read so far (after a restore: the checkpoint's step)."""
        return self.batches.step

    def batch(self, index: int) -> Any:
        if index != self.batches.step:
            raise ValueError(f"a Grain pipeline is read in order: batch {index} was asked for, the next is "
                             f"{self.batches.step}")
        self._before = {index: self.batches.state()}  # the only step a save can still ask for before the next read
        batch = next(self.batches)
        missing = [k for k in BATCH_KEYS if not isinstance(batch, dict) or k not in batch]
        if missing:
            raise ValueError(f"the Grain pipeline's examples lack {missing}: train() needs each example as a dict "
                             "with 'inputs' and 'targets', int token arrays of length --seq-len (other keys are ignored)")
        return {k: np.asarray(batch[k], np.int32) for k in BATCH_KEYS}

    def state_at(self, step: int) -> dict[str, Any]:
        """The data state after ``step`` batches were read: what a checkpoint of ``step`` saves."""
        if step == self.batches.step:
            return self.batches.state()
        if step in self._before:
            return self._before[step]
        raise ValueError(f"no data state for step {step}: the loader has read {self.batches.step} batches")

    def restore(self, state: Any) -> None:
        self.batches.restore(state)
        self._before = {}
