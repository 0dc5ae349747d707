"""Sharded parameters written back as a Hugging Face model directory, one tensor at a time.

Each checkpoint tensor (a layer's slice of a stacked parameter) is cut out on the devices,
gathered to the host, converted to the export dtype, appended to its safetensors shard by
process 0, and freed: host memory stays near one tensor. Shards hold at most
``max_shard_bytes`` each, with ``model.safetensors.index.json`` when there are several, and
``config.json`` says what `transformers.AutoModelForCausalLM.from_pretrained` needs. The
directory is written under a temporary name beside ``out`` and renamed onto it once complete,
so a failed export leaves any previous one intact and nothing half-written at ``out``.

An export replaces only an earlier export: it writes a marker (``MARKER``) listing its files, and
``out`` must be new, empty, or a directory whose every entry that marker lists. A run directory
(``checkpoints/``, ``.lock``), the ``--ckpt`` directory or one holding it, a link, or a directory
holding any other file (a Hub model's ``README.md``, your notes) is refused in one
line before anything is restored, and the replaced export's files are removed by name, never
the directory's other contents.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np

from shardlib.hf import architectures as arch_lib
from shardlib.hf.generation_config import NAME as GENERATION_CONFIG, generation_config_text
from shardlib.hf.load import INDEX, SINGLE
from shardlib.hf.safetensors_io import TensorWriter
from shardlib.models import GPTConfig
from shardlib.runtime.files import AtomicDir, refuse_link
from shardlib.runtime.host import to_host

EXPORT_DTYPES = {"bf16": np.dtype(ml_dtypes.bfloat16), "f32": np.dtype(np.float32)}
DEFAULT_SHARD_BYTES = 5 * 2**30  # transformers' own default shard size
MARKER = ".shardlib-export.json"  # what an export wrote: the only files a later export may replace
MARKER_FORMAT = "shardlib.hf.save/1"
RUN_ENTRIES = ("checkpoints", ".lock", "metrics.jsonl")  # a training run's directory, never an export's


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


def _tensor_order(config: GPTConfig, arch: arch_lib.Architecture
                  ) -> Iterator[tuple[arch_lib.TensorMap, tuple[int, ...] | None]]:
    """(map, index of its stacked dims) in the order transformers lays a checkpoint out:
    embedding, layer by layer (an MoE layer's experts one by one), head."""
    maps = arch_lib.tensors_for(config, arch)
    experts = getattr(config, "n_experts", 0)
    yield from ((t, None) for t in maps if not t.per_layer and t.path == "embedding")
    for i in range(config.n_layers):
        for t in (t for t in maps if t.per_layer):
            yield from (((t, (i, j)) for j in range(experts)) if t.per_expert else [(t, (i,))])
    yield from ((t, None) for t in maps if not t.per_layer and t.path != "embedding")


def _leaf(params: Mapping[str, Any], path: str) -> Any:
    node: Any = params
    for key in path.split("/"):
        node = node[key]
    return node


def save_pretrained(params: Mapping[str, Any], config: GPTConfig, out: str | os.PathLike[str], *,
                    hf_config: Mapping[str, Any] | None = None, architecture: str | None = None,
                    dtype: str = "bf16", max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                    tokenizer_file: str | os.PathLike[str] | None = None,
                    generation_config: Mapping[str, Any] | None = None) -> HfExport:
    """Write ``params`` (the decoder's parameter tree, sharded or not) of a model of ``config`` to
    the Hugging Face directory ``out``.

    ``hf_config`` / ``architecture``: the config.json the weights were imported from and its
    architecture (its other fields, token ids and such, are kept); a model born in shardlib is
    written as ``LlamaForCausalLM``. ``dtype``: "bf16" or "f32" (f32 is bit-exact).
    ``tokenizer_file``: a tokenizer.json copied beside the weights, with the tokenizer_config.json
    and chat_template.jinja beside it (``apply_chat_template`` on the export renders as in training).
    ``generation_config``: the imported model's generation_config.json, written back as it was.
    Call on every process of a job (the gathers are collective); process 0 writes."""
    if dtype not in EXPORT_DTYPES:
        raise ExportError(f"export dtype {dtype!r} is not one of {', '.join(EXPORT_DTYPES)}")
    arch = arch_lib.ARCHITECTURES[architecture] if architecture else arch_lib.export_architecture(config)
    out_dir = check_target(out)
    np_dtype = EXPORT_DTYPES[dtype]
    # a fused tensor (Phi-3's qkv_proj) is written once, at its first part, holding every part's rows
    order = [(t, layer) for t, layer in _tensor_order(config, arch) if not t.fused or t.fused[0] == t.path]
    parts = {t.path: t for t in arch_lib.tensors_for(config, arch)}
    entries = []
    for t, layer in order:
        hf_shapes = [parts[p].placement.hf_shape(tuple(_leaf(params, p).shape)[t.stacked:]) for p in t.fused or [t.path]]
        entries.append((t.hf_name(layer) if layer is not None else t.name, np_dtype,
                        (sum(s[0] for s in hf_shapes), *hf_shapes[0][1:])))
    files = _assign_files(entries, max_shard_bytes)
    main = jax.process_index() == 0
    # ours=: the staging directories of exports killed before they were renamed (kill -9, SIGTERM)
    staging = AtomicDir(out_dir, what="a Hugging Face export", ours=_staging_ours) if main else None
    largest = total = 0
    try:
        writers = _open_writers(staging, entries, files) if main else {}
        for (t, layer), (name, _, _) in zip(order, entries):
            hosts = [to_host(_leaf(params, p)[layer] if layer is not None else _leaf(params, p)) for p in t.fused or [t.path]]
            tensor = np.ascontiguousarray(np.concatenate(
                [parts[p].placement.to_hf(h) for p, h in zip(t.fused or [t.path], hosts)]).astype(np_dtype))
            del hosts
            largest, total = max(largest, tensor.nbytes), total + tensor.nbytes
            if main:
                writers[files[name]][1].add(name, tensor)
            del tensor
        if main:
            for file, writer in writers.values():
                writer.close()
                file.close()
            _write_metadata(staging, config, arch, hf_config, dtype, files, entries, tokenizer_file)
            if generation_config is not None:
                staging.write(GENERATION_CONFIG, generation_config_text(dict(generation_config)))
            write_marker(staging)
            commit(staging, out_dir)
    except BaseException:
        if staging is not None:
            staging.discard()
        raise
    return HfExport(str(out_dir), arch.name, len(entries), len(set(files.values())), total, largest)


def _output_dir(out: str | os.PathLike[str]) -> Path:
    """``out`` made absolute without resolving its last part: a link there is refused, not followed."""
    path = Path(out).expanduser()
    return path.parent.resolve() / path.name


def _marked_files(out_dir: Path) -> set[str] | None:
    """The file names an earlier export's marker lists, or None when ``out_dir`` holds no valid marker."""
    marker = out_dir / MARKER
    if marker.is_symlink() or not marker.is_file():
        return None
    try:
        found = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return None
    names = found.get("files") if isinstance(found, dict) and found.get("format") == MARKER_FORMAT else None
    if not isinstance(names, list) or not all(isinstance(n, str) and n == Path(n).name and n not in ("", ".", "..")
                                              for n in names):
        return None
    return set(names) | {MARKER}


def check_target(out: str | os.PathLike[str], ckpt: str | os.PathLike[str] | None = None) -> Path:
    """``out`` as an absolute path, once it may receive an export: new, empty, or an earlier export
    whose marker lists every entry in it. Anything else is an `ExportError` naming what is in the
    way; ``ckpt``: the checkpoint being exported, which ``out`` must neither be nor hold."""
    out_dir = _output_dir(out)
    refuse_link(out_dir, "a Hugging Face export")
    if ckpt is not None:
        source = Path(ckpt).expanduser().resolve()
        if source == out_dir or out_dir in source.parents:
            raise ExportError(f"{out_dir} is, or holds, the checkpoint being exported ({source}); an export there "
                              "would replace it: pick a new --out")
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"{out_dir} is a file; a Hugging Face export is a directory: pick another --out")
    if not out_dir.is_dir():
        return out_dir
    entries = sorted(p.name for p in out_dir.iterdir())
    run = [name for name in RUN_ENTRIES if name in entries]
    if run:
        raise ExportError(f"{out_dir} is a training run's directory (it holds {', '.join(run)}); an export never "
                          "replaces a run: pick a new or empty --out")
    if not entries:
        return out_dir
    ours = _marked_files(out_dir)
    if ours is None:
        raise ExportError(f"{out_dir} holds files that are not a shardlib export ({_listed(entries)}; no {MARKER}); "
                          "an export replaces only an earlier export: pick a new or empty --out")
    foreign = [name for name in entries if name not in ours or (out_dir / name).is_symlink()
               or not (out_dir / name).is_file()]
    if foreign:
        raise ExportError(f"{out_dir} holds {_listed(foreign)}, which no earlier export wrote; an export replaces "
                          "only its own files: move them away or pick a new or empty --out")
    return out_dir


