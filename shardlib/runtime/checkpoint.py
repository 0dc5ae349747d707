"""Orbax checkpoints of a `TrainState`: async, sharded, restorable onto any mesh and strategy.

One checkpoint is one Orbax step directory ``DIR/<step>/`` with four items:

  state/   the whole TrainState (step, params, optimizer state) as an OCDBT PyTree; every
           process writes only the shards it holds (``ocp.args.StandardSave``)
  data/    JSON ``{"process_count": P, "states": [state of process 0, ..., P-1]}``: the data
           iterator state of *every* process, gathered before the save, because Orbax's JSON
           item is written by process 0 only
  config/  JSON run configuration (whatever the training loop passes; the export reads
           ``config["model"]`` from it)
  meta/    JSON facts about the run that saved it (mesh, process and device count, versions)

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
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import signal
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

from shardlib.sharding.rules import describe_mismatches, listed, path_str
from shardlib.step.state import TRANSIENT_FIELDS

log = logging.getLogger("shardlib.runtime.checkpoint")

FORMAT = "shardlib.runtime.checkpoint/1"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as asked; the message names the directory and the fix."""

    user_facing = True


class CheckpointNotFoundError(CheckpointError):
    """The directory, or the requested step in it, holds no complete checkpoint."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint's tree (paths, shapes, dtypes) differs from the restore target."""


class NonFiniteStateError(CheckpointError):
    """A state with NaN or Inf values, which must never replace a good checkpoint."""


# --------------------------------------------------------------------------------------------
# Small pure helpers
# --------------------------------------------------------------------------------------------


def resolve_directory(directory: str | os.PathLike[str]) -> str:
    """An absolute path (Orbax fails later, in a background thread, on a relative one); URLs pass."""
    text = os.fspath(directory)
    if "://" in text:
        return text
    return str(Path(text).expanduser().resolve())


def _leaf_signature(leaf: Any) -> tuple[tuple[int, ...], str]:
    return tuple(int(d) for d in leaf.shape), np.dtype(leaf.dtype).name


def tree_signature(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{"params/blocks/attn/wq": ((2, 64, 4, 16), "float32"), ...}`` for arrays, structs or metadata.

    Paths are spelled the same whether the tree holds dict keys (Orbax metadata), attributes
    (TrainState, optax namedtuples) or sequence indices, so trees of either kind compare.
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {path_str(path): _leaf_signature(leaf) for path, leaf in flat}


def signature_mismatches(saved: Mapping[str, tuple], target: Mapping[str, tuple]) -> list[str]:
    """Human-readable differences between a checkpoint's tree and a restore target."""
    problems = []
    params_first = lambda path: (not path.startswith("params/"), path)  # the paths users recognise
    for path in sorted(saved.keys() | target.keys(), key=params_first):
        if path not in target:
            problems.append(f"{path}: in the checkpoint {saved[path][0]} {saved[path][1]}, not in the target")
        elif path not in saved:
            problems.append(f"{path}: in the target {target[path][0]} {target[path][1]}, not in the checkpoint")
        elif saved[path] != target[path]:
            (s_shape, s_dtype), (t_shape, t_dtype) = saved[path], target[path]
            problems.append(f"{path}: checkpoint {s_shape} {s_dtype} vs target {t_shape} {t_dtype}")
    return problems


def empty_nodes(tree: Any) -> set[str]:
    """Paths of the subtrees that hold no array (``optax.EmptyState``, ``MaskedNode``, None).

    Leaf signatures cannot see them, yet they are part of the tree Orbax restores into: the
    checkpoint keeps each as None, and a target with one more or one fewer fails inside Orbax.
    The topmost empty subtree counts once, spelled as `tree_signature` spells paths.
    """
    is_empty = lambda node: not jax.tree.leaves(node)
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_empty)
    return {path_str(path) for path, leaf in flat if is_empty(leaf)}


def structure_mismatches(saved: set[str], target: set[str], field: str) -> list[str]:
    """The empty nodes of ``field`` present on one side only, worded like `signature_mismatches`."""
    problems = []
    for path in sorted(p for p in saved ^ target if _field(p) == field):
        where = "in the checkpoint, not in the target" if path in saved else "in the target, not in the checkpoint"
        problems.append(f"{path}: an empty node (no arrays, e.g. optax.EmptyState) {where}")
    return problems


def staleness_of(signature: Mapping[str, tuple]) -> int:
    """The ``staleness`` a state was built with: the number of gradients queued in ``pending``."""
    return len({p.split("/")[1] for p in signature if _field(p) == "pending" and "/" in p})


def _finite_flags(leaves: list[jax.Array]) -> jax.Array:
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])


