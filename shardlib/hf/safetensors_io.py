"""safetensors files read a slice at a time and written a tensor at a time.

Reading: the ``safetensors`` package validates each file's header (length, dtypes, byte ranges,
no overlaps or gaps); the data is then memory-mapped one tensor at a time and only the slice
asked for is copied out (NumPy has no bfloat16, so the package's own NumPy reader cannot return
bf16 checkpoints; ``ml_dtypes`` gives the memory map that type). Writing: the header is computed
from the shapes up front, then each tensor's bytes are appended, so a file never needs all its
tensors in memory at once.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import ml_dtypes
import numpy as np

from shardlib.sharding.rules import listed

# The format's dtype codes, by NumPy dtype: what `TensorWriter` writes (the weights of an HF export,
# and every tensor of `shardlib export`, whose runs may hold unsigned counters).
CODES = {
    np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
    np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.int64): "I64", np.dtype(np.int32): "I32",
    np.dtype(np.int16): "I16", np.dtype(np.int8): "I8", np.dtype(np.uint64): "U64", np.dtype(np.uint32): "U32",
    np.dtype(np.uint16): "U16", np.dtype(np.uint8): "U8", np.dtype(np.bool_): "BOOL",
}
# What `TensorFile` reads as model weights (a Hugging Face checkpoint's): no unsigned ints but bytes.
DTYPES = {code: dtype for dtype, code in CODES.items() if code not in ("U16", "U32", "U64")}


class SafetensorsFileError(ValueError):
    """A file that is not valid safetensors, named with the reason."""

    user_facing = True


class TensorFile:
    """One ``.safetensors`` file: its tensors' dtype, shape and byte range, and slices of them."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        _validate(self.path)
        with open(self.path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        self.data_start = 8 + length
        self.metadata = header.pop("__metadata__", None) or {}
        unknown = sorted(f"{name!r} ({e['dtype']})" for name, e in header.items() if e["dtype"] not in DTYPES)
        if unknown:
            raise SafetensorsFileError(f"{self.path}: tensor {unknown[0]} has a dtype shardlib does not read "
                                       f"({', '.join(DTYPES)}): convert the weights to one of them")
        self.entries = {name: (DTYPES[e["dtype"]], tuple(e["shape"]), tuple(e["data_offsets"]))
                        for name, e in header.items()}
        self.bytes_read = 0  # tensor bytes `read_rows` read (`map_rows` mapped) from the file, all threads together
        self._count = threading.Lock()

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][1]

    def dtype(self, name: str) -> np.dtype:
        return self.entries[name][0]

    def read(self, name: str, box: tuple[slice | np.ndarray, ...] | None = None) -> np.ndarray:
        """A copy of ``name[box]`` (whole when ``box`` is None), touching only the pages that hold it.
        Each entry of ``box`` is a slice or an array of indices (the outer product of them is read)."""
        dtype, shape, (begin, _) = self.entries[name]
        box = tuple(box or ())
        if any(isinstance(b, np.ndarray) for b in box):
            box = np.ix_(*(np.arange(*b.indices(n)) if isinstance(b, slice) else b for b, n in zip(box, shape)))
        if math.prod(shape) == 0:
            return np.zeros(shape, dtype)[box]
        mapped = np.memmap(self.path, dtype=dtype, mode="r", offset=self.data_start + begin, shape=shape)
        block = np.array(mapped[box], copy=True)
        del mapped  # unmapped here (its last reference): its pages leave this process's resident set
        return block

    def map_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of ``name``, read-only, in the file's dtype, without a copy: a private
        read-only mapping of exactly their pages, which the kernel starts reading ahead now
        (``POSIX_FADV_WILLNEED``) and which fault in, from the page cache, as they are first read;
        counted in ``bytes_read``. Unmapped when the array is dropped."""
        dtype, shape, (begin, _) = self.entries[name]
        if not shape:
            raise ValueError(f"{name!r} is a scalar: read() it whole")
        start, stop = max(0, start), min(shape[0], stop)
        want = (max(0, stop - start), *shape[1:])
        size = math.prod(want) * dtype.itemsize
        if not size:
            return np.empty(want, dtype)
        offset = self.data_start + begin + start * math.prod(shape[1:]) * dtype.itemsize
        base = offset - offset % mmap.ALLOCATIONGRANULARITY
        with open(self.path, "rb") as f:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), offset, size, os.POSIX_FADV_WILLNEED)
            mapped = mmap.mmap(f.fileno(), offset - base + size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ,
                               offset=base)
        with self._count:
            self.bytes_read += size
        return np.frombuffer(mapped, dtype, count=math.prod(want), offset=offset - base).reshape(want)

    def read_rows(self, name: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows ``start:stop`` of ``name`` (its first dim), in the file's dtype: one positioned read
        of exactly their bytes, which are contiguous in the row-major file, safe from several threads
        at once; counted in ``bytes_read``. Into ``out`` (a C-contiguous array of their shape and
        dtype) when given: several threads fill one buffer."""
        dtype, shape, (begin, _) = self.entries[name]
        row = math.prod(shape[1:]) * dtype.itemsize
        if not shape:
            raise ValueError(f"{name!r} is a scalar: read() it whole")
        start, stop = max(0, start), min(shape[0], stop)
        want = (max(0, stop - start), *shape[1:])
        if out is None:
            out = np.empty(want, dtype)
        elif out.shape != want or out.dtype != dtype or not out.flags.c_contiguous:
            raise ValueError(f"read_rows({name!r}) into a {out.dtype}{list(out.shape)} buffer, not C-contiguous {dtype}{list(want)}")
        if out.nbytes:
            view, offset = memoryview(out.reshape(-1).view(np.uint8)), self.data_start + begin + start * row
            fd = os.open(self.path, os.O_RDONLY)
            try:
                done = 0
                while done < out.nbytes:
                    got = os.preadv(fd, [view[done:]], offset + done)
                    if got <= 0:
                        raise SafetensorsFileError(f"{self.path} ends inside tensor {name!r}")
                    done += got
            finally:
                os.close(fd)
            with self._count:
                self.bytes_read += out.nbytes
        return out


