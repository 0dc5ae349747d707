"""`shardlib export`: consolidated weights (parameters and model state) from a sharded checkpoint.

The parameters, and the model state when the model keeps one (BatchNorm statistics, without
which it cannot run inference), are restored sharded over all devices (Orbax partial restore:
the optimizer state is never read), then written one tensor at a time: each tensor is gathered to the host
(``jax.device_get``, or ``process_allgather`` when other processes hold some of its shards),
appended to the output file by process 0, and freed. Host memory therefore stays near the
largest tensor, not the model.

Formats, chosen by the suffix of ``--out``:
  .npz          a NumPy zip (``np.load`` reads it); one ``<path>.npy`` entry per tensor
  .safetensors  the safetensors layout (JSON header, then raw little-endian data), written by
                shardlib itself, so no extra package is needed to write or read it
Both carry a JSON record (format, step, run config, each tensor's part, key path and dtype) that
`load_exported` uses to rebuild the exact parameter tree the model expects. A parameter is named
by its path (``blocks/attn/wq``); a model-state tensor by its path under ``model_state/``
(``model_state/bn/mean``), and ``load_exported(path, model_state=True)`` returns that tree too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import struct
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from shardlib.runtime.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointMismatchError,
    signature_mismatches,
    tree_signature,
)
from shardlib.sharding.rules import describe_mismatches, path_keys, path_str

EXPORT_FORMAT = "shardlib.tools.export/2"  # /2 added the model state ("part" of each tensor)
READABLE_FORMATS = ("shardlib.tools.export/1", EXPORT_FORMAT)  # /1: parameters only
METADATA_ENTRY = "__shardlib_export__"  # npz entry / safetensors metadata key holding the JSON record
SUFFIXES = (".npz", ".safetensors")

_SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
}
_FROM_SAFETENSORS = {v: k for k, v in _SAFETENSORS_DTYPES.items()}


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
# Writers: open, add one tensor at a time, close
# --------------------------------------------------------------------------------------------


class _NpzWriter:
    """Streams ``<name>.npy`` entries into a zip; bfloat16 is stored as its uint16 bits."""

    def __init__(self, path: Path, record: dict[str, Any]) -> None:
        self._zip = zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True)
        self._add(METADATA_ENTRY, np.frombuffer(json.dumps(record).encode("utf-8"), np.uint8))

    def _add(self, name: str, array: np.ndarray) -> None:
        with self._zip.open(f"{name}.npy", "w", force_zip64=True) as entry:
            np.lib.format.write_array(entry, np.asarray(array, order="C"), allow_pickle=False)

    def add(self, name: str, array: np.ndarray) -> None:
        self._add(name, array.view(np.uint16) if array.dtype == ml_dtypes.bfloat16 else array)

    def close(self) -> None:
        self._zip.close()


class _SafetensorsWriter:
    """Writes the header up front (offsets follow from shapes and dtypes), then raw tensors in order."""

    def __init__(self, path: Path, record: dict[str, Any]) -> None:
        header: dict[str, Any] = {"__metadata__": {METADATA_ENTRY: json.dumps(record)}}
        offset = 0
        for t in record["tensors"]:
            size = int(np.prod(t["shape"], dtype=np.int64)) * _dtype(t["dtype"]).itemsize
            header[t["name"]] = {"dtype": _SAFETENSORS_DTYPES[t["dtype"]], "shape": t["shape"], "data_offsets": [offset, offset + size]}
            offset += size
        blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
        blob += b" " * (-len(blob) % 8)  # the format pads the header with spaces to 8 bytes
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(blob)) + blob)

    def add(self, name: str, array: np.ndarray) -> None:
        little = array.astype(array.dtype.newbyteorder("<"), copy=False) if array.dtype.byteorder == ">" else array
        self._file.write(little.tobytes(order="C"))

    def close(self) -> None:
        self._file.close()


def _writer(path: Path, record: dict[str, Any]) -> _NpzWriter | _SafetensorsWriter:
    return _NpzWriter(path, record) if path.suffix == ".npz" else _SafetensorsWriter(path, record)


# --------------------------------------------------------------------------------------------
# Readers
# --------------------------------------------------------------------------------------------


def _check_suffix(path: Path) -> None:
    if path.suffix not in SUFFIXES:
        raise CheckpointError(f"exported weights file {str(path)!r} must end in {' or '.join(SUFFIXES)}")


def _read_safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size)), 8 + size


def read_export_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON record of an exported file: format, step, run config, tensor names/paths/dtypes."""
    path = Path(path)
    _check_suffix(path)
    if not path.is_file():
        raise CheckpointError(f"exported weights file {str(path)!r} does not exist")
    if path.suffix == ".npz":
        with np.load(path) as npz:
            if METADATA_ENTRY not in npz.files:
                raise CheckpointError(f"{path} was not written by `shardlib export` (no {METADATA_ENTRY} entry)")
            return json.loads(npz[METADATA_ENTRY].tobytes())
    header, _ = _read_safetensors_header(path)
    meta = header.get("__metadata__", {})
    if METADATA_ENTRY not in meta:
        raise CheckpointError(f"{path} was not written by `shardlib export` (no {METADATA_ENTRY} metadata)")
    return json.loads(meta[METADATA_ENTRY])


