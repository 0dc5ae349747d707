"""Whether a checkpoint is damaged: complete steps, its files against their digests, and which
errors reading it are evidence against its bytes (only those set a checkpoint aside).

The rules `shardlib.runtime.checkpoint.Checkpointer` applies to one step directory; they take
the directory and step, not the manager, so the elastic launcher reads the same rule
(`complete_steps`) without one.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from shardlib.runtime.checkpoint_digests import DIGEST_ITEM, DIGEST_KIND, digest_arrays, digest_hex, sha256
from shardlib.runtime.checkpoint_errors import CheckpointDamagedError, CheckpointError, CheckpointReadError
from shardlib.runtime.files import write_new_file
from shardlib.sharding.rules import listed

LEGACY_FORMATS = ("shardlib.runtime.checkpoint/1",)  # saved before digests: restored unverified, with a warning
COMMIT_MARKER = "commit_success.txt"  # Orbax writes it into the step directory before the commit rename
JSON_ITEMS = ("data", "config", "meta")

# Where an error's text is the only signal: TensorStore raises every failure as a plain ValueError
# with the absl status code at the front of its text, JAX an out-of-memory as a JaxRuntimeError
# whose text names the code, and Orbax wraps a failed chunk read in a bare Exception. One table,
# each row checked against the real library's message (tests/test_checkpoint_damage.py).
TEXT_SIGNALS: dict[str, re.Pattern[str]] = {
    # the devices are full: the checkpoint may well be fine (JAX's allocator)
    "memory": re.compile(r"RESOURCE_EXHAUSTED|[Oo]ut of memory"),
    # a file is absent (TensorStore)
    "missing-file": re.compile(r"\bNOT_FOUND: "),
    # bytes that are short or do not decode (TensorStore); the other codes (UNAVAILABLE,
    # PERMISSION_DENIED, UNAUTHENTICATED, DEADLINE_EXCEEDED, ...) say nothing about the bytes
    "unreadable": re.compile(r"\b(OUT_OF_RANGE|DATA_LOSS|FAILED_PRECONDITION): "),
    # the other chunk reads of a restore that already failed, reported as they are collected:
    # Orbax's wrapper of a failed chunk read, its coroutine (matched against the object's repr),
    # and asyncio's RuntimeError once the loop is gone
    "abandoned-read": re.compile(r"^Encountered error while reading array index"),
    "abandoned-coroutine": re.compile(r"_read_array_index_and_device_put"),
    "closed-loop": re.compile(r"^Event loop is closed$"),
}


# --------------------------------------------------------------------------------------------
# Complete steps
# --------------------------------------------------------------------------------------------


def incomplete_reason(step_dir: str | os.PathLike[str] | Any) -> str | None:
    """Why ``step_dir`` (a committed-looking ``DIR/<step>``) is not a complete checkpoint, or None.

    The one rule: Orbax's commit marker and the digests item. A checkpoint written before
    digests existed (format ``/1``, named in its ``meta``) counts as complete, unverified.
    """
    path = step_dir if hasattr(step_dir, "exists") else Path(step_dir)
    if not (path / COMMIT_MARKER).exists():
        return f"no Orbax commit marker ({COMMIT_MARKER})"
    if (path / DIGEST_ITEM / "metadata").exists():
        return None
    try:
        if json.loads((path / "meta" / "metadata").read_text()).get("format") in LEGACY_FORMATS:
            return None
    except (OSError, ValueError, AttributeError):
        pass
    return f"no digests ({DIGEST_ITEM}/metadata is missing)"


def complete_steps(directory: str | os.PathLike[str] | Any) -> list[int]:
    """Steps with a complete checkpoint in ``directory``, ascending: the step directories Orbax
    names (``ocp.utils.checkpoint_steps``: not the tmp dirs of saves in flight) that
    `incomplete_reason` passes. The one rule of the `Checkpointer` and the elastic launcher."""
    try:
        named = ocp.utils.checkpoint_steps(directory)
    except (OSError, ValueError):
        return []
    name_format = ocp.path.step.standard_name_format()
    return sorted(s for s in named if incomplete_reason(ocp.path.step.build_step_path(directory, name_format, s)) is None)


# --------------------------------------------------------------------------------------------
# The files of one step against their digests
# --------------------------------------------------------------------------------------------


def read_json_item(directory: str, step: int, step_dir: Any, name: str) -> dict[str, Any]:
    """The JSON item ``name`` of ``step`` as a dict, or `CheckpointDamagedError` naming the file."""
    path = step_dir / name / "metadata"
    where = f"{name}/metadata"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointDamagedError(directory, step, "missing-file", f"{path} is missing") from None
    except OSError as err:  # permissions, an outage: no evidence against the bytes
        raise CheckpointReadError(directory, step, f"{path}: {err}") from None
    try:
        value = json.loads(raw.decode("utf-8"))
    except ValueError as err:
        raise CheckpointDamagedError(directory, step, "metadata", f"{where} is not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise CheckpointDamagedError(directory, step, "metadata", f"{where} holds a {type(value).__name__}, not a JSON object")
    return value


def read_digests(directory: str, step: int, step_dir: Any) -> dict[str, Any] | None:
    """The digests item of ``step``; None for a checkpoint saved before digests (`LEGACY_FORMATS`)."""
    if not (step_dir / DIGEST_ITEM / "metadata").exists():
        why = incomplete_reason(step_dir)
        if why is not None:
            raise CheckpointDamagedError(directory, step, "incomplete", why)
        return None
    digests = read_json_item(directory, step, step_dir, DIGEST_ITEM)
    if digests.get("kind") != DIGEST_KIND or not isinstance(digests.get("arrays"), dict) \
            or not isinstance(digests.get("files"), dict):
        raise CheckpointDamagedError(directory, step, "metadata", f"{DIGEST_ITEM}/metadata is not a {DIGEST_KIND} digest record")
    return digests


def check_items(directory: str, step: int, step_dir: Any, digests: Mapping[str, Any] | None) -> None:
    """The JSON items of ``step`` against their SHA-256 and against the step: the meta's step, and
    the data state's where the save tied it to the step. Raises `CheckpointDamagedError`."""
    items = {name: read_json_item(directory, step, step_dir, name) for name in JSON_ITEMS}
    if items["meta"].get("step", step) != step:
        raise CheckpointDamagedError(directory, step, "metadata",
                                     f"meta/metadata says step {items['meta'].get('step')!r}, not {step}")
    states = items["data"].get("states")
    if not isinstance(states, list) or not all(isinstance(d, dict) for d in states):
        raise CheckpointDamagedError(directory, step, "metadata", "data/metadata holds no list of data states ('states')")
    if digests is not None and digests.get("data_step_tied"):
        wrong = [d.get("step") for d in states if d.get("step") != step]
        if wrong:
            raise CheckpointDamagedError(
                directory, step, "data-step",
                f"data/metadata says the data iterator stood at step {wrong[0]!r}, but the checkpoint is step "
                f"{step}: resuming would repeat or skip batches")
    if digests is not None:
        for name in JSON_ITEMS:
            want = digests["files"].get(f"{name}/metadata")
            got = sha256((step_dir / name / "metadata").read_bytes())
            if want != got:
                raise CheckpointDamagedError(directory, step, "metadata",
                                             f"{name}/metadata differs from the SHA-256 saved with it")


