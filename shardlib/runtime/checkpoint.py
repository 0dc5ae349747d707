"""Orbax checkpoints of a `TrainState` (over 600 lines: one `Checkpointer` around one Orbax manager).

Async, sharded, restorable onto any mesh and strategy; the save, the background failures and the
restore share the manager and its state, so they stay one class.

One checkpoint is one Orbax step directory ``DIR/<step>/`` with four items:

  state/   the whole TrainState (step, params, optimizer state) as an OCDBT PyTree; every
           process writes only the shards it holds (``ocp.args.StandardSave``)
  data/    JSON ``{"process_count": P, "states": [state of process 0, ..., P-1]}``: the data
           iterator state of *every* process, gathered before the save, because Orbax's JSON
           item is written by process 0 only
  config/  JSON run configuration (whatever the training loop passes; the export reads
           ``config["model"]`` from it)
  meta/    JSON facts about the run that saved it (mesh, process and device count, versions)
  digests/ JSON digest of every saved array (a 64-bit position-aware sum hash of its logical
           value, so it compares across meshes) and SHA-256 of the three JSON items; computed
           on the devices at save time and written in Orbax's background thread

Integrity: a checkpoint is complete when Orbax committed it (``commit_success.txt``) and its
``digests`` item is there (`incomplete_reason`). `restore` verifies every file it reads and
every restored array against the digests; with ``step=None`` a damaged or incomplete newest
checkpoint is named, set aside as ``<step>.damaged-<reason>`` (never deleted) and the next
newest intact one is restored. A background save that fails is logged at once and raised by the
next `check`/`save`/`wait` as `CheckpointSaveError`, naming the last good step.

Why the design is safe to interrupt: Orbax writes a step into ``<step>.orbax-checkpoint-tmp*``
and renames it on commit, and deletes older steps (``keep``) only after the new one committed.
`Checkpointer.latest_step` and `restore` see committed steps only, so a process killed in the
middle of a save leaves the previous checkpoint as the one that is restored. `save` refuses a
state with non-finite values (and a step whose loss was non-finite), so a bad state never
displaces a good checkpoint by retention.

Restoring onto another layout: pass the *new* program's ``abstract_state()`` (ShapeDtypeStructs
carrying NamedShardings). Orbax reads each device's slice of every array from the saved chunks,
so the device count, mesh and strategy may all differ from the run that saved it. The transient
fields (fp16's loss scale, int8's per-device residuals) are the exception: where the target has
other shapes or none, they start afresh (``fresh=program.fresh_transient``) or are dropped, noted.

The rest lives beside it: `checkpoint_contents` (trees compared, JSON items),
`checkpoint_digests` (the digests and their Orbax item), `checkpoint_damage` (what is damaged,
what is a read error), `checkpoint_errors` (re-exported here), and `preemption`
(`PreemptionGuard`, re-exported here).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from shardlib import compat
from shardlib.runtime.checkpoint_contents import (
    empty_nodes,
    field_of,
    gather_data_states,
    json_bytes,
    mesh_of,
    metrics_nonfinite,
    nonfinite_paths,
    pick_data_state,
    refuse_zero_size,
    signature_mismatches,
    staleness_of,
    structure_mismatches,
    transient_changes,
    tree_signature,
)
from shardlib.runtime.checkpoint_damage import (
    LEGACY_FORMATS,
    ReadingStep,
    agree,
    check_arrays,
    check_items,
    complete_steps,
    incomplete_reason,
    note_damage,
    read_digests,
    read_json_item,
)
from shardlib.runtime.checkpoint_digests import DIGEST_ITEM, DigestHandler, DigestSave, PendingDigests
from shardlib.runtime.checkpoint_errors import (
    CheckpointDamagedError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointReadError,
    CheckpointSaveError,
    NonFiniteStateError,
)
from shardlib.runtime.preemption import PreemptionGuard
from shardlib.sharding.rules import describe_mismatches, listed, path_str
from shardlib.step.state import TRANSIENT_FIELDS

__all__ = [
    "Checkpointer", "PreemptionGuard", "ReadOnlyNotice", "READ_ONLY_NOTICE", "FORMAT", "resolve_directory",
    "CheckpointError", "CheckpointNotFoundError", "CheckpointMismatchError", "NonFiniteStateError",
    "CheckpointDamagedError", "CheckpointReadError", "CheckpointSaveError",
]

log = logging.getLogger("shardlib.runtime.checkpoint")


class ReadOnlyNotice(logging.Filter):
    """Drops Orbax's ``WARNING:absl:Given directory is read only``: a read-only Checkpointer
    (``create=False``: export, evaluation, inspection) is what was asked for, not a problem."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Given directory is read only")


