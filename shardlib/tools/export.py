"""`shardlib export` (over 600 lines: the exporter, its two formats and its reader change together).

Consolidated weights (parameters and model state) from a sharded checkpoint.

The parameters, and the model state when the model keeps one (BatchNorm statistics, without
which it cannot run inference), are restored sharded over all devices (Orbax partial restore:
the optimizer state is never read), then written one tensor at a time: each tensor is gathered to the host
(``jax.device_get``, or ``process_allgather`` when other processes hold some of its shards),
appended to the output file by process 0, and freed. Host memory therefore stays near the
largest tensor, not the model.

Formats, chosen by the suffix of ``--out``:
  .npz          a NumPy zip (``np.load`` reads it); one ``<path>.npy`` entry per tensor
  .safetensors  the safetensors layout (JSON header, then raw little-endian data), streamed by
                shardlib itself and read back with the ``safetensors`` package (which validates it)
The file is written under a temporary name in the same directory, fsynced, then renamed onto
``--out``: a failed export leaves the previous file, if any, intact and no partial file behind.
Both carry a JSON record (format, step, run config, each tensor's part, key path and dtype) that
`load_exported` uses to rebuild the exact parameter tree the model expects. A parameter is named
by its path (``blocks/attn/wq``); a model-state tensor by its path under ``model_state/``
(``model_state/bn/mean``), and ``load_exported(path, model_state=True)`` returns that tree too.
`load_exported` checks every tensor against the record (and the model, given ``like=``) before
reading it, and an ``.npz`` entry's declared size before inflating it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from shardlib.hf import safetensors_io
from shardlib.runtime.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointMismatchError,
    signature_mismatches,
    tree_signature,
)
from shardlib.runtime.files import AtomicFile, make_dir, refuse_link
from shardlib.runtime.host import to_host
from shardlib.sharding.rules import describe_mismatches, listed, path_keys, path_str

EXPORT_FORMAT = "shardlib.tools.export/2"  # /2 added the model state ("part" of each tensor)
READABLE_FORMATS = ("shardlib.tools.export/1", EXPORT_FORMAT)  # /1: parameters only
METADATA_ENTRY = "__shardlib_export__"  # npz entry / safetensors metadata key holding the JSON record
SUFFIXES = (".npz", ".safetensors")

# The dtypes an export records, by name: those the safetensors format writes (the .npz too).
_DTYPE_NAMES = {dtype.name: code for dtype, code in safetensors_io.CODES.items()}


class ExportWriteError(OSError):
    """Writing the exported file failed (a full disk, permissions); ``strerror`` names the file and the fix."""


@dataclasses.dataclass(frozen=True)
class ExportSummary:
    """What `export_params` wrote."""

    path: str
    step: int
    tensors: int
    bytes: int
    largest_tensor_bytes: int
    model: str | None
    model_state_tensors: int = 0  # of ``tensors``: those under ``model_state/``


# --------------------------------------------------------------------------------------------
# Tree <-> named tensors
# --------------------------------------------------------------------------------------------


def _unflatten(items: list[tuple[list[str | int], np.ndarray]]) -> dict[Any, Any]:
    root: dict[Any, Any] = {}
    for keys, value in items:
        node = root
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
    return root


def _dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


# --------------------------------------------------------------------------------------------
# Writers: open, add one tensor at a time, close; the file appears at its path only when complete
# --------------------------------------------------------------------------------------------


def _nbytes(t: dict[str, Any]) -> int:
    """Bytes of a recorded tensor's data."""
    return math.prod(t["shape"]) * _dtype(t["dtype"]).itemsize


class _NpzWriter:
    """Streams ``<name>.npy`` entries into a zip; bfloat16 is stored as its uint16 bits."""

    def __init__(self, file: BinaryIO, record: dict[str, Any]) -> None:
        self._zip = zipfile.ZipFile(file, "w", compression=zipfile.ZIP_STORED, allowZip64=True)
        try:
            self._add(METADATA_ENTRY, np.frombuffer(json.dumps(record).encode("utf-8"), np.uint8))
        except BaseException:
            self.abandon()
            raise

    def _add(self, name: str, array: np.ndarray) -> None:
        with self._zip.open(f"{name}.npy", "w", force_zip64=True) as entry:
            np.lib.format.write_array(entry, np.asarray(array, order="C"), allow_pickle=False)

    def add(self, name: str, array: np.ndarray) -> None:
        self._add(name, array.view(np.uint16) if array.dtype == ml_dtypes.bfloat16 else array)

    def close(self) -> None:
        self._zip.close()  # writes the central directory; the file object is the caller's

    def abandon(self) -> None:
        """After a failed write: forget the file, so that the zip does not write its directory into it
        when collected (the file is discarded)."""
        self._zip.fp = None


