"""Hugging Face checkpoints in and out (`shardlib.hf`), against `transformers` (PyTorch, CPU) as the
independent reference: for Llama (Llama 3.2: llama3 rope scaling, explicit head_dim, tied head), Mistral,
Qwen2 (q/k/v biases), Gemma ((1 + w) norms, sqrt(d) embeddings, GeGLU, tied head), Qwen3 (q/k
RMSNorm per head) and Gemma 2 (soft-caps, query scale, a sliding window shorter than the test's
sequences on alternate layers, sandwich norms) and Gemma 3 text (q/k norms, a local rope base on
its sliding layer, linear scaling on the full one), Phi-3 (fused qkv_proj and gate_up_proj), and the
mixtures of experts Mixtral, Qwen2-MoE (shared expert, gates not renormalised) and Qwen3-MoE, each saved by
``save_pretrained`` with random weights (norm scales and biases drawn too, so none is trivial):

* logits equal transformers' in f32 on 1 device and under zero3 and fsdp_tp on 8 devices;
* each device reads only its own shard of each tensor from the files;
* one zero3 fine-tuning step from the imported weights equals a plain ``jax.jit`` + optax step;
* greedy generation with the KV cache gives transformers' ``generate`` token ids;
* the export loads in transformers with the same logits, and HF -> shardlib -> HF in f32 is bit-exact;
* what is not reproduced (architectures, rope types, sliding windows, foreign tensors) is refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from shardlib import build, make_layout, make_mesh  # noqa: E402
from shardlib.hf import architectures as arch_lib  # noqa: E402
from shardlib.hf.load import PretrainedError, load_params, open_pretrained  # noqa: E402
from shardlib.hf.save import save_pretrained  # noqa: E402
from shardlib.models import MoEConfig, trainable  # noqa: E402
from shardlib.models.decoding import generate  # noqa: E402
from shardlib.models import from_params  # noqa: E402
from shardlib.models.gpt import next_token_loss  # noqa: E402
from shardlib.models.moe import moe_loss  # noqa: E402

VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)
# Llama 3.2 1B / 3B's rope (their published config.json): the "llama" row is Llama 3.2 scaled down.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
LLAMA32 = dict(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False, mlp_bias=False,
               hidden_act="silu", max_position_embeddings=131072, pretraining_tp=1, rms_norm_eps=1e-5,
               rope_theta=500000.0, rope_scaling={k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"},
               tie_word_embeddings=True, torch_dtype="bfloat16", vocab_size=128256, num_key_value_heads=8,
               intermediate_size=8192)
LLAMA32_SIZES = {  # config.json fields of each size, and its parameter count as published (1.24B, 3.21B)
    "1B": (dict(hidden_size=2048, num_attention_heads=32, num_hidden_layers=16, head_dim=64), 1_235_814_400),
    "3B": (dict(hidden_size=3072, num_attention_heads=24, num_hidden_layers=28, head_dim=128), 3_212_749_824),
}
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(head_dim=32, tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)),
    # sliding windows of 6, shorter than the sequences and prompt + continuation: on every layer
    # (Mistral), on the layers from max_window_layers on (Qwen2)
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=6)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    # a window of 6 on layer 0 (prompt 6 + 10 generated: past it); soft-caps low enough that each (and
    # the window, and the query scale) moves these small random weights' logits by over 4e-3, 40x the bound
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16, sliding_window=6, query_pre_attn_scalar=24,
                                                         attn_logit_softcapping=0.05, final_logit_softcapping=1.0)),
    # Gemma 3: q/k norms, a window of 6 on its sliding layer with its own rope base, linear scaling on the full one
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=16, sliding_window=6, query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})),
    # Phi-3 (mini 4k's layout): q, k, v in one qkv_proj and gate, up in one gate_up_proj; its window of 6
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=6, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # MoE (models/moe.py, dropless): 4 experts of 32, top 2; Mixtral renormalises the two gates, with a
    # window of 6 on both layers; Qwen2-MoE does not (norm_topk_prob false), adds its shared expert with
    # its sigmoid gate, q/k/v biases and a window on layer 1; Qwen3-MoE renormalises, with q/k norms
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                                                           intermediate_size=32, sliding_window=6)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        use_sliding_window=True, sliding_window=6, max_window_layers=1)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2,
                                                              moe_intermediate_size=32, head_dim=32, norm_topk_prob=True)),
}
SEQ = 16


def _save(name: str, directory: Path, **shard) -> Path:
    config_cls, model_cls, extra = ARCHS[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**COMMON, **extra}))
    with torch.no_grad():  # scales and biases start at 1 / 0 in transformers: draw them so they matter
        for param_name, param in model.named_parameters():
            if "norm" in param_name or "bias" in param_name:
                param.normal_(0.0, 0.5)
    model.save_pretrained(directory, **shard)
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """One random-weight checkpoint per architecture; Llama's in several shards with an index."""
    root = tmp_path_factory.mktemp("hf")
    return {name: _save(name, root / name, **({"max_shard_size": "100KB"} if name == "llama" else {}))
            for name in ARCHS}


