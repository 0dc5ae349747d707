"""Which training windows each step read (``examples.jsonl``), as a per-step action.

A run restarted after a crash can then be checked to have read every example exactly once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardlib.runtime.files import make_dir, no_follow, refuse_link, write_atomic

if TYPE_CHECKING:
    import numpy as np


def examples_path(out_dir: str | os.PathLike[str], process_index: int, process_count: int) -> Path:
    """``examples.jsonl`` for a single process; ``examples.process<i>.jsonl`` for each of several."""
    name = "examples.jsonl" if process_count == 1 else f"examples.process{process_index}.jsonl"
    return Path(out_dir) / name


def read_examples(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of an examples file, in order: ``{"step": k, "starts": [...]}``."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def loader_window_starts(loader: Any, step: int) -> np.ndarray:
    """The window starts of this process's rows of batch ``step`` of a `shardlib.runtime.data.ByteBatches`.

    The same computation as ``ByteBatches.batch``: a window starting at s reads s .. s+seq_len.
    """
    from shardlib.runtime.data import train_window_starts

    n_starts = len(loader.data) - loader.seq_len
    return train_window_starts(loader.seed, step, loader.global_batch_size, n_starts)[loader.rows]


class ExampleLog:
    """Action: one line per step, the window start offsets (into the train split) of this process's rows.

    ``step`` k is the batch the k-th update consumed (1-based, as in ``metrics.jsonl``). Like
    the metrics log, a run resumed from a checkpoint after ``resume_step`` updates first drops
    the lines of later steps (written by the interrupted run, whose updates were lost), so the
    file describes exactly the data the final state was trained on. Each process writes its own
    file (its own rows); a disabled log writes nothing. It runs as soon as step k is dispatched,
    before that step's checkpoint save: a save commits only once every process has reached it,
    so no checkpoint holds a step whose windows some process has not yet written (a record read
    one step later, with the metrics, could be lost with a killed process whose peers' save of
    that step had already committed). It also comes before the step's metrics line.
    """

    def __init__(self, path: Path, loader: Any, *, enabled: bool, resume_step: int | None) -> None:
        self.path = path
        self.loader = loader
        self._file = None
        if not enabled:
            return
        make_dir(path.parent, "a run's outputs")
        refuse_link(path, "a run's examples")
        if resume_step is not None and path.exists():
            kept = [r for r in read_examples(path) if r["step"] <= resume_step]
            write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept), what="a run's examples")
        elif path.exists():
            path.unlink()  # a fresh run in an old directory
        self._file = open(path, "a", encoding="utf-8", opener=no_follow)

    def __call__(self, step: int, state: Any, metrics: Any) -> None:
        if self._file is None:
            return
        starts = loader_window_starts(self.loader, step - 1)  # batch index: 0-based
        self._file.write(json.dumps({"step": int(step), "starts": [int(s) for s in starts]}) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