class _SafetensorsWriter:
    """`shardlib.hf.safetensors_io.TensorWriter` (the header up front, then one tensor at a time)
    with the record in the header's metadata, its refusals as `CheckpointError` (tests/test_checkpoint.py
    reads the file with ``safetensors.numpy.load_file``)."""

    def __init__(self, file: BinaryIO, record: dict[str, Any]) -> None:
        self._writer = safetensors_io.TensorWriter(
            file, [(t["name"], _dtype(t["dtype"]), tuple(t["shape"])) for t in record["tensors"]],
            metadata={METADATA_ENTRY: json.dumps(record)})

    def add(self, name: str, array: np.ndarray) -> None:
        try:
            self._writer.add(name, array)
        except ValueError as err:
            raise CheckpointError(f"cannot export: {err}") from None

    def abandon(self) -> None:
        pass

    def close(self) -> None:
        try:
            self._writer.close()
        except ValueError as err:
            raise CheckpointError(f"cannot export: {err}") from None


def _writer(file: BinaryIO, suffix: str, record: dict[str, Any]) -> _NpzWriter | _SafetensorsWriter:
    return _NpzWriter(file, record) if suffix == ".npz" else _SafetensorsWriter(file, record)


# --------------------------------------------------------------------------------------------
# Readers: every size, dtype and shape is checked against the record (and the model, given
# ``like``) before the data it describes is read
# --------------------------------------------------------------------------------------------

RECORD_LIMIT = 16 * 2**20  # bytes the JSON record may take (about 80,000 tensors; checked before it is read)
NPY_HEADER_LIMIT = 10_000 + 16  # an .npy header past its data (NumPy's own max_header_size, + magic)


def _check_suffix(path: Path) -> None:
    if path.suffix not in SUFFIXES:
        raise CheckpointError(f"exported weights file {str(path)!r} must end in {' or '.join(SUFFIXES)}")


def _describe(dtype: Any, shape: Any) -> str:
    return f"{np.dtype(dtype).name if not isinstance(dtype, str) else dtype}{list(shape)}"


def _safe_open(path: Path) -> Any:
    """``safetensors.safe_open`` (which validates the header: its length, each tensor's dtype, shape
    and byte range, no overlaps, no gaps), its errors as one `CheckpointError` naming the file."""
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError as err:  # a runtime dependency; only a broken install gets here
        raise CheckpointError(f"reading {path} needs the safetensors package: pip install safetensors") from err
    try:
        return safe_open(str(path), framework="numpy")
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"{path} is not a valid safetensors file: {' '.join(str(err).split())}") from None


def _npy_header(entry: BinaryIO, where: str) -> tuple[tuple[int, ...], bool, np.dtype]:
    try:
        version = np.lib.format.read_magic(entry)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        return read(entry)
    except (ValueError, OSError, zipfile.BadZipFile) as err:
        raise CheckpointError(f"{where} is not a valid .npy entry: {' '.join(str(err).split())}") from None


def _read_npy(zf: zipfile.ZipFile, info: zipfile.ZipInfo, dtype: np.dtype, shape: tuple[int, ...], where: str) -> np.ndarray:
    """The entry's array, once its .npy header states exactly ``dtype`` and ``shape`` and its
    declared size is that header plus the data (so inflating it cannot produce more)."""
    try:
        with zf.open(info) as entry:
            found_shape, fortran, found_dtype = _npy_header(entry, where)
            if found_dtype != dtype or tuple(found_shape) != tuple(shape):
                raise CheckpointError(f"{where} holds {_describe(found_dtype, found_shape)}; the export recorded "
                                      f"{_describe(dtype, shape)}")
            nbytes = math.prod(shape) * dtype.itemsize
            if info.file_size != entry.tell() + nbytes:
                raise CheckpointError(f"{where} declares {info.file_size} bytes uncompressed, not its .npy header "
                                      f"({entry.tell()} bytes) plus {_describe(dtype, shape)} ({nbytes} bytes)")
            array = np.empty(shape, dtype, order="F" if fortran else "C")
            view, filled = memoryview(array.reshape(-1, order="A").view(np.uint8)), 0
            while filled < nbytes:
                got = entry.readinto(view[filled:])
                if not got:
                    raise CheckpointError(f"{where} ends after {filled} of its {nbytes} data bytes")
                filled += got
            return array
    except (zipfile.BadZipFile, OSError, EOFError, zlib.error) as err:
        raise CheckpointError(f"{where} cannot be read: {' '.join(str(err).split())}") from None


