"""Elastic restarts for `shardlib launch --elastic`: who died, whether to go on, where to resume.

The launcher is the supervisor. When a process dies (or hangs: its peers report it as no
longer sending heartbeats), the launcher stops the rest, and this module decides the restart
from facts alone: which processes died, how many are left, ``--min-processes`` and
``--max-restarts``. The restarted job runs the same command on the processes that are left;
the train command picks its mesh from the devices present and resumes from the run
directory's last complete checkpoint. Before it starts, the examples logs are cut back to
that checkpoint (the lost steps will be read again), and the job is told about the restart
through ``SHARDLIB_ELASTIC_RESTART`` so that process 0 records it in ``metrics.jsonl``.

No JAX here: the launcher holds no devices.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from shardlib.exits import EXIT_DIVERGED, EXIT_USAGE
from shardlib.runtime.files import write_atomic

ENV_RESTART = "SHARDLIB_ELASTIC_RESTART"
# JAX's coordination service names the peers that stopped sending heartbeats, one per line.
_HEARTBEAT_LOST = re.compile(r"unhealthy \(stopped sending heartbeats\)")
_TASK_LINE = re.compile(r"^\s*(\d+)\b")
# Exit codes that the same command would hit again on fewer processes: no restart.
NO_RESTART = {EXIT_USAGE: "a command-line or configuration error", EXIT_DIVERGED: "training diverged (non-finite steps)"}


@dataclasses.dataclass(frozen=True)
class Elastic:
    """``--elastic``'s policy: go on while at least ``min_processes`` are left, at most ``max_restarts`` times."""

    min_processes: int = 1
    max_restarts: int = 3


@dataclasses.dataclass(frozen=True)
class Decision:
    """What the launcher does after a failure: restart on ``processes`` processes, or stop (``reason``)."""

    restart: bool
    processes: int
    reason: str


def decide(processes: int, dead: Iterable[int], *, exit_code: int, min_processes: int, max_restarts: int,
           restarts: int) -> Decision:
    """Restart on the processes left unless the failure would recur, fewer than ``min_processes``
    remain, or the restarts are used up. ``exit_code``: the first failure's (128+N for signal N)."""
    left = processes - len(set(dead))
    if exit_code in NO_RESTART:
        return Decision(False, left, f"exit code {exit_code} is {NO_RESTART[exit_code]}, which a restart would repeat; "
                                     "not restarting")
    if restarts >= max_restarts:
        return Decision(False, left, f"--max-restarts {max_restarts} reached; not restarting")
    if left < min_processes:
        return Decision(False, left,
                        f"{left} process(es) left, fewer than --min-processes {min_processes}; not restarting")
    return Decision(True, left, f"restarting on the {left} process(es) left (restart {restarts + 1} of {max_restarts})")


def dead_processes(first_failure: int, output_tails: Mapping[int, Sequence[str]]) -> list[int]:
    """The processes that died: those a survivor reports as no longer sending heartbeats (a hang,
    or a death the heartbeat saw first), else the first process to fail.

    A survivor that exits because a peer died is not dead itself: its own output names the peer.
    """
    reported: set[int] = set()
    for index, lines in output_tails.items():
        reported |= _heartbeat_peers(lines) - {index}
    return sorted(reported) if reported else [first_failure]


def _heartbeat_peers(lines: Sequence[str]) -> set[int]:
    """Task ids listed on the lines after JAX's 'stopped sending heartbeats' message."""
    peers: set[int] = set()
    for i, line in enumerate(lines):
        if not _HEARTBEAT_LOST.search(line):
            continue
        for following in lines[i + 1:]:
            match = _TASK_LINE.match(following)
            if not match:
                break
            peers.add(int(match.group(1)))
    return peers


