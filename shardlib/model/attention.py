"""Attention that model code calls so that one model runs with its sequence split over devices.

``attention(q, k, v, causal=True)`` is softmax(q k^T / sqrt(d)) v. Outside a step, or on a mesh
without a `context` axis, it is plain attention over the local sequence (or the model's own
implementation, ``local=``). Under context parallelism (``context = C > 1``) each device holds
``T / C`` tokens of every sequence (`shardlib.sharding.sequence`) and reaches the others' keys
and values in one of two ways:

* ``ring``: the K/V blocks travel round the context devices with ``ppermute``, C - 1 hops; each
  device folds every block into its queries' output with an online softmax and skips the blocks
  a causal mask hides entirely. The backward pass is a second ring (a ``custom_vjp``): K/V travel
  again with their gradients, which arrive home after the C-th hop. Within a hop the keys are
  taken `KEY_BLOCK` at a time (flash attention's inner loop, forward and backward), so a device
  holds at most two K/V chunks and ``[T/C, KEY_BLOCK]`` scores per head, memory linear in T.
* ``allgather``: every device gathers the whole K/V once per layer and attends its queries to
  them (`flash`, key block by key block); its backward pass reduce-scatters the K/V gradients.
  Simpler and fewer, larger transfers, but the full K/V live on every device.
* ``auto`` picks by the local chunk length (`choose`) and says why, once per choice.

``positions(local_len)`` gives the true positions of this device's tokens (RoPE, learned
position embeddings). The step refuses a model under a context mesh that never calls
``attention``: its own attention would see its own chunk only.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp

from shardlib import compat
from shardlib.model import hooks
from shardlib.sharding import sequence
from shardlib.sharding.mesh import CONTEXT_AXIS

MODES = ("auto", "ring", "allgather")

# ``auto``: the ring below this many local tokens per device is latency bound (C sequential hops,
# each too small a block to hide its transfer), so the one all-gather wins.
RING_MIN_LOCAL = 512

_NEG = float(jnp.finfo(jnp.float32).min)


def positions(local_len: int) -> jax.Array:
    """int32[local_len]: the positions in the whole sequence of this device's tokens (``arange``
    outside context parallelism)."""
    ctx = hooks.current()
    if ctx is None or ctx.context_size == 1:
        return jnp.arange(local_len, dtype=jnp.int32)
    device = jax.lax.axis_index(CONTEXT_AXIS)
    return sequence.positions(device, local_len, ctx.context_size, ctx.context_balance, xp=jnp).astype(jnp.int32)


def choose(seq_len: int, size: int) -> tuple[str, str]:
    """``auto``'s pick for a sequence of ``seq_len`` over ``size`` context devices, and why."""
    local = seq_len // size
    if local >= RING_MIN_LOCAL:
        return "ring", (f"ring: {local} tokens per device >= {RING_MIN_LOCAL}, so each of the {size - 1} hops' "
                        f"[{local} x {local}] block of work hides its K/V transfer, and no device holds the full K/V")
    return "allgather", (f"allgather: {local} tokens per device < {RING_MIN_LOCAL}, so {size - 1} ring hops would "
                         "each be latency bound; one all-gather of K/V per layer is cheaper")


_SAID: set[tuple[int, int, str]] = set()


def _resolve(mode: str, seq_len: int, size: int) -> str:
    if mode not in MODES:
        raise ValueError(f"context attention {mode!r} is not one of {', '.join(MODES)}")
    if mode != "auto":
        return mode
    chosen, why = choose(seq_len, size)
    if (seq_len, size, chosen) not in _SAID:  # once per choice, not once per layer or trace
        _SAID.add((seq_len, size, chosen))
        print(f"shardlib: context attention auto (T={seq_len}, context={size}) -> {why}", file=sys.stderr)
    return chosen


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
              local: Callable[[jax.Array, jax.Array, jax.Array], jax.Array] | None = None) -> jax.Array:
    """softmax(q k^T / sqrt(d)) v for q [batch, seq, heads, head_dim] and k, v [batch, seq,
    kv_heads, head_dim] (``kv_heads`` divides ``heads``: GQA), over the whole sequence even when
    each device holds a part of it. ``local(q, k, v)``: the causal attention to run when the
    sequence is not split (a fused kernel of the model's); default a float32-softmax einsum."""
    ctx = hooks.current()
    size = 1 if ctx is None else ctx.context_size
    if ctx is not None:
        ctx.attention_calls.append(q.shape)
    if size == 1:
        if local is not None and causal:
            return local(q, k, v)
        pos = jnp.arange(q.shape[1])
        return dense(q, k, v, pos, pos, causal)
    mode = _resolve(ctx.context_attention, q.shape[1] * size, size)
    if mode == "ring":
        return ring(q, k, v, causal=causal, size=size, balanced=ctx.context_balance)
    return gathered(q, k, v, causal=causal, size=size, balanced=ctx.context_balance)