def _open_npz(path: Path) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, ValueError) as err:
        raise CheckpointError(f"{path} is not a valid .npz file: {' '.join(str(err).split())}") from None


def _npz_record(path: Path, zf: zipfile.ZipFile) -> dict[str, Any]:
    name = f"{METADATA_ENTRY}.npy"
    packed = [i.filename for i in zf.infolist() if i.compress_type != zipfile.ZIP_STORED]
    if packed:  # what a compressed entry declares cannot be trusted until it is inflated
        raise CheckpointError(f"{path}: entries {listed(packed)} are compressed; `shardlib export` stores every entry "
                              "uncompressed, so this file was not written by it (or was re-packed): refusing to inflate it")
    try:
        info = zf.getinfo(name)
    except KeyError:
        raise CheckpointError(f"{path} was not written by `shardlib export` (no {METADATA_ENTRY} entry)") from None
    if info.file_size > min(RECORD_LIMIT + NPY_HEADER_LIMIT, path.stat().st_size):
        raise CheckpointError(f"{path}: entry {name!r} declares {info.file_size} bytes, more than the file holds or "
                              f"the {RECORD_LIMIT} an export record may take; refusing to read it")
    with zf.open(info) as entry:
        shape, _, dtype = _npy_header(entry, f"{path}: entry {name!r}")
    if dtype != np.uint8 or len(shape) != 1:
        raise CheckpointError(f"{path}: entry {name!r} holds {_describe(dtype, shape)}, not the JSON bytes (uint8[n]) "
                              "of an export record")
    raw = _read_npy(zf, info, np.dtype(np.uint8), tuple(shape), f"{path}: entry {name!r}")
    try:
        return json.loads(raw.tobytes())
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise CheckpointError(f"{path}: the export record is not JSON ({err})") from None


def _check_record(path: Path, record: Any) -> dict[str, Any]:
    """The record, once it is one this shardlib reads: known format, every tensor named once with a
    known dtype and a shape of non-negative ints."""
    if not isinstance(record, dict) or record.get("format") not in READABLE_FORMATS:
        found = record.get("format") if isinstance(record, dict) else type(record).__name__
        raise CheckpointError(f"{path} has export format {found!r}; this shardlib reads "
                              f"{' or '.join(map(repr, READABLE_FORMATS))}")
    tensors, seen = record.get("tensors"), set()
    if not isinstance(tensors, list):
        raise CheckpointError(f"{path}: the export record lists no tensors")
    for t in tensors:
        ok = (isinstance(t, dict) and isinstance(t.get("name"), str) and t["name"] not in seen
              and t.get("dtype") in _DTYPE_NAMES and t.get("part", "params") in ("params", "model_state")
              and isinstance(t.get("shape"), list)
              and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in t["shape"])
              and _named_by_path(t))
        if not ok:
            raise CheckpointError(f"{path}: the export record's tensor entry {str(t)[:200]} is malformed or repeated, "
                                  "or its name is not its path")
        seen.add(t["name"])
    inner = {tuple(t["path"][:k]) for t in tensors for k in range(1, len(t["path"]))}
    clash = [t["name"] for t in tensors if tuple(t["path"]) in inner]
    if clash:
        raise CheckpointError(f"{path}: the export record's tensors {listed(clash)} sit where other tensors' paths "
                              "go on below them; a tree cannot hold both")
    return record


def _named_by_path(t: dict[str, Any]) -> bool:
    """The entry's ``name`` (what ``like=`` and the file's keys check) is its ``path`` (what the tree is
    built from) spelled out, so a file cannot pass the check under one name and land under another."""
    keys = t.get("path")
    if not (isinstance(keys, list) and keys and all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in keys)):
        return False
    prefix = "model_state/" if t.get("part", "params") == "model_state" else ""
    return t["name"] == prefix + path_str(keys)