def nonfinite_paths(tree: Any) -> list[str]:
    """Paths of floating-point leaves holding a NaN or Inf (one fused device reduction, 1 bool per leaf)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    floats = [(path, leaf) for path, leaf in flat if jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.inexact)]
    if not floats:
        return []
    leaves = [leaf for _, leaf in floats]
    sharding = getattr(leaves[0], "sharding", None)
    out = NamedSharding(sharding.mesh, P()) if isinstance(sharding, NamedSharding) else None
    flags = np.asarray(jax.jit(_finite_flags, out_shardings=out)(leaves))
    return [path_str(path) for (path, _), ok in zip(floats, flags) if not ok]


def _refuse_zero_size(state: Any) -> None:
    """Orbax refuses zero-size arrays (naming an internal ParamInfo); name the tensors instead."""
    empty = [path_str(path) for path, leaf in jax.tree_util.tree_leaves_with_path(state) if np.size(leaf) == 0]
    if empty:
        raise CheckpointError(
            f"cannot checkpoint zero-size tensors ({listed(empty)}): Orbax does not save arrays with no elements. "
            "They hold no values: leave them out of the parameters (create the layer only when its size is > 0)")


def is_finite_state(state: Any) -> bool:
    """True when every floating-point value of ``state`` (params, optimizer state) is finite."""
    return not nonfinite_paths(state)


def _metrics_nonfinite(metrics: Mapping[str, Any] | None) -> str | None:
    """Why these step metrics say the step's loss was not finite, or None."""
    if metrics is None:
        return None
    if "loss" in metrics and not np.all(np.isfinite(np.asarray(metrics["loss"]))):
        return f"loss is {float(np.asarray(metrics['loss']))}"
    if "skipped" in metrics and int(np.asarray(metrics["skipped"])):
        return "the step was skipped (non-finite loss or gradient norm)"
    return None


def _mesh_of(state: Any) -> dict[str, int] | None:
    for leaf in jax.tree.leaves(state):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return {str(k): int(v) for k, v in sharding.mesh.shape.items()}
    return None


def _field(path: str) -> str:
    return path.split("/", 1)[0]


def transient_changes(saved: Mapping[str, tuple], target: Mapping[str, tuple]) -> dict[str, str]:
    """Transient field -> why the checkpoint's value cannot be restored into ``target`` (absent
    from either side, or other shapes: another precision, compression or device count)."""
    changes = {}
    for name in TRANSIENT_FIELDS:
        s = {p: v for p, v in saved.items() if _field(p) == name}
        t = {p: v for p, v in target.items() if _field(p) == name}
        if s == t:
            continue
        changes[name] = ("the checkpoint holds none" if not s else "the restore target keeps none" if not t
                         else "their shapes differ: another device count or layout")
    return changes


# --------------------------------------------------------------------------------------------
# Data-iterator state of every process
# --------------------------------------------------------------------------------------------


