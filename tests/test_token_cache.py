"""Text tokenized in chunks by process 0 and streamed to the token cache (`shardlib.hf.token_cache`):
the ids equal the whole string's encode, and the other processes only read the cache."""

from __future__ import annotations

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")

from shardlib.hf import token_cache  # noqa: E402
from shardlib.hf.tokenizer import load_tokenizer, tokenize_text  # noqa: E402
from shardlib.runtime.data import default_corpus  # noqa: E402

TEXT = default_corpus().decode("utf-8", errors="replace")[:20000]


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    """A byte-level BPE (GPT-2's pre-tokenizer) and a SentencePiece-style one (a prefix space on
    every input), trained on the corpus offline."""
    root = tmp_path_factory.mktemp("tok")
    byte_level = tokenizers.ByteLevelBPETokenizer()
    byte_level.train_from_iterator([TEXT], vocab_size=400, show_progress=False)
    byte_level.save(str(root / "byte_level.json"))
    metaspace = tokenizers.SentencePieceBPETokenizer()
    metaspace.train_from_iterator([TEXT], vocab_size=400, show_progress=False)
    metaspace.save(str(root / "metaspace.json"))
    return root


@pytest.mark.parametrize("kind", ["byte_level", "metaspace"])
def test_chunked_ids_equal_the_whole_string_encode(tokenizer_files, kind, tmp_path):
    backend = tokenizers.Tokenizer.from_file(str(tokenizer_files / f"{kind}.json"))
    whole = backend.encode(TEXT, add_special_tokens=False).ids
    cuts = token_cache.cuts(TEXT, lambda s: backend.encode(s, add_special_tokens=False).ids, chunk=500)
    if kind == "byte_level":
        assert len(cuts) >= 30  # cut about every 500 characters: the chunking is exercised
    chunked = np.concatenate(list(token_cache.encoded(backend, TEXT, np.dtype(np.uint16), chunk=500)))
    np.testing.assert_array_equal(chunked, whole)
    with open(tmp_path / "ids.npy", "wb") as f:  # streamed: the header rewritten with the final length
        assert token_cache.stream(backend, TEXT, f, np.dtype(np.uint16), chunk=500) == len(whole)
    np.testing.assert_array_equal(np.load(tmp_path / "ids.npy", mmap_mode="r"), whole)


class Counting:
    """A tokenizers backend recording the length of each text it encodes, by method."""

    def __init__(self, backend):
        self.backend, self.calls = backend, {"encode": [], "encode_batch": []}

    def encode(self, text, **kwargs):
        self.calls["encode"].append(len(text))
        return self.backend.encode(text, **kwargs)

    def encode_batch(self, texts, **kwargs):
        self.calls["encode_batch"].append(sum(map(len, texts)))
        return self.backend.encode_batch(texts, **kwargs)

    def __getattr__(self, name):
        return getattr(self.backend, name)


@pytest.mark.parametrize("process", [0, 1])
def test_only_process_0_encodes_the_others_read_its_cache(tokenizer_files, tmp_path, monkeypatch, process):
    import jax

    from shardlib.hf.tokenizer import _tokenize, cache_path

    (tmp_path / "corpus.txt").write_text(TEXT, encoding="utf-8")
    data = str(tmp_path / "corpus.txt")
    tokenizer = load_tokenizer(tokenizer_files / "byte_level.json")
    whole = tokenizer.backend.encode(TEXT, add_special_tokens=False).ids
    counting = tokenizer.backend = Counting(tokenizer.backend)
    barriers = []

    def barrier(name):  # process 0, elsewhere, writes the cache while process 1 waits here
        barriers.append(name)
        if process == 1:
            other = load_tokenizer(tokenizer_files / "byte_level.json")
            _tokenize(other, data, cache_path(other, data, [tmp_path / "corpus.txt"]))

    monkeypatch.setattr(jax, "process_index", lambda: process)
    monkeypatch.setattr(token_cache, "barrier", barrier)
    monkeypatch.setattr(token_cache, "CHUNK_CHARS", 2000)
    ids, cache, _ = tokenize_text(tokenizer, data)
    np.testing.assert_array_equal(ids, whole)
    assert cache.is_file() and len(barriers) == 1
    if process == 1:
        assert counting.calls == {"encode": [], "encode_batch": []}
    else:  # the cuts' checks encode windows; the chunks go to encode_batch, 8 at a time, all the text once
        assert max(counting.calls["encode"]) <= 2 * token_cache.WINDOW
        assert sum(counting.calls["encode_batch"]) == len(TEXT) and len(counting.calls["encode_batch"]) == 2