def _check_against_model(path: Path, record: dict[str, Any], like: Any, part: str) -> None:
    """Every tensor of ``part`` has the name, shape and dtype the model's tree ``like`` has (arrays or
    ``jax.ShapeDtypeStruct``s), checked before any tensor data is read."""
    expected = {}
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(like)[0]:
        name = path_str(key_path) if part == "params" else f"{part}/{path_str(key_path)}"
        expected[name] = (tuple(np.shape(leaf)), np.dtype(leaf.dtype if hasattr(leaf, "dtype") else np.result_type(leaf)))
    found = {t["name"]: (tuple(t["shape"]), _dtype(t["dtype"])) for t in record["tensors"] if t.get("part", "params") == part}
    problems = [f"{n!r}: the file holds {_describe(found[n][1], found[n][0])}, the model expects "
                f"{_describe(expected[n][1], expected[n][0])}" for n in found if n in expected and found[n] != expected[n]]
    problems += [f"{n!r}: missing from the file" for n in expected if n not in found]
    problems += [f"{n!r}: not in the model" for n in found if n not in expected]
    if problems:
        raise CheckpointMismatchError(f"{path} does not hold the {'parameters' if part == 'params' else part} of "
                                      f"the model given as like= {describe_mismatches(problems)}")


def _check_npz_sizes(path: Path, zf: zipfile.ZipFile, record: dict[str, Any]) -> dict[str, zipfile.ZipInfo]:
    """Each tensor's entry, once no entry (nor the archive) declares more uncompressed bytes than the
    recorded tensors need: a zip bomb is refused before a byte of it is inflated."""
    infos, problems = {}, []
    for t in record["tensors"]:
        try:
            info = infos[t["name"]] = zf.getinfo(f"{t['name']}.npy")
        except KeyError:
            raise CheckpointError(f"{path} has no entry for tensor {t['name']!r} its export record lists") from None
        if info.file_size > _nbytes(t) + NPY_HEADER_LIMIT:
            problems.append(f"{info.filename!r} declares {info.file_size} bytes uncompressed, tensor "
                            f"{_describe(t['dtype'], t['shape'])} needs {_nbytes(t)}")
    needed = sum(map(_nbytes, record["tensors"])) + (len(record["tensors"]) + 1) * NPY_HEADER_LIMIT + RECORD_LIMIT
    declared = sum(info.file_size for info in zf.infolist())
    if declared > path.stat().st_size:
        problems.append(f"its entries declare {declared} bytes stored, the file has {path.stat().st_size}")
    if declared > needed:
        problems.append(f"its {len(zf.infolist())} entries declare {declared} bytes uncompressed in all, the "
                        f"recorded tensors need at most {needed}")
    if problems:
        raise CheckpointError(f"{path} declares more data than its tensors need; refusing to inflate it "
                              f"{describe_mismatches(problems)}")
    return infos


