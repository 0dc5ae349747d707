"""Fault tolerance pieces of the training loop: stop on repeated non-finite steps, record the
examples each step consumed, poison chosen steps (test hook), and the preemption guard.

Kept apart from `shardlib.run.train` so the loop only says *when* these happen. How they fit:

- A step whose loss or gradient norm is NaN/Inf is skipped by the step itself (parameters and
  optimizer state stay as they were, ``metrics["skipped"] == 1``) and `Checkpointer.save`
  refuses to save it. `SkipCounter` ends the run after ``max_skips`` skipped steps in a row,
  because by then the run is not going to recover on its own; the last good checkpoint stays.
- `ExampleLog` writes which training windows every step read (``examples.jsonl``), so a run
  restarted after a crash can be checked to have read every example exactly once.
- `preemption_guard` turns SIGTERM into "finish this step, save, exit 0".
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

EXIT_DIVERGED = 3  # `shardlib train` exit status when the run stopped on non-finite steps


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


# --------------------------------------------------------------------------------------------
# Which examples each step read
# --------------------------------------------------------------------------------------------


def examples_path(out_dir: str | os.PathLike[str], process_index: int, process_count: int) -> Path:
    """``examples.jsonl`` for a single process; ``examples.process<i>.jsonl`` for each of several."""
    name = "examples.jsonl" if process_count == 1 else f"examples.process{process_index}.jsonl"
    return Path(out_dir) / name


def read_examples(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of an examples file, in order: ``{"step": k, "starts": [...]}``."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class ExampleLog:
    """One line per step: the window start offsets (into the train split) of this process's rows.

    ``step`` k is the batch the k-th update consumed (1-based, as in ``metrics.jsonl``). Like
    the metrics log, a run resumed from a checkpoint after ``resume_step`` updates first drops
    the lines of later steps (written by the interrupted run, whose updates were lost), so the
    file describes exactly the data the final state was trained on. Each process writes its own
    file (its own rows); a disabled log writes nothing.
    """

    def __init__(self, path: Path, *, enabled: bool, resume_step: int | None) -> None:
        self.path = path
        self._file = None
        if not enabled:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and path.exists():
            kept = [r for r in read_examples(path) if r["step"] <= resume_step]
            path.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        elif path.exists():
            path.unlink()  # a fresh run in an old directory
        self._file = open(path, "a", encoding="utf-8")

    def write(self, step: int, starts: np.ndarray) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps({"step": int(step), "starts": [int(s) for s in starts]}) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def loader_window_starts(loader: Any, step: int) -> np.ndarray:
    """The window starts of this process's rows of batch ``step`` of a `shardlib.runtime.data.ByteBatches`.

    The same computation as ``ByteBatches.batch``: a window starting at s reads s .. s+seq_len.
    """
    from shardlib.runtime.data import train_window_starts

    n_starts = len(loader.data) - loader.seq_len
    return train_window_starts(loader.seed, step, loader.global_batch_size, n_starts)[loader.rows]


# --------------------------------------------------------------------------------------------
# Test hook: a step whose loss is NaN
# --------------------------------------------------------------------------------------------


def poisoned_model(model: Any) -> Any:
    """``model`` with a NaN loss (and so NaN gradients): what a diverging step looks like.

    Used only for the steps listed in ``TrainConfig.inject_nan_steps`` (hidden flag
    ``--inject-nan-steps``), so tests can drive the non-finite guard end to end. Parameters
    and layout are the model's own, so its compiled step takes and returns the same state.
    """
    import jax.numpy as jnp

    def loss(params: Any, batch: Any, specs: Any = None) -> tuple[Any, dict[str, Any]]:
        value, aux = model.loss(params, batch, specs)
        return value * jnp.float32(jnp.nan), aux

    return dataclasses.replace(model, loss=loss)


def parse_steps(text: str) -> tuple[int, ...]:
    """``"3,5-7"`` -> (3, 5, 6, 7): the value of ``--inject-nan-steps``."""
    steps: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, _, last = part.partition("-")
        steps.extend(range(int(first), int(last or first) + 1))
    return tuple(steps)


# --------------------------------------------------------------------------------------------
# Preemption
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def preemption_guard(enabled: bool) -> Iterator[Any]:
    """A `shardlib.runtime.checkpoint.PreemptionGuard`, or None when disabled or off the main thread.

    Python delivers signals to the main thread only; a loop running elsewhere (a notebook
    thread) keeps SIGTERM's default behaviour unless JAX's preemption service handles it.
    """
    if not enabled:
        yield None
        return
    from shardlib.runtime.checkpoint import PreemptionGuard, _preemption_sync_available

    if threading.current_thread() is not threading.main_thread() and not _preemption_sync_available():
        yield None
        return
    with PreemptionGuard() as guard:
        yield guard


def stop_line(step: int, saved: int | None, directory: str) -> str:
    """The one line a preempted run prints before exiting 0."""
    where = f"checkpoint step {saved} in {directory}" if saved is not None else f"no checkpoint could be saved in {directory}"
    return f"preempted  SIGTERM received: stopped after step {step}; {where}; run the same command again to resume"
