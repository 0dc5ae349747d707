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
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from shardlib.step.compression import as_varying

__all__ = ["apply", "pack", "psum", "psum_scatter"]


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