def read_export_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON record of an exported file: format, step, run config, tensor names/paths/dtypes."""
    path = Path(path)
    _check_suffix(path)
    if not path.is_file():
        raise CheckpointError(f"exported weights file {str(path)!r} does not exist")
    if path.suffix == ".npz":
        with _open_npz(path) as zf:
            return _npz_record(path, zf)
    with _safe_open(path) as f:
        meta = f.metadata() or {}
    if METADATA_ENTRY not in meta:
        raise CheckpointError(f"{path} was not written by `shardlib export` (no {METADATA_ENTRY} metadata)")
    if len(meta[METADATA_ENTRY]) > RECORD_LIMIT:
        raise CheckpointError(f"{path}: the export record takes {len(meta[METADATA_ENTRY])} bytes, more than the "
                              f"{RECORD_LIMIT} it may take")
    try:
        return json.loads(meta[METADATA_ENTRY])
    except (ValueError, RecursionError) as err:
        raise CheckpointError(f"{path}: the export record is not JSON ({err})") from None


def _iter_tensors(path: Path, record: dict[str, Any]) -> Iterator[tuple[dict[str, Any], np.ndarray]]:
    if path.suffix == ".npz":
        with _open_npz(path) as zf:
            infos = _check_npz_sizes(path, zf, record)
            for t in record["tensors"]:
                bf16 = t["dtype"] == "bfloat16"
                dtype = np.dtype(np.uint16) if bf16 else _dtype(t["dtype"])
                array = _read_npy(zf, infos[t["name"]], dtype, tuple(t["shape"]), f"{path}: tensor {t['name']!r}")
                yield t, array.view(ml_dtypes.bfloat16) if bf16 else array
        return
    with _safe_open(path) as f:
        names = set(f.keys())
        for t in record["tensors"]:  # all headers first: nothing is read from a file that disagrees
            if t["name"] not in names:
                raise CheckpointError(f"{path} has no tensor {t['name']!r} its export record lists")
            piece = f.get_slice(t["name"])
            if piece.get_dtype() != _DTYPE_NAMES[t["dtype"]] or list(piece.get_shape()) != t["shape"]:
                raise CheckpointError(f"{path}: tensor {t['name']!r} is {piece.get_dtype()}{list(piece.get_shape())} "
                                      f"in the header; the export recorded {_describe(t['dtype'], t['shape'])}")
        for t in record["tensors"]:
            try:
                array = f.get_tensor(t["name"])
            except Exception as err:  # the package's own errors (SafetensorError, dtype support)
                raise CheckpointError(f"{path}: tensor {t['name']!r} cannot be read: {' '.join(str(err).split())}") from None
            # native byte order, the dtype the .npz file gives and the model declared (float32, not <f4)
            yield t, np.asarray(array, dtype=_dtype(t["dtype"]))


def load_exported(path: str | os.PathLike[str], *, model_state: bool = False, like: Any = None,
                  like_model_state: Any = None) -> Any:
    """The parameter tree (a pure dict of NumPy arrays) of an exported file, ready for ``model.apply``.

    ``model_state=True``: ``(params, model_state)``, the second the BatchNorm statistics (or other
    mutable state) the model needs for inference, None when the model keeps none.

    Every tensor's dtype and shape must be the ones the export recorded (and, in an ``.npz``, its
    declared size what they need, checked before it is inflated). ``like``: the model's parameter
    tree (arrays or ``jax.ShapeDtypeStruct``s, e.g. ``program.abstract_state().params``); the file
    must then hold exactly its tensors, names, shapes and dtypes, checked before any data is read.
    ``like_model_state``: the same for the model state. A difference raises `CheckpointError`
    naming the tensor.
    """
    path = Path(path)
    record = _check_record(path, read_export_metadata(path))
    if like is not None:
        _check_against_model(path, record, like, "params")
    if like_model_state is not None:
        _check_against_model(path, record, like_model_state, "model_state")
    parts: dict[str, list] = {"params": [], "model_state": []}
    for t, array in _iter_tensors(path, record):
        parts[t.get("part", "params")].append((t["path"], array))
    params = _unflatten(parts["params"])
    if not model_state:
        return params
    return params, (_unflatten(parts["model_state"]) if parts["model_state"] else None)


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------


def _spread_sharding(shape: tuple[int, ...], mesh: Mesh) -> NamedSharding:
    """Shard the largest dimension the device count divides (else replicate): device memory / N."""
    n = mesh.devices.size
    dims = sorted((d for d in range(len(shape)) if shape[d] % n == 0 and shape[d] >= n), key=lambda d: -shape[d])
    spec = [None] * len(shape)
    if dims and n > 1:
        spec[dims[0]] = "devices"
    return NamedSharding(mesh, P(*spec))


def _model_params(config: dict[str, Any]) -> Any | None:
    """The abstract parameters of the run's model (a reference model, or one imported from the
    Hugging Face format), else None."""
    from shardlib.models import trainable

    model_config = run_model_config(config)
    return None if model_config is None else trainable(model_config).abstract()


def run_model_config(config: dict[str, Any]) -> Any | None:
    """The `GPTConfig` a saved run config trained: its ``pretrained`` config.json's, or its
    ``--model`` (with ``--vocab-size``); None for a model that is not shardlib's decoder."""
    import dataclasses

    from shardlib.models import CONFIGS

    pretrained = config.get("pretrained")
    if isinstance(pretrained, dict) and isinstance(pretrained.get("config"), dict):
        from shardlib.hf.architectures import to_gpt_config
        from shardlib.hf.peft import saved_lora

        model_config = to_gpt_config(pretrained["config"], f"the checkpoint's record of {pretrained.get('source')}")
        lora = saved_lora(config)
        if lora is None:
            return model_config
        from shardlib.step.precision import get_precision  # a LoRA base is stored in the run's compute dtype

        dtype = get_precision(config.get("precision", "f32")).compute_dtype
        return dataclasses.replace(model_config, lora=lora, compute_dtype=dtype)
    name = config.get("model")
    if not isinstance(name, str) or name not in CONFIGS:
        return None
    vocab = config.get("vocab_size")
    return dataclasses.replace(CONFIGS[name], vocab_size=vocab) if isinstance(vocab, int) else CONFIGS[name]


