"""A rerun into a run directory starts from the flags the run recorded in its ``config.json``.

A forgotten ``--lr`` used to switch a resumed fine-tune's schedule to the default 3e-3, and a
forgotten ``--init-from`` refused the resume: the flags in `RECORDED` (the model's source, the
data, the lr schedule, the batch shape) now default to the record. A flag given with another value
than the record's is kept, and listed in one line, so a change is never silent.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from shardlib.run.config import TrainConfig, flag_name

RECORDED = ("init_from", "tokenizer", "data", "lr", "warmup_steps", "schedule_steps", "seq_len", "batch_size")


def record_of(config: TrainConfig) -> tuple[Path | None, dict[str, Any]]:
    """(the record's file, its settings) of the run directory this run trains into; ({}) when there is none."""
    directory = config.resume_from or config.out
    if directory is None:
        return None, {}
    path = Path(directory).expanduser() / "config.json"
    try:
        found = json.loads(path.read_text(encoding="utf-8")) if path.is_file() and not path.is_symlink() else None
    except (OSError, ValueError, UnicodeDecodeError):
        found = None
    if not isinstance(found, dict) or not isinstance(found.get("model"), str):  # not a shardlib run's record
        return None, {}
    return path, found


def with_recorded(config: TrainConfig, given: frozenset[str]) -> tuple[TrainConfig, list[str]]:
    """``config`` with the record's `RECORDED` settings where their flags were not ``given``, and the
    lines to print: what was taken from the record, and the given flags that differ from it."""
    path, record = record_of(config)
    if path is None:
        return config, []
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    recorded = {name: record[name] for name in RECORDED if name in record and name in fields}
    taken = {name: value for name, value in recorded.items()
             if name not in given and value != getattr(config, name)}
    changed = [name for name, value in recorded.items() if name in given and value != getattr(config, name)]
    lines = []
    if taken:
        lines.append(f"shardlib: from {path} (the run's record): "
                     + ", ".join(f"{flag_name(name)} {_shown(value)}" for name, value in taken.items()))
    if changed:
        lines.append(f"shardlib: note: given flags differ from {path}: "
                     + ", ".join(f"{flag_name(name)} {_shown(getattr(config, name))} (recorded "
                                 f"{_shown(recorded[name])})" for name in changed))
    return dataclasses.replace(config, **taken), lines


def _shown(value: Any) -> str:
    return "unset" if value is None else f"{value:g}" if isinstance(value, float) else str(value)