# ---- blocks: scores [b, t, n, g, s] (query groups g share kv head n), float32 statistics


def _grouped(q: jax.Array, kv_heads: int) -> jax.Array:
    b, t, h, d = q.shape
    if h % kv_heads:
        raise ValueError(f"attention: {h} query heads do not divide into {kv_heads} key/value heads")
    return q.reshape(b, t, kv_heads, h // kv_heads, d)


def _scores(q5, k, pq, pk, causal):
    s = jnp.einsum("btngk,bsnk->btngs", q5, k, preferred_element_type=jnp.float32) / math.sqrt(q5.shape[-1])
    mask = (pk[None, :] <= pq[:, None])[None, :, None, None, :] if causal else None
    return s, mask


def dense(q, k, v, pq, pk, causal: bool) -> jax.Array:
    """Attention of queries at positions ``pq`` to keys at ``pk`` in one block (the reference)."""
    q5 = _grouped(q, k.shape[2])
    s, mask = _scores(q5, k, pq, pk, causal)
    if mask is not None:
        s = jnp.where(mask, s, _NEG)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return jnp.einsum("btngs,bsnk->btngk", p, v).reshape(q.shape).astype(q.dtype)


def gathered(q, k, v, *, causal: bool, size: int, balanced: bool) -> jax.Array:
    """Every device gathers all K/V (and their positions) over `context` and attends to them,
    `flash`-style: [T/C x KEY_BLOCK] scores at a time, never [T/C x T]."""
    device = jax.lax.axis_index(CONTEXT_AXIS)
    pq = sequence.positions(device, q.shape[1], size, balanced, xp=jnp)
    k_all = jax.lax.all_gather(k, CONTEXT_AXIS, axis=1, tiled=True)
    v_all = jax.lax.all_gather(v, CONTEXT_AXIS, axis=1, tiled=True)
    pk = jnp.concatenate([sequence.positions(d, k.shape[1], size, balanced, xp=jnp) for d in range(size)])
    return flash(q, k_all, v_all, pq, pk, causal)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def flash(q, k, v, pq, pk, causal: bool) -> jax.Array:
    """`dense`, with memory linear in the keys: an online softmax over `key_block`s forward, and a
    backward pass that recomputes each block's probabilities from the saved log-sum-exp."""
    return _flash_forward(q, k, v, pq, pk, causal)[0]


def _flash_forward(q, k, v, pq, pk, causal):
    q5 = _grouped(q, k.shape[2])
    out, lse = _finish(q, fold(_empty(q5, v), q5, k, v, pq, pk, causal))
    return out, (q, k, v, pq, pk, out, lse)


def _flash_backward(causal, residuals, d_out):
    q, k, v, pq, pk, out, lse = residuals
    q5, do5, delta = _output_grads(q, k, out, d_out)
    dq, dk, dv = unfold(q5, k, v, pq, pk, do5, lse, delta, causal)
    return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


flash.defvjp(_flash_forward, _flash_backward)


# A whole sequence at least this long runs `causal_flash` under ``attention="auto"`` where the
# backend's own attention is the einsum: below it the [T x T] scores are small and one einsum is
# faster on CPU; above it they dominate the step's memory (scripts/benchmark_context.py --local).
FLASH_MIN_SEQ = 2048


def causal_flash(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal `flash` attention over one whole sequence: memory linear in its length."""
    pos = jnp.arange(q.shape[1])
    return flash(q, k, v, pos, pos, True)


# ---- the ring's schedule: which part of a [local x local] block each hop computes

FULL, KV_FIRST, Q_SECOND, SKIP = range(4)
# (rows of the queries, columns of the keys) each part computes, in halves of the local chunk
PART_SLICES = {FULL: ((0, 2), (0, 2)), KV_FIRST: ((0, 2), (0, 1)), Q_SECOND: ((1, 2), (0, 2))}
PART_COST = {FULL: 1.0, KV_FIRST: 0.5, Q_SECOND: 0.5, SKIP: 0.0}  # fraction of the block's FLOPs
# (causal, balanced) -> the part for a block from an earlier device, from a later one. Balanced,
# an earlier device's first chunk precedes both of ours and its second follows both (KV_FIRST);
# a later device's chunks both precede our second and follow our first (Q_SECOND). Contiguous,
# an earlier device's block is all visible, a later one's all hidden.
PARTS = {(True, True): (KV_FIRST, Q_SECOND), (True, False): (FULL, SKIP),
         (False, True): (FULL, FULL), (False, False): (FULL, FULL)}


def part(device, source, causal: bool, balanced: bool):
    """The part of the block from ``source`` that ``device`` computes (0 hops: its own, FULL)."""
    earlier, later = PARTS[(causal, balanced)]
    return jnp.where(source == device, FULL, jnp.where(source < device, earlier, later))


def schedule(size: int, causal: bool = True, balanced: bool = True) -> list[list[int]]:
    """Per device, the part it computes at each hop (what `ring` runs, for the balance figures)."""
    return [[int(part(d, (d - s) % size, causal, balanced)) for s in range(size)] for d in range(size)]


def block_flops(size: int, causal: bool = True, balanced: bool = True) -> list[float]:
    """Per device, the [local x local] blocks of attention it computes, in units of one block."""
    return [sum(PART_COST[p] for p in row) for row in schedule(size, causal, balanced)]


def _cut(x, halves, axis):
    lo, hi = halves
    n = x.shape[axis] // 2
    return jax.lax.slice_in_dim(x, lo * n, hi * n, axis=axis)


def _paste(acc, value, halves, axis, add=False):
    n = acc.shape[axis] // 2
    index = [slice(None)] * acc.ndim
    index[axis] = slice(halves[0] * n, halves[1] * n)
    return acc.at[tuple(index)].add(value) if add else acc.at[tuple(index)].set(value)


# Keys a score block holds at once: a device's scores are [local queries x KEY_BLOCK] per head,
# never [local x local] (flash attention's inner loop, forward and backward).
KEY_BLOCK = 512


def key_block(n: int) -> int:
    """The largest divisor of ``n`` keys that is at most `KEY_BLOCK`."""
    return max(b for b in range(1, min(n, KEY_BLOCK) + 1) if n % b == 0)


def _varying(x, *like):
    """``x`` varying over the mesh axes that ``like`` vary over (a scan's carry under shard_map
    must match its update's)."""
    axes = tuple(sorted(frozenset().union(*map(compat.varying_axes, like)) - compat.varying_axes(x)))
    return jax.lax.pcast(x, axes, to="varying") if axes else x


def _over_key_blocks(step, carry, k, v, pk, pq, causal):
    """``carry = step(carry, start, (k, v, pk) of the block at start)`` for each `key_block` of the
    keys, skipping those a causal mask hides from every query (half of a whole sequence's). A
    ``while_loop``, not a ``scan``: under remat, a scan's partial evaluation would save what its
    body computes from positions alone (the causal masks) for every block, [T/C x T/C] again."""
    size = key_block(k.shape[1])
    last = pq.max()

    def body(state):
        i, carry = state
        start = i * size
        block = tuple(jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis) for x, axis in ((k, 1), (v, 1), (pk, 0)))
        if causal:
            return i + 1, jax.lax.cond(block[2].min() > last, lambda: carry, lambda: step(carry, start, block))
        return i + 1, step(carry, start, block)

    return jax.lax.while_loop(lambda state: state[0] < k.shape[1] // size, body, (jnp.int32(0), carry))[1]


def _empty(q5, v):
    """The online-softmax state (o, m, l) before any key: no output, max -inf, sum 0."""
    b, t, n, g, _ = q5.shape
    return (jnp.zeros((b, t, n, g, v.shape[-1]), jnp.float32), jnp.full((b, t, n, g), _NEG, jnp.float32),
            jnp.zeros((b, t, n, g), jnp.float32))


def _finish(q, acc):
    """The output (in q's shape and dtype) and the log-sum-exp the backward pass needs."""
    o, m, l = acc
    return (o / l[..., None]).reshape(q.shape).astype(q.dtype), m + jnp.log(l)


def _output_grads(q, k, out, d_out):
    """Grouped queries, grouped output gradients, and delta = rowsum(dO * O) (flash attention's
    backward term)."""
    do5 = _grouped(d_out, k.shape[2]).astype(jnp.float32)
    return _grouped(q, k.shape[2]), do5, (do5 * _grouped(out, k.shape[2]).astype(jnp.float32)).sum(-1)


def fold(acc, q5, k, v, pq, pk, causal):
    """Fold keys (k, v) at positions ``pk`` into the online-softmax state (o, m, l) of queries
    ``q5``, one `key_block` at a time."""

    def step(acc, _, block):
        o, m, l = acc
        kb, vb, pkb = block
        s, mask = _scores(q5, kb, pq, pkb, causal)
        if mask is not None:
            s = jnp.where(mask, s, _NEG)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        if mask is not None:
            p = jnp.where(mask, p, 0.0)
        keep = jnp.exp(m - m_new)
        o_new = keep[..., None] * o + jnp.einsum("btngs,bsnk->btngk", p.astype(v.dtype), vb,
                                                 preferred_element_type=jnp.float32)
        return o_new, m_new, keep * l + p.sum(-1)

    return _over_key_blocks(step, tuple(_varying(a, q5, k, v, pq, pk) for a in acc), k, v, pk, pq, causal)


def unfold(q5, k, v, pq, pk, do5, lse, delta, causal):
    """The gradients (dq, dk, dv) through `fold` of keys (k, v), recomputing each key block's
    probabilities from the log-sum-exp ``lse``."""
    scale = 1.0 / math.sqrt(q5.shape[-1])

    def step(grads, start, block):
        dq, dk, dv = grads
        kb, vb, pkb = block
        s, mask = _scores(q5, kb, pq, pkb, causal)
        p = jnp.exp(s - lse[..., None])
        if mask is not None:
            p = jnp.where(mask, p, 0.0)
        dv_block = jnp.einsum("btngs,btngk->bsnk", p, do5)
        dp = jnp.einsum("btngk,bsnk->btngs", do5, vb.astype(jnp.float32))
        ds = p * (dp - delta[..., None]) * scale
        dk_block = jnp.einsum("btngs,btngk->bsnk", ds, q5.astype(jnp.float32))
        return (dq + jnp.einsum("btngs,bsnk->btngk", ds, kb.astype(jnp.float32)),
                jax.lax.dynamic_update_slice_in_dim(dk, dk_block, start, axis=1),
                jax.lax.dynamic_update_slice_in_dim(dv, dv_block, start, axis=1))

    zeros = tuple(_varying(jnp.zeros(x.shape, jnp.float32), q5, k, v, pq, pk, do5, lse) for x in (q5, k, v))
    return _over_key_blocks(step, zeros, k, v, pk, pq, causal)


def _forward_part(which, acc, q5, k, v, pq, pk, causal):
    """Fold the part ``which`` of the block (k, v) into the online-softmax state (o, m, l)."""
    if which == SKIP:
        return acc
    rows, cols = PART_SLICES[which]
    o, m, l = acc
    o_new, m_new, l_new = fold((_cut(o, rows, 1), _cut(m, rows, 1), _cut(l, rows, 1)), _cut(q5, rows, 1),
                               _cut(k, cols, 1), _cut(v, cols, 1), _cut(pq, rows, 0), _cut(pk, cols, 0), causal)
    return _paste(o, o_new, rows, 1), _paste(m, m_new, rows, 1), _paste(l, l_new, rows, 1)


def _backward_part(which, grads, q5, k, v, pq, pk, do5, lse, delta, causal):
    """Add the part ``which`` of the block's gradients to (dq, dk, dv)."""
    if which == SKIP:
        return grads
    rows, cols = PART_SLICES[which]
    dq, dk, dv = grads
    dq_part, dk_part, dv_part = unfold(_cut(q5, rows, 1), _cut(k, cols, 1), _cut(v, cols, 1), _cut(pq, rows, 0),
                                       _cut(pk, cols, 0), _cut(do5, rows, 1), _cut(lse, rows, 1),
                                       _cut(delta, rows, 1), causal)
    return _paste(dq, dq_part, rows, 1, add=True), _paste(dk, dk_part, cols, 1, add=True), \
        _paste(dv, dv_part, cols, 1, add=True)


def _hop(x, size):
    """Each device's block to the next device of the ring."""
    return jax.lax.ppermute(x, CONTEXT_AXIS, [(d, (d + 1) % size) for d in range(size)])


def _switch(device, source, causal, balanced, run, operand):
    index = part(device, source, causal, balanced)
    return jax.lax.switch(index, [functools.partial(run, which) for which in (FULL, KV_FIRST, Q_SECOND, SKIP)],
                          *operand)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _ring(q, k, v, causal, size, balanced):
    return _ring_forward(q, k, v, causal, size, balanced)[0]


def _ring_forward(q, k, v, causal, size, balanced):
    device = jax.lax.axis_index(CONTEXT_AXIS)
    local = q.shape[1]
    q5 = _grouped(q, k.shape[2])
    pq = sequence.positions(device, local, size, balanced, xp=jnp)
    acc = _forward_part(FULL, _empty(q5, v), q5, k, v, pq, pq, causal)  # its own block first: every row sees itself
    held_k, held_v = k, v
    for hop in range(1, size):
        held_k, held_v = _hop(held_k, size), _hop(held_v, size)
        source = (device - hop) % size
        pk = sequence.positions(source, local, size, balanced, xp=jnp)

        def run(which, acc_o, acc_m, acc_l, kk, vv, pkk):
            return _forward_part(which, (acc_o, acc_m, acc_l), q5, kk, vv, pq, pkk, causal)

        acc = _switch(device, source, causal, balanced, run, (*acc, held_k, held_v, pk))
    out, lse = _finish(q, acc)
    return out, (q, k, v, out, lse)


def _ring_backward(causal, size, balanced, residuals, d_out):
    q, k, v, out, lse = residuals
    device = jax.lax.axis_index(CONTEXT_AXIS)
    local = q.shape[1]
    q5, do5, delta = _output_grads(q, k, out, d_out)
    pq = sequence.positions(device, local, size, balanced, xp=jnp)
    grads = _backward_part(FULL, (jnp.zeros(q5.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32),
                                  jnp.zeros(v.shape, jnp.float32)), q5, k, v, pq, pq, do5, lse, delta, causal)
    dq, dk, dv = grads
    held_k, held_v = k, v
    for hop in range(1, size):  # K/V and their gradients travel on together
        held_k, held_v, dk, dv = (_hop(x, size) for x in (held_k, held_v, dk, dv))
        source = (device - hop) % size
        pk = sequence.positions(source, local, size, balanced, xp=jnp)

        def run(which, g_q, g_k, g_v, kk, vv, pkk):
            return _backward_part(which, (g_q, g_k, g_v), q5, kk, vv, pq, pkk, do5, lse, delta, causal)

        dq, dk, dv = _switch(device, source, causal, balanced, run, (dq, dk, dv, held_k, held_v, pk))
    dk, dv = _hop(dk, size), _hop(dv, size)  # the C-th hop brings each block's gradients home
    return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_ring.defvjp(_ring_forward, _ring_backward)


def ring(q, k, v, *, causal: bool, size: int, balanced: bool) -> jax.Array:
    """Ring attention over the `context` axis (inside the step's shard_map)."""
    _grouped(q, k.shape[2])
    return _ring(q, k, v, causal, size, balanced)