def _params_template(ckpt: Checkpointer, step: int, config: dict[str, Any]) -> Any:
    """The parameter tree to restore into: the model's (checked against the checkpoint), else the saved one."""
    saved = {k.split("/", 1)[1]: v for k, v in ckpt.saved_signature(step).items() if k.startswith("params/")}
    if not saved:
        raise CheckpointError(f"checkpoint {ckpt.directory} step {step} has no 'params' entry; was it saved by shardlib?")
    model_params = _model_params(config)
    if model_params is None:
        return jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), ckpt.saved_tree(step)["params"])
    problems = signature_mismatches(saved, tree_signature(model_params))
    if problems:
        raise CheckpointMismatchError(
            f"checkpoint {ckpt.directory} step {step} does not hold the parameters of model {config['model']!r} "
            f"named in its config {describe_mismatches(problems)}"
        )
    return model_params


def open_checkpoints(path: str | os.PathLike[str]) -> Checkpointer:
    """The checkpoints of ``path``, read-only: a checkpoint directory, or a run folder holding ``checkpoints/``."""
    directory = Path(path).expanduser()
    if (directory / "checkpoints").is_dir():  # `shardlib train --out RUN` saves to RUN/checkpoints
        directory = directory / "checkpoints"
    return Checkpointer(directory, create=False)  # it silences Orbax's read-only notice (READ_ONLY_NOTICE)


def _model_state_template(ckpt: Checkpointer, step: int) -> Any | None:
    """The saved model state (BatchNorm statistics) as abstract arrays, or None when the model keeps none."""
    saved = ckpt.saved_tree(step).get("model_state")
    if not jax.tree.leaves(saved):
        return None
    return jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), saved)


def _tensor_records(parts: dict[str, Any]) -> tuple[list[jax.Array], list[dict[str, Any]]]:
    """(arrays, records) of every tensor of ``parts`` (``{"params": tree, "model_state": tree}``): a
    parameter named by its path, any other part's tensor by its path under the part's name."""
    leaves, records = [], []
    for part, tree in parts.items():
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            name = path_str(path) if part == "params" else f"{part}/{path_str(path)}"
            records.append({"name": name, "part": part, "path": list(path_keys(path)),
                            "shape": list(leaf.shape), "dtype": np.dtype(leaf.dtype).name})
            leaves.append(leaf)
    names = [r["name"] for r in records]
    clashes = sorted({n for n in names if names.count(n) > 1})
    if clashes:
        raise CheckpointError(f"cannot export: parameter and model-state tensors share the names {clashes}; "
                              "rename the parameter collection whose top-level key is 'model_state'")
    return leaves, records


def _restore_parts(ckpt_dir: str | os.PathLike[str], step: int | None) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """(step, run config, {"params": ..., ["model_state": ...]}) restored spread over all devices."""
    ckpt = open_checkpoints(ckpt_dir)
    try:
        step = ckpt.resolve_step(step)
        config = ckpt.saved_config(step)
        templates = {"params": _params_template(ckpt, step, config), "model_state": _model_state_template(ckpt, step)}
        mesh = Mesh(np.asarray(jax.devices()), ("devices",))
        spread = lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=_spread_sharding(tuple(s.shape), mesh))
        target = {part: jax.tree.map(spread, tree) for part, tree in templates.items() if tree is not None}
        return step, config, ckpt.restore_subtree(target, step)
    finally:
        ckpt.close()


def _output_path(out: str | os.PathLike[str]) -> Path:
    """``--out`` made absolute without resolving its last part: a link there is refused, not followed."""
    path = Path(out).expanduser()
    return path.parent.resolve() / path.name


