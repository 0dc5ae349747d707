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
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import signal
import sys
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from shardlib import compat
from shardlib.runtime.files import write_new_file
from shardlib.sharding.rules import describe_mismatches, listed, path_str
from shardlib.step.state import TRANSIENT_FIELDS

log = logging.getLogger("shardlib.runtime.checkpoint")


class _ReadOnlyNotice(logging.Filter):
    """Drops Orbax's ``WARNING:absl:Given directory is read only``: a read-only Checkpointer
    (``create=False``: export, evaluation, inspection) is what was asked for, not a problem."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Given directory is read only")


_READ_ONLY_NOTICE = _ReadOnlyNotice()

FORMAT = "shardlib.runtime.checkpoint/2"
LEGACY_FORMATS = ("shardlib.runtime.checkpoint/1",)  # saved before digests: restored unverified, with a warning
DIGEST_ITEM = "digests"
DIGEST_KIND = "shardlib.poshash64/1"
COMMIT_MARKER = "commit_success.txt"  # Orbax writes it into the step directory before the commit rename
JSON_ITEMS = ("data", "config", "meta")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as asked; the message names the directory and the fix."""

    user_facing = True


class CheckpointNotFoundError(CheckpointError):
    """The directory, or the requested step in it, holds no complete checkpoint."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint's tree (paths, shapes, dtypes) differs from the restore target."""


class NonFiniteStateError(CheckpointError):
    """A state with NaN or Inf values, which must never replace a good checkpoint."""


class CheckpointDamagedError(CheckpointError):
    """A checkpoint whose files are missing, unreadable, or differ from the digests saved with it.

    ``reason`` is one word (``incomplete``, ``missing-file``, ``unreadable``, ``metadata``,
    ``data-step``, ``digest``); the message names the step, the file or tensor, and why.
    """

    def __init__(self, directory: str, step: int, reason: str, detail: str) -> None:
        self.directory, self.step, self.reason, self.detail = directory, int(step), reason, detail
        super().__init__(f"checkpoint {directory} step {step} is damaged ({reason}): {detail}")


class CheckpointReadError(CheckpointError):
    """A checkpoint could not be read for a reason its bytes do not show (storage outage,
    permissions, credentials, an error about the restore target): nothing is set aside."""

    def __init__(self, directory: str, step: int, detail: str) -> None:
        self.directory, self.step, self.detail = directory, int(step), detail
        super().__init__(f"checkpoint {directory} step {step} could not be read ({detail}); this says nothing about "
                         "its files, so nothing was set aside: fix the cause (storage, permissions, credentials) and "
                         "run again")


class CheckpointSaveError(CheckpointError):
    """A background (async) save failed: the run must stop; the last good checkpoint is named."""


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
# Digests: a position-aware 64-bit sum hash of each array's logical value
# --------------------------------------------------------------------------------------------
#
# h(x) = sum over elements i of fmix32((i * G + seed) ^ bits(x[i]))  (mod 2**32), two seeds.
# Each term depends only on the element's row-major index in the *logical* array and its bits,
# and the sum is order-free, so the digest is the same whatever mesh, sharding or process count
# holds the array: every device hashes its own shard and one all-reduce adds them up. For a
# fixed index the term is a bijection of the bits, so any single changed element always changes
# the digest; several changes cancel with probability about 2**-64.

_GOLDEN = np.uint32(0x9E3779B9)
_SEEDS = (np.uint32(0x3C6EF372), np.uint32(0xA54FF53A))


