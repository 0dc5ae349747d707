"""Decoding the GPT with a KV cache: one prefill of the prompts, then one token a step.

* **Prefill** (`prefill`): the prompts run once through the blocks, attending through the
  memory-linear flash kernel (`shardlib.model.attention.flash`) a chunk of `PREFILL_CHUNK`
  queries at a time over the keys up to the chunk's end, so no ``[T0 x T0]`` scores exist and
  no key after a chunk's last query is computed against it. The head runs at the last
  position only: ``[B, vocab]`` logits, never ``[B, T0, vocab]``.
* **Ragged batches**: prompts of different lengths are left-padded (`left_pad`) to a common
  length (rounded up to `ALIGN` slots, so the kernel's key blocks stay large); each row's
  positions count from its first real token and its padding is masked out of every attention,
  as transformers' ``generate`` does with an ``attention_mask``.
* **Stop ids**: a row stops at the first of any of ``stop_token``'s ids (a ``generation_config.json``
  lists several); from then on it emits ``pad_id``, and the loop ends once every row stopped.

``generate_with`` is the cache-less sampler for any causal ``apply`` (the end-of-run sample of
`shardlib train`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardlib.model import attention as attention_lib

from .gpt import GPT, causal_attention, layer_rope

# Queries a prefill chunk holds: each attends to the keys up to its own end (in the flash kernel's
# key blocks), so the chunks above the diagonal are skipped: 56% of the [T0 x T0] scores at 2048
# tokens (one chunk: 100%; 512: 62%; 128: 53%, no faster on CPU; BENCHMARKS.md, "Decoding").
PREFILL_CHUNK = 256
# A prompt is left-padded to a multiple of this many slots, so its key blocks divide evenly.
ALIGN = 64
# From this batch on, a decoding step's head reads vocabulary-major weights (`vocab_major_head`):
# faster at 4 rows and more (43 against 60 ms at 4, 36 against 54 at 8 with a 128k vocabulary on
# CPU), as fast at 2, slower at 1 (29 against 23 ms), and the copy costs 180 ms a call.
VOCAB_MAJOR_MIN_BATCH = 4
# The masking position of a padding slot: later than every real query, so none attends to it.
_PAD_SLOT = 2 ** 30


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values of every decoded slot, [layers, batch, kv_heads, max_len, head_dim] each:
    head-major, the layout a step's two attention products read as they lie (a slot-major cache
    was transposed for both, two whole-layer copies a layer and step)."""

    k: jax.Array
    v: jax.Array


