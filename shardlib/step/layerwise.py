"""dp / ZeRO-1 / ZeRO-2 gradient reductions, layer by layer inside the backward pass's loop.

dp, zero1 and zero2 keep parameters whole. Reduced after the backward pass, every gradient is
whole until then: the backward loop over a scanned layer stack carries the whole stacked
gradient into a separate reduction (zero1/zero2: N times the state shard; dp: the all-reduce
of a bucket of all of them, a concatenated copy and its reduced result). Plain ``jax.jit``
avoids that because GSPMD moves the reduction into the loop.

Here each parameter the model passes through ``gather_layer`` travels with a *state-shard twin*:
a `shardlib.step.zeropp.Carried` (role ``"shard"``) of the replicated weight and a zero
placeholder of its optimizer-state shard's shape (dp: the weight's own shape), sliced together
by the model's scan. ``gather_layer`` returns the weight (no communication); its backward
returns the weight's cotangent (in the master dtype) reduced as `Scatter` says, reduce-scattered
over the dim the state shards and summed over the batch axes neither shards, as the twin's
cotangent. Differentiating with respect to the twins rather than the weights yields the
gradients already reduced, one layer at a time. The same bytes travel as in
`shardlib.step.reduce.Reducer`, which leaves the twins' gradients alone; the reductions of one
gather_layer call share buckets (``bucket_bytes``), so a layer's gradients leave in one
collective per kind.

It applies where it is exact: an uncompressed, unpipelined step without staleness, a model with
``gathers_params=True``, and ``grad_accum == 1`` or a strategy that reduce-scatters every
microbatch anyway (``shard_grad_buffer``: zero2). Parameters the model never passes through
``gather_layer``, slices of a stack sharded on the stack's own dim, and, beside parameters
stored over a batch axis (ZeRO-3's, gathered per layer), whole ones that only need a sum, keep
the reduction after the backward pass.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from shardlib.sharding import rules as rules_lib
from shardlib.sharding.layout import Layout, spec_axes
from shardlib.step import buckets as buckets_lib
from shardlib.step import zeropp
from shardlib.step.compute import ModelCall, StepContext
from shardlib.step.reduce import Reducer, reduced_transposed, rest_axes, scatter_dims

__all__ = ["Layerwise", "Scatter", "Twins", "attach", "gather_tree", "no_twins"]


@dataclasses.dataclass(frozen=True)
class Scatter:
    """The whole reduction one parameter's gradient needs: a reduce-scatter over ``axes`` on
    ``dim`` of the full parameter (None: no dim to scatter, dp), then a sum over ``sums`` (the
    batch axes neither the parameter nor its state shards); ``ndim``: the full parameter's rank
    (a slice of a scanned stack has one dim fewer)."""

    dim: int | None
    axes: tuple[str, ...]
    ndim: int
    sums: tuple[str, ...] = ()


def _scatter_of(ndim: int, param_spec: Any, state_spec: Any, storage_spec: Any, axes: tuple[str, ...]) -> Scatter | None:
    """The twin's reduction for one parameter, or None where it keeps the reduction after the loop:
    stored over a batch axis (ZeRO-3 gathers it), split over ``tensor``, or sharded on several dims."""
    dims = scatter_dims(param_spec, state_spec)
    sums = rest_axes(param_spec, state_spec, axes)
    whole = spec_axes(storage_spec) <= spec_axes(param_spec) and not spec_axes(param_spec) & set(axes)
    if len(dims) > 1 or not whole or not (dims or sums):
        return None
    dim, scatter_axes = dims[0] if dims else (None, ())
    return Scatter(dim, scatter_axes, ndim, sums)


def _is_twin(x: Any) -> bool:
    return zeropp.is_carried(x) and x.role == "shard"


def _local_dim(scatter: Scatter, ndim: int) -> int | None:
    """``scatter``'s dim in a value of rank ``ndim`` (a slice of a stack drops the leading dim)."""
    if scatter.dim is None:
        return None
    dim = scatter.dim - (scatter.ndim - ndim)
    if dim < 0:
        raise ValueError(f"layerwise reduction: a slice of a stack sharded on the stack's own dim {scatter.dim} "
                         "cannot be reduce-scattered per slice; build with layerwise=False")
    return dim


Reduction = tuple[int | None, tuple[str, ...], tuple[str, ...]]  # (local dim, scatter axes, sum axes)


def _bucketed(xs: list[jax.Array], keys: list, bucket_bytes: int, collective, one) -> list[jax.Array]:
    """``collective(key, ids)`` over buckets of ``xs`` sharing a key; ``one(i)`` where a key is None."""
    out = buckets_lib.apply(xs, keys, bucket_bytes, collective)
    return [o if o is not None else one(i) for i, o in enumerate(out)]


