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