def _validate(path: Path) -> None:
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError as err:  # a runtime dependency; only a broken install gets here
        raise SafetensorsFileError(f"reading {path} needs the safetensors package: pip install safetensors") from err
    try:
        with safe_open(str(path), framework="numpy"):
            pass
    except (SafetensorError, OSError, ValueError) as err:
        raise SafetensorsFileError(f"{path} is not a valid safetensors file: {' '.join(str(err).split())}") from None


class TensorWriter:
    """Writes the header of ``tensors`` (name, dtype, shape; in file order), then `add` appends each
    tensor's data in that order, checked against what the header announced."""

    def __init__(self, file: BinaryIO, tensors: Iterable[tuple[str, np.dtype, tuple[int, ...]]],
                 metadata: Mapping[str, str] | None = None) -> None:
        header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
        self._pending = list(tensors)
        offset = 0
        for name, dtype, shape in self._pending:
            size = math.prod(shape) * np.dtype(dtype).itemsize
            header[name] = {"dtype": CODES[np.dtype(dtype)], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
        blob += b" " * (-len(blob) % 8)  # the format pads the header with spaces to 8 bytes
        self._file = file
        self._file.write(struct.pack("<Q", len(blob)) + blob)
        self._pending.reverse()

    def add(self, name: str, array: np.ndarray) -> None:
        expected = self._pending.pop() if self._pending else None
        if expected is None or expected[0] != name or tuple(array.shape) != tuple(expected[2]) \
                or array.dtype != np.dtype(expected[1]):
            raise ValueError(f"tensor {name!r} {array.dtype}{list(array.shape)} is not the next one the safetensors "
                             f"header announced ({expected and expected[0]!r})")
        self._file.write(np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes())

    def close(self) -> None:
        if self._pending:
            raise ValueError(f"tensors {listed([t[0] for t in reversed(self._pending)])} were announced but not written")
