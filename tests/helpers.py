"""Shared fixtures for strategy tests: the tiny GPT, fixed batches, and a one-device reference
written without shardlib's step."""

from __future__ import annotations

import jax
import numpy as np
import optax

from shardlib.models import GPT, get_config, next_token_loss, trainable
from shardlib import build, make_layout, make_mesh
from shardlib.runtime.data import ByteBatches, load_text
from tests import zoo

TINY = get_config("tiny")
BATCH, SEQ, STEPS = 16, 32, 5


def tiny_model():
    return trainable(TINY)


def batches(n: int = STEPS, batch: int = BATCH, seq: int = SEQ) -> list[dict[str, np.ndarray]]:
    source = ByteBatches(np.frombuffer(load_text(None), np.uint8), batch, seq, seed=0, process_index=0, process_count=1)
    return [source.batch(step) for step in range(n)]


def optimizer() -> optax.GradientTransformation:
    """AdamW with eps=1e-5 instead of optax's 1e-8, so that parameters can be compared tightly.

    Adam's update m / (sqrt(v) + eps) changes by up to lr * |dg| / eps when the gradient changes
    by dg, so for near-zero gradients it amplifies the last-bit difference between two summation
    orders (float32 noise |dg| ~ 1e-9 here). With eps=1e-8 that moved single elements by 1.2e-5
    after 5 steps at lr 3e-3, with eps=1e-6 by 2.8e-6; with eps=1e-5 the bound is 3e-7 per step,
    and parameter parity holds at rtol 1e-5 / atol 1e-6 with a genuinely adaptive optimizer.
    """
    return optax.adamw(3e-3, eps=1e-5, weight_decay=0.1)


def train(program, steps: int = STEPS, batch: int = BATCH):
    """Per-step losses, final params (as numpy) and the final state of ``steps`` steps of ``program``."""
    state = program.init(jax.random.key(0))
    losses = []
    for rows in batches(steps, batch=batch):
        state, metrics = program.step(state, rows)
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.tree.map(np.asarray, state.params), state


def run(strategy: str, mesh_sizes, devices=None, steps: int = STEPS, model=None):
    """Per-step losses and final params (as numpy) of ``steps`` AdamW steps."""
    model = model or tiny_model()
    mesh = make_mesh(mesh_sizes, devices=devices)
    program = build(model, optimizer(), make_layout(model, strategy, mesh))
    losses, params, state = train(program, steps)
    return losses, params, program, state


def reference(steps: int = STEPS, config=TINY, seed: int = 0):
    """Per-step losses and final params (as numpy) of the same AdamW steps on one device, with
    no shardlib code in the step: the NNX module itself (`nnx.split` / `nnx.merge`), its loss,
    ``jax.jit(jax.value_and_grad)`` and optax (`tests.zoo.plain_steps`). Initialised as
    `shardlib.from_nnx` initialises (``nnx.Rngs(jax.random.key(seed))``), so both start equal."""
    params, _, loss = zoo.nnx_functional(lambda rngs: GPT(config, rngs=rngs), lambda m, b: next_token_loss(m, b)[0],
                                         seed=jax.random.key(seed))
    params, losses = zoo.plain_steps(lambda p, b: loss(p, None, b)[0], params, optimizer(), batches(steps))
    return np.array(losses), jax.tree.map(np.asarray, params)


def tree_from_flat(flat: dict, like):
    """The tree shaped like ``like`` whose leaves are ``flat``'s values, keyed by parameter path."""
    from shardlib.sharding.rules import path_str

    paths = [path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(like)]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), [flat[p] for p in paths])


def host_copy(tree):
    """NumPy copies of ``tree``'s arrays (a CPU array's host view would alias its buffer and
    block donation of the state it belongs to)."""
    return jax.tree.map(lambda x: np.array(jax.device_get(x), copy=True), tree)


def assert_bitwise(a, b) -> None:
    """The same paths, and every array equal bit for bit in dtype, shape and value; names each
    tensor that differs."""
    a_flat, _ = jax.tree_util.tree_flatten_with_path(host_copy(a))
    b_flat, _ = jax.tree_util.tree_flatten_with_path(host_copy(b))
    assert [jax.tree_util.keystr(p) for p, _ in a_flat] == [jax.tree_util.keystr(p) for p, _ in b_flat]
    differ = [jax.tree_util.keystr(p) for (p, x), (_, y) in zip(a_flat, b_flat)
              if x.dtype != y.dtype or x.shape != y.shape or not np.array_equal(x, y)]
    assert not differ, f"differ: {differ}"


def tpu_chips(topology: str = "v5e:2x4") -> list:
    """The chips of a TPU topology, which libtpu compiles for on this host (nothing runs), or a
    skip naming the install; under CI (CI=true) a missing libtpu fails instead of skipping."""
    import os

    import pytest

    from shardlib.runtime.devices import TopologyError, topology_devices

    try:
        return topology_devices(topology)
    except TopologyError as err:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must compile for TPU: {err}")
        pytest.skip(str(err))


def llama_workspace(root, text_chars: int = 60_000, **save):
    """``root`` holding a corpus (the first ``text_chars`` of the built-in one), a 256-id byte-level
    BPE tokenizer trained on it offline, and a 2-layer random-weight Llama that transformers wrote
    (``save``: `save_pretrained`'s options): the pretrained workflow's inputs, nothing downloaded."""
    import tokenizers
    import torch
    import transformers

    from shardlib.runtime.data import default_corpus

    text = default_corpus().decode("utf-8", errors="replace")[:text_chars]
    (root / "corpus.txt").write_text(text, encoding="utf-8")
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator([text], vocab_size=256, show_progress=False)
    bpe.save(str(root / "tokenizer.json"))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "llama", **save)
    return root