def _json_problem(value: Any, where: str) -> str | None:
    """Where ``value`` holds something JSON would refuse or silently change, or None.

    A NumPy or JAX scalar (``np.int64`` from an index, ``state.step``) is refused by ``json``; a
    non-string dict key would come back as a string after a restore, another key than was saved.
    """
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{where} has the key {key!r} ({type(key).__name__}), which JSON would give back as {str(key)!r}"
            found = _json_problem(item, f"{where}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(value, (list, tuple)):
        return next(filter(None, (_json_problem(item, f"{where}[{i}]") for i, item in enumerate(value))), None)
    if value is None or isinstance(value, (str, int, float)):
        return None
    return f"{where} is a {type(value).__module__}.{type(value).__qualname__}"


def _json_bytes(value: Any, what: str) -> bytes:
    """``value`` as JSON, or an error naming the entry that JSON cannot hold and what to pass."""
    problem = _json_problem(value, what)
    if problem is None:
        try:
            return json.dumps(value, sort_keys=True).encode("utf-8")
        except ValueError as err:  # a cycle, or NaN under allow_nan=False
            problem = f"{what}: {err}"
    raise CheckpointError(
        f"checkpoint {problem}: the {what} is saved as JSON, which holds dicts with str keys, lists, str, int, "
        "float, bool and None only. Pass plain Python values (int(x), float(x), x.tolist())")


def gather_data_states(data_state: Mapping[str, Any]) -> dict[str, Any]:
    """Every process's data state, so process 0's JSON write holds them all.

    Single-process: no communication. Multi-process: two small all-gathers (lengths, then the
    zero-padded UTF-8 JSON bytes); every process must call this (``save`` does).
    """
    encoded = _json_bytes(dict(data_state), "data_state")
    count = jax.process_count()
    if count == 1:
        return {"process_count": 1, "states": [json.loads(encoded)]}
    from jax.experimental import multihost_utils

    lengths = np.asarray(multihost_utils.process_allgather(np.array([len(encoded)], np.int32))).reshape(-1)
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[: len(encoded)] = np.frombuffer(encoded, np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(count, -1)
    return {"process_count": count, "states": [json.loads(bytes(r[:n])) for r, n in zip(rows, lengths)]}


def pick_data_state(saved: Mapping[str, Any], directory: str, step: int) -> dict[str, Any]:
    """This process's data state: the common one if all processes agreed, else its own by index."""
    states = list(saved["states"])
    if all(s == states[0] for s in states):
        return dict(states[0])
    count, index = jax.process_count(), jax.process_index()
    if len(states) != count:
        raise CheckpointError(
            f"checkpoint {directory} step {step}: the {len(states)} processes that saved it had different data "
            f"iterator states, so they cannot be split across {count} processes; resume with {len(states)} processes "
            "or restart the data iterator"
        )
    return dict(states[index])


# --------------------------------------------------------------------------------------------
# The manager
# --------------------------------------------------------------------------------------------


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
            max_to_keep=keep if create else None,  # read-only managers neither save nor delete
            save_interval_steps=(self.every or 1) if create else 0,
            enable_async_checkpointing=async_save,
            create=create,
            read_only=not create,
            cleanup_tmp_directories=create,  # remove the tmp dirs of saves a crash interrupted
            step_name_format=self._name_format,
        )
        handlers = {
            "state": ocp.StandardCheckpointHandler(),
            "data": ocp.JsonCheckpointHandler(),
            "config": ocp.JsonCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler(),
        }
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        if create and async_save:
            _finish_before_exit(self._manager, self.directory)

    # ---- steps ------------------------------------------------------------------------

    def _step_path(self, step: int) -> Any:
        """The committed directory of ``step`` (an ``epath.Path``: local or cloud storage)."""
        return ocp.path.step.build_step_path(self._manager.directory, self._name_format, step)

    def all_steps(self) -> list[int]:
        """Steps whose checkpoint is complete (committed) on disk, ascending.

        Read from the directory, not from Orbax's step list: that list already contains an
        in-flight async save and already lacks the steps retention will delete once it commits.
        """
        return sorted(ocp.utils.checkpoint_steps(self._manager.directory))

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
        if not force and self.every and not self.should_save(step):
            return False
        if step in self._manager.all_steps():  # Orbax's list (in-flight saves too): the same on every process
            log.warning("checkpoint %s step %d is already saved or being saved; not overwriting it", self.directory, step)
            return False
        reason = _metrics_nonfinite(metrics)
        if reason is not None:
            log.warning("not saving checkpoint step %d in %s: %s; the last good checkpoint stays", step, self.directory, reason)
            return False
        _refuse_zero_size(state)
        bad = nonfinite_paths(state)
        if bad:
            raise NonFiniteStateError(
                f"refusing to save checkpoint step {step} in {self.directory}: non-finite values in {listed(bad)}; "
                f"the last good checkpoint (step {self.latest_step()}) is kept. Lower the learning rate, enable "
                "gradient clipping or loss scaling, and resume from it"
            )
        config_json = json.loads(_json_bytes(dict(config or {}), "config"))
        meta = {
            "format": FORMAT,
            "step": step,
            "process_count": jax.process_count(),
            "device_count": jax.device_count(),
            "mesh": _mesh_of(state),
            "jax": jax.__version__,
            "orbax": getattr(ocp, "__version__", "unknown"),
        }
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(gather_data_states(data_state)),
            config=ocp.args.JsonSave(config_json),
            meta=ocp.args.JsonSave(meta),
        )
        return bool(self._manager.save(step, args=args, force=True))

    def wait(self) -> None:
        """Block until an in-flight async save has committed (and retention has run)."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Finish in-flight work and release Orbax's threads."""
        self._manager.close()

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
        return self._manager.item_metadata(step)["state"].tree

    def saved_signature(self, step: int | None = None) -> dict[str, tuple[tuple[int, ...], str]]:
        """Path -> (shape, dtype) of every array in the saved TrainState, from metadata only."""
        return tree_signature(self.saved_tree(step))

    def _json_item(self, name: str, step: int | None) -> dict[str, Any]:
        step = self.resolve_step(step)
        restored = self._manager.restore(step, args=ocp.args.Composite(**{name: ocp.args.JsonRestore()}))
        return dict(restored[name])

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
        keep = lambda sig: {p: v for p, v in sig.items() if _field(p) not in ignore}
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
        """
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
        reinit = transient_changes(self.saved_signature(step), tree_signature(abstract_state))
        self.check_compatible(abstract_state, step, ignore=tuple(reinit))
        if reinit:
            return self._restore_reinitialising(abstract_state, step, reinit, fresh)
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state),
                data=ocp.args.JsonRestore(),
                config=ocp.args.JsonRestore(),
            ),
        )
        return restored["state"], pick_data_state(restored["data"], self.directory, step), dict(restored["config"])

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
        data, config = self._json_item("data", step), self.saved_config(step)
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
        return ocp.PyTreeCheckpointer().restore(
            self.state_path(step),
            args=ocp.args.PyTreeRestore(item=dict(target), restore_args=restore_args, partial_restore=True),
        )


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
        alive.wait_until_finished()

    # CPython's hook for this (what concurrent.futures itself uses); where it is missing, plain
    # atexit at least logs the lost save instead of nothing
    getattr(threading, "_register_atexit", atexit.register)(finish)


# --------------------------------------------------------------------------------------------
# Preemption
# --------------------------------------------------------------------------------------------


def _preemption_sync_available() -> bool:
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
        self.synced = _preemption_sync_available()
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
