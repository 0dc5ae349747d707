"""Deterministic, process-sharded, resumable byte-level text batches -> global jax.Arrays.

Data flow: ``load_text`` -> ``split_train_val`` -> ``ByteBatches.batch(step)`` / ``val_batches``
(this process's rows only, NumPy) -> ``to_global`` (one ``jax.Array`` over the whole mesh).

Design choices, and why:

* **Stateless in the step.** The global batch of step ``s`` is a pure function of
  ``(seed, s)``: its window starts come from ``SeedSequence([seed, s])``. Resuming is therefore
  ``restore({"step": s, "seed": seed})``; there is no buffer or RNG state to checkpoint, and any
  process can jump to any step.
* **Process p takes rows [p*B/P, (p+1)*B/P) of the global batch.** Every process draws the same
  B cheap start indices and gathers only its own rows, so a 2-process run sees exactly the data
  of a 1-process run (the parity tests depend on this), without materialising other rows.
* **Bytes as tokens (vocab 256).** No tokenizer to ship, version or download.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypedDict

import jax
import numpy as np

from shardlib.runtime.files import not_a_file
from shardlib.text import nearest_multiples

VOCAB_SIZE = 256  # byte-level: every token is one byte
_GLOB_CHARS = frozenset("*?[")


class Batch(TypedDict):
    """One process's rows: ``targets`` are ``inputs`` shifted left by one byte."""

    inputs: np.ndarray  # int32[B_local, T]
    targets: np.ndarray  # int32[B_local, T]


class LoaderState(TypedDict):
    """Everything needed to resume a ``ByteBatches`` stream (JSON-serialisable)."""

    step: int
    seed: int


# --------------------------------------------------------------------------------------------
# Text <-> tokens
# --------------------------------------------------------------------------------------------


def encode(text: str) -> np.ndarray:
    """UTF-8 bytes of ``text`` as int32 token ids in [0, 256)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


def decode(tokens: Any) -> str:
    """Tokens (any int array-like, e.g. a jax.Array of samples) -> text; bad UTF-8 becomes U+FFFD."""
    ids = np.asarray(tokens).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= VOCAB_SIZE):
        raise ValueError(
            f"decode: token ids must be bytes in [0, {VOCAB_SIZE}), got range [{ids.min()}, {ids.max()}]; "
            "is the model's vocab larger than 256, or are these logits rather than ids?"
        )
    return bytes(ids.astype(np.uint8)).decode("utf-8", errors="replace")


# --------------------------------------------------------------------------------------------
# Corpus loading
# --------------------------------------------------------------------------------------------


def default_corpus() -> bytes:
    """The ~465 KB of English that ships with every CPython (pydoc topics); never downloads."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics)).encode("utf-8")


def _files_in_folder(folder: Path) -> list[Path]:
    """All ``*.txt`` files under ``folder``, sorted by relative path so the order is portable."""
    files = [p for p in folder.rglob("*.txt") if p.is_file()]
    if not files:
        raise ValueError(f"load_text: folder {str(folder)!r} contains no .txt files; add some or pass a file or glob")
    return sorted(files, key=lambda p: p.relative_to(folder).as_posix())


def _files_for_glob(pattern: str) -> list[Path]:
    """Files matching a glob pattern (``**`` recursive), sorted."""
    files = sorted(Path(m) for m in glob.glob(pattern, recursive=True) if os.path.isfile(m))
    if not files:
        raise ValueError(
            f"load_text: glob {pattern!r} matches no files; check the pattern (use '**' to recurse), "
            "or leave --data out for the built-in corpus"
        )
    return files


def resolve_text_files(path: str) -> list[Path]:
    """The ordered list of files that ``load_text(path)`` reads."""
    target = Path(path).expanduser()
    if target.is_dir():
        return _files_in_folder(target)
    if target.is_file():
        return [target]
    if _GLOB_CHARS & set(path) and not target.exists():
        return _files_for_glob(os.path.expanduser(path))
    raise ValueError(
        f"load_text: path {path!r} {not_a_file(target)}; give --data PATH a text file, a folder of .txt files or a "
        "glob, or leave --data out for the built-in corpus (load_text(None) from Python)"
    )


def load_text(path: str | os.PathLike[str] | None = None) -> bytes:
    """Raw bytes of the corpus: the built-in one (None), a file, a folder of .txt files, or a glob.

    Several files are joined with a newline in sorted order, so the corpus (and hence every
    batch) is the same on every process and every machine.
    """
    if path is None:
        return default_corpus()
    files = resolve_text_files(os.fspath(path))
    data = b"\n".join(f.read_bytes() for f in files)
    if not data.strip():
        shown = ", ".join(str(f) for f in files[:5]) + (" ..." if len(files) > 5 else "")
        raise ValueError(f"load_text: {os.fspath(path)!r} has no text (read {len(files)} empty file(s): {shown})")
    return data


