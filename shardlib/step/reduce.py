"""The reduction of one device's gradients into the optimizer-state layout, over the manual
batch axes, and the specs of what crosses into the step's ``shard_map``.

Dims the storage shards were gathered in the forward pass, so autodiff already reduce-scattered
their gradients (ZeRO-3); dims only the state shards are reduce-scattered here (ZeRO-1/2); the
remaining batch axes are summed (dp). Writing these collectives by hand is what makes the volume
the ZeRO paper's on every backend. ``compression`` is the policy for how the bytes travel.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from shardlib.sharding import rules as rules_lib
from shardlib.sharding.layout import Layout, restrict, spec_axes
from shardlib.step import compression as compression_lib
from shardlib.step.compute import active_axes, sharded_paths

__all__ = ["Reducer", "active_axes", "batch_specs", "vary"]  # active_axes: the axes reductions run over


def batch_specs(layout: Layout, batch: Any) -> Any:
    """The ``shard_map`` specs of a batch: rows split over the batch axes."""
    return jax.tree.map(lambda x: restrict(layout.batch_spec(x.ndim), layout.batch_axes), batch)


def vary(params: Any, specs: Any, axes: tuple[str, ...]) -> Any:
    """Mark every parameter as per-device over ``axes``, so that autodiff never inserts a psum of
    its own: the gradient reductions are the explicit ones of `Reducer` (and the pipeline's)."""
    def one(p, spec):
        missing = tuple(a for a in axes if a not in spec_axes(spec))
        return jax.lax.pcast(p, missing, to="varying") if missing else p

    return jax.tree.map(one, params, specs)


def _reduce_grad(grad: jax.Array, param_spec: P, state_spec: P, batch_axes: tuple[str, ...],
                 method: compression_lib.Compression, residual: jax.Array | None):
    """Reduce one local gradient into its state layout over the batch axes -> (grad, residual).

    A tensor reduced twice carries its residual through the first reduction only.
    """
    for dim, (p_axes, s_axes) in enumerate(zip(param_spec, state_spec)):
        if s_axes and not p_axes:
            grad, residual = compression_lib.compressed_psum_scatter(
                grad, rules_lib.as_axes(s_axes), dim, method, residual)
            method, residual_out, residual = _second_pass(method), residual, None
            break
    else:
        residual_out = None
    rest = tuple(a for a in batch_axes if a not in spec_axes(param_spec) | spec_axes(state_spec))
    if rest:
        grad, new = compression_lib.compressed_psum(grad, rest, method, residual)
        residual_out = new if residual_out is None else residual_out
    return grad, residual_out if residual_out is not None else residual


def _second_pass(method: compression_lib.Compression) -> compression_lib.Compression:
    """A residual belongs to one reduction: a stateful method's second reduction falls back to bf16."""
    return compression_lib.get_compression("bf16") if method.needs_residual else method


@dataclasses.dataclass(frozen=True)
class Reducer:
    """Local gradients -> gradients in the optimizer-state layout, with error-feedback residuals
    (one per device of ``axes``, leading axis) when the compression method keeps them."""

    param_specs: Any  # storage specs over the manual batch axes
    state_specs: Any  # optimizer-state specs over the manual batch axes
    axes: tuple[str, ...]  # the batch axes to reduce over (size > 1)
    method: compression_lib.Compression

    @classmethod
    def for_layout(cls, layout: Layout, method: compression_lib.Compression, exclude: tuple[str, ...] = ()) -> Reducer:
        """Over the layout's batch axes but ``exclude``; refuses to compress an autodiff reduce-scatter."""
        if method.name != "none" and sharded_paths(layout):
            raise ValueError(
                f"grad_compression={method.name!r} cannot compress {layout.strategy.name}'s gradient reduce-scatter: "
                "it is the transpose of the weight all-gather, derived by autodiff; use precision='bf16', which "
                "gathers and reduce-scatters in bfloat16, or a strategy that keeps parameters unsharded (dp, zero1, zero2)"
            )
        return cls(layout.manual(layout.params), layout.manual(layout.state), active_axes(layout, exclude), method)

    def __call__(self, grads: Any, residuals: Any = None) -> tuple[Any, Any]:
        flat, treedef = jax.tree.flatten(grads)
        rows = zip(flat, treedef.flatten_up_to(self.param_specs), treedef.flatten_up_to(self.state_specs),
                   treedef.flatten_up_to(residuals) if residuals is not None else [None] * len(flat))
        out = [_reduce_grad(g, ps, ss, self.axes, self.method, r) for g, ps, ss, r in rows]
        residuals = treedef.unflatten([r for _, r in out]) if self.method.needs_residual else None
        return treedef.unflatten([g for g, _ in out]), residuals

    # ---- error-feedback residuals: one per device, stacked along a leading axis over ``axes``.

    def residual_specs(self, params: Any) -> Any:
        """The residuals' specs (None without residuals): the leading axis split over ``axes``."""
        if not self.method.needs_residual:
            return None
        return jax.tree.map(lambda _: P(self.axes or None), params)

    def zero_residuals(self, params: Any, mesh: jax.sharding.Mesh) -> Any:
        if not self.method.needs_residual:
            return None
        n = math.prod(mesh.shape[a] for a in self.axes)
        return jax.tree.map(lambda p: jnp.zeros((n, *p.shape), jnp.float32), params)

    @staticmethod
    def local(residuals: Any) -> Any:
        """This device's residuals, inside the ``shard_map`` (its block of the leading axis)."""
        return None if residuals is None else jax.tree.map(lambda r: r[0], residuals)

    @staticmethod
    def stacked(residuals: Any) -> Any:
        """The inverse of `local`: this device's block of the leading axis."""
        return None if residuals is None else jax.tree.map(lambda r: r[None], residuals)
