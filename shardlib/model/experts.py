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

`dispatch_sorted` / `combine_sorted` are the dropless exchange: variable-sized groups of tokens
sorted by expert, re-sorted by local expert on arrival. Where the backend has it (TPU, GPU:
`shardlib.backend.BackendPolicy.ragged_all_to_all`) one ``jax.lax.ragged_all_to_all`` sends
each group as it is; on XLA:CPU, which has none, each device's group for device j is padded to
all of its tokens (one all_to_all of ``[P, N, d]``). Either way the group sizes handed to the
grouped matmul count the tokens only, so padding rows are in no group and cost no FLOPs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

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


def _exchange(x: jax.Array) -> jax.Array:
    """``[P, ...]``: block j to device j, the blocks received stacked by source."""
    if expert_devices() == 1:
        return x
    hooks.current().experts_dispatched = True
    return jax.lax.all_to_all(x, EXPERT_AXIS, split_axis=0, concat_axis=0, tiled=True)


def dispatch_sorted(x: jax.Array, sizes: jax.Array) -> tuple[jax.Array, jax.Array, tuple]:
    """``x [N, d]`` sorted by expert, ``sizes [E]`` tokens per expert -> (the tokens for this
    device's E/P experts from every device, ``[P N, d]`` sorted by local expert, then zero rows;
    their group sizes ``[E/P]``, which count the tokens only: rows past their sum are in no group,
    so the grouped matmul (``jax.lax.ragged_dot``) computes no padding; what `combine_sorted` needs)."""
    p = expert_devices()
    per_device = sizes.reshape(p, -1)  # [P, E/P]
    if p > 1 and hooks.backend_policy() is not None and hooks.backend_policy().ragged_all_to_all:
        return _dispatch_ragged(x, per_device)
    n = x.shape[0]
    totals = per_device.sum(axis=1)
    i = jnp.arange(n)
    valid = i[None, :] < totals[:, None]  # [P, N]: row i of the group for device j is a token
    index = jnp.where(valid, (jnp.cumsum(totals) - totals)[:, None] + i[None, :], 0)
    received = _exchange(jnp.where(valid[..., None], x[index], 0))  # [P sources, N, d]
    received_sizes = _exchange(per_device)  # [P sources, E/P]
    # each received row's local expert, by counting group ends (E/P for padding rows)
    local = (i[None, None, :] >= jnp.cumsum(received_sizes, axis=1)[:, :, None]).sum(axis=1)
    order = jnp.argsort(local.reshape(-1), stable=True)  # by local expert; padding (E/P) last
    return received.reshape(p * n, -1)[order], received_sizes.sum(axis=0), ("padded", valid, index, order)


def _dispatch_ragged(x: jax.Array, per_device: jax.Array) -> tuple[jax.Array, jax.Array, tuple]:
    """`dispatch_sorted` with ``jax.lax.ragged_all_to_all``: each device's group for device j is
    sent as it is, no padding on the wire, packed by source on arrival."""
    hooks.current().experts_dispatched = True
    p, n = per_device.shape[0], x.shape[0]
    everyone = jax.lax.all_gather(per_device, EXPERT_AXIS)  # [P sources, P destinations, E/P]: tiny
    me = jax.lax.axis_index(EXPERT_AXIS)
    sent = everyone.sum(axis=2)  # [P sources, P destinations] rows
    send, recv = sent[me], sent[:, me]
    send_at, recv_at = jnp.cumsum(send) - send, jnp.cumsum(recv) - recv
    lands_at = (jnp.cumsum(sent, axis=0) - sent)[me]  # where my rows start on each destination
    received = jax.lax.ragged_all_to_all(x, jnp.zeros((p * n, x.shape[1]), x.dtype), send_at, send, lands_at, recv,
                                         axis_name=EXPERT_AXIS)
    received_sizes = everyone[:, me]  # [P sources, E/P]
    i = jnp.arange(p * n)
    source = (i[:, None] >= jnp.cumsum(recv)[None, :]).sum(axis=1)  # P: a row past every source's
    within = i - recv_at[jnp.minimum(source, p - 1)]
    ends = jnp.cumsum(received_sizes, axis=1)[jnp.minimum(source, p - 1)]  # [P N, E/P]
    local = jnp.where(source < p, (within[:, None] >= ends).sum(axis=1), per_device.shape[1])
    order = jnp.argsort(local, stable=True)  # by local expert; the unused rows last
    back_at = (jnp.cumsum(sent, axis=1) - sent)[:, me]  # where each source's rows for me started there
    return received[order], received_sizes.sum(axis=0), ("ragged", order, recv_at, recv, back_at, send, n)


def combine_sorted(y: jax.Array, plan: tuple) -> jax.Array:
    """The inverse of `dispatch_sorted`: outputs ``[P N, d]`` -> ``[N, d]`` in the sorted order
    of this device's tokens."""
    if plan[0] == "ragged":
        _, order, recv_at, recv, back_at, send, n = plan
        by_source = jnp.zeros_like(y).at[order].set(y)
        return jax.lax.ragged_all_to_all(by_source, jnp.zeros((n, y.shape[-1]), y.dtype), recv_at, recv, back_at, send,
                                         axis_name=EXPERT_AXIS)
    _, valid, index, order = plan
    p, n = valid.shape
    back = _exchange(jnp.zeros_like(y).at[order].set(y).reshape(p, n, -1))
    return jnp.zeros((n, y.shape[-1]), y.dtype).at[index].add(jnp.where(valid[..., None], back, 0))
