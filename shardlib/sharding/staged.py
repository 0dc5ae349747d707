"""Reduce-scatters in two stages where the compiler would run one as an all-reduce.

XLA:TPU (libtpu 0.0.42.1) lowers a reduce-scatter whose group is every chip of the program as an
all-reduce: twice the bytes of the reduce-scatter ZeRO's volume assumes. Compiled here for v5p:2x2x2,
2x2x4, 2x4x4 and 4x4x4, v5e:4x4 and v6e:4x4; v5e:2x4 keeps its reduce-scatter. Over part of the
chips it stays a reduce-scatter. So `stages_for` asks the compiler once per device set (a tiny
probe compile, the step's own options) and, where it answers with an all-reduce, `psum_scatter`
reduces over the whole group in two partial stages that land each device on the same chunk:

* one axis of ``n`` devices (index ``a * inner + b``): over the ``n / inner`` devices that share
  ``b`` (chunk ``a`` of ``n / inner``), then over the ``inner`` devices that share ``a`` (chunk
  ``b`` of that): bytes ``(n/inner - 1)/(n/inner) S + (inner - 1)/inner S/(n/inner)``, which is
  ``(n - 1)/n S``, the one-stage volume;
* several axes: one reduce-scatter per axis, first to last (each over part of the chips).

docs/tpu.md has the figures (bytes against the ZeRO volume, per topology).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def inner_size(n: int) -> int:
    """The second stage's group: the largest divisor of ``n`` whose square is at most ``n`` (64 -> 8,
    16 -> 4, 8 -> 2), so neither stage spans the whole slice."""
    return max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)


def psum_scatter(x: jax.Array, axes: tuple[str, ...], dim: int, inner: int) -> jax.Array:
    """``jax.lax.psum_scatter(x, axes, scatter_dimension=dim, tiled=True)`` (same chunks), in stages
    none of which spans every device of ``axes`` (``inner``: the single axis' second group)."""
    if len(axes) > 1:
        for axis in axes:
            x = jax.lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)
        return x
    (axis,) = axes
    n = jax.lax.axis_size(axis)
    outer = n // inner
    across = [[a * inner + b for a in range(outer)] for b in range(inner)]
    within = [[a * inner + b for b in range(inner)] for a in range(outer)]
    x = jax.lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True, axis_index_groups=across)
    return jax.lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True, axis_index_groups=within)


@functools.lru_cache(maxsize=None)
def _whole_scatter_is_all_reduce(devices: tuple[Any, ...]) -> bool:
    """Does the compiler run a reduce-scatter over all of ``devices`` (in this order) as an all-reduce?"""
    from shardlib import backend as backend_lib

    mesh = Mesh(np.array(devices), ("all",))
    scatter = jax.jit(jax.shard_map(lambda x: jax.lax.psum_scatter(x, "all", scatter_dimension=0, tiled=True),
                                    mesh=mesh, in_specs=P(), out_specs=P("all")))
    probe = jax.ShapeDtypeStruct((8 * 128 * len(devices), 128), np.float32, sharding=NamedSharding(mesh, P()))
    text = scatter.lower(probe).compile(compiler_options=backend_lib.step_compiler_options(list(devices))).as_text()
    return "reduce-scatter" not in text and "all-reduce" in text


def stages_for(mesh: Mesh, axes_groups: Any, backend: Any) -> Mapping[tuple[str, ...], int]:
    """For each mesh-axes group in ``axes_groups`` that spans every device of ``mesh``: the inner
    group size of its staged reduce-scatter, where ``backend`` (a `shardlib.backend.BackendPolicy`)
    stages whole-mesh scatters and the compiler would otherwise run an all-reduce. Empty elsewhere."""
    if backend is None or not backend.stage_whole_scatters or mesh.size < 4:
        return {}
    whole = {tuple(g) for g in axes_groups if g and math.prod(mesh.shape[a] for a in g) == mesh.size}
    if not whole or not _whole_scatter_is_all_reduce(tuple(mesh.devices.flat)):
        return {}
    return {group: inner_size(mesh.size) for group in sorted(whole)}


__all__ = ["inner_size", "psum_scatter", "stages_for"]
