"""Flash attention tiled over queries x keys: the inner loops of `shardlib.model.attention`.

Scores live one ``[QUERY_BLOCK x KEY_BLOCK]`` tile per head at a time. Under a causal mask a tile
whose first key follows its last query is never computed, forward or backward: `tiles` lists the
visible tiles first and ``while_loop``s run exactly that many (about half of a whole
sequence's, T/2 x (T/B + 1) of T x T/B), and only the tiles the diagonal crosses are masked. Operands stay in the compute dtype; products accumulate
in float32 (``preferred_element_type``), as do the online-softmax statistics.

Layout, head-major so that each tile's products batch over (batch, kv head) without transposes:
queries ``[b, n, g, t, d]`` (g query heads share kv head n: GQA without repeating K/V), keys and
values ``[b, n, s, d]``, statistics ``[b, n, g, t]``. Positions ``pq`` [t] and ``pk`` [s] say
which keys each query sees (causal: ``pk <= pq``), in any order: the ring's chunks are not
contiguous.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from shardlib import compat

# Queries and keys a score tile holds: [QUERY_BLOCK x KEY_BLOCK] float32 per head, never [T x T].
QUERY_BLOCK = 256
KEY_BLOCK = 256

_NEG = float(jnp.finfo(jnp.float32).min)  # a hidden score
_START = -1e30  # the running max before any key: exp(_NEG - m) is then 0, no second mask needed


def block(n: int, most: int) -> int:
    """The largest divisor of ``n`` that is at most ``most``."""
    return max(b for b in range(1, min(n, most) + 1) if n % b == 0)


def heads(q: jax.Array, kv_heads: int) -> jax.Array:
    """[b, t, h, d] queries as [b, n, g, t, d] for ``kv_heads`` = n key/value heads."""
    b, t, h, d = q.shape
    if h % kv_heads:
        raise ValueError(f"attention: {h} query heads do not divide into {kv_heads} key/value heads")
    return q.reshape(b, t, kv_heads, h // kv_heads, d).transpose(0, 2, 3, 1, 4)


def kv_heads(k: jax.Array) -> jax.Array:
    """[b, s, n, d] keys or values as [b, n, s, d]."""
    return k.transpose(0, 2, 1, 3)


def unheads(x: jax.Array) -> jax.Array:
    """[b, n, g, t, d] back to [b, t, n * g, d]."""
    b, n, g, t, d = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(b, t, n * g, d)


def tiles(pq: jax.Array, pk: jax.Array, bq: int, bk: int, causal: bool):
    """The (query tile, key tile) pairs to compute as flat indices ``qi * nk + ki`` in row-major
    order: first those every query of which sees every key (no mask to apply), then those the
    causal diagonal crosses, then the hidden ones (a tile whose first key follows its last query);
    and how many of the first two kinds there are."""
    nq, nk = pq.shape[0] // bq, pk.shape[0] // bk
    if not causal:
        return jnp.arange(nq * nk, dtype=jnp.int32), jnp.int32(nq * nk), jnp.int32(0)
    q_tiles, k_tiles = pq.reshape(nq, bq), pk.reshape(nk, bk)
    whole = k_tiles.max(1)[None, :] <= q_tiles.min(1)[:, None]
    visible = k_tiles.min(1)[None, :] <= q_tiles.max(1)[:, None]
    kind = jnp.where(whole, 0, jnp.where(visible, 1, 2)).reshape(-1)
    order = jnp.argsort(kind, stable=True).astype(jnp.int32)
    return order, whole.sum(dtype=jnp.int32), (visible & ~whole).sum(dtype=jnp.int32)


def _varying(x, *like):
    """``x`` varying over the mesh axes that ``like`` vary over (a loop's carry under shard_map
    must match its update's)."""
    axes = tuple(sorted(frozenset().union(*map(compat.varying_axes, like)) - compat.varying_axes(x)))
    return jax.lax.pcast(x, axes, to="varying") if axes else x


def _over_tiles(step, carry, pq, pk, bq, bk, causal):
    """``carry = step(carry, query start, key start, masked)`` for each visible tile: two
    ``while_loop``s bounded by the counts of `tiles`, the unmasked tiles then the diagonal's. Not
    a ``scan`` with a ``cond``: the hidden tiles cost no trip, and under remat a scan's partial
    evaluation would save every tile's causal mask."""
    order, whole, crossed = tiles(pq, pk, bq, bk, causal)
    nk = pk.shape[0] // bk

    def loop(carry, first, count, masked):
        def body(state):
            i, carry = state
            qi, ki = jnp.divmod(order[i], nk)
            return i + 1, step(carry, qi * bq, ki * bk, masked)

        return jax.lax.while_loop(lambda state: state[0] < first + count, body, (first, carry))[1]

    carry = loop(carry, jnp.int32(0), whole, False)
    return loop(carry, whole, crossed, True) if causal else carry


def _at(x, start, size, axis):
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _put(x, value, start, axis, add=False):
    if add:
        value = value + jax.lax.dynamic_slice_in_dim(x, start, value.shape[axis], axis=axis)
    return jax.lax.dynamic_update_slice_in_dim(x, value, start, axis=axis)


def scores(qt, kt, pqt, pkt, masked):
    """One tile's float32 scores q k^T / sqrt(d); ``masked``: the hidden ones `_NEG`."""
    s = jnp.einsum("bngtd,bnsd->bngts", qt, kt, preferred_element_type=jnp.float32) * (1.0 / math.sqrt(qt.shape[-1]))
    return jnp.where(pkt[None, :] <= pqt[:, None], s, _NEG) if masked else s


def empty(q, v):
    """The online-softmax state (o, m, l) before any key: no output, max `_START`, sum 0."""
    b, n, g, t, _ = q.shape
    return (jnp.zeros((b, n, g, t, v.shape[-1]), jnp.float32), jnp.full((b, n, g, t), _START, jnp.float32),
            jnp.zeros((b, n, g, t), jnp.float32))


def finish(acc, dtype):
    """The output (head-major, in ``dtype``) and the log-sum-exp the backward pass needs."""
    o, m, l = acc
    return (o / l[..., None]).astype(dtype), m + jnp.log(l)


def fold(acc, q, k, v, pq, pk, causal):
    """Fold keys (k, v) at positions ``pk`` into the online-softmax state (o, m, l) of queries
    ``q`` at ``pq``, tile by visible tile."""
    bq, bk = block(q.shape[3], QUERY_BLOCK), block(k.shape[2], KEY_BLOCK)

    def step(acc, qs, ks, masked):
        o, m, l = acc
        s = scores(_at(q, qs, bq, 3), _at(k, ks, bk, 2), _at(pq, qs, bq, 0), _at(pk, ks, bk, 0), masked)
        m_old, l_old, o_old = _at(m, qs, bq, 3), _at(l, qs, bq, 3), _at(o, qs, bq, 3)
        m_new = jnp.maximum(m_old, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        keep = jnp.exp(m_old - m_new)
        pv = jnp.einsum("bngts,bnsd->bngtd", p.astype(v.dtype), _at(v, ks, bk, 2), preferred_element_type=jnp.float32)
        return (_put(o, keep[..., None] * o_old + pv, qs, 3), _put(m, m_new, qs, 3),
                _put(l, keep * l_old + p.sum(-1), qs, 3))

    return _over_tiles(step, tuple(_varying(a, q, k, v, pq, pk) for a in acc), pq, pk, bq, bk, causal)


def output_grads(out, d_out):
    """delta = rowsum(dO * O) in float32 (flash attention's backward term), head-major."""
    return (d_out.astype(jnp.float32) * out.astype(jnp.float32)).sum(-1)


def unfold(q, k, v, pq, pk, do, lse, delta, causal):
    """The float32 gradients (dq, dk, dv) through `fold` of keys (k, v), recomputing each visible
    tile's probabilities from the log-sum-exp ``lse``."""
    bq, bk = block(q.shape[3], QUERY_BLOCK), block(k.shape[2], KEY_BLOCK)
    scale = 1.0 / math.sqrt(q.shape[-1])

    def step(grads, qs, ks, masked):
        dq, dk, dv = grads
        qt, kt, vt, dot = _at(q, qs, bq, 3), _at(k, ks, bk, 2), _at(v, ks, bk, 2), _at(do, qs, bq, 3)
        s = scores(qt, kt, _at(pq, qs, bq, 0), _at(pk, ks, bk, 0), masked)
        p = jnp.exp(s - _at(lse, qs, bq, 3)[..., None])
        dv_t = jnp.einsum("bngts,bngtd->bnsd", p.astype(do.dtype), dot, preferred_element_type=jnp.float32)
        dp = jnp.einsum("bngtd,bnsd->bngts", dot, vt, preferred_element_type=jnp.float32)
        ds = (p * (dp - _at(delta, qs, bq, 3)[..., None])).astype(q.dtype)
        dq_t = jnp.einsum("bngts,bnsd->bngtd", ds, kt, preferred_element_type=jnp.float32) * scale
        dk_t = jnp.einsum("bngts,bngtd->bnsd", ds, qt, preferred_element_type=jnp.float32) * scale
        return _put(dq, dq_t, qs, 3, add=True), _put(dk, dk_t, ks, 2, add=True), _put(dv, dv_t, ks, 2, add=True)

    zeros = tuple(_varying(jnp.zeros(x.shape, jnp.float32), q, k, v, pq, pk, do, lse) for x in (q, k, v))
    return _over_tiles(step, zeros, pq, pk, bq, bk, causal)
