"""The pretrained workflow from the command line: a transformers-written Llama and a byte-level BPE
tokenizer the tokenizers library trains offline, fine-tuned under zero3 (`shardlib train
--init-from --tokenizer`), exported (`shardlib export --hf`), loaded back by transformers, and
continued by `shardlib generate`; instruction data trains on its completions only.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from shardlib.cli import main  # noqa: E402
from shardlib.hf.load import open_pretrained  # noqa: E402
from shardlib.hf.tokenizer import instruction_rows, load_tokenizer, tokenize_text  # noqa: E402
from shardlib.run.config import TrainConfig  # noqa: E402
from shardlib.run.train import train  # noqa: E402
from tests.helpers import llama_workspace  # noqa: E402


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return llama_workspace(tmp_path_factory.mktemp("pretrained"), max_shard_size="100KB")


@pytest.fixture(scope="module")
def trained(workspace):
    """The issue's command: 5 zero3 steps from the imported weights, checkpointed, then exported in f32."""
    args = ["train", "--init-from", str(workspace / "llama"), "--data", str(workspace / "corpus.txt"),
            "--tokenizer", str(workspace / "tokenizer.json"), "--strategy", "zero3", "--steps", "5",
            "--ckpt-every", "5", "--out", str(workspace / "R"), "--batch-size", "8", "--seq-len", "32",
            "--no-progress", "--sample-tokens", "0"]
    assert main(args) == 0
    assert main(["export", "--ckpt", str(workspace / "R"), "--out", str(workspace / "EXP"), "--hf", "--dtype", "f32",
                 "--max-shard-mb", "0.1"]) == 0
    return workspace / "R", workspace / "EXP"


def test_train_from_hf_then_export_loads_in_transformers(workspace, trained):
    run, exported = trained
    saved = json.loads((run / "config.json").read_text())
    assert saved["pretrained"]["architecture"] == "LlamaForCausalLM"
    assert (exported / "model.safetensors.index.json").is_file() and (exported / "tokenizer.json").is_file()
    assert (json.loads((exported / "generation_config.json").read_text())
            == json.loads((workspace / "llama" / "generation_config.json").read_text()))  # kept from the import
    fine_tuned = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    original = transformers.AutoModelForCausalLM.from_pretrained(workspace / "llama", dtype=torch.float32)
    ids = torch.tensor([load_tokenizer(workspace / "tokenizer.json").encode("def main():")])
    with torch.no_grad():
        moved = (fine_tuned(ids).logits - original(ids).logits).abs().max().item()
    assert moved > 1e-4  # the export holds the fine-tuned weights, not the imported ones
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r][-1] == 5


@pytest.mark.parametrize("source", ["hf", "run"])
def test_generate_equals_transformers_greedy(workspace, trained, capsys, source):
    """`shardlib generate` (zero3 over 8 devices, KV cache) from the Hugging Face directory and from
    the run's checkpoint: transformers' greedy continuation of the same weights, token for token."""
    run, exported = trained
    given, reference_dir = (workspace / "llama", workspace / "llama") if source == "hf" else (run, exported)
    tokenizer = load_tokenizer(workspace / "tokenizer.json")
    prompt = "import os"
    assert main(["generate", "--from", str(given), "--tokenizer", str(workspace / "tokenizer.json"), "--prompt", prompt,
                 "--max-new-tokens", "12", "--strategy", "zero3"]) == 0
    ours = capsys.readouterr().out
    reference = transformers.AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32)
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, len(ids):].tolist()
    assert ours == prompt + tokenizer.decode(out) + "\n"
    assert len(set(out)) > 1 or source == "run"  # the random model's continuation is not one repeated token


