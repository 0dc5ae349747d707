"""Sharded parameters written back as a Hugging Face model directory, one tensor at a time.

Each checkpoint tensor (a layer's slice of a stacked parameter) is cut out on the devices,
gathered to the host, converted to the export dtype, appended to its safetensors shard by
process 0, and freed: host memory stays near one tensor. Shards hold at most
``max_shard_bytes`` each, with ``model.safetensors.index.json`` when there are several, and
``config.json`` says what `transformers.AutoModelForCausalLM.from_pretrained` needs. The
directory is written under a temporary name beside ``out`` and renamed onto it once complete,
so a failed export leaves any previous one intact and nothing half-written at ``out``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np

from shardlib.hf import architectures as arch_lib
from shardlib.hf.load import INDEX, SINGLE
from shardlib.hf.safetensors_io import TensorWriter
from shardlib.models import GPTConfig
from shardlib.runtime.host import to_host

EXPORT_DTYPES = {"bf16": np.dtype(ml_dtypes.bfloat16), "f32": np.dtype(np.float32)}
DEFAULT_SHARD_BYTES = 5 * 2**30  # transformers' own default shard size


class ExportError(ValueError):
    """An export that cannot be written as asked: one line naming the directory and the fix."""

    user_facing = True


@dataclasses.dataclass(frozen=True)
class HfExport:
    """What `save_pretrained` wrote."""

    directory: str
    architecture: str
    tensors: int
    files: int
    bytes: int
    largest_tensor_bytes: int


def _tensor_order(config: GPTConfig) -> Iterator[tuple[arch_lib.TensorMap, int | None]]:
    """(map, layer) in the order transformers lays a checkpoint out: embedding, layer by layer, head."""
    maps = arch_lib.tensors_for(config)
    yield from ((t, None) for t in maps if not t.per_layer and t.path == "embedding")
    for i in range(config.n_layers):
        yield from ((t, i) for t in maps if t.per_layer)
    yield from ((t, None) for t in maps if not t.per_layer and t.path != "embedding")


def _leaf(params: Mapping[str, Any], path: str) -> Any:
    node: Any = params
    for key in path.split("/"):
        node = node[key]
    return node


def save_pretrained(params: Mapping[str, Any], config: GPTConfig, out: str | os.PathLike[str], *,
                    hf_config: Mapping[str, Any] | None = None, architecture: str | None = None,
                    dtype: str = "bf16", max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                    tokenizer_file: str | os.PathLike[str] | None = None) -> HfExport:
    """Write ``params`` (the decoder's parameter tree, sharded or not) of a model of ``config`` to
    the Hugging Face directory ``out``.

    ``hf_config`` / ``architecture``: the config.json the weights were imported from and its
    architecture (its other fields, token ids and such, are kept); a model born in shardlib is
    written as ``LlamaForCausalLM``. ``dtype``: "bf16" or "f32" (f32 is bit-exact).
    ``tokenizer_file``: a tokenizer.json copied beside the weights, with its tokenizer_config.json.
    Call on every process of a job (the gathers are collective); process 0 writes."""
    if dtype not in EXPORT_DTYPES:
        raise ExportError(f"export dtype {dtype!r} is not one of {', '.join(EXPORT_DTYPES)}")
    arch = arch_lib.ARCHITECTURES[architecture or "LlamaForCausalLM"]
    out_dir = Path(out).expanduser().resolve()
    _check_target(out_dir)
    np_dtype = EXPORT_DTYPES[dtype]
    order = list(_tensor_order(config))
    entries = []
    for t, layer in order:
        shape = tuple(_leaf(params, t.path).shape)
        entries.append((t.name.format(i=layer) if layer is not None else t.name, np_dtype,
                        t.placement.hf_shape(shape[1:] if t.per_layer else shape)))
    files = _assign_files(entries, max_shard_bytes)
    main = jax.process_index() == 0
    staging = out_dir.with_name(f".{out_dir.name}.{os.getpid()}.{secrets.token_hex(4)}.partial") if main else None
    largest = total = 0
    try:
        writers = _open_writers(staging, entries, files) if main else {}
        for (t, layer), (name, _, _) in zip(order, entries):
            leaf = _leaf(params, t.path)
            host = to_host(leaf[layer] if layer is not None else leaf)
            tensor = np.ascontiguousarray(t.placement.to_hf(host).astype(np_dtype))
            largest, total = max(largest, tensor.nbytes), total + tensor.nbytes
            if main:
                writers[files[name]][1].add(name, tensor)
            del host, tensor
        if main:
            for file, writer in writers.values():
                writer.close()
                file.flush()
                os.fsync(file.fileno())
                file.close()
            _write_metadata(staging, config, arch, hf_config, dtype, files, entries, tokenizer_file)
            _commit(staging, out_dir)
    except BaseException:
        if main and staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return HfExport(str(out_dir), arch.name, len(entries), len(set(files.values())), total, largest)


def _check_target(out_dir: Path) -> None:
    """``out`` may be new, empty, or an earlier export (replaced whole); anything else is refused."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"{out_dir} is a file; a Hugging Face export is a directory: pick another --out")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / "config.json").is_file():
        raise ExportError(f"{out_dir} holds files that are not a model export; pick a new or empty directory")


def _assign_files(entries: list[tuple[str, np.dtype, tuple[int, ...]]], max_bytes: int) -> dict[str, str]:
    """Tensor name -> file name: consecutive tensors fill a shard up to ``max_bytes`` (a larger
    tensor gets a shard of its own), named as transformers names them."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, dtype, shape in entries:
        nbytes = math.prod(shape) * dtype.itemsize
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    if len(groups) == 1:
        return {name: SINGLE for name in groups[0]}
    n = len(groups)
    return {name: f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k, group in enumerate(groups) for name in group}


def _open_writers(staging: Path, entries, files: dict[str, str]) -> dict[str, tuple[Any, TensorWriter]]:
    staging.mkdir(parents=True)
    writers = {}
    for file_name in dict.fromkeys(files.values()):
        file = open(staging / file_name, "wb")
        writers[file_name] = (file, TensorWriter(file, [e for e in entries if files[e[0]] == file_name],
                                                 metadata={"format": "pt"}))
    return writers


def _write_metadata(staging: Path, config: GPTConfig, arch: arch_lib.Architecture, hf_config: Mapping[str, Any] | None,
                    dtype: str, files: dict[str, str], entries, tokenizer_file: Any) -> None:
    torch_dtype = {"bf16": "bfloat16", "f32": "float32"}[dtype]
    (staging / "config.json").write_text(json.dumps(arch_lib.from_gpt_config(config, arch, hf_config, torch_dtype),
                                                    indent=2) + "\n", encoding="utf-8")
    if len(set(files.values())) > 1:
        total = sum(math.prod(shape) * d.itemsize for _, d, shape in entries)
        index = {"metadata": {"total_size": total}, "weight_map": files}
        (staging / INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    if tokenizer_file is not None and Path(tokenizer_file).is_file():
        source = Path(tokenizer_file)
        shutil.copyfile(source, staging / "tokenizer.json")
        if (source.parent / "tokenizer_config.json").is_file():
            shutil.copyfile(source.parent / "tokenizer_config.json", staging / "tokenizer_config.json")


def _commit(staging: Path, out_dir: Path) -> None:
    """Rename the complete directory onto ``out_dir``; an earlier export there is set aside first
    and removed only once the new one is in place."""
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.{secrets.token_hex(4)}.replaced")
        os.replace(out_dir, old)
    os.replace(staging, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