def _fmix32(h: jax.Array) -> jax.Array:
    """MurmurHash3's finaliser: a bijection of uint32 that mixes every bit into every other."""
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def _words(x: jax.Array) -> jax.Array:
    """The bits of ``x`` as uint32, shape ``x.shape + (k,)`` (k = 2 for 64-bit values, else 1)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
    dtype = np.dtype(x.dtype)
    if dtype == np.bool_ or dtype.itemsize < 1 or dtype.name in ("int4", "uint4", "int2", "uint2", "float4_e2m1fn"):
        x = x.astype(jnp.float32 if jnp.issubdtype(dtype, jnp.floating) else jnp.int32)  # exact for these
        dtype = np.dtype(x.dtype)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}
    if dtype.itemsize == 8:
        return lax.bitcast_convert_type(x, jnp.uint32)  # adds a trailing axis of 2
    return lax.bitcast_convert_type(x, unsigned[dtype.itemsize]).astype(jnp.uint32)[..., None]


def _array_digest(x: jax.Array) -> jax.Array:
    words = _words(x)
    index = jnp.zeros(words.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(words.ndim)):  # the row-major index, built elementwise (no reshape, no resharding)
        index = index + lax.broadcasted_iota(jnp.uint32, words.shape, axis) * np.uint32(stride & 0xFFFFFFFF)
        stride *= words.shape[axis]
    position = index * _GOLDEN
    lanes = [jnp.sum(_fmix32((position + seed) ^ words), dtype=jnp.uint32) for seed in _SEEDS]
    return jnp.stack(lanes)


def _digest_all(leaves: list[jax.Array]) -> jax.Array:
    return jnp.stack([_array_digest(x) for x in leaves])


_digest_fns: dict[Any, Callable] = {}


def _in_device_memory(x: Any) -> Any:
    """``x``, copied into device memory if it lives in host memory (offloaded optimizer state): one
    computation cannot mix memory spaces. The copy keeps the sharding and is dispatched async."""
    sharding = getattr(x, "sharding", None)
    kind = getattr(sharding, "memory_kind", None)
    if kind is None or kind == "device":
        return x
    return jax.device_put(x, sharding.with_memory_kind("device"))


def digest_arrays(tree: Any) -> tuple[list[str], jax.Array | None]:
    """(paths, a [n, 2] uint32 device array of digests) for the arrays of ``tree``.

    Dispatched asynchronously: nothing waits for the devices until the result is read
    (`digest_hex`). The result is replicated, so every process can read it.
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    flat = [(path_str(path), leaf) for path, leaf in flat if leaf is not None]
    if not flat:
        return [], None
    leaves = [_in_device_memory(leaf) for _, leaf in flat]
    sharding = getattr(leaves[0], "sharding", None)
    out = NamedSharding(sharding.mesh, P()) if isinstance(sharding, NamedSharding) else None
    fn = _digest_fns.get(out)
    if fn is None:
        fn = _digest_fns[out] = jax.jit(_digest_all, out_shardings=out)
    return [p for p, _ in flat], fn(leaves)


def digest_hex(paths: list[str], digests: jax.Array | None) -> dict[str, str]:
    """``{path: "16 hex digits"}``; blocks until the digests are computed."""
    if digests is None:
        return {}
    values = np.asarray(digests)
    return {path: f"{int(a):08x}{int(b):08x}" for path, (a, b) in zip(paths, values)}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class _PendingDigests:
    """The digests item of one save, read from the devices in Orbax's background write.

    `start` dispatches the reduction. An async save calls it right after Orbax has copied the
    arrays to the host, so that the copy (which the loop waits for) is not queued behind it;
    `resolve` (in the background write) waits for `start`, then for the devices.
    """

    def __init__(self, step: int, json_items: Mapping[str, Any], data_step_tied: bool) -> None:
        self.head = {
            "kind": DIGEST_KIND,
            "step": int(step),
            # the same bytes JsonCheckpointHandler writes: json.dumps(item)
            "files": {f"{name}/metadata": _sha256(json.dumps(item).encode("utf-8")) for name, item in json_items.items()},
            "data_step_tied": bool(data_step_tied),
        }
        self._started = threading.Event()
        self._paths: list[str] = []
        self._digests: jax.Array | None = None
        self._error: BaseException | None = None

    def start(self, tree: Any) -> None:
        try:
            self._paths, self._digests = digest_arrays(tree)
        except BaseException as err:  # noqa: BLE001 - raised by resolve, in the save it belongs to
            self._error = err
            raise
        finally:
            self._started.set()

    def cancel(self, err: BaseException) -> None:
        if not self._started.is_set():
            self._error = err
            self._started.set()

    def resolve(self) -> dict[str, Any]:
        self._started.wait()
        if self._error is not None:
            raise self._error
        return {**self.head, "arrays": digest_hex(self._paths, self._digests)}