READ_ONLY_NOTICE = ReadOnlyNotice()  # the one filter: every read-only Checkpointer adds it to absl's logger

FORMAT = "shardlib.runtime.checkpoint/2"  # checkpoint_damage.LEGACY_FORMATS: the formats before digests


def resolve_directory(directory: str | os.PathLike[str]) -> str:
    """An absolute path (Orbax fails later, in a background thread, on a relative one); URLs pass."""
    text = os.fspath(directory)
    if "://" in text:
        return text
    return str(Path(text).expanduser().resolve())


# --------------------------------------------------------------------------------------------
# The manager
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _LatestSkippingLinks(ocp.checkpoint_managers.LatestN):
    """Orbax's ``max_to_keep`` (the newest ``n`` steps), except that a step directory that is a
    symbolic link is kept, with a warning: Orbax's delete refuses a link, and the save whose
    retention tried would be reported failed though it committed."""

    is_link: Callable[[int], bool] = lambda step: False
    _warned: set[int] = dataclasses.field(default_factory=set)

    def should_preserve(self, checkpoints, *, context) -> list[bool]:
        keep = list(super().should_preserve(checkpoints, context=context))
        for i, info in enumerate(checkpoints):
            if not keep[i] and self.is_link(info.step):
                keep[i] = True
                if info.step not in self._warned:
                    self._warned.add(info.step)
                    log.warning("checkpoint step %d is a symbolic link: retention (keep=%d) skipped it, since "
                                "shardlib deletes nothing through a link; remove it yourself when it is not needed",
                                info.step, self.n)
        return keep


