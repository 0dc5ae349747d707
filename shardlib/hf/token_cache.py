"""A text corpus tokenized by one process, in chunks, streamed into its token cache.

Process 0 cuts the text into chunks of about `CHUNK_CHARS` characters at line ends, encodes a
batch of chunks at a time with ``encode_batch`` (the tokenizers library's threads), and appends
each chunk's ids to the cache (an ``.npy`` file whose header, of a fixed size, is rewritten with
the final length; written through `shardlib.runtime.files.AtomicFile`, so it is whole or absent).
The other processes wait at JAX's distributed barrier and read the cache. A cut is taken only
where the tokenizer gives the same ids to the text on both sides of it together as apart (checked
on the lines around it), so the chunks' ids are the whole string's: a tokenizer that marks the
start of every input (a prefix space) is cut nowhere and encodes the text whole.

Memory: the text, one batch of chunks' ids as Python ints, and the ids as a NumPy array only when
the cache cannot be written (a read-only data directory).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

CHUNK_CHARS = 1 << 20  # characters a chunk aims at
BATCH = 8  # chunks encoded together (encode_batch runs them on the library's threads)
WINDOW = 256  # characters each side of a cut that the cut's check encodes
TRIES = 32  # line ends tried past a chunk's target before the chunk grows to the next target
HEADER = 128  # bytes of the cache's .npy header (magic, version, length, dict, padding)


def cuts(text: str, encode: Any, chunk: int | None = None) -> list[int]:
    """Offsets (after a newline) where ``text`` may be cut: ``encode`` (text -> ids) of the window
    around each equals the two sides' ids joined."""
    out: list[int] = []
    start, chunk = 0, chunk or CHUNK_CHARS
    while start + chunk < len(text):
        at = text.find("\n", start + chunk - 1)
        for _ in range(TRIES):
            if at < 0 or at + 1 >= len(text):
                return out
            a, b = text[max(0, at + 1 - WINDOW):at + 1], text[at + 1:at + 1 + WINDOW]
            if encode(a + b) == encode(a) + encode(b):
                out.append(at + 1)
                break
            at = text.find("\n", at + 1)
        start = at + 1  # the cut, or past the line ends tried (this chunk grows by one more)
    return out


def chunks(text: str, encode: Any, chunk: int | None = None) -> Iterator[str]:
    """``text`` cut at `cuts`."""
    bounds = [0, *cuts(text, encode, chunk), len(text)]
    return (text[a:b] for a, b in zip(bounds, bounds[1:]))


def encoded(backend: Any, text: str, dtype: np.dtype, chunk: int | None = None) -> Iterator[np.ndarray]:
    """The ids of ``text`` (no special tokens), a chunk at a time: ``backend.encode(text)``'s ids."""
    encode = lambda s: backend.encode(s, add_special_tokens=False).ids
    batch: list[str] = []
    for piece in chunks(text, encode, chunk):  # a batch of chunks copied out of the text at a time
        batch.append(piece)
        if len(batch) == BATCH:
            yield from _ids(backend, batch, dtype)
            batch = []
    yield from _ids(backend, batch, dtype)


def _ids(backend: Any, batch: list[str], dtype: np.dtype) -> Iterator[np.ndarray]:
    for e in backend.encode_batch(batch, add_special_tokens=False) if batch else ():
        yield np.asarray(e.ids, dtype)


def write_header(f: Any, dtype: np.dtype, length: int) -> None:
    """An ``.npy`` 1.0 header for ``length`` ids of ``dtype`` in exactly `HEADER` bytes, at the start."""
    body = repr({"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (length,)})
    f.seek(0)
    f.write(b"\x93NUMPY\x01\x00" + (HEADER - 10).to_bytes(2, "little") + body.encode().ljust(HEADER - 11) + b"\n")


def stream(backend: Any, text: str, f: Any, dtype: np.dtype, chunk: int | None = None) -> int:
    """``text``'s ids written to ``f`` as an ``.npy`` file, a chunk at a time; their count."""
    write_header(f, dtype, 0)
    length = 0
    for ids in encoded(backend, text, dtype, chunk):
        f.write(ids.astype(np.dtype(dtype).newbyteorder("<")).tobytes())
        length += ids.size
    write_header(f, dtype, length)
    f.seek(0, 2)
    return length


def barrier(name: str) -> None:
    """Every process of the job waits here (JAX's distributed runtime); nothing in one process."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
