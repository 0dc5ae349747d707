"""Flash attention tiled over queries x keys: the inner loops of `shardlib.model.attention`.

Scores live one ``[QUERY_BLOCK x KEY_BLOCK]`` tile per head at a time. Under a causal mask a tile
whose first key follows its last query is never computed, forward or backward: `tiles` lists the
visible tiles first and ``while_loop``s run exactly that many (about half of a whole
sequence's, T/2 x (T/B + 1) of T x T/B), and only the tiles the diagonal crosses are masked. Operands stay in the compute dtype; products accumulate
in float32 (``preferred_element_type``), as do the online-softmax statistics.

Layout, head-major so that each tile's products batch over (batch, kv head) without transposes:
queries ``[b, n, g, t, d]`` (g query heads share kv head n: GQA without repeating K/V), keys and
values ``[b, n, s, d]``, statistics ``[b, n, g, t]``. A `Mask` says which keys each query sees:
positions ``pq`` [t] and ``pk`` [s] (causal: ``pk <= pq``; a sliding window: ``pk > pq - window``),
in any order (the ring's chunks are not contiguous), and segment ids ``[b, t]`` / ``[b, s]``
(packed documents: equal ids only). A tile hidden by any of them is never computed: its keys
all follow its queries, all precede the window, or belong to other documents in every row.
"""

from __future__ import annotations

import math
from typing import NamedTuple

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


class Mask(NamedTuple):
    """Which keys each query sees: all of them, but only ``pk <= pq`` where ``causal``, only
    ``pk > pq - window`` where ``window`` (an int32 scalar, may be traced) is > 0, and only equal
    ids where the segment ids ``sq`` [b, t] / ``sk`` [b, s] are given (None: one document).
    ``softcap`` (a float, static): Gemma 2's scores, ``softcap * tanh(s / softcap)`` before the mask."""

    pq: jax.Array
    pk: jax.Array
    causal: bool = True
    window: jax.Array | None = None
    sq: jax.Array | None = None
    sk: jax.Array | None = None
    softcap: float | None = None

    @property
    def hides(self) -> bool:
        """Whether any key can be hidden from a query (else every tile is whole)."""
        return self.causal or self.window is not None or self.sq is not None

    def part(self, q_start, q_size, k_start, k_size) -> Mask:
        """The mask of queries ``q_start : + q_size`` and keys ``k_start : + k_size``."""
        sq, sk = (None, None) if self.sq is None else (_at(self.sq, q_start, q_size, 1), _at(self.sk, k_start, k_size, 1))
        return self._replace(pq=_at(self.pq, q_start, q_size, 0), pk=_at(self.pk, k_start, k_size, 0), sq=sq, sk=sk)

    def keys(self, pk: jax.Array, sk: jax.Array | None) -> Mask:
        """The same queries' mask over other keys (the ring's next block)."""
        return self._replace(pk=pk, sk=sk)

    def visible(self) -> jax.Array:
        """bool [b or 1, t, s]: whether query t sees key s."""
        pq, pk = self.pq[:, None], self.pk[None, :]
        see = jnp.ones((pq.shape[0], pk.shape[1]), bool)
        if self.causal:
            see = pk <= pq
        if self.window is not None:
            see = see & ((self.window <= 0) | (pk > pq - self.window))
        see = see[None]
        return see if self.sq is None else see & (self.sq[:, :, None] == self.sk[:, None, :])


def window_of(window) -> jax.Array | None:
    """``window`` (int, traced int32 scalar, or None) for a `Mask`: None where statically none."""
    if window is None or (isinstance(window, int) and window <= 0):
        return None
    return jnp.asarray(window, jnp.int32)