class Checkpointer:
    """Async, retained, sharded Orbax checkpoints of a `TrainState`, data state and run config.

    ``every``: `should_save` is true on multiples of it, and `save` without ``force`` saves only
    then. ``every=0`` (the default) means no schedule: `should_save` is never true and `save`
    saves whenever it is called.
    ``keep``: how many complete checkpoints to keep (None: all); older ones are deleted only
    after a newer one committed. ``async_save``: `save` returns once the arrays are copied to
    host memory; writing continues in the background while training goes on (donating the
    state to the next step is safe); a save still in flight when the program ends is waited for
    at exit, with a warning to call `close`. ``create=False`` opens an existing directory read-only
    (for export and inspection) and fails if it does not exist.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        every: int = 0,
        keep: int | None = 3,
        async_save: bool = True,
        create: bool = True,
    ) -> None:
        if every < 0:
            raise CheckpointError(f"checkpoint interval every={every} must be >= 0 (0: save whenever save() is called)")
        if keep is not None and keep < 1:
            raise CheckpointError(f"keep={keep} would delete every checkpoint; use keep >= 1, or None to keep all")
        self.directory = resolve_directory(directory)
        self.every = int(every)
        if not create and not os.path.isdir(self.directory) and "://" not in self.directory:
            raise CheckpointNotFoundError(
                f"checkpoint directory {self.directory} does not exist; pass the --ckpt directory a training run wrote"
            )
        self._name_format = ocp.path.step.standard_name_format()
        options = ocp.CheckpointManagerOptions(
            # read-only managers neither save nor delete
            preservation_policy=_LatestSkippingLinks(keep, self._is_link) if create else None,
            save_interval_steps=(self.every or 1) if create else 0,
            enable_async_checkpointing=async_save,
            create=create,
            read_only=not create,
            cleanup_tmp_directories=create,  # remove the tmp dirs of saves a crash interrupted
            step_name_format=self._name_format,
        )
        if not create:
            logging.getLogger("absl").addFilter(READ_ONLY_NOTICE)  # once: the same filter is added once
        handlers = {
            "state": ocp.StandardCheckpointHandler(),
            "data": ocp.JsonCheckpointHandler(),
            "config": ocp.JsonCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler(),
            DIGEST_ITEM: DigestHandler(),
        }
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        self._writable = create
        self._async = bool(async_save)
        self._failure: tuple[int, BaseException] | None = None  # (step, error) of a failed background save
        self._reported = False
        self._good_step: int | None = None  # the newest complete step when a background save failed
        self._warned_legacy: set[int] = set()
        if create and async_save:
            _finish_before_exit(self._manager, self.directory)
        if create:
            self._set_aside_incomplete()

    # ---- steps ------------------------------------------------------------------------

    def _is_link(self, step: int) -> bool:
        return "://" not in self.directory and os.path.islink(str(self._step_path(step)))

    def _step_path(self, step: int) -> Any:
        """The committed directory of ``step`` (an ``epath.Path``: local or cloud storage)."""
        return ocp.path.step.build_step_path(self._manager.directory, self._name_format, step)

    def all_steps(self) -> list[int]:
        """Steps whose checkpoint is complete (committed, with its digests) on disk, ascending.

        Read from the directory, not from Orbax's step list: that list already contains an
        in-flight async save and already lacks the steps retention will delete once it commits.
        """
        return complete_steps(self._manager.directory)

    def _named_steps(self) -> list[int]:
        """Every ``DIR/<step>`` directory, complete or not (not the tmp dirs of saves in flight)."""
        try:
            return list(ocp.utils.checkpoint_steps(self._manager.directory))
        except (OSError, ValueError):
            return []

    def _set_aside_incomplete(self) -> None:
        """Rename step directories that are not complete checkpoints (an empty ``6/``, one whose
        digests are missing), so that no save collides with them and no restore reads them."""
        for step in sorted(self._named_steps()):
            why = incomplete_reason(self._step_path(step))
            if why is not None:  # process 0 renames; the others never count it either way
                self._set_aside(CheckpointDamagedError(self.directory, step, "incomplete", why), sync=False)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def should_save(self, step: int) -> bool:
        """True when ``step`` is a multiple of ``every`` and newer than every checkpoint saved."""
        if self.every <= 0 or step % self.every:
            return False
        known = self._manager.all_steps()
        return not known or step > max(known)

    # ---- save -------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Any,
        *,
        data_state: Mapping[str, Any],
        config: Mapping[str, Any] | None = None,
        metrics: Mapping[str, Any] | None = None,
        force: bool = False,
    ) -> bool:
        """Start saving ``state`` as checkpoint ``step``; returns whether a save was started.

        ``data_state`` (required; ``{}`` when there is none) is your data position, JSON: a resumed
        run that skips it reads its batches again from the start, so the call has to say so.
        ``config`` (optional) is the run's configuration, JSON, read back by ``saved_config``.

        Call on every process. With ``every > 0`` only steps on the schedule save; ``force``
        saves off it (preemption, end of run). With ``every=0`` every call saves. Never overwrites:
        a step that already has a checkpoint is left alone (False).
        ``metrics`` (the step's): a non-finite loss or a skipped step is not saved (False, logged).
        A state holding NaN/Inf raises `NonFiniteStateError` naming the tensors.
        """
        step = int(step)
        self.check()
        if not force and self.every and not self.should_save(step):
            return False
        if step in self._manager.all_steps():  # Orbax's list (in-flight saves too): the same on every process
            log.warning("checkpoint %s step %d is already saved or being saved; not overwriting it", self.directory, step)
            return False
        reason = metrics_nonfinite(metrics)
        if reason is not None:
            log.warning("not saving checkpoint step %d in %s: %s; the last good checkpoint stays", step, self.directory, reason)
            return False
        refuse_zero_size(state)
        bad = nonfinite_paths(state)
        if bad:
            raise NonFiniteStateError(
                f"refusing to save checkpoint step {step} in {self.directory}: non-finite values in {listed(bad)}; "
                f"the last good checkpoint (step {self.latest_step()}) is kept. Lower the learning rate, enable "
                "gradient clipping or loss scaling, and resume from it"
            )
        config_json = json.loads(json_bytes(dict(config or {}), "config"))
        meta = {
            "format": FORMAT,
            "step": step,
            "process_count": jax.process_count(),
            "device_count": jax.device_count(),
            "mesh": mesh_of(state),
            "jax": jax.__version__,
            "orbax": getattr(ocp, "__version__", "unknown"),
        }
        data = gather_data_states(data_state)
        tied = bool(data["states"]) and all(isinstance(d.get("step"), int) and d["step"] == step for d in data["states"])
        digests = PendingDigests(step, {"data": data, "config": config_json, "meta": meta}, tied)
        if not self._async:  # a synchronous save writes the item before returning: the digests must be under way
            digests.start(state)
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(data),
            config=ocp.args.JsonSave(config_json),
            meta=ocp.args.JsonSave(meta),
            **{DIGEST_ITEM: DigestSave(digests)},
        )
        try:
            started = bool(self._manager.save(step, args=args, force=True))
        except Exception as err:  # the previous background save failed (Orbax re-raises it here), or this one
            digests.cancel(err)
            self._failed(step, err)
            self.check()
            raise
        if self._async and started:
            try:
                digests.start(state)  # after the copy to host, before the state goes on to the next step
            except Exception as err:
                self._failed(step, err)
                self.check()
        if started and self._async:
            self._watch(step)
        return started

    # ---- background failures ----------------------------------------------------------

    def _watch(self, step: int) -> None:
        """Wait for the save of ``step`` in a thread, so a failure is reported at once."""

        def watch() -> None:
            try:
                self._manager.wait_until_finished()
            except BaseException as err:  # noqa: BLE001 - reported, then raised by check()
                self._failed(step, err)

        threading.Thread(target=watch, name=f"shardlib-checkpoint-watch-{step}", daemon=True).start()

    def _failed(self, step: int, err: BaseException) -> None:
        if self._failure is not None:
            return
        self._failure = (step, err)
        self._good_step = max((s for s in self.all_steps() if s != step), default=None)
        log.error("%s", self._failure_message())

    def _failure_message(self) -> str:
        step, err = self._failure
        good = self._good_step
        last = f"the last good checkpoint is step {good}" if good is not None else "there is no good checkpoint yet"
        detail = " ".join(str(err).split())[:300] or type(err).__name__
        return (f"checkpoint {self.directory} step {step} failed to save in the background "
                f"({type(err).__name__}: {detail}); {last}. Stopping: fix the cause (disk space, permissions) "
                "and run the same command again to resume from it")

    def check(self) -> None:
        """Raise `CheckpointSaveError` if a background save failed (call once per step; `save` does)."""
        if self._failure is not None:
            self._reported = True
            raise CheckpointSaveError(self._failure_message()) from self._failure[1]

    def wait(self) -> None:
        """Block until an in-flight async save has committed (and retention has run)."""
        try:
            self._manager.wait_until_finished()
        except Exception as err:
            self._failed(self._failure[0] if self._failure else self._in_flight_step(), err)
        self.check()

    def _in_flight_step(self) -> int:
        known = self._manager.all_steps()
        return max(known) if known else -1

    def close(self) -> None:
        """Finish in-flight work and release Orbax's threads."""
        try:
            self._manager.close()
        except Exception as err:  # noqa: BLE001
            self._failed(self._in_flight_step(), err)
        if not self._reported:  # raised already: closing after it (finally, __exit__) adds nothing
            self.check()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- inspect ------------------------------------------------------------------------

    def resolve_step(self, step: int | None = None) -> int:
        """``step`` if it is complete, or the latest complete step when None; else a clear error."""
        steps = self.all_steps()
        if step is None:
            if not steps:
                pending = sorted(p.name for p in Path(self.directory).glob("*.orbax-checkpoint-tmp*")) if os.path.isdir(self.directory) else []
                extra = f" (incomplete saves, ignored: {', '.join(pending)})" if pending else ""
                raise CheckpointNotFoundError(
                    f"checkpoint directory {self.directory} holds no complete checkpoint{extra}; train with "
                    "checkpointing enabled first, or point at the directory a run saved to"
                )
            return steps[-1]
        if int(step) not in steps:
            raise CheckpointNotFoundError(
                f"checkpoint directory {self.directory} has no complete checkpoint for step {step}; "
                f"complete steps: {', '.join(map(str, steps)) or 'none'}"
            )
        return int(step)

    def saved_tree(self, step: int | None = None) -> Any:
        """The saved TrainState as a dict tree of Orbax array metadata (shape, dtype, sharding)."""
        step = self.resolve_step(step)
        with self._reading(step, "state/_METADATA"):
            return self._manager.item_metadata(step)["state"].tree

    def saved_signature(self, step: int | None = None) -> dict[str, tuple[tuple[int, ...], str]]:
        """Path -> (shape, dtype) of every array in the saved TrainState, from metadata only."""
        return tree_signature(self.saved_tree(step))

    def _json_item(self, name: str, step: int | None) -> dict[str, Any]:
        step = self.resolve_step(step)
        return self._read_json(step, name)

    def _read_json(self, step: int, name: str) -> dict[str, Any]:
        """A JSON item of ``step`` as a dict, or `CheckpointDamagedError` naming the file."""
        return read_json_item(self.directory, step, self._step_path(step), name)

    # ---- integrity ------------------------------------------------------------------------

    def _reading(self, step: int, what: str):
        """Context: an error reading ``step`` (Orbax, TensorStore, the file system) becomes
        `CheckpointDamagedError`; shardlib's own errors (a target that does not match) pass."""
        return ReadingStep(self.directory, step, self._step_path(step), what)

    def _agreed(self, step: int, read: Callable[[], Any], reading: str | None = None) -> Any:
        """``read()`` of ``step``, its damage or read error raised only once every process has said
        how its own read went (`agree`); ``reading``: what it reads, its other errors classified."""
        err, result = None, None
        try:
            with self._reading(step, reading) if reading is not None else contextlib.nullcontext():
                result = read()
        except (CheckpointDamagedError, CheckpointReadError) as found:
            err = found
        err = agree(self.directory, step, err)
        if err is not None:
            raise err
        return result

    def _digests(self, step: int) -> dict[str, Any] | None:
        """The digests item of ``step`` (None for a checkpoint saved before digests, warned once)."""
        digests = read_digests(self.directory, step, self._step_path(step))
        if digests is None and step not in self._warned_legacy:
            self._warned_legacy.add(step)
            log.warning("checkpoint %s step %d was saved before digests (format %s); restored unverified",
                        self.directory, step, LEGACY_FORMATS[0])
        return digests

    def inspect(self, step: int) -> dict[str, Any] | None:
        """Check every file of ``step`` but the array chunks: the commit marker, the digests, the
        JSON items against their SHA-256, the meta's and data state's step. Returns the digests
        (None: a checkpoint saved before digests); raises `CheckpointDamagedError`."""
        why = incomplete_reason(self._step_path(step))
        if why is not None:
            raise CheckpointDamagedError(self.directory, step, "incomplete", why)
        digests = self._digests(step)
        check_items(self.directory, step, self._step_path(step), digests)
        return digests

    def verify(self, step: int, tree: Any, digests: Mapping[str, Any] | None = None) -> None:
        """Compare the arrays of ``tree`` (restored from ``step``, any mesh) with their saved digests;
        `CheckpointDamagedError` names the tensors that differ."""
        check_arrays(self.directory, step, tree, self._digests(step) if digests is None else digests)

    def _set_aside(self, err: CheckpointDamagedError, *, sync: bool = True) -> str | None:
        """Rename the damaged ``DIR/<step>`` to ``DIR/<step>.damaged-<reason>`` (process 0; never
        deleted), write the reason into it and log it; a read-only Checkpointer only logs.
        ``sync``: every process calls this for the same step (a restore), so they wait for the rename."""
        if not self._writable:
            log.warning("%s; skipped (left in place: this Checkpointer is read-only)", err)
            return None
        root = self._manager.directory
        target = root / f"{err.step}.damaged-{err.reason}"
        n = 2
        while target.exists():
            target = root / f"{err.step}.damaged-{err.reason}-{n}"
            n += 1
        source = self._step_path(err.step)
        if jax.process_index() == 0 and source.exists():
            source.rename(target)
            note_damage(target, err)
        if sync and jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"shardlib-checkpoint-set-aside-{err.step}")
        self._manager.reload()
        log.warning("%s; set aside as %s (kept for inspection, never deleted)", err, target.name)
        return target.name

    def saved_config(self, step: int | None = None) -> dict[str, Any]:
        """The run configuration saved with ``step`` (default: latest)."""
        return self._json_item("config", step)

    def saved_meta(self, step: int | None = None) -> dict[str, Any]:
        """Mesh, process/device count and versions of the run that saved ``step``."""
        return self._json_item("meta", step)

    def state_path(self, step: int | None = None) -> Any:
        """The committed ``state`` item directory of ``step``: a plain Orbax PyTree checkpoint."""
        return self._step_path(self.resolve_step(step)) / "state"

    # ---- restore ------------------------------------------------------------------------

    def check_compatible(self, target: Any, step: int | None = None, ignore: tuple[str, ...] = ()) -> None:
        """Raise `CheckpointMismatchError` listing every path whose presence, shape or dtype
        differs (top-level fields in ``ignore`` aside), and every empty node of the optimizer
        state present on one side only (another optimizer chain with the same arrays)."""
        step = self.resolve_step(step)
        keep = lambda sig: {p: v for p, v in sig.items() if field_of(p) not in ignore}
        saved_tree = self.saved_tree(step)
        saved, wanted = keep(tree_signature(saved_tree)), keep(tree_signature(target))
        self._check_staleness(saved, wanted, step)
        problems = signature_mismatches(saved, wanted)
        chain = [] if "opt_state" in ignore else structure_mismatches(empty_nodes(saved_tree), empty_nodes(target),
                                                                       "opt_state")
        if chain:
            raise CheckpointMismatchError(
                f"checkpoint {self.directory} step {step} does not match the restore target "
                f"{describe_mismatches(chain + problems)}. The optimizer chain (the tree structure of opt_state) "
                "differs from the one that saved it (optax.adamw, for one, adds an empty node to optax.adam's "
                f"state); build the program with the optimizer that saved it (its config: {self.saved_config(step)})"
            )
        if problems:
            raise CheckpointMismatchError(
                f"checkpoint {self.directory} step {step} does not match the restore target {describe_mismatches(problems)}. "
                f"Restore it with the model and optimizer that saved it (its config: {self.saved_config(step)})"
            )

    def _check_staleness(self, saved: Mapping[str, tuple], target: Mapping[str, tuple], step: int) -> None:
        """Refuse, naming the option, a checkpoint whose queue of stale gradients (``pending``)
        was built with another ``staleness``: a queue of tau gradients means nothing under tau'."""
        tau, tau_target = staleness_of(saved), staleness_of(target)
        if tau != tau_target:
            raise CheckpointMismatchError(
                f"checkpoint {self.directory} step {step} was saved by a program built with staleness={tau}, and the "
                f"restore target is built with staleness={tau_target}: the queued gradients (TrainState.pending) "
                f"belong to the staleness that queued them. Build the program with build(..., staleness={tau}) "
                "to resume this checkpoint"
            )

    def restore(self, abstract_state: Any, step: int | None = None, *,
                fresh: Callable[[], Mapping[str, Any]] | None = None) -> tuple[Any, dict[str, Any], dict[str, Any]]:
        """(state, this process's data state, config) of ``step`` (default: latest complete).

        ``abstract_state`` is the new program's ``abstract_state()``: its shardings say where
        every restored shard goes, on any mesh, device count or strategy. Fields that describe
        how the step runs (`TRANSIENT_FIELDS`: fp16's loss scale, int8's residuals) restore only
        where the target has them with the saved shapes; otherwise they start afresh from
        ``fresh()`` (the new program's ``fresh_transient``), or are dropped, with a note.

        Every file read is checked, and every restored array compared with the digest saved
        with it. With ``step=None`` a damaged newest checkpoint is named (logged), set aside as
        ``<step>.damaged-<reason>`` and the next newest tried; a given ``step`` that is damaged
        raises `CheckpointDamagedError`.
        """
        explicit = step is not None
        step = self.resolve_step(step)
        if callable(abstract_state):
            raise CheckpointError(
                f"restore target is the method {getattr(abstract_state, '__qualname__', abstract_state)!r}, not a "
                "state: call it, Checkpointer.restore(program.abstract_state(), ...)")
        unsharded = [path_str(p) for p, leaf in jax.tree_util.tree_flatten_with_path(abstract_state)[0]
                     if getattr(leaf, "sharding", None) is None]
        if unsharded:
            raise CheckpointError(
                f"restore target has no sharding for {listed(unsharded)}; pass program.abstract_state() "
                "(ShapeDtypeStructs with shardings) so every shard knows which device it goes to"
            )
        if explicit:
            return self._restore_step(abstract_state, step, fresh)
        damaged: list[CheckpointDamagedError] = []
        for candidate in sorted(self.all_steps(), reverse=True):
            try:
                result = self._restore_step(abstract_state, candidate, fresh)
            except CheckpointDamagedError as err:
                damaged.append(err)
                self._set_aside(err)
                continue
            if damaged:
                log.warning("checkpoint %s: restored step %d, the newest intact checkpoint (damaged: %s)",
                            self.directory, candidate, ", ".join(f"step {e.step} ({e.reason})" for e in damaged))
            return result
        raise CheckpointDamagedError(
            self.directory, damaged[0].step, damaged[0].reason,
            f"{damaged[0].detail}; and no older checkpoint is intact ("
            f"{'; '.join(f'step {e.step}: {e.reason}' for e in damaged[1:]) or 'there is none'}). The damaged ones are "
            "kept as <step>.damaged-<reason>; start afresh in another directory, or repair them")

    def _restore_step(self, abstract_state: Any, step: int,
                      fresh: Callable[[], Mapping[str, Any]] | None) -> tuple[Any, dict[str, Any], dict[str, Any]]:
        """`restore` of one step: its files checked, its arrays read and verified against the digests."""
        if getattr(abstract_state, "steps_taken", None) is not None and not any(
                field_of(p) == "steps_taken" for p in self.saved_signature(step)):
            return self._restore_counting_from_step(abstract_state, step, fresh)
        digests = self._agreed(step, lambda: self.inspect(step))
        reinit = transient_changes(self.saved_signature(step), tree_signature(abstract_state))
        self.check_compatible(abstract_state, step, ignore=tuple(reinit))
        if reinit:
            return self._restore_reinitialising(abstract_state, step, reinit, fresh)
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore(),
                                  config=ocp.args.JsonRestore())
        restored = self._agreed(step, lambda: self._manager.restore(step, args=args), reading="state")
        self.verify(step, restored["state"], digests)
        return restored["state"], pick_data_state(restored["data"], self.directory, step), dict(restored["config"])

    def _restore_counting_from_step(self, abstract_state: Any, step: int,
                                    fresh: Callable[[], Mapping[str, Any]] | None) -> tuple[Any, dict[str, Any], dict[str, Any]]:
        """`restore` of a checkpoint saved before `TrainState.steps_taken` existed: its dropout keys
        were folded from ``step``, so the counter goes on from there (the keys it would have drawn)."""
        counter = abstract_state.steps_taken
        state, data, config = self._restore_step(dataclasses.replace(abstract_state, steps_taken=None), step, fresh)
        log.warning("checkpoint %s step %d holds no steps_taken (saved by an older shardlib): the dropout keys "
                    "go on from its step number, %d", self.directory, step, int(state.step))
        taken = jax.device_put(np.asarray(state.step, np.int32), counter.sharding)
        return dataclasses.replace(state, steps_taken=taken), data, config

    def _restore_reinitialising(self, abstract_state: Any, step: int, reinit: Mapping[str, str],
                                fresh: Callable[[], Mapping[str, Any]] | None) -> tuple[Any, dict[str, Any], dict[str, Any]]:
        """`restore` where transient fields differ: every other field read exactly (a partial
        restore), those in ``reinit`` taken from ``fresh()`` or left None, with a note why."""
        wanted = [name for name in reinit if getattr(abstract_state, name) is not None]
        if wanted and fresh is None:
            raise CheckpointMismatchError(
                f"checkpoint {self.directory} step {step}: {'; '.join(f'{n}: {reinit[n]}' for n in wanted)}, so they "
                "must start afresh; pass fresh=program.fresh_transient to Checkpointer.restore"
            )
        kept = {f.name: getattr(abstract_state, f.name) for f in dataclasses.fields(abstract_state)
                if f.name not in reinit and getattr(abstract_state, f.name) is not None}
        new = dict(fresh()) if wanted else {}
        state = dataclasses.replace(abstract_state, **self.restore_subtree(kept, step),
                                    **{name: new.get(name) for name in reinit})
        for name, why in reinit.items():
            done = "re-initialised" if name in wanted else "dropped"
            log.warning("checkpoint %s step %d: %s %s (%s); everything else restored exactly",
                        self.directory, step, TRANSIENT_FIELDS[name], done, why)
        data, config = self._read_json(step, "data"), self._read_json(step, "config")
        return state, pick_data_state(data, self.directory, step), config

    def restore_subtree(self, target: Mapping[str, Any], step: int | None = None) -> dict[str, Any]:
        """Restore only some top-level entries of the state (e.g. ``{"params": abstract}``).

        Uses Orbax's partial restore on the state item, so the optimizer state is never read.
        """
        step = self.resolve_step(step)
        saved = self.saved_signature(step)
        wanted = {k: v for k, v in saved.items() if k.split("/", 1)[0] in target}
        problems = signature_mismatches(wanted, tree_signature(dict(target)))
        if problems:
            raise CheckpointMismatchError(
                f"checkpoint {self.directory} step {step} does not match the requested entries {describe_mismatches(problems)}"
            )
        restore_args = ocp.checkpoint_utils.construct_restore_args(dict(target))
        digests = self._digests(step)
        args = ocp.args.PyTreeRestore(item=dict(target), restore_args=restore_args, partial_restore=True)
        restored = self._agreed(step, lambda: ocp.PyTreeCheckpointer().restore(self.state_path(step), args=args),
                                reading="state")
        self.verify(step, restored, digests)
        return restored


