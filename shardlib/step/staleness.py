"""Bounded staleness: the gradient reduced at step t is applied at step t + tau.

The train state carries a queue of the last tau reduced gradients (`TrainState.pending`, oldest
first), each with its loss and whether it is real yet. Every step computes and reduces this step's
gradient, applies the oldest queued one, and pushes the new one. The update reads only the
state the step started from, never this step's collectives, so the gradient reduction is off the
update's critical path: XLA may run it alongside compute (one-step-delayed data parallelism,
PipeDream-2BW's weight update with a one-step-old gradient). tau = 0 is no queue: the
synchronous step, unchanged.

The first tau steps have nothing to apply: parameters and optimizer state stay as initialised
(no zero gradient reaches the optimizer's moments), ``metrics["applied"] == 0`` and they are not
counted as skipped; ``state.step`` counts applied updates, as it does for skipped steps. A
gradient whose loss or norm is not finite is dropped when its turn comes (``skipped == 1`` then);
the queue advances either way, so one bad gradient never blocks the ones behind it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

__all__ = ["check_staleness", "delayed_update", "empty_queue", "queue_sharding", "reductions_feeding", "with_queue"]


def check_staleness(staleness: Any, layout: Any, policy: Any, reduce_axes: tuple[str, ...]) -> int:
    """``staleness`` as an int, or a ValueError naming what refuses it and what to do."""
    if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
        raise ValueError(f"staleness must be a non-negative integer (steps between a gradient's reduction and "
                         f"its application; 0: synchronous), got {staleness!r}")
    if staleness == 0:
        return 0
    if policy.dynamic_loss_scale:
        raise ValueError(f"staleness={staleness} cannot run with precision={policy.name!r}: fp16's dynamic loss "
                         "scale changes between a gradient's reduction and its application, so the queued gradient "
                         "would be unscaled by the wrong scale; use precision='bf16' or 'f32'")
    if not reduce_axes:
        sizes = dict(layout.mesh.shape)
        raise ValueError(f"staleness={staleness} overlaps the gradient reduction over the batch axes with the next "
                         f"steps' compute, but strategy {layout.strategy.name!r} on mesh {sizes} has no batch axis "
                         f"with more than one device ({layout.batch_axes}): nothing to overlap, the gradients would "
                         "only arrive late; use staleness=0")
    return staleness


def empty_queue(staleness: int, params: Any) -> tuple | None:
    """tau entries that apply nothing: zeros like the parameters (in the optimizer-state layout)."""
    if staleness == 0:
        return None
    entry = lambda: {"ready": jnp.zeros((), jnp.bool_), "loss": jnp.zeros((), jnp.float32),
                     "grads": jax.tree.map(jnp.zeros_like, params)}
    return tuple(entry() for _ in range(staleness))


def queue_sharding(staleness: int, layout: Any) -> tuple | None:
    """Queued gradients live where the update reads them: the optimizer-state layout (1/N each
    under ZeRO), scalars replicated."""
    if staleness == 0:
        return None
    replicated = NamedSharding(layout.mesh, P())
    return tuple({"ready": replicated, "loss": replicated, "grads": layout.state_shardings()}
                 for _ in range(staleness))


def _push(queue: tuple, loss: jax.Array, grads: Any) -> tuple[dict, tuple]:
    """-> (the oldest entry, the queue with this step's gradient appended), in the queue's dtypes."""
    grads = jax.tree.map(lambda g, q: g.astype(q.dtype), grads, queue[-1]["grads"])
    newest = {"ready": jnp.ones((), jnp.bool_), "loss": loss.astype(jnp.float32), "grads": grads}
    return queue[0], (*queue[1:], newest)


def _adopt(fresh_ok: jax.Array, produced: dict[str, Any], state: Any) -> dict[str, Any]:
    """What the gradient pass produced (int8 residuals, BatchNorm statistics) belongs to this
    step's gradient, so it is kept when that gradient is finite, whatever happens to the applied one."""
    if not jax.tree.leaves(produced):
        return produced
    old = {name: getattr(state, name) for name in produced}
    return jax.lax.cond(fresh_ok, lambda _: produced, lambda _: old, None)


def delayed_update(update: Any, state: Any, loss: jax.Array, aux: dict, grads: Any,
                   produced: dict[str, Any]) -> tuple[Any, dict[str, jax.Array]]:
    """The update half under staleness: apply the oldest queued gradient, queue this one.

    -> (new state, metrics): ``loss`` is this step's, ``grad_norm`` the applied gradient's,
    ``applied`` 1 when a gradient was applied, ``skipped`` 1 when a queued one was not finite.
    """
    oldest, queue = _push(state.pending, loss, grads)
    gate_loss = jnp.where(oldest["ready"], oldest["loss"], jnp.nan)  # nothing queued yet: apply nothing
    one = jnp.ones((), jnp.float32)
    new_state, grad_norm, finite = update(state, oldest["grads"], gate_loss, one, {})
    fresh_ok = jnp.isfinite(loss) & jnp.isfinite(optax.tree.norm(grads))
    new_state = dataclasses.replace(new_state, pending=queue, **_adopt(fresh_ok, produced, state))
    metrics = update.metrics(state, loss, aux, grad_norm, finite)
    metrics["skipped"] = (oldest["ready"] & ~finite).astype(jnp.int32)
    metrics["applied"] = finite.astype(jnp.int32)
    return new_state, metrics


def with_queue(init: Any, staleness: int, layout: Any, sharding: Any) -> Any:
    """``init(key)`` with the empty queue added, in ``sharding`` (which has the queue's)."""
    if staleness == 0:
        return init

    def init_fn(key):
        state = init(key)
        in_state_layout = jax.lax.with_sharding_constraint(state.params, layout.state_shardings())
        return dataclasses.replace(state, pending=empty_queue(staleness, in_state_layout))

    return jax.jit(init_fn, out_shardings=sharding)


_NAME_RE = re.compile(r"%([\w.\-]+)")
_REDUCTIONS = ("all-reduce", "reduce-scatter")


def reductions_feeding(hlo: str, outputs: slice, min_bytes: int = 1024) -> tuple[list[str], list[str]]:
    """The overlap, read from optimised HLO text: -> (the entry computation's all-reduces and
    reduce-scatters of at least ``min_bytes``, those the root tuple's ``outputs`` depend on).

    Under staleness no new parameter depends on this step's gradient reduction, so the reduction
    is off the update's critical path; in the synchronous step every one of them feeds the update.
    """
    from shardlib.tools.hlo import parse_hlo_module, shape_leaves

    module = parse_hlo_module(hlo)
    instructions = module.computations[module.entry]
    entry = {i.name: i for i in instructions}
    reductions = [i.name for i in instructions if i.opcode.removesuffix("-start") in _REDUCTIONS
                  and sum(leaf.nbytes for leaf in shape_leaves(i.shape)) >= min_bytes]
    root = instructions[-1]
    if root.opcode != "tuple":
        raise ValueError(f"the entry computation ends in {root.opcode!r}, not the tuple of the step's outputs")
    todo, seen = _NAME_RE.findall(root.operands)[outputs], set()
    while todo:
        name = todo.pop()
        if name not in seen and name in entry:
            seen.add(name)
            todo.extend(_NAME_RE.findall(entry[name].operands))
    return reductions, [r for r in reductions if r in seen]