@pytest.mark.parametrize("name", ["qwen3", "gemma2", "gemma3", "mixtral"])
def test_generate_from_a_windowed_or_new_family_checkpoint_equals_transformers_greedy(workspace, capsys, name):
    """Issue 46: `shardlib generate --from DIR` (zero3 over 8 devices) on transformers-written Qwen3,
    Gemma 2, Gemma 3 and Mixtral checkpoints (`tests/test_hf.py`'s rows: sliding windows of 6, shorter
    than the prompt plus continuation; Mixtral's 4 experts, top 2, dropless) prints transformers' greedy
    continuation, token for token."""
    from tests.test_hf import _save

    directory = _save(name, workspace / f"family-{name}")
    tokenizer = load_tokenizer(workspace / "tokenizer.json")
    prompt = "import os"
    assert main(["generate", "--from", str(directory), "--tokenizer", str(workspace / "tokenizer.json"),
                 "--prompt", prompt, "--max-new-tokens", "12", "--strategy", "zero3"]) == 0
    ids = tokenizer.encode(prompt)
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, len(ids):].tolist()
    assert len(ids) + 12 > 6 and len(set(out)) > 1
    eos = reference.config.eos_token_id  # the CLI stops at the model's end-of-sequence ids (issue 43)
    stops = {eos} if isinstance(eos, int) else set(eos or ())
    out = out[:next((i for i, t in enumerate(out) if t in stops), len(out))]
    assert capsys.readouterr().out == prompt + tokenizer.decode(out) + "\n"


def test_text_is_tokenized_once_and_cached_beside_the_data(workspace, trained):
    tokenizer = load_tokenizer(workspace / "tokenizer.json")
    ids, cache, cached = tokenize_text(tokenizer, str(workspace / "corpus.txt"))
    assert cached and cache.parent == workspace and cache.name.startswith("corpus.txt.")  # the train run wrote it
    fresh = np.asarray(tokenizer.backend.encode((workspace / "corpus.txt").read_text()).ids)
    np.testing.assert_array_equal(np.asarray(ids), fresh)
    (workspace / "corpus2.txt").write_text("another text", encoding="utf-8")
    assert tokenize_text(tokenizer, str(workspace / "corpus2.txt"))[1] != cache


def test_instruction_data_counts_only_the_completions(workspace, tmp_path):
    tokenizer = load_tokenizer(workspace / "tokenizer.json")
    rows = [{"prompt": f"Q{i}: what is {i} + {i}? A:", "completion": f" {2 * i}"} for i in range(40)]
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    examples = instruction_rows(tokenizer, data, seq_len=32)
    first = examples.tokens[0]
    prompt_len = len(tokenizer.encode(rows[0]["prompt"]))
    counted = np.flatnonzero(examples.mask[0])  # target t predicts token t + 1
    assert list(counted + 1) == list(range(prompt_len, prompt_len + len(tokenizer.encode(rows[0]["completion"]))))
    assert tokenizer.decode(first[counted + 1]) == rows[0]["completion"]
    result = train(TrainConfig(init_from=str(workspace / "llama"), data=str(data), tokenizer=str(workspace / "tokenizer.json"),
                               strategy="zero3", steps=3, batch_size=8, seq_len=32, eval_every=0, sample_tokens=0,
                               progress=False, verbose=False, tensorboard=False, out=str(tmp_path / "run")))
    # The first step's loss is the imported model's on batch 0, over the completion tokens only: as
    # transformers computes it on the same rows.
    from shardlib.runtime.rows import RowBatches, split_rows

    (tokens, mask), _ = split_rows(examples.tokens, examples.mask)
    batch = RowBatches(tokens, mask, 8, seed=0, process_index=0, process_count=1).batch(0)
    reference = transformers.AutoModelForCausalLM.from_pretrained(workspace / "llama", dtype=torch.float32)
    with torch.no_grad():
        logits = reference(torch.tensor(batch["inputs"], dtype=torch.long)).logits
        ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), torch.tensor(batch["targets"], dtype=torch.long),
                                               reduction="none").numpy()
    expected = (ce * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    first = next(r for r in result.records if r.get("step") == 1 and "loss" in r)
    np.testing.assert_allclose(first["loss"], expected, rtol=1e-5)
    assert abs(first["loss"] - ce.mean()) > 1e-3  # the unmasked mean differs: the mask is what made them equal


def test_chat_messages_count_the_assistant_turns(workspace, tmp_path):
    """A chat rendered by the tokenizer's chat_template: the assistant's content counts, the rest not (this
    template writes no EOS; tests/test_chat_templates.py checks the EOS and the generation blocks)."""
    directory = tmp_path / "tok"
    directory.mkdir()
    (directory / "tokenizer.json").write_bytes((workspace / "tokenizer.json").read_bytes())
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    chat = {"messages": [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello!"},
                         {"role": "user", "content": "bye"}, {"role": "assistant", "content": "see you"}]}
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps(chat) + "\n")
    tokenizer = load_tokenizer(directory)
    rows = instruction_rows(tokenizer, data, seq_len=64)
    counted = np.flatnonzero(rows.mask[0]) + 1  # the tokens the counted targets predict
    assert tokenizer.decode(rows.tokens[0][counted]) == "hello!see you"
    no_template = tmp_path / "plain.jsonl"
    no_template.write_text(json.dumps(chat) + "\n")
    with pytest.raises(ValueError, match="no chat template"):
        instruction_rows(load_tokenizer(workspace / "tokenizer.json"), no_template, seq_len=64)