def run_directory(command: Sequence[str]) -> Path:
    """The ``--out DIR`` of the launched command: where its checkpoints and logs live.

    An elastic restart resumes by running the same command again, which only continues a run
    whose directory is fixed and which checkpoints; so ``--out`` is required, and for ``shardlib
    train`` ``--ckpt-every N > 0`` (a loop of your own checkpoints as it says).
    """
    out, every = _flag_value(command, "--out"), _flag_value(command, "--ckpt-every")
    if out is None:
        raise ValueError("--elastic needs the command's --out DIR (and --ckpt-every N): a restart resumes from the "
                         "checkpoints of that run directory; add e.g. --out runs/job --ckpt-every 10 to the train command")
    if _is_shardlib_train(command) and (int(every) if (every or "").isdigit() else 0) == 0:
        raise ValueError(f"--elastic needs the train command's --ckpt-every N (N > 0; got {every or 'none'}): "
                         "without checkpoints a restart trains again from step 0; add e.g. --ckpt-every 10")
    return Path(out)


def _is_shardlib_train(command: Sequence[str]) -> bool:
    """``shardlib train ...`` or ``python -m shardlib.cli train ...``."""
    return any(arg == "train" and Path(before).name in ("shardlib", "shardlib.cli")
               for before, arg in zip(command, command[1:]))


def _flag_value(command: Sequence[str], flag: str) -> str | None:
    """The value of ``flag`` in ``command`` (``--flag V`` or ``--flag=V``; the last one given), or None."""
    value = None
    for i, arg in enumerate(command):
        if arg == flag and i + 1 < len(command):
            value = command[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def latest_checkpoint(out_dir: Path) -> int | None:
    """The newest complete checkpoint step in ``OUT/checkpoints``, or None: complete by the
    checkpointer's one rule (`shardlib.runtime.checkpoint_damage.complete_steps`), so neither a save in
    flight nor an empty step directory is one."""
    from shardlib.runtime.checkpoint_damage import complete_steps  # Orbax loads only when this is asked

    directory = out_dir / "checkpoints"
    steps = complete_steps(directory) if directory.is_dir() else []
    return max(steps) if steps else None


def last_logged_step(out_dir: Path) -> int | None:
    """The last step ``metrics.jsonl`` recorded (where the failed job got to), or None."""
    try:
        lines = (out_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return None
    steps = [r["step"] for r in map(_record, lines) if "loss" in r and isinstance(r.get("step"), int)]
    return max(steps) if steps else None


def command_logged_step(command: Sequence[str]) -> int | None:
    """The last step the ``metrics.jsonl`` of the command's ``--out`` recorded, or None (no --out)."""
    out = _flag_value(command, "--out")
    return last_logged_step(Path(out)) if out else None


def _record(line: str) -> dict[str, Any]:
    try:
        value = json.loads(line)
    except json.JSONDecodeError:  # a line cut short by the kill
        return {}
    return value if isinstance(value, dict) else {}


def trim_examples(out_dir: Path, step: int) -> list[Path]:
    """Cut every ``examples*.jsonl`` back to steps <= ``step``: the restarted job reads the later steps again.

    Each process trims only its own file on resume; the files of processes that are gone, or
    that the new job numbers differently, would otherwise keep the lost steps' windows.
    """
    trimmed = []
    for path in sorted(out_dir.glob("examples*.jsonl")):
        records = [_record(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        kept = [r for r in records if r.get("step", step + 1) <= step]
        write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept), what="a run's examples")
        trimmed.append(path)
    return trimmed


def restart_note(*, restart: int, dead: Sequence[int], how: str, died_at: int | None, resume_step: int | None,
                 processes: int, devices_per_process: int) -> dict[str, Any]:
    """The restart as the job is told it (``SHARDLIB_ELASTIC_RESTART``); process 0 adds the mesh and logs it."""
    return {"event": "restart", "restart": restart, "step": resume_step or 0, "dead": list(dead), "how": how,
            "died_at_step": died_at, "processes": processes, "devices": processes * devices_per_process}


def restart_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """The restart this job was started for, or None for a first start."""
    text = (os.environ if environ is None else environ).get(ENV_RESTART)
    return json.loads(text) if text else None


def describe_restart(note: Mapping[str, Any], mesh: str) -> str:
    """One line for the log: who died, at which step, and the job it became."""
    dead = ", ".join(map(str, note["dead"]))
    at = f" at step {note['died_at_step']}" if note.get("died_at_step") is not None else ""
    return (f"elastic restart {note['restart']}: process {dead} {note['how']}{at}; resumed from step {note['step']} "
            f"on {note['processes']} process(es), {note['devices']} devices, mesh {mesh}")