class _DigestHandler(ocp.JsonCheckpointHandler):
    """Orbax's JSON item, except that the value is computed in the background thread."""

    async def _save_fn(self, x, directory):
        if ocp.multihost.is_primary_host(self._primary_host):
            value = x.resolve() if isinstance(x, _PendingDigests) else x
            (directory / self._filename).write_text(json.dumps(value))


@ocp.args.register_with_handler(_DigestHandler, for_save=True)
@dataclasses.dataclass
class _DigestSave(ocp.args.CheckpointArgs):
    item: Any


@ocp.args.register_with_handler(_DigestHandler, for_restore=True)
@dataclasses.dataclass
class _DigestRestore(ocp.args.CheckpointArgs):
    item: Any = None


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
    """This process's data state: the common one if all processes agreed, else its own by index.

    States that hold ``"shards"`` (a loader cut into logical shards, `shardlib.runtime.grain_data`)
    are merged instead: every shard's state, whatever process saved it, so any process count can
    take the shards over.
    """
    states = list(saved["states"])
    if all(s == states[0] for s in states):
        return dict(states[0])
    if all(isinstance(s.get("shards"), dict) and s.get("step") == states[0].get("step") for s in states):
        return {**states[0], "shards": {k: v for s in states for k, v in s["shards"].items()}}
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
            logging.getLogger("absl").addFilter(_READ_ONLY_NOTICE)  # once: the same filter is added once
        handlers = {
            "state": ocp.StandardCheckpointHandler(),
            "data": ocp.JsonCheckpointHandler(),
            "config": ocp.JsonCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler(),
            DIGEST_ITEM: _DigestHandler(),
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
        data = gather_data_states(data_state)
        tied = bool(data["states"]) and all(isinstance(d.get("step"), int) and d["step"] == step for d in data["states"])
        digests = _PendingDigests(step, {"data": data, "config": config_json, "meta": meta}, tied)
        if not self._async:  # a synchronous save writes the item before returning: the digests must be under way
            digests.start(state)
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(data),
            config=ocp.args.JsonSave(config_json),
            meta=ocp.args.JsonSave(meta),
            **{DIGEST_ITEM: _DigestSave(digests)},
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
        path = self._step_path(step) / name / "metadata"
        where = f"{name}/metadata"
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise CheckpointDamagedError(self.directory, step, "missing-file", f"{path} is missing") from None
        except OSError as err:  # permissions, an outage: no evidence against the bytes
            raise CheckpointReadError(self.directory, step, f"{path}: {err}") from None
        try:
            value = json.loads(raw.decode("utf-8"))
        except ValueError as err:
            raise CheckpointDamagedError(self.directory, step, "metadata", f"{where} is not valid JSON ({err})") from None
        if not isinstance(value, dict):
            raise CheckpointDamagedError(self.directory, step, "metadata",
                                         f"{where} holds a {type(value).__name__}, not a JSON object")
        return value

    # ---- integrity ------------------------------------------------------------------------

    def _reading(self, step: int, what: str):
        """Context: an error reading ``step`` (Orbax, TensorStore, the file system) becomes
        `CheckpointDamagedError`; shardlib's own errors (a target that does not match) pass."""
        return _Reading(self, step, what)

    def _digests(self, step: int) -> dict[str, Any] | None:
        """The digests item of ``step`` (None for a checkpoint saved before digests)."""
        if not (self._step_path(step) / DIGEST_ITEM / "metadata").exists():
            why = incomplete_reason(self._step_path(step))
            if why is not None:
                raise CheckpointDamagedError(self.directory, step, "incomplete", why)
            if step not in self._warned_legacy:
                self._warned_legacy.add(step)
                log.warning("checkpoint %s step %d was saved before digests (format %s); restored unverified",
                            self.directory, step, LEGACY_FORMATS[0])
            return None
        digests = self._read_json(step, DIGEST_ITEM)
        if digests.get("kind") != DIGEST_KIND or not isinstance(digests.get("arrays"), dict) \
                or not isinstance(digests.get("files"), dict):
            raise CheckpointDamagedError(self.directory, step, "metadata",
                                         f"{DIGEST_ITEM}/metadata is not a {DIGEST_KIND} digest record")
        return digests

    def inspect(self, step: int) -> dict[str, Any] | None:
        """Check every file of ``step`` but the array chunks: the commit marker, the digests, the
        JSON items against their SHA-256, the meta's and data state's step. Returns the digests
        (None: a checkpoint saved before digests); raises `CheckpointDamagedError`."""
        why = incomplete_reason(self._step_path(step))
        if why is not None:
            raise CheckpointDamagedError(self.directory, step, "incomplete", why)
        digests = self._digests(step)
        items = {name: self._read_json(step, name) for name in JSON_ITEMS}
        if items["meta"].get("step", step) != step:
            raise CheckpointDamagedError(self.directory, step, "metadata",
                                         f"meta/metadata says step {items['meta'].get('step')!r}, not {step}")
        states = items["data"].get("states")
        if not isinstance(states, list) or not all(isinstance(d, dict) for d in states):
            raise CheckpointDamagedError(self.directory, step, "metadata",
                                         "data/metadata holds no list of data states ('states')")
        if digests is not None and digests.get("data_step_tied"):
            wrong = [d.get("step") for d in states if d.get("step") != step]
            if wrong:
                raise CheckpointDamagedError(
                    self.directory, step, "data-step",
                    f"data/metadata says the data iterator stood at step {wrong[0]!r}, but the checkpoint is step "
                    f"{step}: resuming would repeat or skip batches")
        if digests is not None:
            for name in JSON_ITEMS:
                want = digests["files"].get(f"{name}/metadata")
                got = _sha256((self._step_path(step) / name / "metadata").read_bytes())
                if want != got:
                    raise CheckpointDamagedError(self.directory, step, "metadata",
                                                 f"{name}/metadata differs from the SHA-256 saved with it")
        return digests

    def verify(self, step: int, tree: Any, digests: Mapping[str, Any] | None = None) -> None:
        """Compare the arrays of ``tree`` (restored from ``step``, any mesh) with their saved digests;
        `CheckpointDamagedError` names the tensors that differ."""
        digests = self._digests(step) if digests is None else digests
        if digests is None:
            return
        saved = digests["arrays"]
        got = digest_hex(*digest_arrays(tree))
        bad = [path for path, value in got.items() if saved.get(path) != value]
        if bad:
            raise CheckpointDamagedError(
                self.directory, step, "digest",
                f"the restored values of {listed(bad)} differ from the digests saved with them (a changed bit in "
                "a data file)")

    def _agree(self, step: int, err: CheckpointError | None) -> CheckpointError | None:
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
            return CheckpointReadError(self.directory, step, f"process(es) {bad} could not read it")
        return CheckpointDamagedError(self.directory, step, "unreadable", f"process(es) {bad} found it damaged")

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
            _note_damage(target, err)
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
                _field(p) == "steps_taken" for p in self.saved_signature(step)):
            return self._restore_counting_from_step(abstract_state, step, fresh)
        err = None
        try:
            digests = self.inspect(step)
        except (CheckpointDamagedError, CheckpointReadError) as found:
            err = found
        err = self._agree(step, err)
        if err is not None:
            raise err
        reinit = transient_changes(self.saved_signature(step), tree_signature(abstract_state))
        self.check_compatible(abstract_state, step, ignore=tuple(reinit))
        if reinit:
            return self._restore_reinitialising(abstract_state, step, reinit, fresh)
        restored = None
        try:
            with self._reading(step, "state"):
                restored = self._manager.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(abstract_state),
                        data=ocp.args.JsonRestore(),
                        config=ocp.args.JsonRestore(),
                    ),
                )
        except (CheckpointDamagedError, CheckpointReadError) as found:
            err = found
        err = self._agree(step, err)
        if err is not None:
            raise err
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
        err, restored = None, None
        try:
            with self._reading(step, "state"):
                restored = ocp.PyTreeCheckpointer().restore(
                    self.state_path(step),
                    args=ocp.args.PyTreeRestore(item=dict(target), restore_args=restore_args, partial_restore=True),
                )
        except (CheckpointDamagedError, CheckpointReadError) as found:
            err = found
        err = self._agree(step, err)
        if err is not None:
            raise err
        self.verify(step, restored, digests)
        return restored


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
        abandoned = ("_read_array_index_and_device_put" in repr(obj)
                     or text.startswith("Encountered error while reading array index")
                     or (isinstance(err, RuntimeError) and text == "Event loop is closed"))
        if not abandoned:
            previous(unraisable)

    hook._shardlib_quiet = True
    sys.unraisablehook = hook