@pytest.fixture(scope="module")
def tokens() -> np.ndarray:
    return np.random.RandomState(0).randint(0, VOCAB, (2, SEQ)).astype(np.int32)


def _reference_logits(directory: Path, tokens: np.ndarray) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


@pytest.fixture(scope="module")
def reference_logits(checkpoints, tokens) -> dict[str, np.ndarray]:
    """transformers' f32 logits of each checkpoint on ``tokens``, computed once: the logits test and
    the export test compare with the same numbers (read-only: nothing writes into them)."""
    cache: dict[str, np.ndarray] = {}

    def get(name: str) -> np.ndarray:
        if name not in cache:
            cache[name] = _reference_logits(checkpoints[name], tokens)
            cache[name].flags.writeable = False
        return cache[name]

    return get


def _placed(directory: Path, strategy: str, mesh: dict[str, int]):
    pretrained = open_pretrained(directory)
    model = trainable(pretrained.model_config)
    layout = make_layout(model, strategy, make_mesh(mesh, devices=jax.devices()[:int(np.prod(list(mesh.values())))]))
    return pretrained, model, layout, load_params(pretrained, layout.param_shardings())


@pytest.fixture(scope="module")
def zero3_placed(checkpoints):
    """Each checkpoint imported once under zero3 on 8 devices, shared by the fine-tuning, greedy and
    export tests (none donates or changes the parameters: `Program.init_from` copies them into
    the state the step donates)."""
    cache: dict[str, tuple] = {}

    def get(name: str) -> tuple:
        if name not in cache:
            cache[name] = _placed(checkpoints[name], "zero3", {"fsdp": 8})
        return cache[name]

    return get


CASES = [("dp", {"data": 1}), ("zero3", {"fsdp": 8}), ("fsdp_tp", {"fsdp": 4, "tensor": 2})]


@pytest.mark.parametrize("name", list(ARCHS))
def test_logits_equal_transformers_on_one_and_eight_devices(checkpoints, tokens, reference_logits, name):
    expected = reference_logits(name)
    assert np.abs(expected).max() > 0.1  # logits of a scale the 1e-4 bound means something at
    pretrained = open_pretrained(checkpoints[name])
    model = trainable(pretrained.model_config)
    forward = jax.jit(model.apply)  # traced once, lowered and compiled for each layout's shardings
    for strategy, mesh in CASES:
        layout = make_layout(model, strategy, make_mesh(mesh, devices=jax.devices()[:int(np.prod(list(mesh.values())))]))
        logits = np.asarray(forward(load_params(pretrained, layout.param_shardings()), jnp.asarray(tokens)))
        gap = np.abs(logits - expected).max()
        assert gap <= 1e-4, f"{name} under {strategy}: max |logits - transformers'| = {gap}"