def _reduce(cotangents: list[jax.Array], reductions: tuple[Reduction, ...], bucket_bytes: int,
            bucket_scatters: bool = True) -> list[jax.Array]:
    """The twins' cotangents of one gather_layer call, reduced: reduce-scattered where a dim is
    scattered, then summed over the axes left; in buckets of at most ``bucket_bytes`` per (axes,
    dtype) as `shardlib.step.reduce.Reducer`'s, 0: per tensor (the reduce-scatters too where
    ``bucket_scatters`` is off: the backend policy's)."""
    xs, on = list(cotangents), bool(bucket_bytes)
    keys = [(axes, x.dtype) if on and bucket_scatters and dim is not None else None
            for x, (dim, axes, _) in zip(xs, reductions)]
    xs = _bucketed(xs, keys, bucket_bytes, lambda key, ids: buckets_lib.psum_scatter(
        [xs[i] for i in ids], [reductions[i][0] for i in ids], key[0]),
        lambda i: xs[i] if reductions[i][0] is None else jax.lax.psum_scatter(
            xs[i], reductions[i][1], scatter_dimension=reductions[i][0], tiled=True))
    keys = [(sums, x.dtype) if on and sums else None for x, (_, _, sums) in zip(xs, reductions)]
    return _bucketed(xs, keys, bucket_bytes, lambda key, ids: buckets_lib.psum([xs[i] for i in ids], key[0]),
                     lambda i: jax.lax.psum(xs[i], reductions[i][2]) if reductions[i][2] else xs[i])


@functools.lru_cache(maxsize=None)
def _twin_identity(reductions: tuple[Reduction, ...], dtypes: tuple[Any, ...], bucket_bytes: int,
                   reduce_dtype: Any = None, bucket_scatters: bool = True):
    """``(weights, shards) -> weights``, whose backward reduces the weights' cotangents (cast to
    ``reduce_dtype``, None: to the shards' ``dtypes``) into the shards' cotangents (in ``dtypes``);
    the weights' own cotangents are zero."""

    @jax.custom_vjp
    def twin(weights, shards):
        return weights

    def fwd(weights, shards):
        return weights, None

    def bwd(_, cotangents):
        cast = [c.astype(dtype if reduce_dtype is None else reduce_dtype) for c, dtype in zip(cotangents, dtypes)]
        reduced = _reduce(cast, reductions, bucket_bytes, bucket_scatters)
        return [jnp.zeros_like(c) for c in cotangents], [r if r.dtype == dtype else r.astype(dtype) for r, dtype in zip(reduced, dtypes)]

    twin.defvjp(fwd, bwd)
    return twin


def gather_tree(tree: Any, bucket_bytes: int = 0, matmul_order: bool = False, reduce_dtype: Any = None,
                bucket_scatters: bool = True) -> Any:
    """Every twin in one gather_layer call's ``tree`` -> its weight, through one `_twin_identity`
    (the call's reductions share buckets, in ``reduce_dtype``; None: the master dtype); anything
    else as it is. ``matmul_order`` (the backend policy's, XLA:CPU): matrices reduce in their
    matmul's order (`reduced_transposed`)."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=zeropp.is_carried)
    twins = [leaves[i] for i, x in enumerate(leaves) if _is_twin(x)]
    if not twins:
        return tree
    dims = [_local_dim(t.scatter, t.value.ndim) for t in twins]
    flips = [matmul_order and reduced_transposed(t.value.ndim, dim) for t, dim in zip(twins, dims)]
    order = lambda x, flip: x.T if flip else x
    reductions = tuple((0 if flip and dim is not None else dim, t.scatter.axes, t.scatter.sums)
                       for t, dim, flip in zip(twins, dims, flips))
    dtypes = tuple(t.rider.dtype for t in twins)
    weights = _twin_identity(reductions, dtypes, bucket_bytes, reduce_dtype, bucket_scatters)([order(t.value, f) for t, f in zip(twins, flips)],
                                                               [order(t.rider, f) for t, f in zip(twins, flips)])
    weights = iter(order(w, f) for w, f in zip(weights, flips))
    return treedef.unflatten([next(weights) if _is_twin(x) else x for x in leaves])


@dataclasses.dataclass(frozen=True)
class Twins:
    """The twinned parameters of one trace: what to differentiate, how the model sees it, and the
    reducer that leaves the twins' (already scattered) gradients alone."""

    scatters: tuple[Scatter | None, ...] | None  # per parameter leaf, None where not twinned; None: no twins
    reducer: Reducer

    def inputs(self, params: Any) -> Any:
        """What value_and_grad differentiates: a zero state shard in place of each twinned weight."""
        if self.scatters is None:
            return params
        flat, treedef = jax.tree.flatten(params, is_leaf=zeropp.is_carried)
        return treedef.unflatten([p if s is None else _zero_shard(p, s)
                                  for p, s in zip(flat, self.scatters)])

    def join(self, inputs: Any, params: Any) -> Any:
        """The model's parameters: each twinned weight (a constant) with its shard riding along."""
        if self.scatters is None:
            return inputs
        flat, treedef = jax.tree.flatten(inputs, is_leaf=zeropp.is_carried)
        weights = treedef.flatten_up_to(params)
        return treedef.unflatten([x if s is None else zeropp.Carried(w, x, "shard", s)
                                  for x, w, s in zip(flat, weights, self.scatters)])