def check_arrays(directory: str, step: int, tree: Any, digests: Mapping[str, Any] | None) -> None:
    """The arrays of ``tree`` (restored from ``step``, any mesh) against their saved digests;
    `CheckpointDamagedError` names the tensors that differ. None: saved before digests, unchecked."""
    if digests is None:
        return
    saved = digests["arrays"]
    got = digest_hex(*digest_arrays(tree))
    bad = [path for path, value in got.items() if saved.get(path) != value]
    if bad:
        raise CheckpointDamagedError(
            directory, step, "digest",
            f"the restored values of {listed(bad)} differ from the digests saved with them (a changed bit in "
            "a data file)")


def agree(directory: str, step: int, err: CheckpointError | None) -> CheckpointError | None:
    """Every process takes the same view of ``step``: unread if any process could not read it
    (nothing is set aside then), else damaged if any process found it so."""
    if jax.process_count() == 1:
        return err
    from jax.experimental import multihost_utils

    code = 2 if isinstance(err, CheckpointReadError) else int(err is not None)
    codes = np.asarray(multihost_utils.process_allgather(np.array([code], np.int32))).reshape(-1)
    worst = int(codes.max())
    if worst == code:
        return err
    bad = [int(i) for i in np.flatnonzero(codes == worst)]
    if worst == 2:
        return CheckpointReadError(directory, step, f"process(es) {bad} could not read it")
    return CheckpointDamagedError(directory, step, "unreadable", f"process(es) {bad} found it damaged")


# --------------------------------------------------------------------------------------------
# Errors while reading: damage, or something else
# --------------------------------------------------------------------------------------------


def damage_shown(chain: Sequence[BaseException], text: str) -> str | None:
    """The damage reason an error reading a checkpoint is evidence of, or None when it is not:
    only a missing file, or bytes that are short or do not decode, may mark a checkpoint damaged.
    The exception types where the libraries give them, else `TEXT_SIGNALS`."""
    if any(isinstance(e, FileNotFoundError) for e in chain) or TEXT_SIGNALS["missing-file"].search(text):
        return "missing-file"
    if any(isinstance(e, (json.JSONDecodeError, UnicodeDecodeError)) for e in chain) or TEXT_SIGNALS["unreadable"].search(text):
        return "unreadable"
    return None


