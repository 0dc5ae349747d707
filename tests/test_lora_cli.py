"""LoRA from the command line, against `peft` as the independent reference: a transformers-written
Llama fine-tuned under zero3 with ``--lora-rank``, exported as a PEFT adapter (``export --peft``) and
as merged weights (``export --hf``): ``peft.PeftModel.from_pretrained(base, adapter)`` gives the
merged export's logits; ``--init-lora`` continues from that adapter; bad combinations are one line."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
peft = pytest.importorskip("peft")

from shardlib.cli import main  # noqa: E402
from shardlib.hf.peft import CONFIG_FILE, WEIGHTS_FILE  # noqa: E402
from shardlib.hf.safetensors_io import TensorFile  # noqa: E402
from tests.helpers import llama_workspace  # noqa: E402

LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "q,v,o,gate,down"]


def _train(workspace, out: str, *extra: str) -> list[str]:
    return ["train", "--init-from", str(workspace / "llama"), "--data", str(workspace / "corpus.txt"),
            "--tokenizer", str(workspace / "tokenizer.json"), "--strategy", "zero3", "--batch-size", "8",
            "--seq-len", "32", "--no-progress", "--sample-tokens", "0", "--out", str(workspace / out), *extra]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return llama_workspace(tmp_path_factory.mktemp("lora"), text_chars=30_000)


@pytest.fixture(scope="module")
def trained(workspace):
    """5 zero3 LoRA steps in f32 from the imported weights, then the adapter and the merged model."""
    assert main(_train(workspace, "R", *LORA, "--steps", "5", "--ckpt-every", "5", "--lr", "1e-2")) == 0
    assert main(["export", "--ckpt", str(workspace / "R"), "--out", str(workspace / "PEFT"), "--peft"]) == 0
    assert main(["export", "--ckpt", str(workspace / "R"), "--out", str(workspace / "HF"), "--hf",
                 "--dtype", "f32"]) == 0
    return workspace / "R", workspace / "PEFT", workspace / "HF"


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.numpy()


def test_peft_loads_the_adapter_with_the_merged_exports_logits(workspace, trained, capsys):
    run, adapter, merged = trained
    config = json.loads((adapter / CONFIG_FILE).read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8, "LORA")
    assert sorted(config["target_modules"]) == sorted(["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"])
    assert json.loads((run / "config.json").read_text())["lora"] == {"rank": 4, "alpha": 8.0, "base": None,
                                                                      "targets": ["q", "v", "o", "gate", "down"]}
    ids = torch.tensor(np.random.RandomState(0).randint(0, 256, (2, 16)))
    base = transformers.AutoModelForCausalLM.from_pretrained(workspace / "llama", dtype=torch.float32)
    original = _logits(base, ids)
    with_adapter = _logits(peft.PeftModel.from_pretrained(base, adapter), ids)
    exported = _logits(transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32), ids)
    assert np.abs(with_adapter - original).max() > 1e-2  # the adapters learned something
    gap = np.abs(with_adapter - exported).max()
    assert gap <= 1e-4, f"max |PEFT logits - merged export's| = {gap}"


def test_generate_from_the_lora_run_equals_peft_greedy(workspace, trained, capsys):
    """`shardlib generate --from RUN` (the base and the adapters restored from the checkpoint, zero3):
    the greedy continuation of `peft.PeftModel` over the same base and exported adapter, token for token."""
    from shardlib.hf.tokenizer import load_tokenizer

    run, adapter, _ = trained
    prompt = "import os"
    assert main(["generate", "--from", str(run), "--prompt", prompt, "--max-new-tokens", "12", "--strategy",
                 "zero3"]) == 0
    ours = capsys.readouterr().out
    tokenizer = load_tokenizer(workspace / "tokenizer.json")
    base = transformers.AutoModelForCausalLM.from_pretrained(workspace / "llama", dtype=torch.float32)
    reference = peft.PeftModel.from_pretrained(base, adapter)
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        out = reference.generate(input_ids=torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, len(ids):].tolist()
    assert ours == prompt + tokenizer.decode(out) + "\n"


def test_init_lora_continues_from_the_adapter(workspace, trained, capsys):
    """A run started from the PEFT adapter holds its tensors: one step at lr 1e-9 moves no element by
    more than 1e-7 (AdamW moves each by about lr), where a fresh adapter's B would be all zeros."""
    _, adapter, _ = trained
    assert main(_train(workspace, "R2", "--init-lora", str(adapter), "--steps", "1", "--ckpt-every", "1",
                       "--lr", "1e-9")) == 0
    # q,v,o,gate,down on 2 layers, rank 4: rank x (in + out) = 4 x (128 + 96 + 128 + 192 + 192) a layer
    trains = 2 * 4 * (128 + 96 + 128 + 192 + 192)
    base = 106_816  # the Llama's own parameters
    header = capsys.readouterr().out
    assert (f"trains     {trains:,} of {base + trains:,} parameters ({100 * trains / (base + trains):.2f}%): LoRA rank 4, "
            f"alpha 8 on q,v,o,gate,down from {adapter}; the other {base:,} frozen, stored in float32") in header
    assert main(["export", "--ckpt", str(workspace / "R2"), "--out", str(workspace / "PEFT2"), "--peft"]) == 0
    first, again = TensorFile(adapter / WEIGHTS_FILE), TensorFile(workspace / "PEFT2" / WEIGHTS_FILE)
    assert sorted(first.entries) == sorted(again.entries)
    assert any(np.abs(first.read(n)).max() > 1e-3 for n in first.entries if "lora_B" in n)
    for name in first.entries:
        np.testing.assert_allclose(again.read(name), first.read(name), rtol=0, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("flags, message", [
    (["--lora-alpha", "8"], "--lora-alpha: shapes LoRA adapters: add --lora-rank"),
    (["--lora-rank", "0"], "--lora-rank: LoRA rank must be a positive integer"),
    (["--lora-rank", "4", "--lora-targets", "q,qkv"], "--lora-targets: LoRA targets q,qkv"),
    (["--lora-rank", "8", "--init-lora", "PEFT"], "--init-lora: "),
    (["--lora-base", "int8"], "--lora-base: shapes LoRA adapters: add --lora-rank"),
    (["--lora-rank", "4", "--lora-base", "nf4"], "--lora-base: LoRA base 'nf4' is not supported yet"),
])
def test_bad_lora_flags_are_one_line_before_any_compile(workspace, trained, capsys, flags, message):
    flags = [str(workspace / f) if f == "PEFT" else f for f in flags]
    assert main(_train(workspace, "BAD", *flags, "--steps", "1")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_lora_needs_a_pretrained_base_and_peft_export_a_lora_run(workspace, capsys):
    assert main(["train", "--model", "tiny", "--lora-rank", "4", "--steps", "1", "--no-progress",
                 "--out", str(workspace / "NOBASE")]) == 2
    assert "--lora-rank: adapts a pretrained model, kept frozen: add --init-from" in capsys.readouterr().err


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _int8_dequantised(weight):
    """A Hugging Face weight [out, in] through QLoRA's int8 by its formula: per output row (channel),
    s = absmax / 127, codes = round(w / s) -> codes x s; and where w / s is within 1e-4 of a
    rounding tie (the last bit of the division decides the code there: one step either way)."""
    scale = np.abs(weight).max(axis=1, keepdims=True) / np.float32(127)
    ratio = weight / scale
    return np.round(ratio).astype(np.float32) * scale, np.abs(np.abs(ratio % 1) - 0.5) < 1e-4, scale


def test_qlora_int8_exports_the_adapter_and_merges_into_the_dequantised_base(workspace, capsys):
    """``--lora-base int8``: the run header says so, the checkpoint keeps int8 codes, ``export --peft``
    writes the adapter, and ``export --hf`` merges it into the dequantised base: peft's model over
    the base quantised here by the formula gives the merged export's logits (f32, <= 1e-4), and an
    unadapted projection is exported as that dequantised weight."""
    if importlib.util.find_spec("qwix") is None:
        pytest.skip("QLoRA needs qwix: pip install 'shardlib[qlora]'")
    assert main(_train(workspace, "Q", *LORA, "--lora-base", "int8", "--steps", "3", "--ckpt-every", "3",
                       "--lr", "1e-2")) == 0
    header = capsys.readouterr().out
    assert ("QLoRA rank 4, alpha 8 on q,v,o,gate,down over an int8 base; the other 106,816 frozen, stored in float32, "
            "the projections as int8 codes with per-channel scales (QLoRA)") in header
    assert json.loads((workspace / "Q" / "config.json").read_text())["lora"]["base"] == "int8"
    assert main(["export", "--ckpt", str(workspace / "Q"), "--out", str(workspace / "QPEFT"), "--peft"]) == 0
    assert main(["export", "--ckpt", str(workspace / "Q"), "--out", str(workspace / "QHF"), "--hf",
                 "--dtype", "f32"]) == 0
    base = transformers.AutoModelForCausalLM.from_pretrained(workspace / "llama", dtype=torch.float32)
    state = base.state_dict()
    formula = {name: _int8_dequantised(w.numpy()) for name, w in state.items()
               if name.endswith(tuple(f"{p}.weight" for p in PROJECTIONS))}
    quantised = {name: torch.from_numpy(back) for name, (back, _, _) in formula.items()}
    assert len(quantised) == 2 * 7
    base.load_state_dict({**state, **quantised})
    ids = torch.tensor(np.random.RandomState(0).randint(0, 256, (2, 16)))
    plain = _logits(base, ids)
    with_adapter = _logits(peft.PeftModel.from_pretrained(base, workspace / "QPEFT"), ids)
    merged = transformers.AutoModelForCausalLM.from_pretrained(workspace / "QHF", dtype=torch.float32)
    assert np.abs(with_adapter - plain).max() > 1e-2  # the adapters learned something
    gap = np.abs(with_adapter - _logits(merged, ids)).max()
    assert gap <= 1e-4, f"max |PEFT logits over the int8 base - merged export's| = {gap}"
    up = "model.layers.1.mlp.up_proj.weight"  # not adapted: the dequantised weight itself
    back, tie, scale = formula[up]
    gap = np.abs(merged.state_dict()[up].numpy() - back)
    assert (gap[~tie] <= 1e-7).all() and (gap[tie] <= scale.repeat(back.shape[1], 1)[tie] * 1.001).all()
