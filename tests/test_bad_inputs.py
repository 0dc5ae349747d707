"""Every bad input is one line naming the file and the field, exit 2, before any compile (issue 42 §4, §6).

One tiny Hugging Face directory (written once for the module by `save_pretrained`, no compile),
a word-level tokenizer of 9 ids and a small corpus are the inputs each case spoils in one place.
Each case runs the CLI's ``main`` in-process with the step's compile replaced by a function that
fails the test, so a refusal that came after the compile could not pass.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")

from shardlib.cli import main  # noqa: E402
from shardlib.hf.save import save_pretrained  # noqa: E402
from shardlib.hf.tokenizer import cache_path, load_tokenizer  # noqa: E402
from shardlib.models import CONFIGS, trainable  # noqa: E402
from shardlib.runtime.data import resolve_text_files  # noqa: E402

WORDS = ["[UNK]", "the", "a", "cat", "dog", "sat", "on", "mat", "."]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """``model/`` (a tiny Llama directory with a tokenizer), ``corpus.txt``."""
    root = tmp_path_factory.mktemp("inputs")
    params = jax.tree.map(lambda s: np.full(s.shape, 0.01, s.dtype), trainable(CONFIGS["tiny"]).abstract())
    save_pretrained(params, CONFIGS["tiny"], root / "model", dtype="f32")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = tokenizers.Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(root / "model" / "tokenizer.json"))
    (root / "corpus.txt").write_text("the cat sat on the mat . a dog sat on a mat . " * 200)
    return root


@pytest.fixture
def no_compile(monkeypatch):
    """Building the train program fails the test: every refusal must come before it."""
    import shardlib.run.setup as setup

    def build_program(*args, **kwargs):
        raise AssertionError("the step was built (and would compile) before the refusal")

    monkeypatch.setattr(setup, "build_program", build_program)


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _train(work: Path, *flags: str) -> list[str]:
    return ["train", "--steps", "1", "--seq-len", "16", "--batch-size", "8", "--no-progress", "--sample-tokens", "0",
            "--out", str(work / "run"), *flags]


# ---------------------------------------------------------------- §6 --init-from needs the model's tokenizer


def test_init_from_without_a_tokenizer_for_text_is_refused(inputs, tmp_path, capsys, no_compile):
    assert main(_train(tmp_path, "--init-from", str(inputs / "model"))) == 2
    line = _one_error_line(capsys)
    assert "--init-from:" in line and "pass --tokenizer" in line and "--data" in line, line
    assert main(_train(tmp_path, "--init-from", str(inputs / "model"), "--data", str(inputs / "corpus.txt"))) == 2
    assert "vocabulary is its tokenizer's, not bytes" in _one_error_line(capsys)


# ---------------------------------------------------------------- the token cache


def _cache(inputs: Path, work: Path) -> Path:
    data = work / "corpus.txt"
    shutil.copy(inputs / "corpus.txt", data)
    return cache_path(load_tokenizer(inputs / "model"), str(data), resolve_text_files(str(data)))


CACHES = {
    "an id past the vocabulary": (lambda c: np.save(c, np.array([1, 2, 300], np.uint16)), "holds token id 300"),
    "negative ids": (lambda c: np.save(c, np.array([1, -2, 3], np.int32)), "holds a int32 array"),
    "float ids": (lambda c: np.save(c, np.array([1.0, 2.5], np.float32)), "holds a float32 array"),
    "a link": (lambda c: c.symlink_to(c.parent / "elsewhere.npy"), "is a symbolic link"),
}


@pytest.mark.parametrize("case", list(CACHES))
def test_a_spoiled_token_cache_is_refused_naming_it(inputs, tmp_path, capsys, no_compile, case):
    spoil, message = CACHES[case]
    cache = _cache(inputs, tmp_path)
    np.save(tmp_path / "elsewhere.npy", np.array([1, 2, 3], np.uint16))
    spoil(cache)
    assert main(_train(tmp_path, "--init-from", str(inputs / "model"), "--tokenizer", str(inputs / "model"),
                       "--data", str(tmp_path / "corpus.txt"))) == 2
    line = _one_error_line(capsys)
    assert f"the token cache {cache} {message}" in line, line


# ---------------------------------------------------------------- chat templates: code from a download


CHAT_TEMPLATES = {
    "sandbox escape": ("{{ cycler.__init__.__globals__ }}", "does what the sandbox forbids"),
    "syntax error": ("{% for m in messages %}{{ m.content }}", "does not parse (line 1"),
    "huge repetition": ("{{ 'a' * 10**10 }}", "repetition of 10000000000 items"),
    "huge power": ("{{ 7 ** 10000000 }}", "a power of 10000000"),
    "huge output": ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "renders more than 16777216 characters"),
    "endless loop": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                     "took more than 0.5 s"),
}


@pytest.mark.parametrize("case", list(CHAT_TEMPLATES))
def test_a_hostile_or_broken_chat_template_is_one_line_naming_it(inputs, tmp_path, capsys, no_compile, monkeypatch,
                                                                  case):
    import shardlib.hf.chat_template as chat_template

    monkeypatch.setattr(chat_template, "TIME_LIMIT", 0.5)
    source, message = CHAT_TEMPLATES[case]
    tok = tmp_path / "tok"
    tok.mkdir()
    shutil.copy(inputs / "model" / "tokenizer.json", tok)
    (tok / "tokenizer_config.json").write_text(json.dumps({"chat_template": source}))
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "the cat"},
                                             {"role": "assistant", "content": "sat on a mat"}]}) + "\n")
    assert main(_train(tmp_path, "--init-from", str(inputs / "model"), "--tokenizer", str(tok),
                       "--data", str(data))) == 2
    line = _one_error_line(capsys)
    assert f"{tok / 'tokenizer_config.json'}: the chat_template " in line and message in line, line


# ---------------------------------------------------------------- instruction lines


def test_a_deeply_nested_instruction_line_is_one_line(inputs, tmp_path, capsys, no_compile):
    data = tmp_path / "deep.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    assert main(_train(tmp_path, "--init-from", str(inputs / "model"), "--tokenizer", str(inputs / "model"),
                       "--data", str(data))) == 2
    assert f"{data}:2 is not JSON this reads (RecursionError" in _one_error_line(capsys)


def test_a_long_line_is_cut_before_it_is_tokenized(inputs, tmp_path, monkeypatch):
    """Memory bounded by --seq-len: the tokenizer never sees more than the cut, and the row's ids
    are the first ids of the whole text tokenized (the reference)."""
    from shardlib.hf import tokenizer as tokenizer_lib

    tokenizer, seq_len = load_tokenizer(inputs / "model"), 16
    long_text = "the cat sat on the mat . " * 40_000  # 1 MB in one line
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"prompt": long_text, "completion": "a dog"}) + "\n"
                    + json.dumps({"prompt": "a cat", "completion": "sat"}) + "\n")
    whole = tokenizer.encode(long_text)
    seen = []
    encode = tokenizer_lib.Tokenizer.encode
    monkeypatch.setattr(tokenizer_lib.Tokenizer, "encode",
                        lambda self, text, **kw: seen.append(len(text)) or encode(self, text, **kw))
    rows = tokenizer_lib.instruction_rows(tokenizer, data, seq_len)
    assert max(seen) <= (seq_len + 1) * tokenizer_lib.CHARS_PER_TOKEN
    assert rows.truncated == 1
    np.testing.assert_array_equal(rows.tokens[0], whole[:seq_len + 1])


# ---------------------------------------------------------------- config.json and the safetensors files


def _index(model: Path, weight_map) -> None:
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _u16_weights(model: Path, dtype=np.uint16) -> None:
    import safetensors.numpy

    tensors = safetensors.numpy.load_file(str(model / "model.safetensors"))
    tensors["model.norm.weight"] = np.zeros(tensors["model.norm.weight"].shape, dtype)
    safetensors.numpy.save_file(tensors, str(model / "model.safetensors"))


CONFIGS_REFUSED = {  # case: (change to config.json, or a function spoiling the directory; what the line says)
    "head_dim odd": ({"head_dim": 15}, "head_dim must be a positive even integer (rotary pairs), got 15"),
    "head_dim a string": ({"head_dim": "16"}, "head_dim must be a positive even integer (rotary pairs), got '16'"),
    "head_dim negative": ({"head_dim": -16}, "head_dim must be a positive even integer (rotary pairs), got -16"),
    "kv heads not dividing": ({"num_key_value_heads": 3}, "num_key_value_heads=3 does not divide num_attention_heads=4"),
    "kv heads negative": ({"num_key_value_heads": -2}, "num_key_value_heads must be a positive integer, got -2"),
    "kv heads a string": ({"num_key_value_heads": "2"}, "num_key_value_heads must be a positive integer, got '2'"),
    "rope_theta a string": ({"rope_parameters": {"rope_theta": "1e4", "rope_type": "default"}},
                            "rope_parameters.rope_theta must be a positive number"),
    "rms_norm_eps a string": ({"rms_norm_eps": "1e-6"}, "rms_norm_eps must be a positive number, got '1e-6'"),
    "max_position_embeddings a string": ({"max_position_embeddings": "64"}, "max_position_embeddings must be a positive"),
    "max_position_embeddings -1": ({"max_position_embeddings": -1}, "max_position_embeddings must be a positive integer"),
    "rope_scaling a list": ({"rope_scaling": [1, 2]}, "rope_scaling must be an object (or null), got [1, 2]"),
    "10^8 layers": ({"num_hidden_layers": 10**8}, "num_hidden_layers is 100000000, and the weights hold 2 layers"),
    "deeply nested": ("[" * 100_000 + "]" * 100_000, "config.json is not valid JSON: RecursionError"),
    "U16 weights": (_u16_weights, "tensor 'model.norm.weight' (U16) has a dtype shardlib does not read"),
    "I32 weights": (lambda m: _u16_weights(m, np.int32), "tensor 'model.norm.weight' is stored as int32, not a floating"),
    "weight_map a list": (lambda m: _index(m, ["model.safetensors"]), "weight_map must be an object"),
    "weight_map of numbers": (lambda m: _index(m, {"model.norm.weight": 3}), "weight_map must be an object"),
}


@pytest.mark.parametrize("case", list(CONFIGS_REFUSED))
def test_a_bad_config_or_weights_file_is_one_line_naming_the_field(inputs, tmp_path, capsys, no_compile, case):
    change, message = CONFIGS_REFUSED[case]
    model = tmp_path / "model"
    shutil.copytree(inputs / "model", model)
    config = json.loads((model / "config.json").read_text())
    if isinstance(change, dict):
        config.pop("rope_parameters") if "rope_parameters" in change else None
        (model / "config.json").write_text(json.dumps({**config, **change}))
    elif isinstance(change, str):
        (model / "config.json").write_text(change)
    else:
        change(model)
    assert main(_train(tmp_path, "--init-from", str(model), "--tokenizer", str(model),
                       "--data", str(inputs / "corpus.txt"))) == 2
    line = _one_error_line(capsys)
    assert "--init-from:" in line and message in line, line


# ---------------------------------------------------------------- generate's flags


@pytest.fixture(scope="module")
def big_tokenizer(inputs) -> Path:
    """A tokenizer of 300 ids, more than the tiny model's 256 embedding rows."""
    from tokenizers.models import WordLevel

    path = inputs / "big" / "tokenizer.json"
    path.parent.mkdir()
    tokenizers.Tokenizer(WordLevel({f"w{i}": i for i in range(300)}, unk_token="w0")).save(str(path))
    return path