def test_each_checkpoint_byte_is_read_once_whatever_the_layout(checkpoints):
    """Under zero3 on 8 devices a matrix's shard is a column block of the checkpoint's rows; the
    reader still reads each tensor's bytes once (counted by the reader), not once per device, and
    exactly once: what one process of a job reads (tests/test_hf_import_processes.py: its share)."""
    pretrained = open_pretrained(checkpoints["qwen2"])
    stored = sum(int(np.prod(f.shape(n))) * f.dtype(n).itemsize for n, f in pretrained.files.items())
    model = trainable(pretrained.model_config)
    for strategy, mesh in (("zero3", {"fsdp": 8}), ("fsdp_tp", {"fsdp": 4, "tensor": 2})):
        files = set(pretrained.files.values())
        before = sum(f.bytes_read for f in files)
        layout = make_layout(model, strategy, make_mesh(mesh))
        jax.block_until_ready(load_params(pretrained, layout.param_shardings()))
        assert sum(f.bytes_read for f in files) - before == stored, strategy


def test_one_process_slices_each_shard_and_converts_it_without_collectives(checkpoints, monkeypatch):
    """In one process every device's shard is sliced on the host from the rows read once: no
    parameter takes the resharding path. On these CPU devices no program runs either: each
    device's shard is the host buffer the conversion wrote (placed without a copy, so nothing
    zero-filled or copied after). The programs an accelerator's devices run to convert (and
    stack) the shards give the same bits, and have no collective in their compiled HLO. The
    checkpoint tensors are mapped (`TensorFile.map_rows`), never copied into read buffers."""
    from shardlib.hf import local_rows, rows
    from shardlib.hf.safetensors_io import TensorFile
    from shardlib.sharding.rules import path_str

    monkeypatch.setattr(rows, "_assembler", lambda *a: pytest.fail("a resharding program in one process"))
    monkeypatch.setattr(local_rows, "programs", lambda *a: pytest.fail("a program for CPU devices"))
    monkeypatch.setattr(TensorFile, "read_rows", lambda *a, **k: pytest.fail("a copying read in one process"))
    written = []
    host_buffer = local_rows._host_buffer
    monkeypatch.setattr(local_rows, "_host_buffer", lambda *a: written.append(host_buffer(*a)) or written[-1])
    pretrained = open_pretrained(checkpoints["qwen2"])
    shardings = make_layout(trainable(pretrained.model_config), "zero3", make_mesh({"fsdp": 8})).param_shardings()
    params = jax.block_until_ready(load_params(pretrained, shardings))
    placed = {s.data.unsafe_buffer_pointer() for leaf in jax.tree.leaves(params) for s in leaf.addressable_shards}
    assert placed == {buffer.ctypes.data for buffer in written} and len(placed) == 8 * len(jax.tree.leaves(params))
    monkeypatch.undo()
    # an accelerator's path (the programs convert and stack on the devices) run on these devices: the same bits
    monkeypatch.setattr(local_rows, "in_host_memory", lambda sharding: False)
    on_devices = jax.block_until_ready(load_params(pretrained, shardings))
    monkeypatch.undo()
    for got, want in zip(jax.tree.leaves(on_devices), jax.tree.leaves(params)):
        assert got.sharding == want.sharding and np.asarray(got).tobytes() == np.asarray(want).tobytes()
    maps = {t.path: t for t in arch_lib.tensors_for(pretrained.model_config, pretrained.architecture)}
    split = 0
    for (path, sharding), value in zip(jax.tree_util.tree_flatten_with_path(shardings)[0], jax.tree.leaves(params)):
        t, shape = maps[path_str(path)], value.shape
        assert local_rows.applies(t, shape, sharding) and value.sharding == sharding
        split += any(s is not None for s in sharding.spec)
        name = arch_lib.hf_names(t, *shape[:t.stacked])[0]
        stored = pretrained.files[name].dtype(name)  # what an accelerator's devices are sent
        for program in local_rows.programs(t, shape, sharding, np.dtype(np.float32), stored):
            hlo = program.as_text()
            assert not [op for op in ("all-to-all", "all-gather", "all-reduce", "collective-permute",
                                      "reduce-scatter") if op in hlo], path_str(path)
    assert split >= 5  # zero3 splits the matrices over the 8 devices: the shards are slices