def tiles(mask: Mask, bq: int, bk: int):
    """The (query tile, key tile) pairs to compute as flat indices ``qi * nk + ki`` in row-major
    order: first those every query of which sees every key (no mask to apply), then those partly
    hidden (the causal diagonal, the window's edge, a document boundary crosses them), then the
    hidden ones (keys all after the queries, all before their window, or in other documents in
    every row); and how many of the first two kinds there are."""
    nq, nk = mask.pq.shape[0] // bq, mask.pk.shape[0] // bk
    q_pos, k_pos = mask.pq.reshape(nq, bq), mask.pk.reshape(nk, bk)
    q_lo, q_hi, k_lo, k_hi = q_pos.min(1)[:, None], q_pos.max(1)[:, None], k_pos.min(1)[None, :], k_pos.max(1)[None, :]
    whole = visible = jnp.ones((nq, nk), bool)
    if mask.causal:
        whole, visible = whole & (k_hi <= q_lo), visible & (k_lo <= q_hi)
    if mask.window is not None:
        off = mask.window <= 0
        whole, visible = whole & (off | (k_lo > q_hi - mask.window)), visible & (off | (k_hi > q_lo - mask.window))
    if mask.sq is not None:  # ranges of ids per tile and row: exact for packed (non-decreasing) ids
        b = mask.sq.shape[0]
        sq, sk = mask.sq.reshape(b, nq, bq), mask.sk.reshape(b, nk, bk)
        sq_lo, sq_hi, sk_lo, sk_hi = sq.min(2)[:, :, None], sq.max(2)[:, :, None], sk.min(2)[:, None], sk.max(2)[:, None]
        whole = whole & ((sq_lo == sq_hi) & (sk_lo == sk_hi) & (sq_lo == sk_lo)).all(0)
        visible = visible & ((sk_lo <= sq_hi) & (sk_hi >= sq_lo)).any(0)
    kind = jnp.where(whole, 0, jnp.where(visible, 1, 2)).reshape(-1)
    order = jnp.argsort(kind, stable=True).astype(jnp.int32)
    return order, whole.sum(dtype=jnp.int32), (visible & ~whole).sum(dtype=jnp.int32)


def _varying(x, *like):
    """``x`` varying over the mesh axes that ``like`` vary over (a loop's carry under shard_map
    must match its update's)."""
    axes = tuple(sorted(frozenset().union(*map(compat.varying_axes, like)) - compat.varying_axes(x)))
    return jax.lax.pcast(x, axes, to="varying") if axes else x


def _over_tiles(step, carry, mask, bq, bk):
    """``carry = step(carry, query start, key start, masked)`` for each visible tile: two
    ``while_loop``s bounded by the counts of `tiles`, the unmasked tiles then the partly hidden
    ones. Not a ``scan`` with a ``cond``: the hidden tiles cost no trip, and under remat a scan's
    partial evaluation would save every tile's mask."""
    order, whole, crossed = tiles(mask, bq, bk)
    nk = mask.pk.shape[0] // bk

    def loop(carry, first, count, masked):
        def body(state):
            i, carry = state
            qi, ki = jnp.divmod(order[i], nk)
            return i + 1, step(carry, qi * bq, ki * bk, masked)

        return jax.lax.while_loop(lambda state: state[0] < first + count, body, (first, carry))[1]

    carry = loop(carry, jnp.int32(0), whole, False)
    return loop(carry, whole, crossed, True) if mask.hides else carry


def _at(x, start, size, axis):
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _put(x, value, start, axis, add=False):
    if add:
        value = value + jax.lax.dynamic_slice_in_dim(x, start, value.shape[axis], axis=axis)
    return jax.lax.dynamic_update_slice_in_dim(x, value, start, axis=axis)


def scores(qt, kt, mask, masked):
    """One tile's float32 scores q k^T / sqrt(d); ``masked``: those ``mask`` (the tile's `Mask`)
    hides `_NEG`."""
    s = jnp.einsum("bngtd,bnsd->bngts", qt, kt, preferred_element_type=jnp.float32) * (1.0 / math.sqrt(qt.shape[-1]))
    if mask.softcap:
        s = mask.softcap * jnp.tanh(s / mask.softcap)
    return jnp.where(mask.visible()[:, None, None], s, _NEG) if masked else s


def empty(q, v):
    """The online-softmax state (o, m, l) before any key: no output, max `_START`, sum 0."""
    b, n, g, t, _ = q.shape
    return (jnp.zeros((b, n, g, t, v.shape[-1]), jnp.float32), jnp.full((b, n, g, t), _START, jnp.float32),
            jnp.zeros((b, n, g, t), jnp.float32))


