"""ZeRO++ for zero3: the per-layer weight all-gather in int8 (qwZ) and the gradient
reduce-scatter compressed (qgZ), as one ``jax.custom_vjp`` around the gather.

ZeRO-3's gather is a manual ``all_gather`` inside the step's ``shard_map``; autodiff's transpose
of it is the gradient reduce-scatter, which cannot be compressed. `gather` writes both halves
itself:

* forward: the local shard, flattened, in blocks of at most ``block_size`` elements (a block never
  straddles two devices' shards: each device quantises only its own) -> int8 codes and one
  float32 scale per block -> ``all_gather`` of codes and scales -> dequantised into the compute
  dtype where the cast comes first (GPU/TPU: bf16 under ``precision="bf16"``), else the shard's
  dtype. Master weights stay float32.
  Under remat the backward pass recomputes the gather, so it is int8 there too (ZeRO++'s default).
* backward: the reduce-scatter of the full local gradient, plain (``grads="none"``, in the
  precision's ``reduce_dtype``) or through `shardlib.step.compression.compressed_psum_scatter`
  (``"bf16"``, ``"int8"``, which sum in float32); the gradient returns in the master dtype.

Error feedback under qgZ (int8): the residual is an extra primal input of the gather, and its
cotangent *is* the new residual. The step hands the model each gathered parameter as a `Carried`
pytree node (shard, residual), so a scanned layer stack slices both together and the residual
reaches the gather of its own layer; differentiating with respect to the parameters then
returns `Carried(gradient, new residual)`, which `shardlib.step.reduce.Reducer` splits again.
The residual is the sender's quantisation error of its whole local gradient: 4 Psi bytes per
device (docs/zeropp.md).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from shardlib.model import hooks
from shardlib.registry import lookup
from shardlib.sharding import rules as rules_lib
from shardlib.step import compression as compression_lib  # its int8 blocks, scales and reductions


@dataclasses.dataclass(frozen=True)
class WeightGather:
    """How the forward (and recomputed) ZeRO-3 weight gather sends a shard."""

    name: str
    block_size: int | None  # elements per float32 scale; None: the shard's own dtype, no quantisation
    description: str = ""


WEIGHT_GATHERS: dict[str, WeightGather] = {
    "none": WeightGather("none", None, "the shard's own dtype (float32, or bf16 when cast first)"),
    "int8": WeightGather("int8", 256, "int8 + float32 scale per 256-element block of the local shard (qwZ)"),
}


def get_weight_gather(name: str | WeightGather) -> WeightGather:
    """The named preset, or the object itself; an unknown name lists the known ones."""
    return lookup(WEIGHT_GATHERS, name, WeightGather, "weight gather")


@dataclasses.dataclass(frozen=True)
class GatherPolicy:
    """What one ZeRO-3 gather does: its forward wire format and its backward's compression."""

    weights: WeightGather = WEIGHT_GATHERS["none"]
    grads: compression_lib.Compression = compression_lib.METHODS["none"]
    # The gathered weight's dtype (None: the shard's): the compute dtype where the cast comes first
    dtype: Any = None
    # The dtype the backward's exact reduce-scatter ("none") runs in (None: the cotangent's)
    reduce_dtype: Any = None
    backend: Any = None  # the step's `shardlib.backend.BackendPolicy`: its matmul order (None: plain)

    @property
    def plain(self) -> bool:
        """Nothing to change: autodiff's own all_gather / reduce-scatter pair."""
        return self.weights.block_size is None and self.grads.name == "none"


PLAIN = GatherPolicy()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Carried:
    """A parameter and what rides with it through the model (and a scan over stacked layers, which
    slices both together) to its ``gather_layer`` call; as a gradient: the two cotangents.

    ``role`` says what rides: ``"residual"``, the qgZ error-feedback residual of a gathered shard
    (its cotangent is the new residual); ``"shard"``, the optimizer-state shard of a replicated
    parameter (`shardlib.step.layerwise`: its cotangent is the reduce-scattered gradient, and
    ``scatter`` names the reduction)."""

    value: Any
    rider: Any
    role: str = dataclasses.field(default="residual", metadata=dict(static=True))
    scatter: Any = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def residual(self) -> Any:
        """The qgZ residual (None for another rider)."""
        return self.rider if self.role == "residual" else None


def is_carried(x: Any) -> bool:
    return isinstance(x, Carried)


def carry(params: Any, residuals: Any, carries: Any) -> Any:
    """Wrap every parameter whose ``carries`` flag is set with its residual."""
    return jax.tree.map(lambda p, r, c: Carried(p, r) if c else p, params, residuals, carries)


def split(grads: Any) -> tuple[Any, Any]:
    """`Carried` gradients -> (gradients, new residuals; None where nothing was carried)."""
    values = jax.tree.map(lambda g: g.value if is_carried(g) else g, grads, is_leaf=is_carried)
    residuals = jax.tree.map(lambda g: g.residual if is_carried(g) else None, grads, is_leaf=is_carried)
    return values, residuals


# ----------------------------------------------------------------------------------------------
# The gather along one dim, with its backward written out
# ----------------------------------------------------------------------------------------------