def _listed(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _staging_ours(path: Path) -> bool:
    """A killed export's staging directory: a real directory holding only the files it writes."""
    if path.is_symlink() or not path.is_dir():
        return False
    names = {p.name for p in path.iterdir()}
    return all(n == MARKER or n.endswith(".safetensors") or n in _METADATA for n in names)


def write_marker(staging: AtomicDir) -> None:
    names = sorted(p.name for p in staging.tmp.iterdir())
    staging.write(MARKER, json.dumps({"format": MARKER_FORMAT, "files": names}, indent=2) + "\n")


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


TOKENIZER_FILES = ("tokenizer_config.json", "chat_template.jinja")  # copied from beside the tokenizer.json
_METADATA = ("config.json", INDEX, "tokenizer.json", GENERATION_CONFIG, *TOKENIZER_FILES)


def _open_writers(staging: AtomicDir, entries, files: dict[str, str]) -> dict[str, tuple[Any, TensorWriter]]:
    writers = {}
    for file_name in dict.fromkeys(files.values()):
        file = staging.open(file_name)
        writers[file_name] = (file, TensorWriter(file, [e for e in entries if files[e[0]] == file_name],
                                                 metadata={"format": "pt"}))
    return writers


def _write_metadata(staging: AtomicDir, config: GPTConfig, arch: arch_lib.Architecture, hf_config: Mapping[str, Any] | None,
                    dtype: str, files: dict[str, str], entries, tokenizer_file: Any) -> None:
    torch_dtype = {"bf16": "bfloat16", "f32": "float32"}[dtype]
    staging.write("config.json", json.dumps(arch_lib.from_gpt_config(config, arch, hf_config, torch_dtype),
                                            indent=2) + "\n")
    if len(set(files.values())) > 1:
        total = sum(math.prod(shape) * d.itemsize for _, d, shape in entries)
        index = {"metadata": {"total_size": total}, "weight_map": files}
        staging.write(INDEX, json.dumps(index, indent=2) + "\n")
    if tokenizer_file is not None and Path(tokenizer_file).is_file():
        source = Path(tokenizer_file)
        staging.copy(source, "tokenizer.json")
        for name in TOKENIZER_FILES:
            if (source.parent / name).is_file():
                staging.copy(source.parent / name, name)


def commit(staging: AtomicDir, out_dir: Path) -> None:
    """Rename the complete directory onto ``out_dir``. An earlier export there (checked by
    `check_target` again, in case files appeared since) is set aside first, and only the files its
    marker lists are removed once the new one is in place; anything else keeps the old directory."""
    check_target(out_dir)
    old = staging.commit()
    if old is not None:
        for name in _marked_files(old) or ():
            (old / name).unlink(missing_ok=True)
        try:
            old.rmdir()
        except OSError:  # something not ours was added since the check: kept, and said so
            print(f"shardlib: note: {old} holds files the earlier export did not write; kept", file=sys.stderr)