def _quiet_abandoned_reads() -> None:
    """After a failed read, Orbax leaves the other chunk reads of that restore to be collected
    later, each printing "Exception ignored in <coroutine _read_array_index_and_device_put>"
    (and "Event loop is closed"); the damage is already named, so drop those reports only."""
    previous = sys.unraisablehook
    if getattr(previous, "_shardlib_quiet", False):
        return

    def hook(unraisable) -> None:
        err, obj = unraisable.exc_value, unraisable.object
        text = str(err)
        abandoned = (TEXT_SIGNALS["abandoned-coroutine"].search(repr(obj))
                     or TEXT_SIGNALS["abandoned-read"].search(text)
                     or (isinstance(err, RuntimeError) and TEXT_SIGNALS["closed-loop"].search(text)))
        if not abandoned:
            previous(unraisable)

    hook._shardlib_quiet = True
    sys.unraisablehook = hook


class ReadingStep:
    """Context: an error reading ``step`` (Orbax, TensorStore, the file system) becomes
    `CheckpointDamagedError` when it is evidence against the bytes (`damage_shown`), else
    `CheckpointReadError`; shardlib's own errors (a target that does not match) and the devices
    running out of memory pass as they are."""

    def __init__(self, directory: str, step: int, step_dir: Any, what: str) -> None:
        self.directory, self.step, self.step_dir, self.what = directory, step, step_dir, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, err, tb) -> bool:
        if err is None or isinstance(err, CheckpointError) or not isinstance(err, Exception):
            return False
        chain, seen = [], err
        while seen is not None and len(chain) < 8:  # Orbax wraps TensorStore's error; the cause says what
            chain.append(seen)
            seen = seen.__cause__ or seen.__context__
        text = " | ".join(" ".join(str(e).split()) for e in chain)
        if TEXT_SIGNALS["memory"].search(text):
            return False  # the devices are full, the checkpoint may be fine
        _quiet_abandoned_reads()
        cause = chain[-1]
        brief = " ".join(str(cause).split())
        detail = f"reading {self.what}: {type(cause).__name__}: {brief.split(' See full TensorStore details')[0][:300]}"
        reason = damage_shown(chain, text)
        if reason is None:
            raise CheckpointReadError(self.directory, self.step, detail) from err
        missing = missing_data_files(self.step_dir / "state") if reason == "unreadable" else []
        if missing:  # OCDBT reads a deleted data file as empty bytes, "truncated": name what is gone
            reason, detail = "missing-file", f"reading {self.what}: its data file(s) {listed(missing)} are missing"
        raise CheckpointDamagedError(self.directory, self.step, reason, detail) from err


def missing_data_files(state_dir: Any) -> list[str]:
    """The data files that the OCDBT b-tree of a local ``state`` item refers to and that are not on
    disk, relative to it; [] when none are, or the tree cannot be read (cloud storage: not checked)."""
    if "://" in str(state_dir):
        return []
    import tensorstore as ts

    try:
        kv = ts.KvStore.open(f"file://{state_dir}/").result()
        versions = ts.ocdbt.dump(kv).result().get("versions") or []
        nodes, files = [versions[-1]["root"]["location"]] if versions else [], set()
        while nodes:
            node = nodes.pop()
            files.add(_ocdbt_file(node))
            for entry in ts.ocdbt.dump(kv, node).result().get("entries", []):
                for value in entry.values():
                    if isinstance(value, str) and value.startswith("value:"):
                        files.add(_ocdbt_file(value))
                    elif isinstance(value, str) and value.startswith("btreenode:"):
                        nodes.append(value)
    except Exception:  # noqa: BLE001 - a best-effort diagnosis of a read that already failed
        return []
    return sorted(f for f in files if not (Path(str(state_dir)) / f).is_file())


def _ocdbt_file(location: str) -> str:
    """``value:ocdbt.process_0/:d/e3bc...:0:3837`` -> ``ocdbt.process_0/d/e3bc...``."""
    base, relative = location.split(":", 1)[1].rsplit(":", 2)[0].split(":", 1)
    return base + relative


def note_damage(step_dir: Any, err: CheckpointDamagedError) -> None:
    """``DAMAGED.txt`` in a set-aside step directory: into that directory only, never through a
    link (a linked step directory's target is someone else's); the log names the reason anyway."""
    try:
        if "://" in str(step_dir):
            (step_dir / "DAMAGED.txt").write_text(str(err) + "\n")
        else:
            write_new_file(step_dir, "DAMAGED.txt", str(err) + "\n")
    except OSError:
        pass
