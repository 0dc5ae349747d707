"""The TPU policy's Pallas splash attention (`shardlib.model.splash`), its numerics on CPU.

The kernel runs in Pallas's interpreter here (the compiled TPU program is
`tests/test_tpu_compile.py::test_tpu_bf16_attention_is_the_pallas_splash_kernel`): inside a
``shard_map`` manual over ``fsdp`` as the step's is, with the heads split over ``tensor`` by the
inner ``shard_map``, its output and the gradients of q, k, v (GQA: 4 query heads, 2 key/value
heads) equal a causal attention written in the test, float32; and so they do with a sliding
window (traced, switched between the kernels of a model's window values) and packed documents
(segment ids), against `tests.test_attention_masks.masked_reference`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from shardlib import make_mesh
from shardlib.model import splash
from tests.test_attention_masks import masked_reference
from tests.test_context_parallel import causal_reference


def test_splash_in_a_manual_shard_map_with_heads_split_matches_dense(monkeypatch):
    monkeypatch.setattr(splash, "INTERPRET", True)
    mesh = make_mesh({"fsdp": 2, "tensor": 2}, devices=jax.devices()[:4])
    keys = jax.random.split(jax.random.key(0), 4)
    q, w = (jax.random.normal(key, (2, 256, 4, 128)) for key in keys[:2])
    k, v = (jax.random.normal(key, (2, 256, 2, 128)) for key in keys[2:])

    def split(q, k, v):
        return jax.shard_map(splash.causal, mesh=mesh, in_specs=(P("fsdp"),) * 3, out_specs=P("fsdp"),
                             axis_names={"fsdp"})(q, k, v)

    with jax.set_mesh(mesh):
        got, pull = jax.vjp(jax.jit(split), q, k, v)
        grads = pull(w)
    want, want_pull = jax.vjp(causal_reference, q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, want_pull(w)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def test_splash_with_a_traced_window_and_documents_matches_the_masked_reference(monkeypatch):
    """Window 100 (LocalMask), traced and picked by ``lax.switch`` from the values (0, 100), two
    packed rows of documents (SegmentIds) and Gemma 2's soft-cap (the kernel's
    ``attn_logits_soft_cap``; the backward's flash loop through the cap's derivative), in the
    step's manual shard_map with heads split."""
    monkeypatch.setattr(splash, "INTERPRET", True)
    mesh = make_mesh({"fsdp": 2, "tensor": 2}, devices=jax.devices()[:4])
    keys = jax.random.split(jax.random.key(2), 4)
    q, w = (jax.random.normal(key, (2, 256, 4, 128)) for key in keys[:2])
    q = q * 4  # scores large enough for the cap to bend them
    k, v = (jax.random.normal(key, (2, 256, 2, 128)) for key in keys[2:])
    ids = np.array([[0] * 40 + [1] * 150 + [2] * 66, [0] * 200 + [1] * 56], np.int32)

    def split(q, k, v):
        def body(q, k, v, ids, window):
            return splash.causal(q, k, v, segment_ids=ids, window=window, windows=(0, 100), softcap=5.0)

        return jax.shard_map(body, mesh=mesh, in_specs=(P("fsdp"),) * 4 + (P(),), out_specs=P("fsdp"),
                             axis_names={"fsdp"})(q, k, v, jnp.asarray(ids), jnp.int32(100))

    with jax.set_mesh(mesh):
        got, pull = jax.vjp(jax.jit(split), q, k, v)
        grads = pull(w)
    want, want_pull = jax.vjp(lambda q, k, v: masked_reference(q, k, v, ids, 100, 5.0), q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, want_pull(w)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