def _zero_shard(param: jax.Array, scatter: Scatter) -> jax.Array:
    """The twin: zeros of the state shard's shape, varying over the scatter's axes (as its
    reduce-scattered cotangent will be) and invariant over those it is summed over (as a psum is)."""
    n = math.prod(jax.lax.axis_size(a) for a in scatter.axes)  # 1 where nothing is scattered
    shape = tuple(d // n if i == scatter.dim else d for i, d in enumerate(param.shape))
    zeros = jnp.zeros(shape, param.dtype)
    return jax.lax.pcast(zeros, scatter.axes, to="varying") if scatter.axes else zeros


@dataclasses.dataclass(frozen=True)
class Layerwise:
    """Which parameters may be twinned (from the layouts); `twins` keeps those the model gathers."""

    scatters: tuple[Scatter | None, ...]
    paths: tuple[str, ...]

    def twins(self, call: ModelCall, reducer: Reducer, params: Any, rows: Any, ctx: StepContext) -> Twins:
        """The twins of this trace: only parameters an abstract trace of the loss saw reach
        ``gather_layer`` (a twin anywhere else would reach model code as a pytree, not an array)."""
        seen = call.probe(params, rows, ctx)
        keep = lambda s, path: s is not None and path in seen.gathered and not (path in seen.sliced and s.dim == 0)
        scatters = tuple(s if keep(s, path) else None for s, path in zip(self.scatters, self.paths))
        flags = [s is not None for s in scatters]
        return Twins(scatters, reducer.reduced_where(flags))


def no_twins(reducer: Reducer) -> Twins:
    """The identity: every gradient reduced after the backward pass."""
    return Twins(None, reducer)


def _scatters(layout: Layout, reducer: Reducer) -> tuple[tuple[Scatter | None, ...], tuple[str, ...]]:
    """Per parameter leaf, its twin's reduction or None. Where some parameter is stored over a
    batch axis (ZeRO-3 gathers it, and its gather reduce-scatters), the small whole parameters
    beside it keep their one bucketed sum after the loop rather than a collective per layer."""
    leaves = jax.tree.leaves(layout.params, is_leaf=rules_lib.is_layout)
    param_specs = jax.tree.leaves(reducer.param_specs)
    specs = zip(param_specs, jax.tree.leaves(reducer.state_specs), jax.tree.leaves(reducer.storage_specs))
    scatters = [_scatter_of(len(l.shape), ps, ss, st, reducer.axes) for l, (ps, ss, st) in zip(leaves, specs)]
    if any(spec_axes(ps) & set(reducer.axes) for ps in param_specs):
        scatters = [s if s is None or s.dim is not None else None for s in scatters]
    return tuple(scatters), tuple(l.path for l in leaves)


def has_twins(layout: Layout, reducer: Reducer) -> bool:
    """Whether some parameter's gradient can be reduced inside the backward loop (dp, zero1 and
    zero2 keep parameters whole over the batch axes; `shardlib.step.options` refuses the rest)."""
    return any(s is not None for s in _scatters(layout, reducer)[0])


def attach(provider: Any, layout: Layout) -> Any:
    """``provider`` with layerwise twins; `build` attaches them where no row of
    `shardlib.step.options.REFUSALS` for ``layerwise`` holds."""
    scatters, paths = _scatters(layout, provider.reducer)
    bucket_bytes = provider.reducer.bucket_bytes if provider.reducer.bucketed else 0
    call = dataclasses.replace(provider.call, gather_tree=functools.partial(
        gather_tree, bucket_bytes=bucket_bytes, matmul_order=layout.backend.matmul_order,
        reduce_dtype=provider.reducer.reduce_dtype, bucket_scatters=layout.backend.bucket_scatters))
    return dataclasses.replace(provider, call=call, layerwise=Layerwise(scatters, paths))
