"""Pre-tokenised data (issue 28): ``shardlib train --data tokens.bin|.npy --vocab-size V``.

The files are made here (uint16 / uint32 ids above 255, so bytes could not stand in for them);
the reference for what a run reads is the file itself, through NumPy, at the window starts the
stateless loader's formula gives. The run that trains on a .bin file, and resumes from its
checkpoint reading each window once, is tests/test_cli_edges.py's (it shares that file's compile).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from shardlib.cli import main
from shardlib.runtime.data import ByteBatches, split_train_val, train_window_starts
from shardlib.runtime.tokens import load_tokens

VOCAB, SEQ, BATCH, SEED = 300, 32, 16, 5


def token_ids(n: int = 20_000, vocab: int = VOCAB) -> np.ndarray:
    """A token stream with structure to learn: a repeating ramp with noise."""
    rng = np.random.default_rng(0)
    return ((np.arange(n) * 7 + rng.integers(0, 3, n)) % vocab).astype(np.int64)


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardlib train: error: "), err
    return err[0]


def test_bin_and_npy_files_load_as_their_ids(tmp_path):
    ids = token_ids(vocab=70_000)
    (tmp_path / "a16.bin").write_bytes((ids % 65_536).astype(np.uint16).tobytes())
    (tmp_path / "a32.bin").write_bytes(ids.astype(np.uint32).tobytes())
    np.save(tmp_path / "a.npy", ids.astype(np.uint32))
    np.testing.assert_array_equal(load_tokens(tmp_path / "a16.bin"), ids % 65_536)
    np.testing.assert_array_equal(load_tokens(tmp_path / "a32.bin", "uint32"), ids)
    np.testing.assert_array_equal(load_tokens(tmp_path / "a.npy"), ids)
    np.save(tmp_path / "signed.npy", ids.astype(np.int32))
    with pytest.raises(ValueError, match="unsigned"):
        load_tokens(tmp_path / "signed.npy")


def test_windows_are_the_files_ids_at_the_formulas_starts(tmp_path):
    ids = token_ids()
    np.save(tmp_path / "t.npy", ids.astype(np.uint16))
    train, _ = split_train_val(load_tokens(tmp_path / "t.npy"))
    batches = ByteBatches(train, BATCH, SEQ, seed=SEED, process_index=0, process_count=1)
    starts = train_window_starts(SEED, 3, BATCH, len(train) - SEQ)
    batch = batches.batch(3)
    np.testing.assert_array_equal(batch["inputs"], np.stack([ids[s:s + SEQ] for s in starts]))
    np.testing.assert_array_equal(batch["targets"], np.stack([ids[s + 1:s + SEQ + 1] for s in starts]))
    assert batch["inputs"].max() >= 256  # ids, not bytes


@pytest.mark.parametrize("flags, named", [
    (["--vocab-size", "200"], "--vocab-size: "),  # the file holds ids up to 299
    ([], "--vocab-size: "),  # tiny's own vocabulary is 256
    (["--vocab-size", "300", "--token-dtype", "uint32"], "check --token-dtype"),  # uint16 ids read as uint32: huge
])
def test_token_file_mistakes_are_one_line_before_compiling(flags, named, tmp_path, capsys):
    path = tmp_path / "t.bin"
    path.write_bytes(token_ids().astype(np.uint16).tobytes())
    code = main(["train", "--model", "tiny", "--data", str(path), "--out", str(tmp_path / "run"), *flags])
    assert code == 2
    line = _one_error_line(capsys)
    assert named in line, line


def test_vocab_size_and_token_dtype_without_a_token_file_are_refused(tmp_path, capsys):
    assert main(["train", "--model", "tiny", "--vocab-size", "300", "--out", str(tmp_path / "a")]) == 2
    assert "--vocab-size: " in _one_error_line(capsys)
    np.save(tmp_path / "t.npy", token_ids().astype(np.uint16))
    assert main(["train", "--model", "tiny", "--data", str(tmp_path / "t.npy"), "--vocab-size", "300",
                 "--token-dtype", "uint32", "--out", str(tmp_path / "b")]) == 2
    assert "--token-dtype: " in _one_error_line(capsys)


def test_the_largest_id_is_scanned_once_and_cached_beside_the_file(tmp_path):
    import json
    import os

    from shardlib.runtime.tokens import CACHE_SUFFIX, check_vocab

    ids = token_ids()
    path = tmp_path / "tokens.bin"
    ids.astype(np.uint16).tofile(path)
    check_vocab(load_tokens(path), VOCAB, str(path))
    cache = tmp_path / ("tokens.bin" + CACHE_SUFFIX)
    assert json.loads(cache.read_text())["max_id"] == int(ids.max())
    # A later run reads the cache, not the file: a cached id past the vocabulary is what it sees.
    cache.write_text(json.dumps({**json.loads(cache.read_text()), "max_id": VOCAB}))
    with pytest.raises(ValueError, match=f"holds token id {VOCAB}"):
        check_vocab(load_tokens(path), VOCAB, str(path))
    # A file written since (another modification time) is scanned again.
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
    check_vocab(load_tokens(path), VOCAB, str(path))
    assert json.loads(cache.read_text())["max_id"] == int(ids.max())


def test_a_pipe_or_device_given_as_data_is_named_for_what_it_is(tmp_path):
    from shardlib.runtime.data import load_text

    os.mkfifo(tmp_path / "t.bin")
    with pytest.raises(ValueError, match=r"t.bin' is a FIFO \(named pipe\); give --data a regular"):
        load_tokens(tmp_path / "t.bin")
    (tmp_path / "d.bin").symlink_to(os.devnull)
    with pytest.raises(ValueError, match="d.bin' is a character device"):
        load_tokens(tmp_path / "d.bin")
    with pytest.raises(ValueError, match=r"t.bin' is a FIFO \(named pipe\); give --data PATH a text file"):
        load_text(str(tmp_path / "t.bin"))
    with pytest.raises(ValueError, match="missing.bin' does not exist"):
        load_tokens(tmp_path / "missing.bin")
