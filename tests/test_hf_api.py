"""The one-call Python API (issue 45 §6): `shardlib.hf.from_pretrained` gives the sharded model and
its tokenizer, whose logits are transformers'; `shardlib.hf.save_pretrained` writes it back
bit-exact in f32, with its tokenizer, chat template and generation_config.json;
`shardlib.hf.generate` continues prompts as transformers' greedy ``generate`` does."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import shardlib.hf  # noqa: E402
from tests.helpers import llama_workspace  # noqa: E402

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = llama_workspace(tmp_path_factory.mktemp("api"))
    directory = root / "llama"
    (directory / "tokenizer.json").write_bytes((root / "tokenizer.json").read_bytes())
    (directory / "chat_template.jinja").write_text(TEMPLATE)
    return directory


def _reference_logits(directory, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits.numpy()


def test_from_pretrained_then_save_pretrained(llama, tmp_path):
    model, tokenizer = shardlib.hf.from_pretrained(llama, strategy="zero3", mesh={"data": 2, "fsdp": 4})
    assert tokenizer.chat_template == TEMPLATE and tokenizer.vocab_size == model.config.vocab_size
    embed = jax.tree.leaves(model.params)[0]
    assert dict(embed.sharding.mesh.shape)["fsdp"] == 4 and embed.dtype == np.float32
    ids = np.asarray([tokenizer.encode("def main():")], np.int32)
    expected = _reference_logits(llama, ids)
    np.testing.assert_allclose(np.asarray(model.module()(ids)), expected, atol=2e-5)
    out = shardlib.hf.save_pretrained(model, tmp_path / "EXP", dtype="f32")
    assert (out / "chat_template.jinja").read_text() == TEMPLATE
    assert json.loads((out / "generation_config.json").read_text()) == json.loads(
        (llama / "generation_config.json").read_text())
    np.testing.assert_array_equal(_reference_logits(out, ids), expected)  # f32: the same weights, bit for bit


def test_generate_is_transformers_greedy(llama):
    model, tokenizer = shardlib.hf.from_pretrained(llama, strategy="zero3")
    prompts = ["def main():", "import os"]
    texts = shardlib.hf.generate(model, tokenizer, prompts, max_new_tokens=8)
    reference = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32)
    for prompt, text in zip(prompts, texts):
        ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.no_grad():
            out = reference.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert text == tokenizer.decode(out[0, ids.shape[1]:].numpy())


def test_bfloat16_and_a_bad_dtype(llama):
    model, _ = shardlib.hf.from_pretrained(llama, strategy="dp", dtype="bfloat16", tokenizer=False)
    assert model.config.compute_dtype == "bfloat16"
    assert {leaf.dtype for leaf in jax.tree.leaves(model.params)} == {np.dtype(jax.numpy.bfloat16)}
    with pytest.raises(ValueError, match="dtype 'float16' is not one of float32, bfloat16"):
        shardlib.hf.from_pretrained(llama, dtype="float16")