class _Reading:
    """See `Checkpointer._reading`."""

    def __init__(self, ckpt: Checkpointer, step: int, what: str) -> None:
        self.ckpt, self.step, self.what = ckpt, step, what

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
        if any(mark in text for mark in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory")):
            return False  # the devices are full, the checkpoint may be fine
        _quiet_abandoned_reads()
        cause = chain[-1]
        brief = " ".join(str(cause).split())
        detail = f"reading {self.what}: {type(cause).__name__}: {brief.split(' See full TensorStore details')[0][:300]}"
        reason = damage_shown(chain, text)
        if reason is None:
            raise CheckpointReadError(self.ckpt.directory, self.step, detail) from err
        missing = missing_data_files(self.ckpt._step_path(self.step) / "state") if reason == "unreadable" else []
        if missing:  # OCDBT reads a deleted data file as empty bytes, "truncated": name what is gone
            reason, detail = "missing-file", f"reading {self.what}: its data file(s) {listed(missing)} are missing"
        raise CheckpointDamagedError(self.ckpt.directory, self.step, reason, detail) from err


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


# TensorStore's status codes for bytes that are absent, short or do not decode; the others
# (UNAVAILABLE, PERMISSION_DENIED, UNAUTHENTICATED, DEADLINE_EXCEEDED, ...) say nothing about them.
_DAMAGE_CODES = re.compile(r"\b(NOT_FOUND|OUT_OF_RANGE|DATA_LOSS|FAILED_PRECONDITION): ")


def damage_shown(chain: Sequence[BaseException], text: str) -> str | None:
    """The damage reason an error reading a checkpoint is evidence of, or None when it is not:
    only a missing file, or bytes that are short or do not decode, may mark a checkpoint damaged."""
    if any(isinstance(e, FileNotFoundError) for e in chain) or "NOT_FOUND: " in text:
        return "missing-file"
    if any(isinstance(e, (json.JSONDecodeError, UnicodeDecodeError)) for e in chain) or _DAMAGE_CODES.search(text):
        return "unreadable"
    return None


def _note_damage(step_dir: Any, err: CheckpointDamagedError) -> None:
    """``DAMAGED.txt`` in a set-aside step directory: into that directory only, never through a
    link (a linked step directory's target is someone else's); the log names the reason anyway."""
    try:
        if "://" in str(step_dir):
            (step_dir / "DAMAGED.txt").write_text(str(err) + "\n")
        else:
            write_new_file(step_dir, "DAMAGED.txt", str(err) + "\n")
    except OSError:
        pass


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