def export_params(ckpt_dir: str | os.PathLike[str], out: str | os.PathLike[str], *, step: int | None = None) -> ExportSummary:
    """Write the parameters of checkpoint ``step`` (default: latest complete) to ``out``, and the
    model state (BatchNorm statistics) under ``model_state/`` when the model keeps one.

    ``ckpt_dir``: a checkpoint directory, or the run folder of `shardlib train` holding one.

    Call on every process of a multi-process job (the gathers are collective); process 0 writes.
    """
    out_path = _output_path(out)
    _check_suffix(out_path)
    refuse_link(out_path, "the exported weights")  # before the restore: a planted link costs nothing
    step, config, parts = _restore_parts(ckpt_dir, step)
    leaves, tensors = _tensor_records({part: parts[part] for part in ("params", "model_state") if part in parts})
    record = {"format": EXPORT_FORMAT, "step": step, "config": config, "tensors": tensors}
    output = writer = None
    total = largest = 0
    try:
        if jax.process_index() == 0:  # written under a temporary name, renamed onto out_path once complete
            make_dir(out_path.parent)
            output = AtomicFile(out_path, what="the exported weights")
            writer = _writer(output.file, out_path.suffix, record)
        for leaf, t in zip(leaves, tensors):
            host = to_host(leaf)  # may alias the device buffer on CPU: free the leaf only after writing
            total += host.nbytes
            largest = max(largest, host.nbytes)
            if writer is not None:
                writer.add(t["name"], host)
            del host
            leaf.delete()  # free its device shards before gathering the next tensor
        if output is not None:
            writer.close()
            output.commit()
    except BaseException as err:
        if writer is not None:
            writer.abandon()
        if output is not None:
            output.discard()
        if isinstance(err, OSError) and jax.process_index() == 0:
            raise ExportWriteError(err.errno, f"cannot write {out_path}: {err.strerror or err}; nothing was left there, "
                                              "and a previous file is kept as it was: free space or pick another --out") from err
        raise
    state_tensors = sum(t["part"] == "model_state" for t in tensors)
    return ExportSummary(str(out_path), step, len(tensors), total, largest, config.get("model"), state_tensors)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def export_hf(ckpt_dir: str | os.PathLike[str], out: str | os.PathLike[str], *, step: int | None = None,
              dtype: str = "bf16", max_shard_bytes: int | None = None) -> Any:
    """Write checkpoint ``step`` (default: latest complete) of a decoder run as a Hugging Face model
    directory (`shardlib.hf.save.save_pretrained`): the config.json it was imported from, or a
    Llama one for a reference model, and its tokenizer when the run had one."""
    from shardlib.hf.save import DEFAULT_SHARD_BYTES, check_target, save_pretrained

    check_target(out, ckpt_dir)  # before the restore: a directory it would not replace costs nothing
    step, config, parts = _restore_parts(ckpt_dir, step)
    model_config = run_model_config(config)
    if model_config is None:
        raise CheckpointError(f"{ckpt_dir} is not a run of shardlib's decoder (model {config.get('model')!r}); the "
                              "Hugging Face format needs one: export .npz or .safetensors instead")
    pretrained = config.get("pretrained") or {}
    if not pretrained.get("architecture"):  # born in shardlib: Llama, or Mixtral for an MoE whose routing it computes
        from shardlib.hf.architectures import UnsupportedModel, export_architecture

        try:
            export_architecture(model_config)
        except UnsupportedModel as err:
            raise CheckpointError(f"{ckpt_dir}: {err}; export .npz or .safetensors instead") from None
        if getattr(model_config, "dropless", True) is False:
            print(f"shardlib: warning: {ckpt_dir} trained its experts with a capacity (capacity_factor "
                  f"{model_config.capacity_factor}); MixtralForCausalLM runs dropless, so its outputs differ from "
                  "training's wherever an assignment was dropped", file=sys.stderr)
    params = parts["params"]
    if model_config.lora is not None:  # a LoRA run: its adapters merged into the weights they adapt
        from shardlib.models.lora import merged

        params, model_config = merged(params, model_config), dataclasses.replace(model_config, lora=None)
    return step, save_pretrained(params, model_config, out, hf_config=pretrained.get("config"),
                                 architecture=pretrained.get("architecture"), dtype=dtype,
                                 max_shard_bytes=max_shard_bytes or DEFAULT_SHARD_BYTES,
                                 tokenizer_file=config.get("tokenizer_file"),
                                 generation_config=pretrained.get("generation_config"))


