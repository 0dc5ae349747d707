"""Logical-axis rules: ordered tables mapping a tensor's logical axis names to mesh axes.

A rule table is data: ``(("embed", "fsdp"), ("embed", None), ("mlp", "tensor"), ...)``. For each
dimension, the first rule for its logical name that *can* apply wins: its mesh axes must not be
used by an earlier dimension of the same tensor, and their size must divide the dimension. A
rule that cannot apply is skipped with a note, and a dimension no rule could shard stays
replicated; every such fallback is recorded on the leaf so that `report` can say why a tensor is
replicated and `check_replication` can refuse it.

Names follow JAX and Flax: a tuple shorter than the tensor's rank leaves the trailing dims
unnamed; a longer one is an error naming the tensor. Trees without annotations (someone else's
model) get their logical names from regex path rules, also first match wins; and a strategy's
ZeRO fallback (`AutoShard`) shards whatever its rules leave whole along the largest dimension its
axes divide (zero1/zero2's optimizer state on XLA:CPU: the last, `Layout.state_from_last`), so an
unannotated model still gets ZeRO's memory.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MeshAxes = str | tuple[str, ...] | None
Rules = Sequence[tuple[str, MeshAxes]]
Logical = tuple[str | None, ...]
PathRules = Sequence[tuple[str, Logical | None]]


class RuleError(ValueError):
    """A rule table or annotation that cannot be applied to this mesh or tree."""


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """Where one tensor lives: its path, shape, logical names, spec, and why it is not sharded."""

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    logical: Logical | None
    spec: P
    notes: tuple[str, ...] = ()

    def shards(self, mesh: Mesh) -> int:
        return math.prod(mesh.shape[a] for entry in self.spec if entry for a in as_axes(entry))

    def bytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    def bytes_per_device(self, mesh: Mesh) -> int:
        return self.bytes() // self.shards(mesh)


def as_axes(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def validate_rules(rules: Rules, mesh: Mesh, *, table: str = "rules") -> None:
    """Refuse rules that name mesh axes the mesh does not have."""
    for name, axes in rules:
        for axis in as_axes(axes):
            if axis not in mesh.shape:
                raise RuleError(
                    f"{table}: rule {name!r} -> {axes!r} names mesh axis {axis!r}, which is not in the mesh "
                    f"(axes: {', '.join(mesh.shape)})"
                )


# Tensors below this many elements stay replicated rather than take the ZeRO fallback: sharding
# a 4 KiB (float32) bias saves under 4 KiB per device and adds a gather and a reduce-scatter per
# step, so like big_vision's minimum size it is not worth a collective.
AUTO_SHARD_MIN_SIZE = 1024

# Logical names the fallback never shards: a stacked layer axis is iterated by a scan (or split
# over 'pipe'), so splitting it over the batch axes would leave each device a subset of layers.
AUTO_SHARD_SKIP: tuple[str, ...] = ("layers",)


@dataclasses.dataclass(frozen=True)
class AutoShard:
    """The ZeRO fallback: a tensor no rule shards over ``axes`` is split along its largest dim they
    divide (``from_last``: the last).

    Unannotated models (and dims whose rules could not apply) then still get ZeRO's memory, as with
    PyTorch FSDP2 or DeepSpeed ZeRO-3, which shard every parameter without annotations.
    """

    axes: tuple[str, ...]
    min_size: int = AUTO_SHARD_MIN_SIZE
    skip: tuple[str | None, ...] = AUTO_SHARD_SKIP
    from_last: bool = False  # `Strategy.state_from_last`

    def apply(self, entries: list[MeshAxes], names: Logical, shape: Sequence[int], mesh: Mesh) -> str | None:
        """Shard one free dim of ``entries`` in place; the note saying what happened, or None if not needed."""
        axes = tuple(a for a in self.axes if mesh.shape[a] > 1)
        used = {a for entry in entries for a in as_axes(entry)}
        if not axes or used.intersection(axes):
            return None  # nothing to shard over, or a rule already shards it over these axes
        n = math.prod(mesh.shape[a] for a in axes)
        target = f"{'x'.join(axes)}={n}"
        if math.prod(shape) < self.min_size:
            return f"auto-shard: under {self.min_size} elements, kept whole rather than split over {target}"
        free = [d for d, size in enumerate(shape)
                if entries[d] is None and names[d] not in self.skip and size % n == 0]
        if not free:
            return f"auto-shard: no free dimension of {tuple(shape)} divisible by {target}"
        dim = free[-1] if self.from_last else max(free, key=lambda d: (shape[d], -d))  # the largest; the first of equals
        entries[dim] = axes[0] if len(axes) == 1 else axes
        return f"auto-sharded dim {dim} ({shape[dim]}) over {target}: no rule shards it there"


def names_for_rank(logical: Logical | None, shape: Sequence[int], path: str = "?") -> Logical:
    """One name (or None) per dim. As in JAX and Flax, fewer names than dims leave the trailing dims unnamed."""
    if logical is None:
        return (None,) * len(shape)
    if len(logical) > len(shape):
        raise RuleError(
            f"{path}: {len(logical)} logical axes {tuple(logical)} for a tensor of shape {tuple(shape)} "
            f"(rank {len(shape)}); give at most one name per dimension"
        )
    return tuple(logical) + (None,) * (len(shape) - len(logical))


def spec_for(
    logical: Logical | None, shape: Sequence[int], rules: Rules, mesh: Mesh, *, path: str = "?",
    auto: AutoShard | None = None, from_last: bool = False,
) -> tuple[P, tuple[str, ...]]:
    """Resolve one tensor's logical names to a PartitionSpec, with notes on every fallback.

    ``auto`` (the strategy's ZeRO fallback) then shards a tensor the rules left off its axes.
    ``from_last``: where rules for several dims name the same mesh axes, the last dim gets them.
    """
    names = names_for_rank(logical, shape, path)
    entries, notes = _apply_rules(names, shape, rules, mesh, from_last)
    if logical is None:
        notes.insert(0, "no logical axis names (unannotated; add path rules)")
    if auto is not None:
        note = auto.apply(entries, names, shape, mesh)
        if note is not None:
            notes.append(note)
    return P(*entries), tuple(notes)


def _apply_rules(names: Logical, shape: Sequence[int], rules: Rules, mesh: Mesh,
                 from_last: bool = False) -> tuple[list[MeshAxes], list[str]]:
    """Per dim (in order, or from the last), the first rule for its name that can apply; a note
    for every rule that could not."""
    used: set[str] = set()
    entries: list[MeshAxes] = [None] * len(names)
    notes: list[str] = []
    dims = list(enumerate(zip(names, shape)))
    for dim, (name, size) in reversed(dims) if from_last else dims:
        chosen: tuple[str, ...] = ()
        for rule_name, axes in rules:
            if name is None or rule_name != name:
                continue
            axes = tuple(a for a in as_axes(axes) if mesh.shape[a] > 1)
            if not axes:  # explicit replication (or only size-1 axes): the table's own fallback
                break
            clash = used.intersection(axes)
            n = math.prod(mesh.shape[a] for a in axes)
            if clash:
                notes.append(f"dim {dim} ({name}): {'/'.join(sorted(clash))} already shards another dim")
            elif size % n:
                notes.append(f"dim {dim} ({name}={size}) not divisible by {'x'.join(axes)}={n}")
            else:
                chosen = axes
                break
        used.update(chosen)
        entries[dim] = None if not chosen else chosen[0] if len(chosen) == 1 else chosen
    return entries, notes


def path_str(path: Sequence[Any]) -> str:
    """``(DictKey('blocks'), DictKey('w_up'))`` -> ``"blocks/w_up"``.

    A ``/`` inside a key is written ``\\/`` (and a backslash ``\\\\``), so that ``{"a/b": x}`` and
    ``{"a": {"b": y}}`` keep two names: layouts, checkpoint checks, exports and `init_from` find
    tensors by these strings, and one name for two tensors would give both one entry."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(_escape_key(str(getattr(key, attr))))
                break
        else:
            parts.append(_escape_key(str(key)))
    return "/".join(parts)


def _escape_key(key: str) -> str:
    return key.replace("\\", "\\\\").replace("/", "\\/")


MAX_LISTED = 12  # items an error message shows before "... and N more"


def listed(items: Sequence[str], limit: int = MAX_LISTED, sep: str = ", ") -> str:
    """``"a, b, ... and N more"``: the first ``limit`` items of an error message's list."""
    more = len(items) - limit
    return sep.join(items[:limit]) + (f"{sep}... and {more} more" if more > 0 else "")


def describe_mismatches(problems: Sequence[str]) -> str:
    """``"(N difference(s)): a; b; ... and M more"`` for an error message."""
    return f"({len(problems)} difference(s)): {listed(problems, sep='; ')}"


def path_keys(path: Sequence[Any]) -> tuple[str | int, ...]:
    """``(DictKey('blocks'), SequenceKey(0))`` -> ``("blocks", 0)``: dict keys as they are (str or
    int), indices as int, anything else as its string (what JSON and NNX filters take)."""
    def one(entry: Any) -> str | int:
        for attr in ("key", "idx", "name"):
            if hasattr(entry, attr):
                value = getattr(entry, attr)
                return value if isinstance(value, (str, int)) else str(value)
        return str(entry)

    return tuple(one(entry) for entry in path)


def logical_from_paths(tree: Any, path_rules: PathRules) -> Any:
    """Logical names for an unannotated pytree from regex rules on its paths (first match wins)."""
    compiled = [(re.compile(pattern), logical) for pattern, logical in path_rules]

    def lookup(path, leaf):
        name = path_str(path)
        for pattern, logical in compiled:
            if pattern.search(name):
                if logical is not None and len(logical) > np.ndim(leaf):
                    raise RuleError(
                        f"path rule {pattern.pattern!r} gives {len(logical)} names {logical} to {name!r} "
                        f"of shape {tuple(np.shape(leaf))}; give at most one name per dimension"
                    )
                return logical
        return None

    return jax.tree_util.tree_map_with_path(lookup, tree)


def layout_tree(
    abstract: Any, logical: Any, rules: Rules, mesh: Mesh, *, table: str = "rules", auto: AutoShard | None = None,
    from_last: bool = False,
) -> Any:
    """A pytree of `LeafLayout` for ``abstract`` (arrays or ShapeDtypeStructs) under ``rules``.

    ``auto`` is the ZeRO fallback for tensors the rules leave off its axes (see `AutoShard`);
    ``from_last`` as in `spec_for`.
    """
    validate_rules(rules, mesh, table=table)
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    layouts = []
    for (path, leaf), names in zip(flat, logical_leaves(abstract, logical)):
        name = path_str(path)
        spec, notes = spec_for(names, leaf.shape, rules, mesh, path=name, auto=auto, from_last=from_last)
        full = None if names is None else names_for_rank(names, leaf.shape, name)
        layouts.append(LeafLayout(name, tuple(leaf.shape), np.dtype(leaf.dtype), full, spec, notes))
    return jax.tree.unflatten(treedef, layouts)


def is_names(x: Any) -> bool:
    """Whether ``x`` is one tensor's names (None, or a plain tuple of names / mesh-axis tuples / None),
    not a container of the logical tree: a NamedTuple of layers is a tuple too."""
    if x is None:
        return True
    return type(x) is tuple and all(_is_name_entry(e) for e in x)


def _is_name_entry(e: Any) -> bool:
    """One dim's entry: None, a name, a tuple of mesh axes, or another marker (P.UNCONSTRAINED); a
    container (a layer's NamedTuple, dict, list or dataclass of names) is not one."""
    if type(e) is tuple:
        return all(isinstance(a, str) for a in e)
    return not isinstance(e, (tuple, list, dict)) and not dataclasses.is_dataclass(e)


def logical_leaves(abstract: Any, logical: Any) -> list[Logical | None]:
    """The names of each leaf of ``abstract``, in its flattening order, read from ``logical`` by the
    parameters' own structure, so NamedTuple and tuple containers are never taken for names."""
    treedef = jax.tree.structure(abstract, is_leaf=lambda x: x is None)
    try:
        per_leaf = treedef.flatten_up_to(logical)
    except (ValueError, TypeError) as error:
        raise RuleError(f"the logical axes tree does not have the parameters' structure ({error}); give one names "
                        "tuple (or None) per parameter, in the same containers") from None
    leaves = jax.tree.leaves(abstract, is_leaf=lambda x: x is None)
    return [names for leaf, names in zip(leaves, per_leaf) if leaf is not None]


def is_layout(x: Any) -> bool:
    return isinstance(x, LeafLayout)


def shardings(layouts: Any, mesh: Mesh) -> Any:
    return jax.tree.map(lambda l: NamedSharding(mesh, l.spec), layouts, is_leaf=is_layout)


def replicated_leaves(layouts: Any, mesh: Mesh) -> list[LeafLayout]:
    """Leaves that ended up on every device although a rule (or nothing) wanted them sharded."""
    return [l for l in jax.tree.leaves(layouts, is_leaf=is_layout) if l.notes and l.shards(mesh) == 1]


def check_replication(layouts: Any, mesh: Mesh, max_bytes: int) -> None:
    """Raise if an unintentionally replicated tensor is larger than ``max_bytes``."""
    offenders = [l for l in replicated_leaves(layouts, mesh) if l.bytes() > max_bytes]
    if offenders:
        lines = "\n".join(f"  {l.path} {l.shape}: {'; '.join(l.notes)}" for l in offenders)
        raise RuleError(
            f"{len(offenders)} tensor(s) larger than {max_bytes} bytes would be replicated on every device:\n{lines}\n"
            "change the model dimensions, the mesh, or add a fallback rule; or raise the replication limit"
        )


def report(layouts: Any, mesh: Mesh) -> str:
    """One line per tensor: path, shape, logical names, spec, bytes per device, and why replicated."""
    from shardlib.text import format_bytes, format_table

    rows = [
        {
            "path": l.path,
            "shape": "x".join(map(str, l.shape)) or "scalar",
            "logical": ",".join(str(n) for n in l.logical) if l.logical is not None else "-",
            "spec": str(tuple(l.spec)),
            "per device": format_bytes(l.bytes_per_device(mesh)),
            "note": "; ".join(l.notes),
        }
        for l in jax.tree.leaves(layouts, is_leaf=is_layout)
    ]
    return format_table(rows, ["path", "shape", "logical", "spec", "per device", "note"])


def logical_axes_of(tree: Any) -> Any:
    """Axis names stored on an annotated tree: Flax NNX Variables or linen Partitioned boxes.

    Logical names (``nn.with_logical_partitioning``, ``out_sharding=("embed", "mlp")``) and mesh-axis
    placements (``nn.with_partitioning(init, ("fsdp", None))``, ``out_sharding=P("fsdp", "tensor")``,
    which strategy ``as_annotated`` keeps) come out alike: one tuple per leaf, entries a name, a
    tuple of mesh axes or None; None for unannotated leaves. The structure is that of the
    *unboxed* values.
    """
    from flax import linen as nn
    from flax import nnx

    def names(x):
        if isinstance(x, nnx.Variable):
            meta = x.get_metadata()
            found = meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding")
            return tuple(found) if found is not None else None
        if isinstance(x, nn.Partitioned):  # LogicallyPartitioned is one too
            return tuple(x.names)
        return None

    is_box = lambda x: isinstance(x, (nnx.Variable, nn.Partitioned))
    return jax.tree.map(names, tree, is_leaf=is_box)