def _iter_tensors(path: Path, record: dict[str, Any]) -> Iterator[tuple[dict[str, Any], np.ndarray]]:
    if path.suffix == ".npz":
        with np.load(path) as npz:
            for t in record["tensors"]:
                array = npz[t["name"]]
                yield t, array.view(ml_dtypes.bfloat16) if t["dtype"] == "bfloat16" else array
        return
    header, data_start = _read_safetensors_header(path)
    with open(path, "rb") as f:
        for t in record["tensors"]:
            begin, end = header[t["name"]]["data_offsets"]
            f.seek(data_start + begin)
            raw = f.read(end - begin)
            # read as the file's little-endian bytes, returned in the native byte order (a copy), so a
            # tensor's dtype is the one the .npz file gives and the model declared (float32, not <f4)
            yield t, np.frombuffer(raw, _dtype(t["dtype"]).newbyteorder("<")).reshape(t["shape"]).astype(_dtype(t["dtype"]))


def load_exported(path: str | os.PathLike[str], *, model_state: bool = False) -> Any:
    """The parameter tree (a pure dict of NumPy arrays) of an exported file, ready for ``model.apply``.

    ``model_state=True``: ``(params, model_state)``, the second the BatchNorm statistics (or other
    mutable state) the model needs for inference, None when the model keeps none.
    """
    path = Path(path)
    record = read_export_metadata(path)
    if record.get("format") not in READABLE_FORMATS:
        raise CheckpointError(f"{path} has export format {record.get('format')!r}; this shardlib reads "
                              f"{' or '.join(map(repr, READABLE_FORMATS))}")
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
    """The abstract parameters of ``config["model"]`` when it names a reference model, else None."""
    name = config.get("model")
    if not isinstance(name, str):
        return None
    from shardlib.models import CONFIGS, trainable

    if name not in CONFIGS:
        return None
    return trainable(CONFIGS[name]).abstract()


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


def _to_host(array: jax.Array) -> np.ndarray:
    if array.is_fully_addressable:
        return np.asarray(jax.device_get(array))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


class _DropReadOnlyNotice(logging.Filter):
    """Orbax warns "Given directory is read only" whenever a read-only manager opens; export means it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Given directory is read only")


def _open_checkpoints(path: str | os.PathLike[str]) -> Checkpointer:
    """The checkpoints of ``path``, read-only: a checkpoint directory, or a run folder holding ``checkpoints/``."""
    directory = Path(path).expanduser()
    if (directory / "checkpoints").is_dir():  # `shardlib train --out RUN` saves to RUN/checkpoints
        directory = directory / "checkpoints"
    absl_logger, notice = logging.getLogger("absl"), _DropReadOnlyNotice()
    absl_logger.addFilter(notice)
    try:
        return Checkpointer(directory, create=False)
    finally:
        absl_logger.removeFilter(notice)


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
    ckpt = _open_checkpoints(ckpt_dir)
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


def export_params(ckpt_dir: str | os.PathLike[str], out: str | os.PathLike[str], *, step: int | None = None) -> ExportSummary:
    """Write the parameters of checkpoint ``step`` (default: latest complete) to ``out``, and the
    model state (BatchNorm statistics) under ``model_state/`` when the model keeps one.

    ``ckpt_dir``: a checkpoint directory, or the run folder of `shardlib train` holding one.

    Call on every process of a multi-process job (the gathers are collective); process 0 writes.
    """
    out_path = Path(out).expanduser().resolve()
    _check_suffix(out_path)
    step, config, parts = _restore_parts(ckpt_dir, step)
    leaves, tensors = _tensor_records({part: parts[part] for part in ("params", "model_state") if part in parts})
    record = {"format": EXPORT_FORMAT, "step": step, "config": config, "tensors": tensors}
    writing = jax.process_index() == 0
    if writing:
        out_path.parent.mkdir(parents=True, exist_ok=True)
    writer = _writer(out_path, record) if writing else None
    total = largest = 0
    try:
        for leaf, t in zip(leaves, tensors):
            host = _to_host(leaf)  # may alias the device buffer on CPU: free the leaf only after writing
            total += host.nbytes
            largest = max(largest, host.nbytes)
            if writer is not None:
                writer.add(t["name"], host)
            del host
            leaf.delete()  # free its device shards before gathering the next tensor
    finally:
        if writer is not None:
            writer.close()
    state_tensors = sum(t["part"] == "model_state" for t in tensors)
    return ExportSummary(str(out_path), step, len(tensors), total, largest, config.get("model"), state_tensors)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ckpt", required=True, help="run folder of `shardlib train` (its --out) or the checkpoints "
                                                    "directory inside it")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest complete one)")
    parser.add_argument("--out", required=True, help="output file: FILE.npz or FILE.safetensors")


def run(args: argparse.Namespace) -> int:
    summary = export_params(args.ckpt, args.out, step=args.step)
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
