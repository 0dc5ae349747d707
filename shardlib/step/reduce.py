"""The reduction of one device's gradients into the optimizer-state layout, over the manual
batch axes, and the specs of what crosses into the step's ``shard_map``.

Dims the storage shards were gathered in the forward pass, so autodiff already reduce-scattered
their gradients (ZeRO-3); dims only the state shards are reduce-scattered here (ZeRO-1/2); the
remaining batch axes are summed (dp). Writing these collectives by hand is what makes the volume
the ZeRO paper's on every backend. ``compression`` is the policy for how the bytes travel, and
the precision's ``reduce_dtype`` the dtype an exact reduction runs in (float32 by default; bf16
halves the bytes). Matrices are reduced in their matmul's order where the backend policy says so
(``matmul_order``: XLA:CPU, `reduced_transposed`).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from shardlib.sharding import rules as rules_lib
from shardlib.sharding.layout import Layout, restrict, spec_axes
from shardlib.step import buckets as buckets_lib
from shardlib.step import compression as compression_lib
from shardlib.step import zeropp
from shardlib.step.compute import active_axes

# DDP's default (25 MiB): large enough that a bucket's fixed cost is small against its bytes,
# small enough that the concatenated copy it needs stays a fraction of a large model's gradients.
DEFAULT_BUCKET_BYTES = 25 * 2**20

__all__ = ["DEFAULT_BUCKET_BYTES", "Reducer", "active_axes", "scatter_dims", "vary"]  # active_axes: the axes reductions run over


def vary(params: Any, specs: Any, axes: tuple[str, ...]) -> Any:
    """Mark every parameter as per-device over ``axes``, so that autodiff never inserts a psum of
    its own: the gradient reductions are the explicit ones of `Reducer` (and the pipeline's)."""
    def one(p, spec):
        missing = tuple(a for a in axes if a not in spec_axes(spec))
        return jax.lax.pcast(p, missing, to="varying") if missing else p

    return jax.tree.map(one, params, specs)


def scatter_dims(param_spec: P, state_spec: P) -> tuple[tuple[int, tuple[str, ...]], ...]:
    """The dims only the optimizer state shards (ZeRO-1/2): each is reduce-scattered here."""
    return tuple((dim, rules_lib.as_axes(s_axes)) for dim, (p_axes, s_axes) in enumerate(zip(param_spec, state_spec))
                 if s_axes and not p_axes)


def rest_axes(param_spec: P, state_spec: P, batch_axes: tuple[str, ...]) -> tuple[str, ...]:
    """The batch axes neither layout shards: the gradient is summed over them (dp, hsdp's ``data``)."""
    return tuple(a for a in batch_axes if a not in spec_axes(param_spec) | spec_axes(state_spec))


def reduced_transposed(ndim: int, scatter_dim: int | None) -> bool:
    """Whether a gradient is reduced transposed. A Dense kernel ``[in, out]``'s gradient is JAX's
    transpose of the matmul ``dy^T x``, whose result is ``[out, in]``: reduced in that order (all of
    it, or split on ``out``, where `Strategy.state_from_last` places ZeRO-1/2's state), the
    reduction takes the matmul's result as it is and the two transposes cancel. Reduced as
    ``[in, out]``, XLA:CPU computes the matmul from two transposed operands, unfused. Only
    matrices: for more dims the matmul's order depends on which dims it contracts."""
    return ndim == 2 and scatter_dim in (None, 1)


def _one_dim(dims: tuple[tuple[int, tuple[str, ...]], ...]) -> int | None:
    """The dim `scatter_dims` scatters: None for none, -1 for several (no order suits them all)."""
    return None if not dims else dims[0][0] if len(dims) == 1 else -1


def _transposed_spec(spec: P) -> P:
    return P(*reversed(tuple(spec) + (None,) * (2 - len(spec))))


def _scatter_grad(grad: jax.Array, dims, method: compression_lib.Compression, residual: jax.Array | None):
    """Reduce-scatter every dim in ``dims``, one after the other -> (grad, residual).

    A residual belongs to one reduction: it rides the first, the later ones use `_second_pass`.
    """
    for i, (dim, axes) in enumerate(dims):
        grad, new = compression_lib.compressed_psum_scatter(
            grad, axes, dim, method if i == 0 else _second_pass(method), residual if i == 0 else None)
        residual = new if i == 0 else residual
    return grad, residual


def _sum_grad(grad: jax.Array, rest: tuple[str, ...], scattered: bool, method: compression_lib.Compression,
              residual: jax.Array | None):
    """Sum over the ``rest`` axes -> (grad, residual); after a scatter without the residual."""
    if not rest:
        return grad, residual
    if scattered:
        return compression_lib.compressed_psum(grad, rest, _second_pass(method))[0], residual
    grad, new = compression_lib.compressed_psum(grad, rest, method, residual)
    return grad, (residual if new is None else new)


def _second_pass(method: compression_lib.Compression) -> compression_lib.Compression:
    """A residual belongs to one reduction: a stateful method's second reduction falls back to bf16."""
    return compression_lib.get_compression("bf16") if method.needs_residual else method


def _non_batch(spec: P, batch_axes: tuple[str, ...]) -> tuple[str, ...]:
    """The mesh axes of ``spec`` that are not batch axes (``tensor``): a qgZ residual keeps only those."""
    return tuple(a for a in spec_axes(spec) if a not in batch_axes)


def _autodiff_only(layout: Layout, axes: tuple[str, ...]) -> list[str]:
    """Parameters stored over the batch axes whose whole reduction is autodiff's reduce-scatter
    (no batch axis left for the Reducer to sum over): compression would touch none of it."""
    leaves = jax.tree.leaves(layout.params, is_leaf=rules_lib.is_layout)
    manual = zip(leaves, jax.tree.leaves(layout.manual(layout.params)), jax.tree.leaves(layout.manual(layout.state)))
    return [leaf.path for leaf, p_spec, s_spec in manual
            if spec_axes(p_spec) & set(axes) and not rest_axes(p_spec, s_spec, axes)]


@dataclasses.dataclass(frozen=True)
class Reducer:
    """Local gradients -> gradients in the optimizer-state layout, with error-feedback residuals
    when the compression method keeps them.

    Two phases, so that an accumulated step can run the first per microbatch and the second once:
    `scatter` (the dims only the state shards: shrinks the gradient to its state shard) and
    `finish` (the sum over the batch axes neither layout shards, e.g. hsdp's ``data``).
    """

    param_specs: Any  # storage specs over the manual batch axes
    state_specs: Any  # optimizer-state specs over the manual batch axes
    axes: tuple[str, ...]  # the batch axes to reduce over (size > 1)
    method: compression_lib.Compression
    storage_specs: Any = None  # full storage specs (tensor axes too): where the residuals live
    bucket_bytes: int = 0  # pack uncompressed reductions into buckets of this size (`buckets`); 0: one per tensor
    # qgZ: the gathers' own backward compresses the ZeRO-3 reduce-scatter (`shardlib.step.zeropp`),
    # and a gathered parameter's residual travels with it to its gather (`carry`)
    compresses_gathers: bool = False
    reduced: Any = None  # per tensor: True where layerwise twins reduced it in the backward loop
    # The dtype the exact reductions run in (`Precision.reduce_dtype`): each gradient is cast to it
    # before its collective and back after; None: the gradient's own. Compressed methods sum in float32.
    reduce_dtype: Any = None
    # Reduce matrices in their matmul's order (`reduced_transposed`): the backend policy's
    # ``matmul_order`` (XLA:CPU), read from the layout
    matmul_order: bool = False
    # Bucket the reduce-scatters too (the backend policy's ``bucket_scatters``; not on TPU)
    bucket_scatters: bool = True

    @classmethod
    def for_layout(cls, layout: Layout, method: compression_lib.Compression, exclude: tuple[str, ...] = (),
                   bucket_bytes: int | None = 0, reduce_dtype: Any = None) -> Reducer:
        """Over the layout's batch axes but ``exclude``; where a parameter's whole reduction is the
        autodiff reduce-scatter, compression moves into its gather's backward (qgZ; hsdp's
        data-axis sum stays the Reducer's).
        ``bucket_bytes`` (0 or None: off) buckets the uncompressed reductions only: a compressed
        one keeps its per-tensor chunks, scales and residual. ``reduce_dtype``: the dtype the exact
        reductions run in (None: the gradients'); the matmul order is the layout's backend policy's."""
        axes = active_axes(layout, exclude)
        untouched = _autodiff_only(layout, axes) if method.name != "none" else []
        storage = jax.tree.map(lambda l: l.spec, layout.params, is_leaf=rules_lib.is_layout)
        reducer = cls(layout.manual(layout.params), layout.manual(layout.state), axes, method, storage,
                      buckets_lib.checked_limit("bucket_bytes", bucket_bytes), compresses_gathers=bool(untouched),
                      reduce_dtype=None if reduce_dtype is None else jnp.dtype(reduce_dtype),
                      matmul_order=layout.backend.matmul_order, bucket_scatters=layout.backend.bucket_scatters)
        twice = reducer.reduced_twice(layout)
        if method.needs_residual and twice:
            warnings.warn(
                f"grad_compression={method.name!r}: {len(twice)} tensor(s) are reduced in two collectives (a "
                f"reduce-scatter, then a sum over the other batch axes), and their error-feedback residual belongs "
                f"to the first, so the second sends bf16 without feedback: {rules_lib.listed(twice)}. Keep them "
                "int8 throughout by sharding their optimizer state over all the batch axes (the built-in strategies do), "
                "or choose grad_compression='bf16' for all", UserWarning, stacklevel=4)
        return reducer

    def reduced_twice(self, layout: Layout) -> list[str]:
        """Paths of the parameters whose gradient takes two reductions or more: a reduce-scatter
        (autodiff's under qgZ) and then a sum, or two scatters. Only the first carries a residual
        (`_second_pass`)."""
        leaves, treedef = jax.tree.flatten(layout.params, is_leaf=rules_lib.is_layout)
        return [leaf.path for leaf, (ps, ss) in zip(leaves, self._specs_of(treedef))
                if len(scatter_dims(ps, ss)) + self._carries(ps) + bool(rest_axes(ps, ss, self.axes)) > 1]

    def _carries(self, param_spec: P) -> bool:
        """Whether this parameter's reduce-scatter is its gather's compressed backward (qgZ)."""
        return self.compresses_gathers and bool(spec_axes(param_spec) & set(self.axes))

    def carry(self, params: Any, residuals: Any) -> Any:
        """Inside the ``shard_map``: every qgZ parameter as a `zeropp.Carried` (shard, residual), so
        that differentiating the loss returns its new residual beside its gradient."""
        if not (self.compresses_gathers and self.method.needs_residual):
            return params
        flags = jax.tree.map(self._carries, self.param_specs)
        return zeropp.carry(params, residuals, flags)

    def reduced_where(self, flags: list[bool]) -> Reducer:
        """This reducer for gradients that arrive already reduced into their state shards where
        ``flags`` is set (`shardlib.step.layerwise`): it leaves those alone."""
        flat, treedef = jax.tree.flatten(self.param_specs)
        states = treedef.flatten_up_to(self.state_specs)
        return dataclasses.replace(self, param_specs=treedef.unflatten(
            [ss if flag else ps for ps, ss, flag in zip(flat, states, flags)]), reduced=treedef.unflatten(list(flags)))

    def _rest(self, treedef) -> list[tuple[str, ...]]:
        """Per tensor: the batch axes `finish` sums over (none for one reduced in the loop)."""
        done = treedef.flatten_up_to(self.reduced) if self.reduced is not None else [False] * treedef.num_leaves
        return [() if d else rest_axes(ps, ss, self.axes) for (ps, ss), d in zip(self._specs_of(treedef), done)]

    def _map(self, fn, grads: Any, residuals: Any) -> tuple[Any, Any]:
        """``fn(grad, param_spec, state_spec, residual) -> (grad, residual)`` over every tensor."""
        flat, treedef = jax.tree.flatten(grads)
        rs = treedef.flatten_up_to(residuals) if residuals is not None else [None] * len(flat)
        out = [fn(g, ps, ss, r) for g, (ps, ss), r in zip(flat, self._specs_of(treedef), rs)]
        residuals = treedef.unflatten([r for _, r in out]) if self.method.needs_residual else None
        return treedef.unflatten([g for g, _ in out]), residuals

    @property
    def bucketed(self) -> bool:
        """Whether the reductions run in buckets: asked for, and uncompressed (no residuals)."""
        return self.bucket_bytes > 0 and self.method.name == "none"

    def _specs_of(self, treedef) -> list[tuple[P, P]]:
        return list(zip(treedef.flatten_up_to(self.param_specs), treedef.flatten_up_to(self.state_specs)))

    def _whole_locally(self, treedef) -> list[bool]:
        """Per tensor: whether its local gradient is not sharded over the step's automatic axes
        (``tensor``). Only those are bucketed: flattening a tensor-sharded gradient into a bucket
        would make GSPMD reshard it, collectives over ``tensor`` the buckets were to save."""
        storage = treedef.flatten_up_to(self.param_specs if self.storage_specs is None else self.storage_specs)
        return [spec_axes(full) <= spec_axes(ps) for full, ps in zip(storage, treedef.flatten_up_to(self.param_specs))]

    def _in_matmul_order(self, phase, reduces, grads: Any, residuals: Any) -> tuple[Any, Any]:
        """``phase(reducer, grads, residuals)`` with every gradient it reduces (``reduces(scatter
        dims, sum axes)``) in ``reduce_dtype`` (exact reductions only: compressed ones sum in
        float32), and every matrix among them that `reduced_transposed` picks transposed, its specs
        with it (on a backend with ``matmul_order``; uncompressed only: a residual keeps its
        tensor's shape). Each returns in its own dtype and order."""
        flat, treedef = jax.tree.flatten(grads)
        specs, rests = self._specs_of(treedef), self._rest(treedef)
        scatters = [scatter_dims(ps, ss) for ps, ss in specs]
        reduced = [bool(reduces(scatter, rest)) for scatter, rest in zip(scatters, rests)]
        exact = self.method.name == "none"
        flips = [self.matmul_order and exact and local and r and reduced_transposed(g.ndim, _one_dim(scatter))
                 for g, local, scatter, r in zip(flat, self._whole_locally(treedef), scatters, reduced)]
        dtypes = [g.dtype for g in flat]
        wide = [exact and r and self.reduce_dtype is not None and jnp.issubdtype(g.dtype, jnp.floating)
                and g.dtype != self.reduce_dtype for g, r in zip(flat, reduced)]
        if not any(flips) and not any(wide):
            return phase(self, grads, residuals)
        flat = [g.astype(self.reduce_dtype) if w else g for g, w in zip(flat, wide)]
        order = lambda xs: [x.T if f else x for x, f in zip(xs, flips)]
        swap = lambda tree: treedef.unflatten([_transposed_spec(s) if f else s
                                               for s, f in zip(treedef.flatten_up_to(tree), flips)])
        view = self if not any(flips) else dataclasses.replace(
            self, param_specs=swap(self.param_specs), state_specs=swap(self.state_specs),
            storage_specs=None if self.storage_specs is None else swap(self.storage_specs))
        out, residuals = phase(view, treedef.unflatten(order(flat)), residuals)
        out = order(treedef.flatten_up_to(out))
        return treedef.unflatten([o.astype(d) if w else o for o, d, w in zip(out, dtypes, wide)]), residuals

    def scatter(self, grads: Any, residuals: Any = None) -> tuple[Any, Any]:
        """Reduce-scatter every dim only the state shards: gradients become their state shards."""
        return self._in_matmul_order(Reducer._scatter, lambda scatter, rest: scatter, grads, residuals)

    def finish(self, grads: Any, residuals: Any = None) -> tuple[Any, Any]:
        """Sum `scatter`'s output over the batch axes neither layout shards."""
        return self._in_matmul_order(Reducer._finish, lambda scatter, rest: rest, grads, residuals)

    def _scatter(self, grads: Any, residuals: Any = None) -> tuple[Any, Any]:
        if self.bucketed and self.bucket_scatters:
            return self._scatter_buckets(grads), residuals
        return self._map(lambda g, ps, ss, r: _scatter_grad(g, scatter_dims(ps, ss), self.method, r), grads, residuals)

    def _finish(self, grads: Any, residuals: Any = None) -> tuple[Any, Any]:
        if self.bucketed:
            return self._finish_buckets(grads), residuals

        rests = iter(self._rest(jax.tree.structure(grads)))

        def one(g, ps, ss, r):
            scattered = bool(scatter_dims(ps, ss)) or self._carries(ps)  # the residual rode that reduction
            return _sum_grad(g, next(rests), scattered, self.method, r)

        return self._map(one, grads, residuals)

    def _scatter_buckets(self, grads: Any) -> Any:
        """`scatter` in buckets: tensors with one scattered dim that divides share collectives; a
        tensor scattered on two dims (or not dividing: its error) goes alone."""
        flat, treedef = jax.tree.flatten(grads)
        dims = [scatter_dims(ps, ss) for ps, ss in self._specs_of(treedef)]

        def key(g, d, local):
            bucketable = local and len(d) == 1 and g.size and g.shape[d[0][0]] % jax.lax.axis_size(d[0][1]) == 0
            return (d[0][1], g.dtype) if bucketable else None

        keys = [key(g, d, local) for g, d, local in zip(flat, dims, self._whole_locally(treedef))]
        out = buckets_lib.apply(flat, keys, self.bucket_bytes, lambda k, ids: buckets_lib.psum_scatter(
            [flat[i] for i in ids], [dims[i][0][0] for i in ids], k[0]))
        return treedef.unflatten([o if o is not None else _scatter_grad(g, d, self.method, None)[0]
                                  for o, g, d in zip(out, flat, dims)])

    def _finish_buckets(self, grads: Any) -> Any:
        """`finish` in buckets: tensors summed over the same axes share collectives."""
        flat, treedef = jax.tree.flatten(grads)
        rest = self._rest(treedef)
        keys = [(axes, g.dtype) if axes and g.size and local else None
                for g, axes, local in zip(flat, rest, self._whole_locally(treedef))]
        out = buckets_lib.apply(flat, keys, self.bucket_bytes,
                                lambda k, ids: buckets_lib.psum([flat[i] for i in ids], k[0]))
        return treedef.unflatten([o if o is not None else _sum_grad(g, axes, False, self.method, None)[0]
                                  for o, g, axes in zip(out, flat, rest)])

    def __call__(self, grads: Any, residuals: Any = None) -> tuple[Any, Any]:
        grads, carried = zeropp.split(grads)
        grads, residuals = self.finish(*self.scatter(grads, residuals))
        if residuals is None:
            return grads, residuals
        return grads, jax.tree.map(lambda new, old: old if new is None else new, carried, residuals,
                                   is_leaf=lambda x: x is None)

    # ---- error-feedback residuals: one per device that computes a distinct local gradient.

    def _lead_axes(self, param_spec: P) -> tuple[str, ...]:
        """The batch axes a parameter is not stored over: its local gradients differ along them
        (all of them under qgZ, whose residual is of the whole gathered local gradient)."""
        return tuple(a for a in self.axes if self._carries(param_spec) or a not in spec_axes(param_spec))

    def residual_specs(self, manual_axes: tuple[str, ...] | None = None) -> Any:
        """The residuals' specs (None without residuals): a leading axis over `_lead_axes`, then the
        parameter's storage spec, so a residual is sharded like the local gradient it corrects
        (over ``tensor`` and a ZeRO-3 shard as the parameter is). ``manual_axes``: restricted to
        them, for the ``shard_map``."""
        if not self.method.needs_residual:
            return None

        def one(param_spec, storage):
            lead = self._lead_axes(param_spec)
            storage = restrict(storage, _non_batch(storage, self.axes)) if self._carries(param_spec) else storage
            spec = P(None if not lead else lead[0] if len(lead) == 1 else lead, *storage)
            return spec if manual_axes is None else restrict(spec, manual_axes)

        return jax.tree.map(one, self.param_specs, self.storage_specs)

    def zero_residuals(self, params: Any, mesh: jax.sharding.Mesh) -> Any:
        if not self.method.needs_residual:
            return None
        flat, treedef = jax.tree.flatten(params)

        def zeros(p, param_spec):
            n = math.prod(mesh.shape[a] for a in self._lead_axes(param_spec))
            return jnp.zeros((n, *p.shape), jnp.float32)

        return treedef.unflatten([zeros(p, s) for p, s in zip(flat, treedef.flatten_up_to(self.param_specs))])

    @staticmethod
    def local(residuals: Any) -> Any:
        """This device's residuals, inside the ``shard_map`` (its block of the leading axis)."""
        return None if residuals is None else jax.tree.map(lambda r: r[0], residuals)

    @staticmethod
    def stacked(residuals: Any) -> Any:
        """The inverse of `local`: this device's block of the leading axis."""
        return None if residuals is None else jax.tree.map(lambda r: r[None], residuals)
