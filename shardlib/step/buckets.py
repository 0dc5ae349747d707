"""Gradient buckets: many small reductions as a few large ones, each one collective.

Every collective pays a fixed cost (a launch, a rendezvous of all devices, on a real link its
latency) on top of its bytes; a model of a few hundred small tensors pays it a few hundred
times per step. PyTorch DDP's buckets and FSDP's flat parameters answer this by packing
gradients into flat buffers; so does `Reducer` with ``bucket_bytes`` (see `shardlib.step.reduce`).

A bucket holds tensors of one dtype reduced over the same mesh axes and varying over the same
manual axes (a tensor invariant over ``pipe`` must not come back varying over it), in tree order, until the
next tensor would take it past ``limit`` bytes; a tensor at least ``limit`` bytes long is its own
bucket. The bytes on the wire are unchanged: a bucket sends exactly the sum of its tensors.

* `psum`: flatten, concatenate, one ``psum``, split.
* `psum_scatter` (ZeRO-1/2): each device must receive, of every tensor, the tiled slice a
  per-tensor ``psum_scatter`` would give it. Each tensor's scattered dim is moved to the front
  and reshaped to ``(n, -1)`` (row j: slice j), rows are concatenated across tensors, and one
  tiled ``psum_scatter`` over rows hands device j row j of the sum: slice j of every tensor.
* `all_gather` (ZeRO-1/2's updated parameters, `gather`): the inverse packing. Each device
  flattens its shard of every tensor (scattered dim in front) into one row, one tiled
  ``all_gather`` stacks the n rows, and column block t of the stack, reshaped, is tensor t whole.
  GSPMD writes one all-gather per tensor for the same resharding.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from shardlib.sharding.rules import as_axes
from shardlib.step.compression import as_varying

__all__ = ["all_gather", "apply", "checked_limit", "gather", "pack", "psum", "psum_scatter"]


def checked_limit(name: str, limit: int | None) -> int:
    """A bucket size argument as bytes: 0 (or None) for one collective per tensor; negative refused."""
    if limit is not None and limit < 0:
        raise ValueError(f"{name} must be >= 0 (0 or None: one collective per tensor), got {limit}")
    return int(limit or 0)


def pack(sizes: Sequence[int], limit: int) -> list[list[int]]:
    """Greedy buckets of indices into ``sizes``, in order, each at most ``limit`` bytes (a larger
    tensor alone)."""
    buckets: list[list[int]] = []
    used = limit  # forces a new bucket for the first tensor
    for i, size in enumerate(sizes):
        if used + size > limit:
            buckets.append([])
            used = 0
        buckets[-1].append(i)
        used += size
    return buckets


def _nbytes(x: jax.Array) -> int:
    return x.size * np.dtype(x.dtype).itemsize


def _varying(x: jax.Array) -> frozenset[str]:
    """The manual axes ``x`` varies over (its ``shard_map`` type)."""
    return getattr(getattr(jax.typeof(x), "mat", None), "varying", frozenset())


def apply(xs: Sequence[jax.Array], keys: Sequence[Hashable | None], limit: int,
          reduce: Callable[[Hashable, list[int]], list[jax.Array]]) -> list[jax.Array | None]:
    """Bucket the tensors of equal non-None key and run ``reduce(key, indices) -> reduced`` on each
    bucket; -> the reduced tensor at each bucketed index, None where the key is None. Tensors
    that vary over different manual axes never share a bucket."""
    groups: dict[tuple[Hashable, frozenset[str]], list[int]] = {}
    for i, key in enumerate(keys):
        if key is not None:
            groups.setdefault((key, _varying(xs[i])), []).append(i)
    out: list[jax.Array | None] = [None] * len(xs)
    for (key, _), members in groups.items():
        for bucket in pack([_nbytes(xs[i]) for i in members], limit):
            ids = [members[j] for j in bucket]
            for i, reduced in zip(ids, reduce(key, ids)):
                out[i] = reduced
    return out


def _split(flat: jax.Array, sizes: Sequence[int], axis: int) -> list[jax.Array]:
    return jnp.split(flat, np.cumsum(sizes)[:-1].tolist(), axis=axis)


def psum(xs: Sequence[jax.Array], axes: tuple[str, ...]) -> list[jax.Array]:
    """``[jax.lax.psum(x, axes) for x in xs]`` as one ``psum`` (all of one dtype)."""
    if len(xs) == 1:
        return [jax.lax.psum(as_varying(xs[0], axes), axes)]
    flat = jnp.concatenate([x.reshape(-1) for x in xs])
    summed = jax.lax.psum(as_varying(flat, axes), axes)
    return [part.reshape(x.shape) for part, x in zip(_split(summed, [x.size for x in xs], 0), xs)]


def psum_scatter(xs: Sequence[jax.Array], dims: Sequence[int], axes: tuple[str, ...]) -> list[jax.Array]:
    """``[jax.lax.psum_scatter(x, axes, scatter_dimension=d, tiled=True) for x, d in ...]`` as one
    ``psum_scatter`` (all of one dtype; every ``x.shape[d]`` divisible by the axes' size)."""
    if len(xs) == 1:
        return [jax.lax.psum_scatter(as_varying(xs[0], axes), axes, scatter_dimension=dims[0], tiled=True)]
    n = jax.lax.axis_size(axes)
    fronts = [jnp.moveaxis(x, d, 0) for x, d in zip(xs, dims)]
    rows = jnp.concatenate([f.reshape(n, -1) for f in fronts], axis=1)
    mine = jax.lax.psum_scatter(as_varying(rows, axes), axes, scatter_dimension=0, tiled=True)
    parts = _split(mine, [f.size // n for f in fronts], 1)
    return [jnp.moveaxis(p.reshape(f.shape[0] // n, *f.shape[1:]), 0, d) for p, f, d in zip(parts, fronts, dims)]


def all_gather(xs: Sequence[jax.Array], dims: Sequence[int], axes: tuple[str, ...]) -> list[jax.Array]:
    """``[jax.lax.all_gather(x, axes, axis=d, tiled=True) for x, d in ...]`` as one ``all_gather``
    (all of one dtype)."""
    if len(xs) == 1:
        return [jax.lax.all_gather(xs[0], axes, axis=dims[0], tiled=True)]
    n = jax.lax.axis_size(axes)
    fronts = [jnp.moveaxis(x, d, 0) for x, d in zip(xs, dims)]
    row = jnp.concatenate([f.reshape(1, -1) for f in fronts], axis=1)
    rows = jax.lax.all_gather(row, axes, axis=0, tiled=True)  # (n, sum of the shard sizes)
    parts = _split(rows, [f.size for f in fronts], 1)
    return [jnp.moveaxis(p.reshape(n * f.shape[0], *f.shape[1:]), 0, d) for p, f, d in zip(parts, fronts, dims)]


def _entries(spec: P, ndim: int) -> list[tuple[str, ...]]:
    return [as_axes(e) for e in tuple(spec) + (None,) * (ndim - len(spec))]


def _gather_dim(x: jax.Array, source: NamedSharding, target: NamedSharding) -> tuple[int, tuple[str, ...]] | None:
    """(dim, axes) when ``source`` -> ``target`` is one tiled all-gather over ``axes`` of one dim
    (the target's axes of that dim a prefix of the source's, every other dim alike) that a
    ``shard_map`` can split evenly; else None (GSPMD reshards it)."""
    src, dst = _entries(source.spec, x.ndim), _entries(target.spec, x.ndim)
    differ = [d for d in range(x.ndim) if src[d] != dst[d]]
    if x.size == 0 or len(differ) != 1 or src[differ[0]][:len(dst[differ[0]])] != dst[differ[0]]:
        return None
    if any(x.shape[d] % math.prod(source.mesh.shape[a] for a in src[d]) for d in range(x.ndim)):
        return None
    dim = differ[0]
    return dim, src[dim][len(dst[dim]):]


def gather(tree: Any, source: Any, target: Any, limit: int) -> Any:
    """``tree`` (laid out as the ``source`` shardings) resharded to ``target``. Leaves whose
    resharding is an all-gather of one dim (ZeRO-1/2's state shards -> replicated parameters) go
    in buckets of at most ``limit`` bytes, one ``all_gather`` each, inside a ``shard_map`` manual
    over every mesh axis (each device's block is local data: no resharding around the bucket);
    the rest, and everything when ``limit`` is 0, by ``with_sharding_constraint``."""
    flat, treedef = jax.tree.flatten(tree)
    srcs, dsts = treedef.flatten_up_to(source), treedef.flatten_up_to(target)
    plans = [_gather_dim(x, s, t) if limit else None for x, s, t in zip(flat, srcs, dsts)]
    ids = [i for i, plan in enumerate(plans) if plan is not None]
    out = [x if plan is not None else jax.lax.with_sharding_constraint(x, t) for x, t, plan in zip(flat, dsts, plans)]
    if ids:
        gathered = _gather_mapped([flat[i] for i in ids], [plans[i] for i in ids], [srcs[i] for i in ids],
                                  [dsts[i] for i in ids], limit)
        for i, g in zip(ids, gathered):
            out[i] = g
    return treedef.unflatten(out)


def _gather_mapped(xs: list[jax.Array], plans: list[tuple[int, tuple[str, ...]]], srcs: list[NamedSharding],
                   dsts: list[NamedSharding], limit: int) -> list[jax.Array]:
    """The bucketed all-gathers of `gather`, in one fully manual ``shard_map``. ``check_vma`` is
    off: an ``all_gather`` result is typed varying though every device holds the same tensor."""
    mesh = srcs[0].mesh

    def body(*local):
        keys = [(axes, x.dtype) for x, (_, axes) in zip(local, plans)]
        return tuple(apply(local, keys, limit, lambda k, members: all_gather(
            [local[i] for i in members], [plans[i][0] for i in members], k[0])))

    return list(jax.shard_map(body, mesh=mesh, in_specs=tuple(s.spec for s in srcs),
                              out_specs=tuple(t.spec for t in dsts), axis_names=set(mesh.axis_names),
                              check_vma=False)(*xs))
