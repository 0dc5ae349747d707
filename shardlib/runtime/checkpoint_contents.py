"""What a checkpoint holds, compared with what a restore asks for: tree signatures, empty nodes,
transient fields, finiteness, and the JSON items (the data state of every process).

Pure helpers of `shardlib.runtime.checkpoint`: no Orbax here, so the export and the run's
checks compare trees without loading it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from shardlib.runtime.checkpoint_errors import CheckpointError
from shardlib.sharding.rules import listed, path_str
from shardlib.step.state import TRANSIENT_FIELDS


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
    for path in sorted(p for p in saved ^ target if field_of(p) == field):
        where = "in the checkpoint, not in the target" if path in saved else "in the target, not in the checkpoint"
        problems.append(f"{path}: an empty node (no arrays, e.g. optax.EmptyState) {where}")
    return problems


def staleness_of(signature: Mapping[str, tuple]) -> int:
    """The ``staleness`` a state was built with: the number of gradients queued in ``pending``."""
    return len({p.split("/")[1] for p in signature if field_of(p) == "pending" and "/" in p})


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


def refuse_zero_size(state: Any) -> None:
    """Orbax refuses zero-size arrays (naming an internal ParamInfo); name the tensors instead."""
    empty = [path_str(path) for path, leaf in jax.tree_util.tree_leaves_with_path(state) if np.size(leaf) == 0]
    if empty:
        raise CheckpointError(
            f"cannot checkpoint zero-size tensors ({listed(empty)}): Orbax does not save arrays with no elements. "
            "They hold no values: leave them out of the parameters (create the layer only when its size is > 0)")


def is_finite_state(state: Any) -> bool:
    """True when every floating-point value of ``state`` (params, optimizer state) is finite."""
    return not nonfinite_paths(state)


def metrics_nonfinite(metrics: Mapping[str, Any] | None) -> str | None:
    """Why these step metrics say the step's loss was not finite, or None."""
    if metrics is None:
        return None
    if "loss" in metrics and not np.all(np.isfinite(np.asarray(metrics["loss"]))):
        return f"loss is {float(np.asarray(metrics['loss']))}"
    if "skipped" in metrics and int(np.asarray(metrics["skipped"])):
        return "the step was skipped (non-finite loss or gradient norm)"
    return None


def mesh_of(state: Any) -> dict[str, int] | None:
    """The mesh shape of the first array of ``state`` on a `NamedSharding` (the checkpoint's ``meta``)."""
    for leaf in jax.tree.leaves(state):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return {str(k): int(v) for k, v in sharding.mesh.shape.items()}
    return None


def field_of(path: str) -> str:
    """The top-level field of a signature path: ``"params/blocks/wq"`` -> ``"params"``."""
    return path.split("/", 1)[0]


def transient_changes(saved: Mapping[str, tuple], target: Mapping[str, tuple]) -> dict[str, str]:
    """Transient field -> why the checkpoint's value cannot be restored into ``target`` (absent
    from either side, or other shapes: another precision, compression or device count)."""
    changes = {}
    for name in TRANSIENT_FIELDS:
        s = {p: v for p, v in saved.items() if field_of(p) == name}
        t = {p: v for p, v in target.items() if field_of(p) == name}
        if s == t:
            continue
        changes[name] = ("the checkpoint holds none" if not s else "the restore target keeps none" if not t
                         else "their shapes differ: another device count or layout")
    return changes



# --------------------------------------------------------------------------------------------
# The JSON items: the data-iterator state of every process, the config
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


def json_bytes(value: Any, what: str) -> bytes:
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
    encoded = json_bytes(dict(data_state), "data_state")
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