def _quantised_all_gather(x: jax.Array, axes: tuple[str, ...], dim: int, block_size: int) -> jax.Array:
    """``all_gather(x, axes, axis=dim, tiled=True)`` with int8 blocks of the local shard on the wire."""
    plan = compression_lib.plan_chunks(x.size, 1, block_size)
    flat = jnp.pad(x.astype(jnp.float32).reshape(-1), (0, plan.padded_chunk - x.size))
    codes, scales = compression_lib.quantise(flat.reshape(plan.n_blocks, plan.block))
    codes = jax.lax.all_gather(codes, axes, axis=0)  # [N, n_blocks, block]
    scales = jax.lax.all_gather(scales, axes, axis=0)
    n = codes.shape[0]
    shards = compression_lib.dequantise(codes, scales).reshape(n, -1)[:, :x.size].reshape(n, *x.shape)
    stacked = jnp.moveaxis(shards, 0, dim)  # [..., N, shard_dim, ...]: device i's rows come i-th
    return stacked.reshape(*x.shape[:dim], n * x.shape[dim], *x.shape[dim + 1:]).astype(x.dtype)


def _forward_gather(x: jax.Array, axes: tuple[str, ...], dim: int, weights: WeightGather, dtype: Any) -> jax.Array:
    """The gathered weight in ``dtype`` (None: the shard's): cast before a plain gather, quantised
    from the master shard and dequantised into it under qwZ."""
    if weights.block_size is None:
        return jax.lax.all_gather(_cast(x, dtype), axes, axis=dim, tiled=True)
    return _cast(_quantised_all_gather(x, axes, dim, weights.block_size), dtype)


def _cast(x: jax.Array, dtype: Any) -> jax.Array:
    return x if dtype is None or x.dtype == dtype else x.astype(dtype)


def gather_dim(x: jax.Array, residual: jax.Array | None, axes: tuple[str, ...], dim: int,
               policy: GatherPolicy) -> jax.Array:
    """One dim's gather under ``policy``; ``residual`` (float32, the gathered shape) feeds qgZ."""
    return _make_gather(axes, dim, policy, residual is not None, jnp.dtype(x.dtype))(x, residual)


@functools.lru_cache(maxsize=None)
def _make_gather(axes: tuple[str, ...], dim: int, policy: GatherPolicy, with_residual: bool, in_dtype: Any):
    """The custom_vjp gather for one (axes, dim, policy) of an ``in_dtype`` shard; its residual
    argument's cotangent is the new residual."""
    floating = jnp.issubdtype(in_dtype, jnp.floating)
    dtype = policy.dtype if floating else None
    # exact: in the reduce dtype; compressed: from the shard's dtype (its methods sum in float32)
    reduce = (policy.reduce_dtype if policy.grads.name == "none" else in_dtype) if floating else None

    @jax.custom_vjp
    def gather(x, residual):
        return _forward_gather(x, axes, dim, policy.weights, dtype)

    def fwd(x, residual):
        return gather(x, residual), residual

    def bwd(residual, cotangent):
        cotangent = hooks.matmul_ordered(_cast(cotangent, reduce), dim, policy.backend)
        grad, new = compression_lib.compressed_psum_scatter(cotangent, axes, dim, policy.grads, residual)
        return _cast(grad, in_dtype), (new if with_residual else None)

    gather.defvjp(fwd, bwd)
    return gather


def gather_spec(x: Any, spec: Sequence[Any], policy: GatherPolicy) -> jax.Array:
    """All-gather ``x`` (an array, or a `Carried` shard and residual) along every dim whose spec
    entry names mesh axes. The residual rides the last gather: its transpose is the first
    reduction of the full local gradient; earlier dims' reductions carry none."""
    value, residual = (x.value, x.residual) if is_carried(x) else (x, None)
    dims = [(dim, rules_lib.as_axes(axes)) for dim, axes in enumerate(spec) if axes]
    for i, (dim, axes) in enumerate(dims):
        last = i == len(dims) - 1
        value = gather_dim(value, residual if last else None, axes, dim, policy)
    return value


def step_gather(weight_gather: str | WeightGather, grads: compression_lib.Compression, *, backend: Any = None,
                wire_dtype: Any = None, reduce_dtype: Any = None):
    """The ``gather(shard, spec)`` a step's `ModelCall` uses (None: `hooks.all_gather_spec`, with the
    same ``backend``, ``wire_dtype`` and ``reduce_dtype`` from the compute context). ``grads``: the
    method of the gathers' backward (qgZ), "none" where the `Reducer` compresses elsewhere. Where
    ZeRO++ cannot apply (no gather, a pipeline, tensor parallelism) `shardlib.step.options` refuses."""
    policy = GatherPolicy(get_weight_gather(weight_gather), grads, wire_dtype, reduce_dtype, backend)
    return None if policy.plain else functools.partial(gather_spec, policy=policy)


__all__ = ["Carried", "GatherPolicy", "WEIGHT_GATHERS", "WeightGather", "carry", "gather_spec", "get_weight_gather",
           "is_carried", "split", "step_gather"]
