"""Bounded staleness: the gradient computed at step t is reduced and applied at step t + tau.

The train state carries a queue of the last tau *local* (unreduced) gradients
(`TrainState.pending`, oldest first), each with its loss and whether it is real yet. Step t
reduces the oldest one over the batch axes and applies it, while it computes this step's local
gradient and pushes it. The reduction reads only the state the step started from, never this
step's batch, so it can run from the step's first instruction alongside the forward and backward
pass: the communication overlaps the next step's compute (one-step-delayed data parallelism;
PipeDream-2BW's update with a one-step-old gradient). The update waits for the reduction, not for
the compute. tau = 0 is no queue: the synchronous step, unchanged.

What it costs: tau local gradients per device (tau x Psi floats, as many as dp's gradient
buffer; under ZeRO-1/2 N times what their state-layout shards would be), and the staleness itself.
Only reductions the step writes can move (`Reducer`: dp, zero1, zero2, tp, hsdp's data axis).
ZeRO-3's reduce-scatter is autodiff's transpose of the weight gather, inside the backward pass,
so strategies that store parameters over a batch axis are refused, as are pipelines and zero2's
per-microbatch reduce-scatter (`shardlib.step.options`).

The first tau steps have nothing to apply: parameters and optimizer state stay as initialised
(no zero gradient reaches the optimizer's moments), ``metrics["applied"] == 0`` and they are not
counted as skipped; ``state.step`` counts applied updates, as it does for skipped steps. A
gradient whose loss or norm is not finite is dropped when its turn comes (``skipped == 1`` then);
the queue advances either way, so one bad gradient never blocks the ones behind it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from shardlib.sharding import rules as rules_lib
from shardlib.sharding.layout import restrict
from shardlib.step import batch as batch_lib
from shardlib.step import reduce as reduce_lib
from shardlib.step.compute import StepContext
from shardlib.step.state import step_key

__all__ = ["check_staleness", "queue_sharding", "train_step", "with_queue"]


def check_staleness(staleness: Any) -> int:
    """``staleness`` as an int, or a ValueError; what it cannot run with is `shardlib.step.options`'s."""
    if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
        raise ValueError(f"staleness must be a non-negative integer (steps between a gradient's computation and "
                         f"its reduction and application; 0: synchronous), got {staleness!r}")
    return staleness


def _local_sharding(layout: Any, axes: tuple[str, ...]) -> Any:
    """A local gradient per device: a leading axis over the batch axes, then the storage spec."""
    lead = axes[0] if len(axes) == 1 else axes
    return jax.tree.map(lambda leaf: NamedSharding(layout.mesh, P(lead, *leaf.spec)), layout.params,
                        is_leaf=rules_lib.is_layout)


def queue_sharding(staleness: int, layout: Any, reducer: Any) -> tuple | None:
    if staleness == 0:
        return None
    replicated = NamedSharding(layout.mesh, P())
    grads = _local_sharding(layout, reducer.axes)
    return tuple({"ready": replicated, "loss": replicated, "grads": grads} for _ in range(staleness))


def with_queue(init: Any, staleness: int, layout: Any, reducer: Any, sharding: Any) -> Any:
    """``init(key)`` with tau entries that apply nothing (zeros, not ready), in ``sharding``."""
    if staleness == 0:
        return init
    n = math.prod(layout.mesh.shape[a] for a in reducer.axes)

    def init_fn(key, *given):
        state = init(key, *given)
        entry = lambda: {"ready": jnp.zeros((), jnp.bool_), "loss": jnp.zeros((), jnp.float32),
                         "grads": jax.tree.map(lambda p: jnp.zeros((n, *p.shape), p.dtype), state.params)}
        return dataclasses.replace(state, pending=tuple(entry() for _ in range(staleness)))

    return jax.jit(init_fn, out_shardings=sharding)


def _gathered_sum(stacked: Any, mesh: Any, mean: bool = False) -> Any:
    """The sum (or mean) of per-device values (leading axis), through an all-gather and a local
    sum rather than a psum: XLA's all-reduce combiner would merge a psum of this step's loss with
    the deferred gradient all-reduce, making the reduction wait for this step's forward pass."""
    gathered = jax.lax.with_sharding_constraint(stacked, NamedSharding(mesh, P()))
    combine = jnp.mean if mean else jnp.sum
    return jax.tree.map(lambda x: combine(x, axis=0) if jnp.issubdtype(x.dtype, jnp.floating) else x[0], gathered)


class _Unreduced:
    """A reducer that leaves the gradients local: the provider computes, `train_step` reduces later."""

    def __call__(self, grads: Any, residuals: Any = None) -> tuple[Any, Any]:
        return grads, residuals


