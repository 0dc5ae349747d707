"""The token exchange of an MoE layer over the ``expert`` mesh axis, called from model code.

Inside a shardlib step with ``expert`` = P > 1 devices, each device holds E/P of a layer's E
experts (its storage split, never gathered: `shardlib.step.compute.gathered_axes`) and its own
rows of the batch. A layer lays its rows' tokens out per expert, ``[E, slots, d]``; `dispatch`
sends each block of E/P experts to the device that holds them (one ``all_to_all``: block j of
every device lands on device j), so a device gets ``[E/P, P * slots, d]``, every device's tokens
for its own experts. `combine` is the inverse exchange of the experts' outputs. Both are the
identity outside a step or with ``expert`` = 1, so the same layer runs on one device unchanged,
and the autodiff transpose of an ``all_to_all`` is the reverse one, so the backward pass sends
the gradients back the same way. docs/moe.md has the formulas.
"""

from __future__ import annotations

import jax

from shardlib.model import hooks
from shardlib.sharding.mesh import EXPERT_AXIS


def expert_devices() -> int:
    """How many devices the step splits the experts over (1 outside a step, or with ``expert`` = 1)."""
    ctx = hooks.current()
    if ctx is None or EXPERT_AXIS not in ctx.row_axes:
        return 1
    return jax.lax.axis_size(EXPERT_AXIS)


def dispatch(x: jax.Array) -> jax.Array:
    """``[E, slots, d]`` per device -> ``[E/P, P * slots, d]``: each device's tokens for the experts it holds."""
    if expert_devices() == 1:
        return x
    hooks.current().experts_dispatched = True
    return jax.lax.all_to_all(x, EXPERT_AXIS, split_axis=0, concat_axis=1, tiled=True)


def combine(y: jax.Array) -> jax.Array:
    """The inverse of `dispatch`: ``[E/P, P * slots, d]`` -> ``[E, slots, d]``, each token's
    expert outputs back on the device of its row."""
    if expert_devices() == 1:
        return y
    return jax.lax.all_to_all(y, EXPERT_AXIS, split_axis=1, concat_axis=0, tiled=True)