def left_pad(rows: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(int32[B, T0] with each row's tokens at its right end, int32[B] lengths) of token rows of
    different lengths, T0 the longest."""
    lengths = np.asarray([len(r) for r in rows], np.int32)
    if not len(rows) or lengths.min() < 1:
        raise ValueError("generate needs at least one prompt, each of at least one token")
    out = np.full((len(rows), int(lengths.max())), pad_id, np.int32)
    for i, row in enumerate(rows):
        out[i, out.shape[1] - len(row):] = np.asarray(row, np.int32)
    return out, lengths


def generate(
    model: GPT,
    prompt: Any,
    steps: int,
    *,
    rng: jax.Array,
    temperature: float = 0.8,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_token: int | Sequence[int] | None = None,
    lengths: Any = None,
    pad_id: int | None = None,
) -> jax.Array:
    """Sample ``steps`` tokens after ``prompt`` -> int32[B, T0 + steps] (the prompt, then the new tokens).

    ``prompt``: int32[B, T0], left-padded when ``lengths`` (int32[B], each row's real tokens) is
    given (`left_pad`). ``temperature=0`` is greedy; ``top_k`` / ``top_p`` (nucleus) restrict
    sampling; step i draws with ``fold_in(rng, i)``. A row stops at the first of the ``stop_token``
    ids it produces (kept) and emits ``pad_id`` (default: the first stop id) after it. Under a mesh
    the parameters stay in whatever sharding they have; XLA places the collectives.
    """
    prompt = np.asarray(prompt, np.int32)
    batch, prompt_len = prompt.shape
    lengths = np.full((batch,), prompt_len, np.int32) if lengths is None else np.asarray(lengths, np.int32)
    if prompt_len < 1 or lengths.shape != (batch,) or lengths.min() < 1 or lengths.max() > prompt_len:
        raise ValueError(f"generate needs prompts of at least one token, and lengths [batch] of 1 .. {prompt_len}; "
                         f"got prompt {prompt.shape}, lengths {lengths.tolist()}")
    if int(lengths.max()) + steps > model.config.max_seq_len:
        raise ValueError(f"prompt length {int(lengths.max())} + steps {steps} exceeds max_seq_len "
                         f"{model.config.max_seq_len}")
    if steps == 0:
        return jnp.asarray(prompt)
    check_sampling(temperature, top_k, top_p)
    stops = stop_ids(stop_token)
    pad_id = (stops[0] if stops else 0) if pad_id is None else int(pad_id)
    extra = -prompt_len % ALIGN  # more left padding: the kernel's key blocks stay whole
    padded = np.pad(prompt, ((0, 0), (extra, 0)), constant_values=pad_id)
    ragged = bool(extra or lengths.min() < prompt_len)
    graphdef, state = nnx.split(model)
    head = vocab_major_head(model) if batch >= VOCAB_MAJOR_MIN_BATCH and steps > 1 else None
    new = _generate_cached(graphdef, state, head, jnp.asarray(padded), jnp.asarray(lengths), rng, steps,
                           float(temperature), top_k, top_p, stops, pad_id, ragged)
    return jnp.concatenate([jnp.asarray(prompt), new], axis=1)


def stop_ids(stop_token: int | Sequence[int] | None) -> tuple[int, ...]:
    """The stop ids as a tuple (none, one, or a ``generation_config.json`` list)."""
    if stop_token is None:
        return ()
    return (int(stop_token),) if np.ndim(stop_token) == 0 else tuple(int(t) for t in stop_token)


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Sampling settings in range, each named when not."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be at least 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def vocab_major_head(model: GPT) -> jax.Array:
    """The head's weights as [vocab, d_model] rows, laid out so in memory: the embedding table when
    tied, else a transposed copy of ``lm_head`` made by its own compiled call (inside the decoding's
    program XLA would lay the transpose out as it pleased). A step's head then reads each
    vocabulary row contiguously and writes [vocab, B]: 1.5x faster than XLA:CPU's [B, d] x [d, vocab]
    at batch 8 (BENCHMARKS.md, "Decoding"), for one more copy of the head while decoding (from
    `VOCAB_MAJOR_MIN_BATCH` rows on)."""
    if model.config.tie_embeddings:
        return model.embedding[...]
    return _transpose(model.lm_head[...])


_transpose = jax.jit(jnp.transpose)


def step_head(model: GPT, x: jax.Array, weights: jax.Array) -> jax.Array:
    """`GPT.head` of one position a row (x [B, 1, d]) over vocabulary-major ``weights``
    (`vocab_major_head`) -> float32[vocab, B], vocabulary-major too (transposed to [B, vocab], XLA
    folds the transpose into the product, which then runs as slowly as before); the same
    operations (final norm, the product in the compute dtype accumulated in float32, Gemma 2's
    final soft-cap)."""
    h = model.final_norm(x[:, 0])
    logits = jnp.einsum("vd,bd->vb", weights.astype(h.dtype), h, preferred_element_type=jnp.float32)
    cap = model.config.final_softcap
    return logits if cap is None else jnp.tanh(logits / cap) * cap


@functools.partial(jax.jit, static_argnums=(0, 6, 7, 8, 9, 10, 11, 12))
def _generate_cached(graphdef: nnx.GraphDef, state: nnx.State, head: jax.Array | None, prompt: jax.Array,
                     lengths: jax.Array, rng: jax.Array, steps: int, temperature: float, top_k: int | None,
                     top_p: float | None, stops: tuple[int, ...], pad_id: int, ragged: bool) -> jax.Array:
    model = nnx.merge(graphdef, state)
    batch, prompt_len = prompt.shape
    logits, cache = prefill(model, prompt, lengths, prompt_len + steps, ragged=ragged)
    first = _pick(logits, jax.random.fold_in(rng, 0), temperature, top_k, top_p)
    stopped = jnp.isin(first, jnp.asarray(stops, jnp.int32)) if stops else jnp.zeros((batch,), bool)
    pad = prompt_len - lengths

    def running(carry: tuple[jax.Array, KVCache, jax.Array, jax.Array]) -> jax.Array:
        i, _, _, stopped = carry
        return (i < steps) & ~stopped.all()

    def step(carry: tuple[jax.Array, KVCache, jax.Array, jax.Array]) -> tuple[jax.Array, KVCache, jax.Array, jax.Array]:
        i, cache, out, stopped = carry
        logits, cache = decode_step(model, out[:, i - 1], cache, prompt_len + i - 1, pad, head)
        key = jax.random.fold_in(rng, i)  # greedy reads [vocab, B] logits as they lie
        if temperature == 0.0:
            token = jnp.argmax(logits, axis=0 if head is not None else 1).astype(jnp.int32)
        else:
            token = _pick(logits.T if head is not None else logits, key, temperature, top_k, top_p)
        if stops:
            token = jnp.where(stopped, pad_id, token)
            stopped = stopped | jnp.isin(token, jnp.asarray(stops, jnp.int32))
        return i + 1, cache, out.at[:, i].set(token), stopped

    out = jnp.full((batch, steps), pad_id, jnp.int32).at[:, 0].set(first)
    return jax.lax.while_loop(running, step, (jnp.int32(1), cache, out, stopped))[2]


def prefill(model: GPT, tokens: jax.Array, lengths: jax.Array, max_len: int, *, ragged: bool = True
            ) -> tuple[jax.Array, KVCache]:
    """(float32[B, vocab] logits at the last slot, the cache of ``max_len`` slots holding the
    prompts' keys and values) for left-padded ``tokens`` int32[B, T0] of ``lengths`` real tokens.
    ``ragged=False`` promises that no row is padded: every row then shares one set of positions
    (the kernel runs once for the batch instead of per row, 18% faster on CPU)."""
    batch, prompt_len = tokens.shape
    slots = jnp.arange(prompt_len, dtype=jnp.int32)[None, :]
    pad = (prompt_len - lengths)[:, None]
    real = slots >= pad
    positions = jnp.maximum(slots - pad, 0)
    tables = model.rope(prompt_len, positions=positions), model.local_rope(prompt_len, positions=positions)
    # the masking positions: padding follows every real query
    order = jnp.where(real, slots, _PAD_SLOT) if ragged else None

    def attend(q: jax.Array, k: jax.Array, v: jax.Array, **options: Any) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        if model.config.custom_attention:  # a window, soft-cap or query scale: the einsum (Gemma 2)
            return causal_attention(q, k, v, visible=real if ragged else None, **options), (k, v)
        return prompt_attention(q, k, v, order), (k, v)

    graphdef, stacked = nnx.split(model.blocks)

    def body(x: jax.Array, layer: tuple[nnx.State, jax.Array | None]) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        layer_state, window = layer
        return nnx.merge(graphdef, layer_state).cached(x, *layer_rope(window, *tables), attend, window)

    x, (k, v) = jax.lax.scan(body, model.embed(tokens), (stacked, model.windows(stacked)))
    grow = ((0, 0), (0, 0), (0, 0), (0, max_len - prompt_len), (0, 0))
    return model.head(x[:, -1:])[:, 0], KVCache(*(jnp.pad(a.swapaxes(2, 3), grow) for a in (k, v)))


def decode_step(model: GPT, tokens: jax.Array, cache: KVCache, slot: jax.Array, pad: jax.Array,
                head: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
    """(float32 logits of ``tokens`` int32[B] at cache slot ``slot``, the cache with their keys and
    values added); row b's first ``pad[b]`` slots are padding, never attended to. The logits are
    [vocab, B] by ``head`` (`vocab_major_head`), else [B, vocab] by `GPT.head`. The whole cache is
    the layer scan's carry, each layer's keys written into it in place and attended where they lie
    (a cache passed through as the scan's per-layer input and output is copied whole every step:
    2.5x slower steps at 2k tokens)."""
    positions = (slot - pad)[:, None]
    tables = model.rope(1, positions=positions), model.local_rope(1, positions=positions)
    visible = jnp.arange(cache.k.shape[3])[None, :] >= pad[:, None]
    graphdef, stacked = nnx.split(model.blocks)

    def body(carry: tuple[jax.Array, jax.Array, KVCache], layer: tuple[nnx.State, jax.Array | None]
             ) -> tuple[tuple[jax.Array, jax.Array, KVCache], None]:
        x, index, cache = carry
        layer_state, window = layer

        def attend(q: jax.Array, k: jax.Array, v: jax.Array, **options: Any) -> tuple[jax.Array, KVCache]:
            at = (index, 0, 0, slot, 0)
            new = KVCache(*(jax.lax.dynamic_update_slice(old, kv.swapaxes(1, 2)[None].astype(old.dtype), at)
                            for old, kv in ((cache.k, k), (cache.v, v))))
            keys, values = (a[index].astype(q.dtype) for a in (new.k, new.v))
            return step_attention(q, keys, values, slot, visible, **options), new

        x, cache = nnx.merge(graphdef, layer_state).cached(x, *layer_rope(window, *tables), attend, window)
        return (x, index + 1, cache), None

    (x, _, cache), _ = jax.lax.scan(body, (model.embed(tokens[:, None]), jnp.int32(0), cache),
                                    (stacked, model.windows(stacked)))
    return (model.head(x)[:, 0] if head is None else step_head(model, x, head)), cache


def step_attention(q: jax.Array, k: jax.Array, v: jax.Array, slot: jax.Array, visible: jax.Array, *,
                   window: jax.Array | int | None = None, softcap: float | None = None,
                   scale: float | None = None) -> jax.Array:
    """`shardlib.models.gpt.causal_attention` of one query a row (q [B, 1, heads, d] at position
    ``slot``) over a head-major cache (k / v [B, kv_heads, S, d]), the same operations in the same
    order: scores in float32, Gemma 2's ``scale`` / ``softcap`` / ``window``, keys after ``slot``
    or not ``visible`` (bool[B, S]) masked out."""
    batch, _, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    q = q.reshape(batch, kv_heads, heads // kv_heads, head_dim)  # query groups share a kv head
    scores = jnp.einsum("bngk,bnsk->bngs", q, k, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(head_dim) if scale is None else scores * scale
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    key_pos = jnp.arange(k.shape[2])
    seen = (key_pos <= slot)[None, :] & visible
    if window is not None:
        seen = seen & ((window <= 0) | (key_pos > slot - window))[None, :]
    scores = jnp.where(seen[:, None, None, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bngs,bnsk->bngk", probs, v).reshape(batch, 1, heads, head_dim)


def prompt_attention(q: jax.Array, k: jax.Array, v: jax.Array, order: jax.Array | None) -> jax.Array:
    """Causal attention of a batch of prompts (q [B, T, heads, d], k / v [B, T, kv_heads, d]) by
    each row's masking positions ``order`` (int32[B, T]: a key is seen by the queries at or after
    it; None: ``arange(T)`` for every row), through the flash kernel: `PREFILL_CHUNK` queries at a
    time, each chunk over the keys up to its end only. Memory linear in T; no chunk wholly above
    the diagonal is computed."""
    seq = q.shape[1]
    if order is None:  # one set of positions, the whole batch in one call
        order = jnp.arange(seq, dtype=jnp.int32)[None]
        row = lambda q, k, v, pq, pk: attention_lib.flash(q, k, v, pq[0], pk[0], True)  # noqa: E731
    else:  # each row's own
        row = jax.vmap(lambda q, k, v, pq, pk: attention_lib.flash(q[None], k[None], v[None], pq, pk, True)[0])
    chunks = []
    for start in range(0, seq, PREFILL_CHUNK):
        end = min(start + PREFILL_CHUNK, seq)
        chunks.append(row(q[:, start:end], k[:, :end], v[:, :end], order[:, start:end], order[:, :end]))
    return jnp.concatenate(chunks, axis=1)


def generate_with(
    apply: Any,
    params: Any,
    prompt: jax.Array,
    steps: int,
    *,
    rng: jax.Array,
    window: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    stop_token: int | Sequence[int] | None = None,
) -> jax.Array:
    """Continue ``prompt`` (int32[B, T0]) by ``steps`` tokens with a causal model -> int32[B, steps].

    ``apply(params, tokens[B, window]) -> logits[B, window, V]`` (hashable: it is a static jit
    argument). Each step reruns the forward pass on a fixed ``window`` (no KV cache: simple and
    compiled once, fine for the small models this is meant for). While the window fills, the
    logits are read at the last real token (attention is causal, so the padding after it does
    not change them); once full, it slides by one, so ``steps`` may exceed ``window``.
    Greedy by default (``temperature=0``); step i draws with ``fold_in(rng, i)``. A row that
    produces one of the ``stop_token`` ids repeats it after, and the loop ends once every row has
    stopped (what follows is then 0): `until_stop` trims a row at its stop id.
    """
    prompt = jnp.asarray(prompt, jnp.int32)
    if not 1 <= prompt.shape[1] <= window:
        raise ValueError(f"prompt length {prompt.shape[1]} must be between 1 and the window {window}")
    check_sampling(temperature, top_k, None)
    return _generate(apply, params, prompt, rng, steps, window, float(temperature), top_k, stop_ids(stop_token))


def until_stop(ids: Any, stop_token: int | Sequence[int] | None) -> np.ndarray:
    """One row of generated ``ids`` up to (not including) its first stop id: what is printed."""
    ids = np.asarray(ids).reshape(-1)
    hits = np.flatnonzero(np.isin(ids, stop_ids(stop_token)))
    return ids[:hits[0]] if len(hits) else ids


@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6, 7, 8))
def _generate(apply: Any, params: Any, prompt: jax.Array, rng: jax.Array, steps: int, window: int,
              temperature: float, top_k: int | None, stops: tuple[int, ...]) -> jax.Array:
    batch, prompt_len = prompt.shape
    buffer = jnp.zeros((batch, window), jnp.int32).at[:, :prompt_len].set(prompt)
    stop_array = jnp.asarray(stops, jnp.int32)

    def running(carry: tuple[jax.Array, ...]) -> jax.Array:
        i, _, _, _, stopped = carry
        return (i < steps) & ~stopped.all()

    def step(carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        i, buffer, length, out, stopped = carry
        logits = jax.lax.dynamic_index_in_dim(apply(params, buffer), length - 1, axis=1, keepdims=False)
        token = _pick(logits.astype(jnp.float32), jax.random.fold_in(rng, i), temperature, top_k, None)
        if stops:
            token = jnp.where(stopped, out[:, jnp.maximum(i - 1, 0)], token)
            stopped = stopped | jnp.isin(token, stop_array)
        shifted = jnp.roll(buffer, -1, axis=1).at[:, window - 1].set(token)
        buffer = jnp.where(length >= window, shifted, buffer.at[:, jnp.minimum(length, window - 1)].set(token))
        return i + 1, buffer, jnp.minimum(length + 1, window), out.at[:, i].set(token), stopped

    init = (jnp.int32(0), buffer, jnp.int32(prompt_len), jnp.zeros((batch, steps), jnp.int32),
            jnp.zeros((batch,), bool))
    return jax.lax.while_loop(running, step, init)[3]


def _pick(logits: jax.Array, key: jax.Array, temperature: float, top_k: int | None, top_p: float | None) -> jax.Array:
    """One token per row of ``logits`` [B, V]: greedy at temperature 0, else sampled from the
    ``top_k`` most likely and / or the smallest set whose probability reaches ``top_p``."""
    logits = logits.astype(jnp.float32)
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None:
        descending = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(descending, axis=-1)
        kept = jnp.sum(jnp.cumsum(probs, axis=-1) - probs < top_p, axis=-1, keepdims=True)  # at least 1
        logits = jnp.where(logits < jnp.take_along_axis(descending, kept - 1, axis=-1), -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
