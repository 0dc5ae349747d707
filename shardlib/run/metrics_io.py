"""Where a training run's numbers go: ``metrics.jsonl``, TensorBoard events and a loss-curve PNG.

Kept apart from the loop so the loop only says *what* happened at a step. Only process 0
writes (metrics are global already, so the other processes would write the same numbers).
TensorBoard and matplotlib are optional (the ``shardlib[cli]`` extra): without them the run says
so in one line and ``metrics.jsonl`` still holds every number.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardlib.runtime.files import AtomicFile, make_dir, no_follow


def _jsonable(value: Any) -> Any:
    """Plain Python numbers for JSON; non-finite floats become None (JSON has no NaN)."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All records of a ``metrics.jsonl`` file, in order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def append_record(path: str | os.PathLike[str], record: Mapping[str, Any]) -> None:
    """One line outside the step loop (an event such as an elastic restart: ``{"event": ..., "step": ...}``)."""
    path = Path(path)
    make_dir(path.parent, "a run's outputs")
    with open(path, "a", encoding="utf-8", opener=no_follow) as f:
        f.write(json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n")


def _restart_events(path: Path) -> list[dict[str, Any]]:
    """The step-0 restart events a fresh start keeps: an elastic restart with no checkpoint starts over."""
    from shardlib.runtime.elastic import restart_from_env

    if restart_from_env() is None:
        return []
    return [r for r in read_metrics(path) if r.get("event") == "restart" and r.get("step") == 0]


def _move_aside(path: Path) -> Path:
    """Rename ``path`` to the first free ``<name>.<n>``, never over an existing file."""
    n = 1
    while True:
        aside = path.with_name(f"{path.name}.{n}")
        try:
            os.link(path, aside)  # fails if ``aside`` exists, where a rename would replace it
        except FileExistsError:
            n += 1
            continue
        os.unlink(path)
        return aside


class MetricsLog:
    """Appends one JSON object per step to ``metrics.jsonl`` and mirrors scalars to TensorBoard.

    Also a loop action (`shardlib.run.actions.Action`): ``log(step, state, record)`` writes the record.

    ``resume_step``: when a run continues from a checkpoint taken after that many steps,
    records of later steps (written by the interrupted run after its last checkpoint) are
    dropped first, so the file holds each step once. Steps are 1-based: record ``k`` is the
    state after k updates. Event lines (``{"event": "restart", "step": k, ...}``, written by an
    elastic restart) follow the same rule; readers tell them from step records by ``event``.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        *,
        enabled: bool = True,
        tensorboard: bool = True,
        resume_step: int | None = None,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / "metrics.jsonl"
        self.enabled = enabled
        self.records: list[dict[str, Any]] = []
        self._file = None
        self._writer = None
        if not enabled:
            return
        make_dir(self.out_dir, "a run's outputs")
        if self.path.is_symlink():
            from shardlib.run.config import TrainConfigError

            raise TrainConfigError("out", f"{self.path} is a symbolic link; shardlib writes metrics only into a regular "
                                          "file in the run directory, never through a link: remove it and run again")
        if self.path.exists():  # a resumed run keeps the steps up to its checkpoint; a fresh one none
            old = read_metrics(self.path)
            self.records = ([r for r in old if r.get("step", 0) <= resume_step] if resume_step is not None
                            else _restart_events(self.path))
            if self.records != old:  # never rewritten: the old file is kept whole beside the new one
                _note(f"moved {self.path} aside to {_move_aside(self.path).name}: its records after step "
                      f"{resume_step or 0} belong to a run that did not carry on from there")
                with open(self.path, "x", encoding="utf-8", opener=no_follow) as f:
                    f.write("".join(json.dumps(r) + "\n" for r in self.records))
        self._file = open(self.path, "a", encoding="utf-8", opener=no_follow)
        if tensorboard:
            self._writer = _event_writer(self.out_dir)

    @property
    def writes_events(self) -> bool:
        """Whether TensorBoard events are being written (a writer was requested and is installed)."""
        return self._writer is not None

    def write(self, record: Mapping[str, Any]) -> None:
        """Log one step's record (must contain ``step``)."""
        clean = {k: _jsonable(v) for k, v in record.items()}
        self.records.append(clean)
        if not self.enabled:
            return
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        if self._writer is not None:
            step = int(clean["step"])
            for key, value in clean.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._writer.add_scalar(_tb_tag(key), value, step)

    def __call__(self, step: int, state: Any, record: Mapping[str, Any]) -> None:
        self.write(record)

    def add_text(self, tag: str, text: str, step: int) -> None:
        if self._writer is not None:
            self._writer.add_text(tag, text, step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _note(message: str) -> None:
    print(f"note: {message}", file=sys.stderr, flush=True)


def _event_writer(out_dir: Path) -> Any | None:
    """TensorBoard's event writer from whichever package is installed: tensorboard's own first
    (0.3 s to import), else tensorboardX (whose writer imports PyTorch where it is installed:
    2.7 s and about 9 CPU s on a loaded 2-core host, in every run), else None and a note."""
    try:
        return _TensorBoardEvents(out_dir)
    except ImportError:
        pass
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        _note("TensorBoard events are off: neither tensorboardX nor tensorboard is installed "
              "(pip install 'shardlib[cli]'); metrics.jsonl has every number")
        return None
    return SummaryWriter(logdir=str(out_dir), flush_secs=10)


class _TensorBoardEvents:
    """tensorboardX's ``add_scalar``/``add_text``/``close`` on tensorboard's own event file writer
    and summary protos, which need neither TensorFlow nor PyTorch."""

    def __init__(self, out_dir: Path) -> None:
        from tensorboard.compat.proto import event_pb2
        from tensorboard.plugins.scalar.summary_v2 import scalar_pb
        from tensorboard.plugins.text.summary_v2 import text_pb
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._scalar_pb, self._text_pb = event_pb2.Event, scalar_pb, text_pb
        self._file = EventFileWriter(str(out_dir), flush_secs=10)

    def _add(self, summary: Any, step: int) -> None:
        self._file.add_event(self._event(wall_time=time.time(), step=step, summary=summary))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._add(self._scalar_pb(tag, value), step)

    def add_text(self, tag: str, text: str, step: int) -> None:
        self._add(self._text_pb(tag, text), step)

    def close(self) -> None:
        self._file.close()


def _tb_tag(key: str) -> str:
    """Group the curves in TensorBoard: losses together, throughput together."""
    if key.endswith("loss"):
        return f"loss/{key}"
    if key in ("tokens_per_s", "tokens_per_s_per_device", "step_time_s"):
        return f"speed/{key}"
    if key.startswith("memory_"):
        return f"memory/{key}"
    return f"train/{key}"


def plot_loss_curve(records: list[Mapping[str, Any]], path: str | os.PathLike[str], title: str = "") -> Path | None:
    """Train (and validation, where present) loss against step, saved as a PNG; None (and a note)
    without matplotlib, which only this plot needs."""
    # The object API with an explicit Agg canvas: renders without a display and leaves pyplot's
    # global backend alone (a notebook's inline plots keep working).
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        _note(f"no loss curve ({path}): matplotlib is not installed (pip install 'shardlib[cli]')")
        return None

    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    if train:
        ax.plot(*zip(*train), label="train", linewidth=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation", markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(path)
    with AtomicFile(out, what="a run's output") as f:  # never through a link planted at its name
        fig.savefig(f, format="png")
    return out