def _mapped(layout: Any, provider: Any, reducer: Any, queue_sharding_: Any):
    """(params, batch, ctx, residuals, oldest local grads) -> (loss, aux, oldest reduced, residuals,
    model state, this step's local grads): the deferred reduction beside this step's gradients."""
    manual_axes = layout.manual_axes
    mapped_params = layout.manual(layout.params, manual_axes)
    local_specs = jax.tree.map(lambda s: restrict(s.spec, manual_axes), queue_sharding_)
    residual_specs = reducer.residual_specs(manual_axes)
    local_provider = dataclasses.replace(provider, reducer=_Unreduced())

    def body(params, batch, ctx, residuals, oldest):
        reduced, residuals = reducer(jax.tree.map(lambda g: g[0], oldest), reducer.local(residuals))
        params = reduce_lib.vary(params, mapped_params, reducer.axes)
        (loss, aux), grads, _, model_state = local_provider.value_and_grad(params, batch, ctx, None)
        per_device = jax.tree.map(lambda x: x[None], ((loss, aux), model_state))
        return per_device, reduced, reducer.stacked(residuals), jax.tree.map(lambda g: g[None], grads)

    lead = P(reducer.axes[0] if len(reducer.axes) == 1 else reducer.axes)

    def mapped(*args):
        args = (args[0], batch_lib.in_context_order(layout, args[1]), *args[2:])
        per_device, reduced, residuals, grads = jax.shard_map(
            body, mesh=layout.mesh,
            in_specs=(mapped_params, batch_lib.specs(layout, args[1]), P(), residual_specs, local_specs),
            out_specs=(lead, layout.manual(layout.state, manual_axes), residual_specs, local_specs),
            axis_names=set(manual_axes))(*args)
        (loss, aux), model_state = _gathered_sum(per_device[0], layout.mesh), per_device[1]
        return loss, aux, reduced, residuals, _gathered_sum(model_state, layout.mesh, mean=True), grads

    return mapped


def _adopt(fresh_ok: jax.Array, produced: dict[str, Any], state: Any) -> dict[str, Any]:
    """Model state (BatchNorm statistics) belongs to this step's forward pass: kept when its loss is finite."""
    if not jax.tree.leaves(produced):
        return produced
    old = {name: getattr(state, name) for name in produced}
    return jax.lax.cond(fresh_ok, lambda _: produced, lambda _: old, None)


def train_step(layout: Any, provider: Any, reducer: Any, update: Any, sharding: Any, donate: bool,
               options: dict[str, str] | None = None):
    """The jitted ``step(state, batch) -> (state, metrics)`` under staleness.

    Metrics: ``loss`` is this step's, ``grad_norm`` the applied gradient's, ``applied`` 1 when a
    gradient was applied, ``skipped`` 1 when a queued one was not finite.
    """
    mapped = _mapped(layout, provider, reducer, sharding.pending[0]["grads"])

    def step_fn(state, batch):
        oldest, one = state.pending[0], jnp.ones((), jnp.float32)
        # state.step counts applied updates; with the queued ones it counts the steps taken (the
        # loss's step; dropout keys read TrainState.steps_taken, which also counts dropped gradients).
        taken = state.step + sum(entry["ready"].astype(jnp.int32) for entry in state.pending)
        ctx = StepContext(scale=one, key=step_key(state), model_state=state.model_state, step=taken)
        loss, aux, reduced, residuals, model_state, grads = mapped(state.params, batch, ctx, state.grad_residual,
                                                                   oldest["grads"])
        gate_loss = jnp.where(oldest["ready"], oldest["loss"], jnp.nan)  # nothing queued yet: apply nothing
        # The residuals belong to the reduction of the applied gradient: adopted with its update.
        new_state, grad_norm, finite = update(state, reduced, gate_loss, one, {"grad_residual": residuals})
        newest = {"ready": jnp.ones((), jnp.bool_), "loss": loss.astype(jnp.float32), "grads": grads}
        new_state = dataclasses.replace(new_state, pending=(*state.pending[1:], newest),
                                        **_adopt(jnp.isfinite(loss), {"model_state": model_state}, state))
        metrics = update.metrics(state, loss, aux, grad_norm, finite)
        metrics["skipped"] = (oldest["ready"] & ~finite).astype(jnp.int32)
        metrics["applied"] = finite.astype(jnp.int32)
        return new_state, metrics

    return jax.jit(step_fn, in_shardings=(sharding, None), out_shardings=(sharding, NamedSharding(layout.mesh, P())),
                   donate_argnums=(0,) if donate else (), compiler_options=options)
