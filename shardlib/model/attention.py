"""Attention that model code calls so that one model runs with its sequence split over devices.

``attention(q, k, v, causal=True)`` is softmax(q k^T / sqrt(d)) v. Outside a step, or on a mesh
without a `context` axis, it is plain attention over the local sequence (or the model's own
implementation, ``local=``). Under context parallelism (``context = C > 1``) each device holds
``T / C`` tokens of every sequence (`shardlib.sharding.sequence`) and reaches the others' keys
and values in one of two ways:

* ``ring``: the K/V blocks travel round the context devices with ``ppermute``, C - 1 hops; each
  device folds every block into its queries' output with an online softmax and skips the blocks
  a causal mask hides entirely. The backward pass is a second ring (a ``custom_vjp``): K/V travel
  again with their gradients, which arrive home after the C-th hop. Within a hop queries and keys
  are tiled (`shardlib.model.flash`, forward and backward, hidden tiles never computed), so a
  device holds at most two K/V chunks and one ``[QUERY_BLOCK x KEY_BLOCK]`` tile of scores per
  head, memory linear in T.
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

from shardlib.model import flash as flash_lib
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
              local: Callable[..., jax.Array] | None = None, segment_ids: jax.Array | None = None,
              window: jax.Array | int | None = None) -> jax.Array:
    """softmax(q k^T / sqrt(d)) v for q [batch, seq, heads, head_dim] and k, v [batch, seq,
    kv_heads, head_dim] (``kv_heads`` divides ``heads``: GQA), over the whole sequence even when
    each device holds a part of it. ``local(q, k, v, segment_ids=, window=)``: the causal attention
    to run when the sequence is not split (a fused kernel of the model's); default a float32-softmax
    einsum. ``segment_ids`` (int32[batch, seq], packed rows): a query sees a key only when their ids
    are equal; ``window`` (> 0): only the keys after ``position - window`` are seen."""
    ctx = hooks.current()
    size = 1 if ctx is None else ctx.context_size
    if ctx is not None:
        ctx.attention_calls.append(q.shape)
    if size == 1:
        if local is not None and causal:
            return local(q, k, v, segment_ids=segment_ids, window=window)
        pos = jnp.arange(q.shape[1])
        return dense(q, k, v, pos, pos, causal, segment_ids=segment_ids, window=window)
    if segment_ids is not None or window is not None:
        raise ValueError(f"{'segment ids (packed rows)' if segment_ids is not None else 'attention windows'} do not "
                         f"run with the sequence split over a context axis (size {size}): use a mesh without one")
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


def dense(q, k, v, pq, pk, causal: bool, *, segment_ids: jax.Array | None = None,
          window: jax.Array | int | None = None) -> jax.Array:
    """Attention of queries at positions ``pq`` to keys at ``pk`` in one block (the reference);
    ``segment_ids`` (int32[batch, seq], the keys' and queries' alike) and ``window`` hide keys too."""
    q5 = _grouped(q, k.shape[2])
    s = jnp.einsum("btngk,bsnk->btngs", q5, k, preferred_element_type=jnp.float32) / math.sqrt(q5.shape[-1])
    seen = jnp.ones((1, pq.shape[0], pk.shape[0]), bool)
    if causal:
        seen = seen & (pk[None, :] <= pq[:, None])[None]
    if window is not None:
        seen = seen & ((window <= 0) | (pk[None, :] > pq[:, None] - window))[None]
    if segment_ids is not None:
        seen = seen & (segment_ids[:, :, None] == segment_ids[:, None, :])
    if causal or window is not None or segment_ids is not None:
        s = jnp.where(seen[:, :, None, None, :], s, _NEG)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return jnp.einsum("btngs,bsnk->btngk", p, v).reshape(q.shape).astype(q.dtype)


def gathered(q, k, v, *, causal: bool, size: int, balanced: bool) -> jax.Array:
    """Every device gathers all K/V (and their positions) over `context` and attends to them,
    `flash`-style: one [QUERY_BLOCK x KEY_BLOCK] tile of scores at a time, never [T/C x T]."""
    device = jax.lax.axis_index(CONTEXT_AXIS)
    pq = sequence.positions(device, q.shape[1], size, balanced, xp=jnp)
    k_all = jax.lax.all_gather(k, CONTEXT_AXIS, axis=1, tiled=True)
    v_all = jax.lax.all_gather(v, CONTEXT_AXIS, axis=1, tiled=True)
    pk = jnp.concatenate([sequence.positions(d, k.shape[1], size, balanced, xp=jnp) for d in range(size)])
    return flash(q, k_all, v_all, pq, pk, causal)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def flash(q, k, v, pq, pk, causal: bool) -> jax.Array:
    """`dense`, with memory linear in the keys and the hidden tiles skipped: an online softmax over
    [query x key] tiles forward (`shardlib.model.flash`), and a backward pass that recomputes each
    visible tile's probabilities from the saved log-sum-exp."""
    return _flash_forward(q, k, v, pq, pk, causal)[0]


def _flash_forward(q, k, v, pq, pk, causal):
    qh, kh, vh = flash_lib.heads(q, k.shape[2]), flash_lib.kv_heads(k), flash_lib.kv_heads(v)
    out, lse = flash_lib.finish(flash_lib.fold(flash_lib.empty(qh, vh), qh, kh, vh, pq, pk, causal), q.dtype)
    return flash_lib.unheads(out), (qh, kh, vh, pq, pk, out, lse)


def _flash_backward(causal, residuals, d_out):
    qh, kh, vh, pq, pk, out, lse = residuals
    do = flash_lib.heads(d_out, kh.shape[1])
    dq, dk, dv = flash_lib.unfold(qh, kh, vh, pq, pk, do, lse, flash_lib.output_grads(out, do), causal)
    return _from_heads(dq, dk, dv, qh.dtype, kh.dtype, vh.dtype) + (None, None)


def _from_heads(dq, dk, dv, *dtypes):
    """Head-major float32 gradients as the [batch, seq, heads, head_dim] arguments' dtypes."""
    return tuple(x.astype(dtype) for x, dtype in zip((flash_lib.unheads(dq), flash_lib.kv_heads(dk),
                                                      flash_lib.kv_heads(dv)), dtypes))


flash.defvjp(_flash_forward, _flash_backward)


# A whole sequence at least this long runs `causal_flash` under ``attention="auto"`` where the
# backend's own attention is the einsum: measured on CPU (scripts/benchmark_flash.py --cpu-time,
# BENCHMARKS.md), forward + backward takes 1.15x the einsum's at 256 tokens (one tile: the loop's
# cost and nothing skipped) and 0.67x at 512.
FLASH_MIN_SEQ = 512


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


# Head-major axes (`shardlib.model.flash`) of a sequence: queries and statistics 3, keys 2.
_T, _S = 3, 2


def _forward_part(which, acc, q, k, v, pq, pk, causal):
    """Fold the part ``which`` of the block (k, v) into the online-softmax state (o, m, l)."""
    if which == SKIP:
        return acc
    rows, cols = PART_SLICES[which]
    new = flash_lib.fold(tuple(_cut(a, rows, _T) for a in acc), _cut(q, rows, _T), _cut(k, cols, _S),
                         _cut(v, cols, _S), _cut(pq, rows, 0), _cut(pk, cols, 0), causal)
    return tuple(_paste(a, a_new, rows, _T) for a, a_new in zip(acc, new))


def _backward_part(which, grads, q, k, v, pq, pk, do, lse, delta, causal):
    """Add the part ``which`` of the block's gradients to (dq, dk, dv)."""
    if which == SKIP:
        return grads
    rows, cols = PART_SLICES[which]
    dq, dk, dv = grads
    dq_part, dk_part, dv_part = flash_lib.unfold(
        _cut(q, rows, _T), _cut(k, cols, _S), _cut(v, cols, _S), _cut(pq, rows, 0), _cut(pk, cols, 0),
        _cut(do, rows, _T), _cut(lse, rows, _T), _cut(delta, rows, _T), causal)
    return _paste(dq, dq_part, rows, _T, add=True), _paste(dk, dk_part, cols, _S, add=True), \
        _paste(dv, dv_part, cols, _S, add=True)


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
    q5, k, v = flash_lib.heads(q, k.shape[2]), flash_lib.kv_heads(k), flash_lib.kv_heads(v)
    pq = sequence.positions(device, local, size, balanced, xp=jnp)
    acc = _forward_part(FULL, flash_lib.empty(q5, v), q5, k, v, pq, pq, causal)  # its own block first: every row sees itself
    held_k, held_v = k, v
    for hop in range(1, size):
        held_k, held_v = _hop(held_k, size), _hop(held_v, size)
        source = (device - hop) % size
        pk = sequence.positions(source, local, size, balanced, xp=jnp)

        def run(which, acc_o, acc_m, acc_l, kk, vv, pkk):
            return _forward_part(which, (acc_o, acc_m, acc_l), q5, kk, vv, pq, pkk, causal)

        acc = _switch(device, source, causal, balanced, run, (*acc, held_k, held_v, pk))
    out, lse = flash_lib.finish(acc, q.dtype)
    return flash_lib.unheads(out), (q5, k, v, out, lse)


def _ring_backward(causal, size, balanced, residuals, d_out):
    q5, k, v, out, lse = residuals
    device = jax.lax.axis_index(CONTEXT_AXIS)
    local = q5.shape[_T]
    do5 = flash_lib.heads(d_out, k.shape[1])
    delta = flash_lib.output_grads(out, do5)
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
    return _from_heads(dq, dk, dv, q5.dtype, k.dtype, v.dtype)


_ring.defvjp(_ring_forward, _ring_backward)


def ring(q, k, v, *, causal: bool, size: int, balanced: bool) -> jax.Array:
    """Ring attention over the `context` axis (inside the step's shard_map)."""
    _grouped(q, k.shape[2])
    return _ring(q, k, v, causal, size, balanced)