@pytest.mark.parametrize("name", list(ARCHS))
def test_a_zero3_fine_tuning_step_equals_plain_jit(zero3_placed, tokens, name):
    """The imported weights, one AdamW step under zero3 on 8 devices, against the same step written
    with jax.jit + optax on the module's own parameters (no shardlib in the step). The two are
    different programs, so the gradients differ by float32 summation noise |dg| ~ 1e-8; Adam's first
    step moves a parameter by lr g / (|g| + eps), which turns that into up to lr |dg| / eps: eps is
    1e-3 so that stays 1e-8, under the bound, for a gradient near zero (at eps 1e-5 one of Gemma 3's
    8192 wo entries came out 1.2e-6 apart from exactly this)."""
    pretrained, model, layout, params = zero3_placed(name)
    tx = optax.adamw(1e-3, eps=1e-3)
    program = build(model, tx, layout)
    batch = {"inputs": np.tile(tokens, (4, 1)), "targets": np.roll(np.tile(tokens, (4, 1)), -1, axis=1)}
    state, metrics = program.step(program.init_from(params), batch)

    host = jax.tree.map(np.asarray, params)

    model_loss = moe_loss if isinstance(pretrained.model_config, MoEConfig) else next_token_loss

    def loss(p, b):
        return model_loss(from_params(pretrained.model_config, p), b)[0]

    @jax.jit
    def plain(p, b):
        value, grads = jax.value_and_grad(loss)(p, b)
        updates, _ = tx.update(grads, tx.init(p), p)
        return optax.apply_updates(p, updates), value

    expected, expected_loss = plain(host, batch)
    np.testing.assert_allclose(float(metrics["loss"]), float(expected_loss), rtol=1e-6)
    for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(state.params)[0], jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("name", list(ARCHS))
def test_greedy_generation_equals_transformers(checkpoints, tokens, zero3_placed, name):
    reference = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[name], dtype=torch.float32)
    prompt = tokens[:, :6]
    with torch.no_grad():
        want = reference.generate(torch.tensor(prompt, dtype=torch.long), max_new_tokens=10, do_sample=False,
                                  eos_token_id=None, pad_token_id=0).numpy()
    pretrained, _, _, params = zero3_placed(name)
    got = generate(from_params(pretrained.model_config, params), prompt, 10, rng=jax.random.key(0), temperature=0.0)
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("name", list(ARCHS))
def test_export_round_trip_is_bit_exact_and_loads_in_transformers(zero3_placed, reference_logits, tokens, tmp_path,
                                                                  name):
    """HF -> shardlib (zero3 shards) -> HF in f32: every tensor equal bit for bit, the index names
    each shard, and transformers' logits of the export equal those of the original."""
    pretrained, _, _, params = zero3_placed(name)
    out = tmp_path / "export"
    written = save_pretrained(params, pretrained.model_config, out, hf_config=pretrained.hf_config,
                              architecture=pretrained.architecture.name, dtype="f32", max_shard_bytes=40_000)
    assert written.files > 1 and (out / "model.safetensors.index.json").is_file()
    exported = open_pretrained(out)
    for tensor, file in pretrained.files.items():
        original, copy = file.read(tensor), exported.files[tensor].read(tensor)
        assert original.dtype == copy.dtype and np.array_equal(original.view(np.uint32), copy.view(np.uint32)), tensor
    assert set(exported.files) == set(pretrained.files)
    np.testing.assert_array_equal(_reference_logits(out, tokens), reference_logits(name))