def export_peft(ckpt_dir: str | os.PathLike[str], out: str | os.PathLike[str], *, step: int | None = None) -> Any:
    """Write the LoRA adapters of checkpoint ``step`` (default: latest complete) as a PEFT adapter
    directory (`shardlib.hf.peft.save_adapter`) for the Hugging Face model the run started from."""
    from shardlib.hf.peft import save_adapter
    from shardlib.hf.save import check_target

    check_target(out, ckpt_dir)  # before the restore, as export_hf
    step, config, parts = _restore_parts(ckpt_dir, step)
    model_config = run_model_config(config)
    if model_config is None or model_config.lora is None:
        raise CheckpointError(f"{ckpt_dir} trained no LoRA adapters (a run of shardlib train --init-from ... "
                              "--lora-rank R has them): export the whole model with --hf instead")
    directory, tensors = save_adapter(parts["params"], model_config, out, base=(config.get("pretrained") or {}).get("source"))
    return step, directory, tensors


class ExportFlagError(ValueError):
    """Flags that do not go together: one line, exit 2."""

    user_facing = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ckpt", required=True, help="run folder of `shardlib train` (its --out) or the checkpoints "
                                                    "directory inside it")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest complete one)")
    parser.add_argument("--out", required=True, help="output file: FILE.npz or FILE.safetensors; with --hf a directory")
    parser.add_argument("--hf", action="store_true", help="write a Hugging Face model directory (config.json, "
                                                         "safetensors shards and index) that transformers loads")
    parser.add_argument("--peft", action="store_true", help="write a LoRA run's adapters as a PEFT adapter "
                                                           "directory (adapter_config.json, adapter_model.safetensors)")
    parser.add_argument("--dtype", choices=["bf16", "f32"], default=None, help="with --hf: the weights' dtype "
                                                                              "(default bf16; f32 is bit-exact)")
    parser.add_argument("--max-shard-mb", type=float, default=None, help="with --hf: the largest safetensors shard "
                                                                        "(default 5120)")


def run(args: argparse.Namespace) -> int:
    if args.max_shard_mb is not None and not (math.isfinite(args.max_shard_mb) and args.max_shard_mb * 2**20 >= 1):
        raise ExportFlagError(f"--max-shard-mb {args.max_shard_mb} is not a shard size: give a positive number of "
                              "MiB (at least 1 byte; the default 5120)")
    if args.peft:
        if args.hf or args.dtype is not None or args.max_shard_mb is not None:
            raise ExportFlagError("--peft writes the adapters alone, in float32: drop --hf, --dtype and --max-shard-mb "
                                  "(export the merged model in a second command)")
        step, directory, tensors = export_peft(args.ckpt, args.out, step=args.step)
        if jax.process_index() == 0:
            print(f"exported step {step}'s LoRA adapters as PEFT: {tensors} tensors to {directory}")
        return 0
    if args.hf:
        step, written = export_hf(args.ckpt, args.out, step=args.step, dtype=args.dtype or "bf16",
                                  max_shard_bytes=None if args.max_shard_mb is None else int(args.max_shard_mb * 2**20))
        if jax.process_index() == 0:
            print(f"exported step {step} as {written.architecture}: {written.tensors} tensors in {written.files} "
                  f"file(s) ({written.bytes / 2**20:.2f} MiB, largest {written.largest_tensor_bytes / 2**20:.2f} MiB) "
                  f"to {written.directory}")
        return 0
    if args.dtype is not None or args.max_shard_mb is not None:
        raise ExportFlagError("--dtype and --max-shard-mb shape a Hugging Face export: add --hf, or drop them")
    try:
        summary = export_params(args.ckpt, args.out, step=args.step)
    except ExportWriteError as err:  # a full disk is the user's to fix: one line, exit 2
        raise CheckpointError(err.strerror) from None
    if jax.process_index() == 0:
        print(
            f"exported {summary.tensors} tensors ({summary.bytes / 2**20:.2f} MiB, largest "
            f"{summary.largest_tensor_bytes / 2**20:.2f} MiB) of step {summary.step}"
            f"{f' (model {summary.model})' if summary.model else ''} to {summary.path}"
        )
        if summary.model_state_tensors:
            print(f"{summary.model_state_tensors} of them are the model state (BatchNorm statistics) under "
                  "model_state/; load_exported(path, model_state=True) returns (params, model_state)")
    return 0