def finish(acc, dtype):
    """The output (head-major, in ``dtype``) and the log-sum-exp the backward pass needs."""
    o, m, l = acc
    return (o / l[..., None]).astype(dtype), m + jnp.log(l)


def fold(acc, q, k, v, mask):
    """Fold keys (k, v) into the online-softmax state (o, m, l) of queries ``q``, tile by tile
    that ``mask`` (a `Mask`) leaves visible."""
    bq, bk = block(q.shape[3], QUERY_BLOCK), block(k.shape[2], KEY_BLOCK)

    def step(acc, qs, ks, masked):
        o, m, l = acc
        s = scores(_at(q, qs, bq, 3), _at(k, ks, bk, 2), mask.part(qs, bq, ks, bk), masked)
        m_old, l_old, o_old = _at(m, qs, bq, 3), _at(l, qs, bq, 3), _at(o, qs, bq, 3)
        m_new = jnp.maximum(m_old, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        keep = jnp.exp(m_old - m_new)
        pv = jnp.einsum("bngts,bnsd->bngtd", p.astype(v.dtype), _at(v, ks, bk, 2), preferred_element_type=jnp.float32)
        return (_put(o, keep[..., None] * o_old + pv, qs, 3), _put(m, m_new, qs, 3),
                _put(l, keep * l_old + p.sum(-1), qs, 3))

    return _over_tiles(step, tuple(_varying(a, q, k, v, *_arrays(mask)) for a in acc), mask, bq, bk)


def _arrays(mask):
    return [x for x in (mask.pq, mask.pk, mask.window, mask.sq, mask.sk) if x is not None]


def output_grads(out, d_out):
    """delta = rowsum(dO * O) in float32 (flash attention's backward term), head-major."""
    return (d_out.astype(jnp.float32) * out.astype(jnp.float32)).sum(-1)


def unfold(q, k, v, mask, do, lse, delta):
    """The float32 gradients (dq, dk, dv) through `fold` of keys (k, v), recomputing each visible
    tile's probabilities from the log-sum-exp ``lse``."""
    bq, bk = block(q.shape[3], QUERY_BLOCK), block(k.shape[2], KEY_BLOCK)
    scale = 1.0 / math.sqrt(q.shape[-1])

    def step(grads, qs, ks, masked):
        dq, dk, dv = grads
        qt, kt, vt, dot = _at(q, qs, bq, 3), _at(k, ks, bk, 2), _at(v, ks, bk, 2), _at(do, qs, bq, 3)
        s = scores(qt, kt, mask.part(qs, bq, ks, bk), masked)
        p = jnp.exp(s - _at(lse, qs, bq, 3)[..., None])
        dv_t = jnp.einsum("bngts,bngtd->bnsd", p.astype(do.dtype), dot, preferred_element_type=jnp.float32)
        dp = jnp.einsum("bngtd,bnsd->bngts", dot, vt, preferred_element_type=jnp.float32)
        ds = p * (dp - _at(delta, qs, bq, 3)[..., None])
        if mask.softcap:  # through the cap: d/dx c tanh(x / c) = 1 - tanh(x / c)^2 (0 where hidden: p = 0)
            ds = ds * (1.0 - jnp.square(jnp.clip(s / mask.softcap, -1.0, 1.0)))
        ds = ds.astype(q.dtype)
        dq_t = jnp.einsum("bngts,bnsd->bngtd", ds, kt, preferred_element_type=jnp.float32) * scale
        dk_t = jnp.einsum("bngts,bngtd->bnsd", ds, qt, preferred_element_type=jnp.float32) * scale
        return _put(dq, dq_t, qs, 3, add=True), _put(dk, dk_t, ks, 2, add=True), _put(dv, dv_t, ks, 2, add=True)

    zeros = tuple(_varying(jnp.zeros(x.shape, jnp.float32), q, k, v, do, lse, *_arrays(mask)) for x in (q, k, v))
    return _over_tiles(step, zeros, mask, bq, bk)