@pytest.mark.parametrize("size", list(LLAMA32_SIZES))
def test_llama_3_2_configs_read_as_transformers_computes_them(size):
    """Llama 3.2 1B / 3B's config.json fields: the tied head, head_dim, and the llama3 rope
    frequencies equal transformers' own (its rope init function on the full-size config); the
    parameter count is the published one, so no field was read wrong."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from shardlib.models.configs import param_count

    fields, count = LLAMA32_SIZES[size]
    config = {**LLAMA32, **fields}
    gpt = arch_lib.to_gpt_config(config, size)
    assert gpt.tie_embeddings and gpt.head_dim == fields["head_dim"] and param_count(gpt) == count
    expected, scale = ROPE_INIT_FUNCTIONS["llama3"](transformers.LlamaConfig(**config), "cpu")
    assert scale == 1.0
    np.testing.assert_allclose(np.asarray(_frequencies(gpt.head_dim, gpt.rope_theta, gpt.rope_scaling)),
                               expected.numpy(), rtol=1e-6)


def _frequencies(head_dim: int, theta: float, scaling):
    """`rope_frequencies` as the model computes it, inside a compiled program (one compile, not one
    per operation run eagerly)."""
    from shardlib.models.gpt import rope_frequencies

    return jax.jit(rope_frequencies, static_argnums=(0, 1, 2))(head_dim, theta, scaling)


ROPES = {  # rope_parameters of each scaling transformers computes, with non-default knobs where it has them
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn_mscale": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 8.0, "original_max_position_embeddings": 64,
                    "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},
}


@pytest.mark.parametrize("rope", list(ROPES))
def test_rope_scalings_equal_transformers(rope, tokens, tmp_path):
    """Linear, dynamic (within max_position_embeddings) and YaRN rope: the frequencies and
    attention factor equal transformers' own rope init functions, a Llama checkpoint's logits equal
    transformers' within 1e-4 in f32, and the export's config.json reads back to the same scaling."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(**{**COMMON, "num_hidden_layers": 1}, head_dim=32, rope_parameters=ROPES[rope])
    model = transformers.LlamaForCausalLM(hf_config)
    model.save_pretrained(tmp_path)
    pretrained, module, _, params = _placed(tmp_path, "dp", {"data": 1})
    gpt = pretrained.model_config
    inv_freq, attention = ROPE_INIT_FUNCTIONS[ROPES[rope]["rope_type"]](hf_config, "cpu")
    np.testing.assert_allclose(np.asarray(_frequencies(gpt.head_dim, gpt.rope_theta, gpt.rope_scaling)),
                               inv_freq.numpy(), rtol=1e-6)
    assert gpt.rope_scaling.attention_factor == pytest.approx(attention, rel=1e-12)
    logits = np.asarray(jax.jit(module.apply)(params, jnp.asarray(tokens)))
    np.testing.assert_allclose(logits, _reference_logits(tmp_path, tokens), atol=1e-4, rtol=0)
    exported = arch_lib.from_gpt_config(gpt, pretrained.architecture, pretrained.hf_config)
    assert arch_lib.to_gpt_config(exported, "export") == gpt
    assert arch_lib.to_gpt_config({**exported, "rope_parameters": None}, "as 4.x writes it") == gpt


def _read_like_transformers_4(config: dict) -> dict:
    """config.json as transformers 4.x's LlamaConfig reads it, field by field: ``rope_theta`` (its
    default 10000 when absent), ``rope_scaling`` with ``rope_type`` or the older ``type``, ``torch_dtype``."""
    scaling = config.get("rope_scaling") or {}
    return {"rope_theta": config.get("rope_theta", 10000.0), "torch_dtype": config.get("torch_dtype"),
            "rope_type": scaling.get("rope_type", scaling.get("type", "default")),
            **{k: scaling.get(k) for k in ("factor", "low_freq_factor", "high_freq_factor",
                                           "original_max_position_embeddings")},
            "head_dim": config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]}