def _as_bytes_array(data: bytes | np.ndarray) -> np.ndarray:
    """The corpus as an array without a copy: bytes as uint8 (read-only, so batches cannot corrupt it);
    an unsigned integer array (token ids, `shardlib.runtime.tokens`, often a memory map) as it is."""
    if isinstance(data, (bytes, bytearray)):
        return np.frombuffer(bytes(data), dtype=np.uint8)
    if isinstance(data, np.ndarray) and data.dtype.kind == "u":
        return data
    return np.asarray(data, dtype=np.uint8)


def split_train_val(data: bytes | np.ndarray, val_fraction: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """Split into (train, val) uint8 arrays, holding out the last ``val_fraction`` of the bytes.

    The tail (not interleaved chunks) because then no training window can overlap a validation
    window: both sides are contiguous, so windows never straddle the boundary, and the split
    stays valid for any ``seq_len`` chosen later.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"split_train_val: val_fraction must be in [0, 1), got {val_fraction}")
    arr = _as_bytes_array(data)
    n_val = int(round(len(arr) * val_fraction))
    return arr[: len(arr) - n_val], arr[len(arr) - n_val :]


# --------------------------------------------------------------------------------------------
# Batch geometry checks
# --------------------------------------------------------------------------------------------


def check_batch_size(
    global_batch_size: int,
    process_count: int = 1,
    data_parallel_size: int | None = None,
    data_parallel_axes: tuple[str, ...] = ("data", "fsdp"),
) -> None:
    """Raise a ValueError naming the fix when the global batch cannot be split evenly."""
    if global_batch_size < 1:
        raise ValueError(f"batch size must be positive, got {global_batch_size}")
    if data_parallel_size is not None and global_batch_size % data_parallel_size:
        raise ValueError(
            f"batch size {global_batch_size} is not divisible by the {data_parallel_size} data-parallel devices "
            f"(mesh axes {'×'.join(data_parallel_axes)}); use a multiple of {data_parallel_size}: "
            f"{nearest_multiples(global_batch_size, data_parallel_size)}"
        )
    if global_batch_size % process_count:
        raise ValueError(
            f"batch size {global_batch_size} is not divisible by the {process_count} processes (each loads an "
            f"equal block of rows); use a multiple of {process_count}: "
            f"{nearest_multiples(global_batch_size, process_count)}"
        )


def _check_window(seq_len: int, n_bytes: int, what: str) -> None:
    """A window needs seq_len + 1 bytes (inputs plus the one-byte-shifted targets)."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    if seq_len + 1 > n_bytes:
        raise ValueError(
            f"seq_len {seq_len} needs {seq_len + 1} bytes per window but the {what} data has only {n_bytes} bytes; "
            "use a shorter seq_len or a larger corpus"
        )


def local_rows(global_batch_size: int, process_index: int, process_count: int) -> slice:
    """Rows [p*B/P, (p+1)*B/P) of the global batch that process p loads."""
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is outside [0, {process_count})")
    per_process = global_batch_size // process_count
    return slice(process_index * per_process, (process_index + 1) * per_process)


def _windows(data: np.ndarray, starts: np.ndarray, seq_len: int) -> Batch:
    """Gather windows data[s : s+T+1] and split them into inputs / shifted targets."""
    rows = data[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)
    return Batch(inputs=rows[:, :-1], targets=rows[:, 1:])


def _resolve_processes(process_index: int | None, process_count: int | None) -> tuple[int, int]:
    """Explicit values win (tests, custom launchers); otherwise ask the JAX runtime."""
    count = jax.process_count() if process_count is None else process_count
    index = jax.process_index() if process_index is None else process_index
    return index, count


# --------------------------------------------------------------------------------------------
# Training batches
# --------------------------------------------------------------------------------------------


def train_window_starts(seed: int, step: int, global_batch_size: int, n_starts: int) -> np.ndarray:
    """The B window starts of step ``step``: identical on every process, a pure function of its args.

    Uses ``SeedSequence.generate_state`` (a fixed hash) rather than a ``Generator`` method, whose
    algorithm NumPy may change between versions; that keeps old checkpoints resuming on the
    same data. Modulo bias is < n_starts / 2**64.
    """
    if seed < 0 or step < 0:
        raise ValueError(f"seed and step must be non-negative, got seed={seed}, step={step}")
    words = np.random.SeedSequence([seed, step]).generate_state(global_batch_size, dtype=np.uint64)
    return (words % np.uint64(n_starts)).astype(np.int64)


class ByteBatches:
    """Random windows of a byte corpus; process p gets rows [p*B/P, (p+1)*B/P) of each global batch.

    ``batch(step)`` is pure in (seed, step). Iterating yields ``batch(step)`` and advances
    ``step``; ``state()`` / ``restore()`` checkpoint that single integer (and the seed).
    """

    def __init__(
        self,
        data: bytes | np.ndarray,
        global_batch_size: int,
        seq_len: int,
        *,
        seed: int = 0,
        start_step: int = 0,
        process_index: int | None = None,
        process_count: int | None = None,
        data_parallel_size: int | None = None,
    ) -> None:
        self.data = _as_bytes_array(data)
        self.process_index, self.process_count = _resolve_processes(process_index, process_count)
        check_batch_size(global_batch_size, self.process_count, data_parallel_size)
        _check_window(seq_len, len(self.data), "train")
        self.global_batch_size = global_batch_size
        self.seq_len = seq_len
        self.seed = int(seed)
        self.step = int(start_step)
        self.rows = local_rows(global_batch_size, self.process_index, self.process_count)

    @property
    def local_batch_size(self) -> int:
        return self.rows.stop - self.rows.start

    def batch(self, step: int) -> Batch:
        """This process's rows of the global batch of ``step``."""
        n_starts = len(self.data) - self.seq_len  # last valid start leaves seq_len + 1 bytes
        starts = train_window_starts(self.seed, step, self.global_batch_size, n_starts)
        return _windows(self.data, starts[self.rows], self.seq_len)

    def pad_fraction(self, step: int) -> float:
        """Padding positions over all positions of batch ``step``: none, a window is all text."""
        return 0.0

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        out = self.batch(self.step)
        self.step += 1
        return out

    def state(self) -> LoaderState:
        """The step of the next batch ``next()`` returns, and the seed."""
        return LoaderState(step=self.step, seed=self.seed)

    def restore(self, state: LoaderState) -> None:
        """Continue a saved stream: the next batch is the one that followed the save."""
        self.step = int(state["step"])
        self.seed = int(state["seed"])


# --------------------------------------------------------------------------------------------
# Validation batches
# --------------------------------------------------------------------------------------------


def val_window_starts(n_bytes: int, seq_len: int, count: int) -> np.ndarray:
    """``count`` evenly spaced window starts spanning the whole validation array (no RNG)."""
    return np.linspace(0, n_bytes - seq_len - 1, num=count).round().astype(np.int64)


def val_batches(
    data: bytes | np.ndarray,
    global_batch_size: int,
    seq_len: int,
    num_batches: int | None = None,
    *,
    process_index: int | None = None,
    process_count: int | None = None,
    data_parallel_size: int | None = None,
) -> list[Batch]:
    """A fixed list of validation batches (this process's rows), the same every call.

    Windows are evenly spaced over the validation data. ``num_batches=None`` takes as many
    batches as fit without windows overlapping (at least one), so the whole split is covered.
    """
    arr = _as_bytes_array(data)
    index, count = _resolve_processes(process_index, process_count)
    check_batch_size(global_batch_size, count, data_parallel_size)
    _check_window(seq_len, len(arr), "validation")
    if num_batches is None:
        num_batches = max(1, ((len(arr) - 1) // seq_len) // global_batch_size)
    if num_batches < 1:
        raise ValueError(f"val_batches: num_batches must be positive, got {num_batches}")
    starts = val_window_starts(len(arr), seq_len, num_batches * global_batch_size).reshape(num_batches, -1)
    rows = local_rows(global_batch_size, index, count)
    return [_windows(arr, step_starts[rows], seq_len) for step_starts in starts]


# --------------------------------------------------------------------------------------------
# Host-local rows -> global arrays
# --------------------------------------------------------------------------------------------


def _addressable_rows(array: jax.Array) -> tuple[int, int]:
    """The [start, stop) span of dim 0 that this process's devices hold; must be contiguous."""
    spans = sorted({(s.index[0].indices(array.shape[0])[:2]) for s in array.addressable_shards})
    start, stop = spans[0][0], spans[0][1]
    for lo, hi in spans[1:]:
        if lo > stop:
            raise ValueError(
                f"to_global: this process's devices hold non-contiguous batch rows {spans}; build the mesh with "
                "each process's devices adjacent along the batch axes (jax.make_mesh does)"
            )
        stop = max(stop, hi)
    return start, stop


def to_global(
    local_batch: dict[str, np.ndarray],
    sharding: jax.sharding.NamedSharding,
    *,
    rows: slice | None = None,
) -> dict[str, jax.Array]:
    """Assemble each process's rows into global ``jax.Array``s laid out by ``sharding``.

    Single-process, local rows are the global batch. Multi-process, ``rows`` says which global
    rows ``local_batch`` holds (a loader's ``.rows``; default: block ``jax.process_index()``).
    This checks that the mesh puts exactly those rows on this process's devices, since
    otherwise the global batch would silently be a permutation (or, with the batch axis
    replicated across processes, replicas would hold different data).
    """
    out = {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in local_batch.items()}
    for key, array in out.items():
        if array.ndim == 0:
            continue
        n_local = np.shape(local_batch[key])[0]
        n_proc = jax.process_count()
        want = rows if rows is not None else local_rows(n_local * n_proc, jax.process_index(), n_proc)
        start, stop = _addressable_rows(array)
        if (start, stop) != (want.start, want.stop):
            raise ValueError(
                f"to_global: {key!r} rows [{start}, {stop}) of the global batch {array.shape} live on process "
                f"{jax.process_index()}'s devices, but the loader gave it rows [{want.start}, {want.stop}); "
                f"order the mesh devices by process along the batch axes ({sharding.spec}), e.g. with jax.make_mesh, "
                "or, if the batch is replicated across processes, load the full batch (process_count=1) on each"
            )
    return out
