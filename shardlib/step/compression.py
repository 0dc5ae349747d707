"""Compressed gradient reductions for the data-parallel axes, usable inside ``jax.shard_map``.

Gradient reduction is the collective that grows with model size and never shrinks with more
devices, so sending fewer bytes per element is the cheapest way to speed up a bandwidth-bound
step. Each method here is a drop-in for the two reductions `shardlib.step.reduce.Reducer` performs:

* ``compressed_psum(x, axes, method, residual)``: like ``jax.lax.psum(x, axes)``;
* ``compressed_psum_scatter(x, axes, dim, method, residual)``: like
  ``jax.lax.psum_scatter(x, axes, scatter_dimension=dim, tiled=True)`` (same chunk layout).

Both return ``(reduced, new_residual)``. Methods (``METHODS``):

* ``none``: the exact collective, in the precision's ``reduce_dtype`` (`shardlib.step.precision`;
  float32 by default, bf16 on request: then the collective itself runs in bf16).
* ``bf16``: bfloat16 on the wire, half the bytes (as ``reduce_dtype=bf16``), but summed in
  float32; no state. The two do not combine: `shardlib.step.options` refuses ``bf16`` or ``int8``
  beside a non-float32 ``reduce_dtype``. Like int8 it runs as ``all_to_all``
  of the chunks, a float32 sum on the owner, then (``psum``) an ``all_gather``: no reduction
  arithmetic happens in bfloat16 (more accurate), and XLA:CPU, which aborts compiling some
  bfloat16 all-reduces and reduce-scatters inside a full train step (jaxlib 0.10.2,
  ChangeOpDataType), compiles it.
* ``int8``: per-block int8 with float32 scales (``scale = max|block| / 127``) and error feedback.
  Summing int8 over devices would overflow, so the reduction is done as: quantise locally ->
  ``all_to_all`` the int8 chunks and their scales (each device receives every device's copy of
  the chunk it owns) -> dequantise and sum in float32. ``psum`` then re-quantises the reduced
  chunk to int8 (fresh scales) and ``all_gather``s it: gathering int8 instead of bf16 keeps the
  whole all-reduce at ~1/4 of float32 (bf16 would give ~3/8), and its rounding error is not lost:
  it is added to the owner device's residual, so error feedback corrects it next step too.

Error feedback: the caller keeps one residual per device (shaped like ``x``, float32) and
passes it back next step. What each device sends is ``x + residual``; the new residual is
``x + residual - dequantised(sent)`` (plus, for the owner of a chunk, the gather's rounding).
Over T steps the reduced outputs then add up to ``T * exact_sum + sum(r_0) - sum(r_T)``: the
error stays bounded instead of growing with T. When a step is skipped (non-finite gradients,
which propagate through the scales as NaN), the caller must keep the old residual as well.

Padding: the flattened tensor is split into one chunk per device (``ceil(n / N)`` elements, the
last zero-padded; ``psum_scatter`` chunks are exactly the tiled slices, so the scattered dim must
divide by N as for ``jax.lax.psum_scatter``), and each chunk into the fewest equal blocks of at
most ``block_size`` elements, the last block zero-padded (under one element per block). Zeros
quantise exactly and never raise a block's scale; the padding is sent (``wire_bytes`` counts it)
and cut off afterwards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Union

import jax
import jax.numpy as jnp
import numpy as np

from shardlib.registry import lookup
from shardlib.sharding.rules import as_axes

Axes = Union[str, Sequence[str]]

INT8_MAX = 127
SCALE_DTYPE = np.dtype(np.float32)
REDUCTION_KINDS = ("psum", "psum_scatter")


@dataclasses.dataclass(frozen=True)
class Compression:
    """How one method sends gradients: its wire dtype and whether it carries a residual."""

    name: str
    needs_residual: bool  # the caller must carry the returned residual to the next step
    comm_dtype: np.dtype | None  # element type on the wire; None = the gradient's own dtype
    block_size: int | None = None  # elements per quantisation scale (int8 only)
    description: str = ""


METHODS: dict[str, Compression] = {
    "none": Compression("none", False, None, None, "exact reduction in the gradient dtype"),
    "bf16": Compression("bf16", False, np.dtype(jnp.bfloat16), None, "bfloat16 on the wire, ~2x fewer bytes"),
    "int8": Compression(
        "int8", True, np.dtype(np.int8), 256,
        "int8 + float32 scale per 256-element block, error feedback, ~4x fewer bytes",
    ),
}


def get_compression(method: str | Compression) -> Compression:
    """The named preset, or the object itself; an unknown name lists the known ones."""
    return lookup(METHODS, method, Compression, "gradient compression")


# ----------------------------------------------------------------------------------------------
# Chunk and block arithmetic (shared by the reductions and wire_bytes, so the two agree)
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    """How n elements are split over N devices and into quantisation blocks."""

    n_elements: int
    n_devices: int
    chunk: int  # elements of the tensor each device owns (before padding)
    block: int  # elements per scale
    n_blocks: int  # blocks per chunk

    @property
    def padded_chunk(self) -> int:
        return self.n_blocks * self.block


def plan_chunks(n_elements: int, n_devices: int, block_size: int) -> ChunkPlan:
    """``ceil(n / N)`` elements per device, in the fewest blocks of at most ``block_size``.

    Blocks are evened out (``ceil(chunk / n_blocks)`` each) so a chunk is padded by fewer than
    ``n_blocks`` elements: 375 elements become 2 blocks of 188, not 2 of 256.
    """
    if n_devices < 1 or block_size < 1:
        raise ValueError(f"plan_chunks needs n_devices >= 1 and block_size >= 1, got {n_devices}, {block_size}")
    chunk = -(-n_elements // n_devices)
    n_blocks = max(1, -(-chunk // block_size))
    return ChunkPlan(n_elements, n_devices, chunk, max(1, -(-chunk // n_blocks)), n_blocks)


def wire_bytes(n_elements: int, n_devices: int, method: str | Compression, kind: str,
               grad_dtype: Any = jnp.float32) -> float:
    """Bytes one device sends to reduce a gradient of ``n_elements`` over ``n_devices``.

    Ring convention of docs/design.md: all-reduce 2(N-1)/N S, reduce-scatter / all-gather /
    all-to-all (N-1)/N S for a full buffer of S bytes. int8 counts its padding and its float32
    scales, in both the all-to-all and (for ``psum``) the all-gather. ``grad_dtype`` is the wire
    type of ``none``.
    """
    comp = get_compression(method)
    if kind not in REDUCTION_KINDS:
        raise ValueError(f"wire_bytes kind must be one of {REDUCTION_KINDS}, got {kind!r}")
    if kind == "psum_scatter" and n_elements % n_devices:
        raise ValueError(
            f"psum_scatter of {n_elements} elements over {n_devices} devices: the scattered "
            "dimension must divide by the device count"
        )
    n = n_devices
    if n <= 1 or n_elements == 0:
        return 0.0
    if comp.name == "int8":
        plan = plan_chunks(n_elements, n, comp.block_size)
        phase = (n - 1) * (plan.padded_chunk * 1 + plan.n_blocks * SCALE_DTYPE.itemsize)
        return float(phase * (2 if kind == "psum" else 1))
    itemsize = np.dtype(comp.comm_dtype if comp.comm_dtype is not None else grad_dtype).itemsize
    factor = 2 if kind == "psum" else 1
    return factor * (n - 1) / n * n_elements * itemsize


# ----------------------------------------------------------------------------------------------
# Helpers used inside shard_map
# ----------------------------------------------------------------------------------------------


def as_varying(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Mark ``x`` as per-device over ``axes`` (all_to_all needs it; a psum of an invariant value
    is N times it, and treating it as N equal contributions gives the same sum)."""
    mat = getattr(jax.typeof(x), "mat", None)
    varying = getattr(mat, "varying", frozenset())
    missing = tuple(a for a in axes if a not in varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _with_residual(x: jax.Array, residual: jax.Array | None) -> jax.Array:
    """What this device sends: ``x + residual`` in float32."""
    u = x.astype(jnp.float32)
    if residual is None:
        return u
    if residual.shape != x.shape:
        raise ValueError(
            f"compression residual has shape {residual.shape} but the gradient has {x.shape}: "
            "pass back the residual returned for this same tensor"
        )
    return u + residual.astype(jnp.float32)


def quantise(u: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Blocks ``[..., block]`` -> int8 codes and one float32 scale per block (max|block|/127).

    A NaN/inf in a block makes its scale non-finite, so the dequantised block is NaN and the
    step's non-finite check still sees it.
    """
    scale = jnp.max(jnp.abs(u), axis=-1) / INT8_MAX
    safe = jnp.where(scale > 0, scale, 1.0)[..., None]
    codes = jnp.where(scale[..., None] > 0, jnp.round(u / safe), 0.0)
    return jnp.clip(codes, -INT8_MAX, INT8_MAX).astype(jnp.int8), scale.astype(jnp.float32)


def dequantise(q: jax.Array, scale: jax.Array) -> jax.Array:
    return q.astype(jnp.float32) * scale[..., None]


def _int8_reduce_rows(rows: jax.Array, axes: tuple[str, ...], plan: ChunkPlan) -> tuple[jax.Array, jax.Array]:
    """Rows ``[N, chunk]`` (row j goes to device j) -> this device's summed chunk and local error.

    Returns the reduced chunk as ``[n_blocks, block]`` float32 and the quantisation error of
    every row as ``[N, n_blocks, block]``.
    """
    n = plan.n_devices
    padded = jnp.pad(rows, ((0, 0), (0, plan.padded_chunk - plan.chunk)))
    blocks = padded.reshape(n, plan.n_blocks, plan.block)
    q, scale = quantise(blocks)
    local_err = blocks - dequantise(q, scale)
    q_in = jax.lax.all_to_all(q, axes, 0, 0, tiled=True)  # row k: device k's copy of my chunk
    scale_in = jax.lax.all_to_all(scale, axes, 0, 0, tiled=True)
    return jnp.sum(dequantise(q_in, scale_in), axis=0), local_err


def _bf16_reduce_rows(rows: jax.Array, axes: tuple[str, ...]) -> tuple[jax.Array, jax.Array]:
    """Rows ``[N, chunk]`` -> this device's chunk summed in float32, and each row's rounding error."""
    sent = rows.astype(jnp.bfloat16)
    received = jax.lax.all_to_all(sent, axes, 0, 0, tiled=True)  # row k: device k's copy of my chunk
    return jnp.sum(received.astype(jnp.float32), axis=0), rows - sent.astype(jnp.float32)


def _rows(u: jax.Array, n: int, chunk: int) -> jax.Array:
    """Flatten and zero-pad to ``[n, chunk]``: row j is the part device j owns."""
    return jnp.pad(u.reshape(-1), (0, n * chunk - u.size)).reshape(n, chunk)


def _no_comm(x: jax.Array, residual: jax.Array | None, comp: Compression) -> tuple[jax.Array, jax.Array | None]:
    """One device on the axes: nothing to send, nothing to lose."""
    u = _with_residual(x, residual)
    out = u.astype(x.dtype)
    keep = residual is not None or comp.needs_residual
    return out, (u - out.astype(jnp.float32) if keep else None)


# ----------------------------------------------------------------------------------------------
# The two reductions
# ----------------------------------------------------------------------------------------------


def compressed_psum(
    x: jax.Array, axes: Axes, method: str | Compression = "none", residual: jax.Array | None = None
) -> tuple[jax.Array, jax.Array | None]:
    """Sum ``x`` over the manual mesh ``axes`` with compression: ``(sum, new_residual)``.

    The sum has ``x``'s shape and dtype and is the same on every device (invariant over
    ``axes``). ``new_residual`` is float32 shaped like ``x``, per device; it is None only when
    the method needs none and none was given (any lossy method feeds back a given residual).
    """
    comp, axes = get_compression(method), as_axes(axes)
    n = jax.lax.axis_size(axes) if axes else 1
    if x.size == 0:  # a (0, d) parameter: no bytes to send, but the sum is invariant like any other
        return jnp.zeros(x.shape, x.dtype), (None if residual is None and not comp.needs_residual else
                                             jnp.zeros(x.shape, jnp.float32))
    if n == 1:
        return _no_comm(x, residual, comp)
    u = as_varying(_with_residual(x, residual), axes)
    if comp.name == "none":
        out = jax.lax.psum(u.astype(x.dtype), axes)
        return out, (None if residual is None else jnp.zeros_like(u))
    if comp.name == "bf16":
        chunk = -(-x.size // n)
        reduced, local_err = _bf16_reduce_rows(_rows(u, n, chunk), axes)
        sent = reduced.astype(jnp.bfloat16)
        local_err = local_err.at[jax.lax.axis_index(axes)].add(reduced - sent.astype(jnp.float32))
        full = jax.lax.all_gather(sent, axes, to="invarying").astype(jnp.float32).reshape(-1)[:x.size]
        err = local_err.reshape(-1)[:x.size].reshape(x.shape)
        return full.reshape(x.shape).astype(x.dtype), (None if residual is None else err)
    if comp.name != "int8":
        raise ValueError(f"compressed_psum has no implementation for method {comp.name!r}")
    plan = plan_chunks(x.size, n, comp.block_size)
    reduced, local_err = _int8_reduce_rows(_rows(u, n, plan.chunk), axes, plan)
    q, scale = quantise(reduced)
    # The gather's rounding of my chunk joins my residual: error feedback corrects it next step.
    local_err = local_err.at[jax.lax.axis_index(axes)].add(reduced - dequantise(q, scale))
    q_all = jax.lax.all_gather(q, axes, to="invarying")
    scale_all = jax.lax.all_gather(scale, axes, to="invarying")

    def unpad(blocks: jax.Array) -> jax.Array:
        return blocks.reshape(n, plan.padded_chunk)[:, :plan.chunk].reshape(-1)[:x.size].reshape(x.shape)

    return unpad(dequantise(q_all, scale_all)).astype(x.dtype), unpad(local_err)


def compressed_psum_scatter(
    x: jax.Array, axes: Axes, dim: int, method: str | Compression = "none", residual: jax.Array | None = None
) -> tuple[jax.Array, jax.Array | None]:
    """``psum_scatter(x, axes, scatter_dimension=dim, tiled=True)`` with compression.

    Device i (its linear index over ``axes``) gets slice i of ``dim`` of the sum, exactly the
    layout of ``jax.lax.psum_scatter``. Returns ``(chunk, new_residual)``; the residual is
    float32 shaped like the full local ``x``, per device.
    """
    comp, axes = get_compression(method), as_axes(axes)
    dim = dim + x.ndim if dim < 0 else dim
    if not 0 <= dim < x.ndim:
        raise ValueError(f"compressed_psum_scatter: dim {dim} is out of range for a gradient of shape {x.shape}")
    n = jax.lax.axis_size(axes) if axes else 1
    if n == 1:
        return _no_comm(x, residual, comp)
    if x.shape[dim] % n:
        raise ValueError(
            f"compressed_psum_scatter: dimension {dim} of the gradient {x.shape} has size {x.shape[dim]}, "
            f"which does not divide by the {n} devices of mesh axes {axes}; shard a dimension that "
            "divides, or reduce this tensor with compressed_psum"
        )
    u = as_varying(_with_residual(x, residual), axes)
    if comp.name == "none":
        out = jax.lax.psum_scatter(u.astype(x.dtype), axes, scatter_dimension=dim, tiled=True)
        return out, (None if residual is None else jnp.zeros_like(u))
    front = jnp.moveaxis(u, dim, 0)  # tiled slices of dim become contiguous rows
    out_shape = (front.shape[0] // n, *front.shape[1:])
    if comp.name == "bf16":
        reduced, local_err = _bf16_reduce_rows(front.reshape(n, -1), axes)
        out = jnp.moveaxis(reduced.reshape(out_shape), 0, dim).astype(x.dtype)
        return out, (None if residual is None else jnp.moveaxis(local_err.reshape(front.shape), 0, dim))
    if comp.name != "int8":
        raise ValueError(f"compressed_psum_scatter has no implementation for method {comp.name!r}")
    plan = plan_chunks(x.size, n, comp.block_size)
    reduced, local_err = _int8_reduce_rows(front.reshape(n, plan.chunk), axes, plan)
    out = reduced.reshape(-1)[:plan.chunk].reshape(out_shape)
    err = local_err.reshape(n, plan.padded_chunk)[:, :plan.chunk].reshape(front.shape)
    return jnp.moveaxis(out, 0, dim).astype(x.dtype), jnp.moveaxis(err, 0, dim)


__all__ = [
    "METHODS",
    "REDUCTION_KINDS",
    "ChunkPlan",
    "Compression",
    "compressed_psum",
    "compressed_psum_scatter",
    "dequantise",
    "get_compression",
    "plan_chunks",
    "quantise",
    "wire_bytes",
]
