"""Pre-tokenised corpora: a flat array of token ids in a ``.bin`` or ``.npy`` file (nanoGPT / Levanter style).

``.bin`` is raw ids with no header, so its element type is not in the file: uint16 by default
(nanoGPT's, enough for vocabularies up to 65,536 such as GPT-2's 50,257), uint32 when asked
(``--token-dtype uint32``). ``.npy`` carries its own dtype (any unsigned integer type). Both are
memory-mapped, never read whole; the training windows are the same stateless random windows as
for text (`shardlib.runtime.data.ByteBatches`): drawn at random with replacement, each a function
of the seed and the step, so a resumed run reads the windows the uninterrupted run would have
read (none twice, none skipped, compared with it), not each example of the file exactly once.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from shardlib.runtime.files import not_a_file, write_atomic

SUFFIXES = (".bin", ".npy")
BIN_DTYPES = ("uint16", "uint32")


def is_token_file(path: str | os.PathLike[str] | None) -> bool:
    """True for a path that names a token file (by its suffix)."""
    return path is not None and Path(path).suffix.lower() in SUFFIXES


def load_tokens(path: str | os.PathLike[str], dtype: str = "uint16") -> np.ndarray:
    """The token ids of ``path`` as a read-only, memory-mapped 1-D unsigned array; ``dtype`` is for ``.bin``."""
    target = Path(path).expanduser()
    why = not_a_file(target)
    if why is not None:
        raise ValueError(f"token file {str(target)!r} {why}; give --data a regular .bin or .npy file of token ids")
    if target.suffix.lower() == ".npy":
        tokens = np.load(target, mmap_mode="r")
        if tokens.dtype.kind != "u" or tokens.ndim != 1:
            raise ValueError(f"token file {str(target)!r} holds a {tokens.dtype} array of shape {tokens.shape}; save "
                             "the token ids as a 1-D unsigned array (np.uint16 or np.uint32)")
    else:
        if dtype not in BIN_DTYPES:
            raise ValueError(f"a .bin token file holds {' or '.join(BIN_DTYPES)} ids, not {dtype!r}")
        size = np.dtype(dtype).itemsize
        if target.stat().st_size % size:
            raise ValueError(f"token file {str(target)!r} has {target.stat().st_size} bytes, not a whole number of "
                             f"{dtype} ids; check --token-dtype (uint16 or uint32)")
        tokens = np.memmap(target, dtype=dtype, mode="r")
    if tokens.size < 2:
        raise ValueError(f"token file {str(target)!r} holds {tokens.size} token(s); training needs a corpus")
    return tokens


CACHE_SUFFIX = ".max-id.json"


def largest_id(tokens: np.ndarray, path: str | os.PathLike[str]) -> int:
    """The largest id of the token file ``path``: one pass over it (18 GB for a large corpus) on
    process 0 only, the others receive it; the result is cached beside the file (``PATH.max-id.json``,
    keyed by its size, modification time and dtype), so later runs read no token at all."""
    import jax

    largest = _cached_largest(tokens, path) if jax.process_index() == 0 else 0
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        largest = int(multihost_utils.broadcast_one_to_all(np.int64(largest)))
    return largest


def _cached_largest(tokens: np.ndarray, path: str | os.PathLike[str]) -> int:
    import json

    target = Path(path).expanduser()
    stat = target.stat()
    key = {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns, "dtype": str(tokens.dtype)}
    cache = target.with_name(target.name + CACHE_SUFFIX)
    try:
        saved = json.loads(cache.read_text())
        if {k: saved.get(k) for k in key} == key and isinstance(saved.get("max_id"), int):
            return saved["max_id"]
    except (OSError, ValueError):
        pass  # no cache yet, or an unreadable one: scan
    largest = int(tokens.max())
    try:
        write_atomic(cache, json.dumps({**key, "max_id": largest}) + "\n", what="a token file's cached largest id")
    except (OSError, ValueError):  # ValueError: a link at its name, left alone  # a read-only data directory: the next run scans again
        pass
    return largest


def check_vocab(tokens: np.ndarray, vocab_size: int, path: str) -> None:
    """Every id must have an embedding row: the largest id is below the vocabulary size (`largest_id`)."""
    largest = largest_id(tokens, path)
    if largest >= vocab_size:
        raise ValueError(f"{path} holds token id {largest}, but the vocabulary has {vocab_size} ids; pass "
                         f"--vocab-size V with V > {largest} (the tokenizer's vocabulary size), or check --token-dtype")
