"""Sliding windows and document (segment) masks in every attention kernel, at kernel level.

Each kernel (shardlib's tiled flash on one sequence, the context-parallel ring and all-gather,
``jax.nn.dot_product_attention`` as the cuDNN route builds its arguments, run here by its "xla"
implementation) is compared, values and gradients, with `masked_reference`: a softmax attention
written in this test with the same mask. The tile counts are checked against a brute-force count
of the tiles with at least one visible (query, key) pair, so a tile the window or a document
boundary hides entirely is never computed, forward or backward. The Pallas splash kernel's are in
`tests/test_splash.py`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from shardlib import make_mesh
from shardlib.model import attention as attention_lib
from shardlib.model import hooks
from shardlib.sharding import sequence
from tests.test_context_parallel import _blocks, _count_tiles, _triangle

T = 32
# two packed rows: documents of 5, 11, 16 tokens and of 20, 12
SEGMENTS = np.array([[0] * 5 + [1] * 11 + [2] * 16, [0] * 20 + [1] * 12], np.int32)


def sees(t: int, segment_ids=None, window=None) -> np.ndarray:
    """bool [b or 1, t, t]: query i sees key j (causal, within the window and its document)."""
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    see = (j <= i) & ((j > i - window) if window else True)
    see = see[None]
    return see if segment_ids is None else see & (segment_ids[:, :, None] == segment_ids[:, None, :])


def masked_reference(q, k, v, segment_ids=None, window=None, softcap=None):
    """softmax(q k^T / sqrt(d)) v where `sees`, float32, GQA by repeating kv heads; ``softcap``:
    the scores ``softcap * tanh(s / softcap)`` first (Gemma 2)."""
    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    s = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])
    s = s if softcap is None else softcap * jnp.tanh(s / softcap)
    s = jnp.where(sees(q.shape[1], segment_ids, window)[:, None], s, -1e30)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), v)


def visible_tiles(t: int, tile: int, segment_ids=None, window=None) -> int:
    """[tile x tile] blocks of the [t x t] scores holding at least one visible pair, in any row."""
    see = sees(t, segment_ids, window)
    n = t // tile
    return int(see.reshape(see.shape[0], n, tile, n, tile).any(axis=(0, 2, 4)).sum())


def _operands(t: int = T):
    """q (scores large enough for a soft-cap of 5 to bend them), k, v and an output cotangent."""
    keys = jax.random.split(jax.random.key(3), 4)
    q, w = (jax.random.normal(key, (2, t, 4, 8)) for key in keys[:2])
    k, v = (jax.random.normal(key, (2, t, 2, 8)) for key in keys[2:])
    return 4 * q, k, v, w


def _assert_matches(attend, segment_ids, window, softcap=None, t: int = T):
    """``attend(q, k, v)`` and its gradients equal `masked_reference`'s."""
    q, k, v, w = _operands(t)
    got, pull = jax.vjp(attend, q, k, v)
    grads = pull(w)
    want, want_pull = jax.vjp(lambda q, k, v: masked_reference(q, k, v, segment_ids, window, softcap), q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, want_pull(w)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


CASES = {"window": (None, 6), "documents": (SEGMENTS, None), "both": (SEGMENTS, 6)}


@pytest.mark.parametrize("case", CASES)
def test_flash_masks_match_and_hidden_tiles_are_never_computed(case, monkeypatch):
    """One sequence of 32 tokens in tiles of 4 x 4 (GQA): values and gradients equal the
    reference, and forward and backward each compute exactly the tiles with a visible pair, fewer
    than the causal triangle's 36. The window is traced (a jit argument, as under the layers' scan)."""
    segment_ids, window = CASES[case]
    _blocks(monkeypatch, 4)
    computed = _count_tiles(monkeypatch)
    ids = None if segment_ids is None else jnp.asarray(segment_ids)

    @jax.jit
    def attend(q, k, v, window):
        return attention_lib.causal_flash(q, k, v, segment_ids=ids, window=window)

    _assert_matches(lambda q, k, v: attend(q, k, v, None if window is None else jnp.int32(window)), segment_ids, window)
    expected = visible_tiles(T, 4, segment_ids, window)
    assert expected < _triangle(T // 4)
    assert len(computed) == 2 * expected


def test_a_traced_window_of_zero_is_no_window(monkeypatch):
    """A layer without a window in a model with some (Gemma 2's global layers: window 0 in the
    scanned array) computes the whole causal triangle, and equals plain causal attention."""
    _blocks(monkeypatch, 4)
    computed = _count_tiles(monkeypatch)
    attend = jax.jit(lambda q, k, v, w: attention_lib.causal_flash(q, k, v, window=w))
    _assert_matches(lambda q, k, v: attend(q, k, v, jnp.int32(0)), None, None)
    assert len(computed) == 2 * _triangle(T // 4)


@pytest.mark.parametrize("mode,balanced,softcap", [("ring", True, 5.0), ("ring", False, None), ("allgather", True, 5.0)])
def test_split_sequence_masks_match_and_hidden_tiles_are_never_computed(mode, balanced, softcap, monkeypatch):
    """The sequence split over context=4 (the ring's hops carry the keys' segment ids with them),
    tiles of 2 x 2: documents and a window of 6 (and Gemma 2's soft-cap of 5) give the reference's
    values and gradients, and over all devices each pass computes only the tiles with a visible pair."""
    size = 4
    _blocks(monkeypatch, 2)
    computed = _count_tiles(monkeypatch)
    order = sequence.order(T, size, balanced)
    mesh = make_mesh({"context": size}, devices=jax.devices()[:size])
    ids = jnp.asarray(SEGMENTS)

    def split(q, k, v):
        def body(q, k, v, ids, window):
            ctx = hooks.ComputeContext(lambda names, shape: P(), context_size=size, context_balance=balanced,
                                       context_attention=mode)
            with hooks.compute_context(ctx):
                return attention_lib.attention(q, k, v, causal=True, segment_ids=ids, window=window, softcap=softcap)

        spec = P(None, "context")
        run = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4 + (P(),), out_specs=spec)
        out = run(q[:, order], k[:, order], v[:, order], ids[:, order], jnp.int32(6))
        return out[:, np.argsort(order)]

    _assert_matches(jax.jit(split), SEGMENTS, 6, softcap)
    assert len(computed) == 2 * visible_tiles(T, 2, SEGMENTS, 6)


@pytest.mark.parametrize("case", CASES)
def test_fused_attention_arguments_match(case):
    """The cuDNN route's arguments (``local_window_size`` (window - 1, 0), documents as a mask),
    run by jax.nn.dot_product_attention's XLA implementation; the window traced and switched
    between the model's values (0 and 6), as under the layers' scan."""
    from shardlib.models.gpt import fused_attention

    segment_ids, window = CASES[case]
    ids = None if segment_ids is None else jnp.asarray(segment_ids)
    if window is None:
        attend = jax.jit(lambda q, k, v: fused_attention("xla", q, k, v, segment_ids=ids))
    else:
        traced = jax.jit(lambda q, k, v, w: fused_attention("xla", q, k, v, segment_ids=ids, window=w, windows=(0, 6)))
        attend = lambda q, k, v: traced(q, k, v, jnp.int32(window))  # noqa: E731
    _assert_matches(attend, segment_ids, window)
    if window is not None:  # the other branch of the switch: no window
        _assert_matches(lambda q, k, v: traced(q, k, v, jnp.int32(0)), segment_ids, None)


def test_a_static_mask_kernel_with_a_traced_window_and_no_values_is_refused():
    from shardlib.models.gpt import fused_attention

    q, k, v, _ = _operands()
    with pytest.raises(ValueError, match=r"traced window needs the values it can take \(windows="):
        jax.jit(lambda q, k, v, w: fused_attention("xla", q, k, v, window=w))(q, k, v, jnp.int32(6))


def test_softcapped_flash_matches(monkeypatch):
    """Gemma 2's soft-cap (scores 5 tanh(s / 5), its derivative in the backward) with a window and
    documents, shardlib's flash on one sequence (the split sequence's: above)."""
    _blocks(monkeypatch, 4)
    ids = jnp.asarray(SEGMENTS)
    attend = jax.jit(lambda q, k, v: attention_lib.causal_flash(q, k, v, segment_ids=ids, window=6, softcap=5.0))
    _assert_matches(attend, SEGMENTS, 6, 5.0)


def test_windowed_softcapped_model_runs_every_attention_alike():
    """A Gemma-2-shaped model (windows 6 and 0 alternating under the layers' scan, soft-cap, query
    scale) gives the einsum's logits and gradients with attention="flash"; a Mistral-shaped one
    (window 6 on every layer) with jax.nn.dot_product_attention's route ("xla", the cuDNN route's
    arguments) too."""
    from flax import nnx

    from shardlib.models import GPT, GPTConfig

    base = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=T)
    gemma = GPTConfig(**base, layer_windows=(6, 0), attn_softcap=5.0, query_scale=12.0)
    mistral = GPTConfig(**base, layer_windows=(6, 6))
    tokens = jax.random.randint(jax.random.key(0), (2, T), 0, 64)

    def run(config, attention):
        with nnx.use_eager_sharding(False):  # shardlib places the parameters (no mesh here)
            model = GPT(dataclasses.replace(config, attention=attention), rngs=nnx.Rngs(0))
        graph, params = nnx.split(model)
        loss = lambda p: jnp.mean(jnp.square(nnx.merge(graph, p)(tokens)))  # noqa: E731
        return jax.jit(jax.value_and_grad(loss))(params)

    for config, fused in ((gemma, "flash"), (mistral, "xla")):
        (want, want_grads), (got, grads) = run(config, "einsum"), run(config, fused)
        np.testing.assert_allclose(got, want, rtol=1e-5)
        for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("implementation", ["einsum", "flash", "xla", "splash"])
def test_the_models_dispatch_passes_documents_and_window_on(implementation, capsys):
    """`models.gpt._local_attention` (what a model's attention runs on one sequence) with documents
    and a window of 6: each implementation equals the reference (splash outside a TPU step: flash,
    said on stderr)."""
    from shardlib.models.gpt import _local_attention

    q, k, v, _ = _operands()
    got = jax.jit(lambda q, k, v: _local_attention(implementation, q, k, v, segment_ids=jnp.asarray(SEGMENTS),
                                                   window=6))(q, k, v)
    np.testing.assert_allclose(got, masked_reference(q, k, v, SEGMENTS, 6), rtol=1e-5, atol=1e-6)
    assert ("the Pallas splash kernel does not take" in capsys.readouterr().err) == (implementation == "splash")