def _llama3_inv_freq_as_transformers_4(read: dict) -> np.ndarray:
    """transformers 4.x's ``_compute_llama3_parameters`` (written out here) from the fields it read."""
    dim, factor, old_len = read["head_dim"], read["factor"], read["original_max_position_embeddings"]
    inv_freq = 1.0 / (read["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    wavelen = 2 * np.pi / inv_freq
    scaled = torch.where(wavelen > old_len / read["low_freq_factor"], inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - read["low_freq_factor"]) / (read["high_freq_factor"] - read["low_freq_factor"])
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / read["high_freq_factor"]) * ~(wavelen > old_len / read["low_freq_factor"])
    return torch.where(medium, smoothed, scaled).numpy()


def test_export_config_reads_in_transformers_4_with_the_rope_and_generation_config(checkpoints, tmp_path):
    """Issue 46 §3: the exported config.json carries transformers 4.x's fields (``rope_theta`` +
    ``rope_scaling``, ``torch_dtype``) beside 5's (``rope_parameters``, ``dtype``), so a 4.x reader
    gets Llama 3's θ and scaling, not θ = 10000 unscaled; generation_config.json comes back as it was."""
    from shardlib.hf.generation_config import read_generation_config

    source = checkpoints["llama"]
    pretrained, _, _, params = _placed(source, "dp", {"data": 1})
    out = tmp_path / "export"
    save_pretrained(params, pretrained.model_config, out, hf_config=pretrained.hf_config,
                    architecture=pretrained.architecture.name, dtype="f32",
                    generation_config=read_generation_config(source))
    config = json.loads((out / "config.json").read_text())
    read = _read_like_transformers_4(config)
    assert read == {**{k: LLAMA3_ROPE[k] for k in LLAMA3_ROPE if k != "rope_type"}, "rope_type": "llama3",
                    "torch_dtype": "float32", "head_dim": 32}
    assert config["rope_parameters"] == LLAMA3_ROPE and config["dtype"] == "float32"
    reference = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    np.testing.assert_allclose(_llama3_inv_freq_as_transformers_4(read), reference.model.rotary_emb.inv_freq.numpy(),
                               rtol=1e-6)
    plain = json.loads((checkpoints["qwen2"] / "config.json").read_text())
    qwen = arch_lib.from_gpt_config(arch_lib.to_gpt_config(plain, "qwen2"), arch_lib.ARCHITECTURES["Qwen2ForCausalLM"],
                                    plain)
    assert _read_like_transformers_4(qwen)["rope_theta"] == plain["rope_parameters"]["rope_theta"]
    assert qwen["rope_scaling"] is None
    assert (source / "generation_config.json").is_file()
    assert json.loads((out / "generation_config.json").read_text()) == json.loads(
        (source / "generation_config.json").read_text())
    assert transformers.GenerationConfig.from_pretrained(out).to_dict() == \
        transformers.GenerationConfig.from_pretrained(source).to_dict()


def test_refusals_name_what_is_not_reproduced(checkpoints, tmp_path):
    base = json.loads((checkpoints["mistral"] / "config.json").read_text())
    cases = {
        "architecture": ({**base, "architectures": ["DeepseekV3ForCausalLM"]}, "DeepseekV3ForCausalLM.*LlamaForCausalLM"),
        "longrope": ({**json.loads((checkpoints["phi3"] / "config.json").read_text()), "rope_scaling": {
            "type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}, "rope_parameters": None},
            "Phi-3's rope type 'su'"),
        "rope": ({**base, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0}},
                 "rope type 'longrope'"),
        "dynamic": ({**base, "max_position_embeddings": 32, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4,
                                                                              "factor": 2.0}}, "'dynamic'.*at most 32"),
        "bias": ({**base, "architectures": ["LlamaForCausalLM"], "attention_bias": True}, "attention_bias=True"),
        "dense layers": ({**json.loads((checkpoints["qwen2_moe"] / "config.json").read_text()), "decoder_sparse_step": 2},
                         "decoder_sparse_step=2.*every layer routed"),
        "router jitter": ({**json.loads((checkpoints["mixtral"] / "config.json").read_text()), "router_jitter_noise": 0.1},
                          "router_jitter_noise=0.1"),
    }
    for label, (config, message) in cases.items():
        with pytest.raises(arch_lib.UnsupportedModel, match=message):
            arch_lib.to_gpt_config(config, label, seq_len=64)
    gemma2 = open_pretrained(checkpoints["gemma2"]).model_config  # soft-caps: not in jax.nn.dot_product_attention
    for attention in ("cudnn", "xla", "blocked"):
        with pytest.raises(ValueError, match=f"attention='{attention}' cannot run attention soft-capping"):
            dataclasses.replace(gemma2, attention=attention)
    for attention in ("flash", "splash"):  # windows and soft-caps run there (tests/test_attention_masks.py)
        dataclasses.replace(gemma2, attention=attention)
    # a window only where it can matter: a run within it keeps full causal attention (and flash)
    assert open_pretrained(checkpoints["mistral"], seq_len=6).model_config.layer_windows is None
    assert open_pretrained(checkpoints["mistral"], seq_len=7).model_config.layer_windows == (6, 6)
    assert open_pretrained(checkpoints["qwen2"]).model_config.layer_windows == (0, 6)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(base))
    (pickled / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(PretrainedError, match="pytorch_model.bin.*never loaded"):
        open_pretrained(pickled)
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "config.json").write_text(json.dumps({**base, "intermediate_size": 96}))
    os.symlink(checkpoints["mistral"] / "model.safetensors", wrong / "model.safetensors")
    with pytest.raises(PretrainedError, match=r"gate_proj.weight' has shape \[128, 64\], and config.json implies \[96, 64\]"):
        open_pretrained(wrong)