GENERATE_REFUSED = {
    "top-k above the vocabulary": (["--top-k", "300"], "--top-k 300 is more than the 256 tokens"),
    "empty prompt": (["--prompt", ""], "--prompt is empty"),
    "unknown strategy": (["--strategy", "zero9"], "unknown strategy 'zero9'"),
    "no devices": (["--cpu-devices", "0"], "--cpu-devices must be a positive device count, got 0"),
    "temperature nan": (["--temperature", "nan"], "temperature must be a finite number >= 0"),
    "temperature inf": (["--temperature", "inf"], "temperature must be a finite number >= 0"),
    "a tokenizer past the embedding": (["--tokenizer", "BIG"], "has 300 ids, and"),
}


@pytest.mark.parametrize("case", list(GENERATE_REFUSED))
def test_a_bad_generate_flag_is_one_line_before_anything_compiles(inputs, big_tokenizer, capsys, monkeypatch, case):
    import shardlib.hf.load as load

    def load_params(*args, **kwargs):
        raise AssertionError("the parameters were read before the refusal")

    monkeypatch.setattr(load, "load_params", load_params)
    flags, message = GENERATE_REFUSED[case]
    flags = [str(big_tokenizer) if f == "BIG" else f for f in flags]
    prompt = [] if "--prompt" in flags else ["--prompt", "the cat"]
    assert main(["generate", "--from", str(inputs / "model"), *prompt, *flags]) == 2
    line = _one_error_line(capsys)
    assert message in line, line