def _finish_before_exit(manager: ocp.CheckpointManager, directory: str) -> None:
    """Commit the in-flight async save of ``manager`` when the program ends without ``close()``.

    A loop that saves the last step and returns (or raises) would otherwise lose that save: at
    exit, Python shuts the thread pools Orbax's background write uses down *before* ordinary
    ``atexit`` handlers run, so the write fails ("cannot schedule new futures after shutdown")
    and leaves only a tmp directory. ``threading``'s own exit hooks run first, newest first,
    which is the one place a wait can still finish the write. The manager is held by a weak
    reference, so a closed, unused one is still freed (the save thread keeps a busy one alive).
    """
    ref = weakref.ref(manager)

    def finish() -> None:
        alive = ref()
        if alive is None or not alive.is_saving_in_progress():
            return
        log.warning("checkpoint %s: a save was still being written when the program ended; waiting for it to "
                    "commit. Call ckpt.close() (or use `with Checkpointer(...) as ckpt:`) at the end of the "
                    "training loop", directory)
        try:
            alive.wait_until_finished()
        except Exception as err:  # noqa: BLE001 - at exit there is no one left to raise to
            log.error("checkpoint %s: the save in flight at exit failed (%s: %s); the previous checkpoint is the "
                      "newest good one", directory, type(err).__name__, err)

    compat.at_exit_before_threads(finish)  # while Orbax's writer threads can still finish the save