def test_an_moe_model_born_in_shardlib_exports_as_mixtral(tokens, tmp_path):
    """A top-2 MoE model made by shardlib (random init, renormalised gates: what Mixtral computes) is
    written as MixtralForCausalLM, each expert's w1 / w3 / w2 its own tensor, and transformers' logits of
    the export equal shardlib's within 1e-4; a top-1 one (its gate the softmax probability) and a
    shared expert are refused by name rather than written as a Mixtral that computes otherwise."""
    from shardlib.models import MoEGPT

    config = MoEConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=16, n_experts=4,
                       top_k=2, dropless=True, remat=False)
    with nnx.use_eager_sharding(False):  # initialised and run in compiled programs, not op by op
        model = nnx.jit(lambda: MoEGPT(config, rngs=nnx.Rngs(1)))()
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    got = np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(tokens)))
    written = save_pretrained(params, config, tmp_path / "mixtral", dtype="f32")
    assert written.architecture == "MixtralForCausalLM"
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in open_pretrained(tmp_path / "mixtral").files
    np.testing.assert_allclose(_reference_logits(tmp_path / "mixtral", tokens), got, atol=1e-4, rtol=0)
    for change, message in (({"top_k": 1}, "top_k=1 gates not renormalised"), ({"shared_d_ff": 8}, "a shared expert")):
        with pytest.raises(arch_lib.UnsupportedModel, match=message):
            save_pretrained(params, dataclasses.replace(config, **change), tmp_path / "refused", dtype="f32")
    assert not (tmp_path / "refused").exists()


def test_completion_only_loss_counts_the_masked_targets(tokens):
    """``loss_mask`` makes the loss the mean over the counted targets, as written out by hand."""
    from shardlib.models import build as build_gpt, get_config

    model = nnx.jit(lambda: build_gpt(get_config("tiny")))()  # compiled once, not op by op
    mask = np.zeros(tokens.shape, np.float32)
    mask[:, 10:] = 1.0
    batch = {"inputs": tokens, "targets": np.roll(tokens, -1, axis=1), "loss_mask": mask}
    loss, logits = nnx.jit(lambda m, b: (next_token_loss(m, b)[0], m(b["inputs"])))(model, batch)
    logp = np.asarray(jax.nn.log_softmax(logits), np.float64)
    ce = -np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    np.testing.assert_allclose(float(loss), (ce * mask).sum() / mask.sum(), rtol=1e-5)