# ---------------------------------------------------------------- export's shard size


@pytest.mark.parametrize("size", ["0", "-1", "nan", "inf", "1e-9"])
def test_export_max_shard_mb_must_be_a_size(tmp_path, capsys, size):
    assert main(["export", "--ckpt", str(tmp_path), "--hf", "--out", str(tmp_path / "x"), "--max-shard-mb", size]) == 2
    assert f"--max-shard-mb {float(size)} is not a shard size" in _one_error_line(capsys)


# ---------------------------------------------------------------- train's --xla-options and --log-to


@pytest.mark.parametrize("options,message", [("xla_no_such_option=1", "No such compile option: 'xla_no_such_option'"),
                                             ("a=b=c", "No such compile option: 'a'"),
                                             ("xla_cpu_enable_fast_math=maybe", "'maybe' is not a valid bool value")])
def test_xla_options_are_checked_before_the_step_compiles(tmp_path, capsys, monkeypatch, options, message):
    import shardlib.step.program as program

    def build(*args, **kwargs):
        raise AssertionError("the step was built (and would compile) before the refusal")

    monkeypatch.setattr(program, "build", build)
    assert main(["train", "--model", "tiny", "--steps", "1", "--no-progress", "--out", str(tmp_path / "run"),
                 "--xla-options", options]) == 2
    line = _one_error_line(capsys)
    assert "--xla-options:" in line and message in line, line


def test_log_to_a_tracker_that_cannot_log_is_refused_leaving_out_as_it_was(tmp_path, capsys, monkeypatch):
    from shardlib.run import trackers

    pytest.importorskip("wandb")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: no wandb login
    for name in ("WANDB_API_KEY", "WANDB_MODE", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "run"
    flags = ["train", "--model", "tiny", "--steps", "1", "--no-progress", "--out", str(out)]
    assert main([*flags, "--log-to", "wandb"]) == 2
    assert "--log-to: wandb has no API key for api.wandb.ai" in _one_error_line(capsys)
    monkeypatch.setattr(trackers.MlflowLog, "package", "no_such_tracker_package")
    assert main([*flags, "--log-to", "mlflow"]) == 2
    assert '--log-to: mlflow is not installed: pip install "shardlib[mlflow]"' in _one_error_line(capsys)
    assert not out.exists()  # a plain rerun finds nothing in its way