def test_generate_places_the_import_over_two_processes(workspace, capsys):
    """hsdp on 2 processes x 4 devices (`shardlib launch`): each process reads its own devices'
    shards of the Hugging Face files, and the greedy continuation is transformers'."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDLIB_")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")])))
    prompt = "class Mesh"
    done = subprocess.run(
        [sys.executable, "-m", "shardlib.cli", "launch", "--processes", "2", "--devices-per-process", "4", "--",
         sys.executable, "-m", "shardlib.cli", "generate", "--from", str(workspace / "llama"), "--tokenizer",
         str(workspace / "tokenizer.json"), "--prompt", prompt, "--max-new-tokens", "10", "--strategy", "hsdp",
         "--mesh", "data=2,fsdp=4"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = [line.split(" ", 1)[1] for line in done.stdout.splitlines() if line.startswith("[p0] ")]
    tokenizer = load_tokenizer(workspace / "tokenizer.json")
    reference = transformers.AutoModelForCausalLM.from_pretrained(workspace / "llama", dtype=torch.float32)
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, len(ids):].tolist()
    printed = "\n".join(printed)  # after any of the job's own start-up lines
    assert printed[printed.index(prompt):] == prompt + tokenizer.decode(out)
    assert not any(line.startswith("[p1] ") and prompt in line for line in done.stdout.splitlines())


def test_resuming_a_fine_tune_takes_init_from_and_the_batch_from_its_record(workspace, trained, capsys):
    """A rerun into the run without --init-from, --tokenizer, --data, --seq-len or --batch-size takes
    them from the run's config.json (said in one line), resumes, and its header says so: the weights
    and optimizer state are the checkpoint's, not fresh."""
    run, _ = trained
    assert main(["train", "--resume-from", str(run), "--steps", "6", "--no-progress", "--sample-tokens", "0"]) == 0
    captured = capsys.readouterr()
    taken = [line for line in captured.err.splitlines() if "(the run's record)" in line]
    assert taken == [f"shardlib: from {run / 'config.json'} (the run's record): --init-from {workspace / 'llama'}, "
                     f"--tokenizer {workspace / 'tokenizer.json'}, --data {workspace / 'corpus.txt'}, --seq-len 32, "
                     "--batch-size 8"]
    weights = next(line for line in captured.out.splitlines() if line.startswith("weights "))
    assert weights.endswith("resumed: weights and optimizer state from the checkpoint") and "fresh" not in weights
    assert "resumed    step 5" in captured.out
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r][-1] == 6


def test_export_hf_onto_its_own_run_exits_2_and_keeps_the_checkpoints(workspace, trained, capsys):
    """Issue 42's command: the run directory holds config.json, and it is not an export to replace."""
    run, _ = trained
    before = {str(p): p.read_bytes() if p.is_file() else None for p in sorted(run.rglob("*"))}
    assert main(["export", "--ckpt", str(run), "--hf", "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"{run} is, or holds, the checkpoint being exported" in err, err
    assert {str(p): p.read_bytes() if p.is_file() else None for p in sorted(run.rglob("*"))} == before
