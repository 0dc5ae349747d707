"""A Hugging Face model directory read straight into sharded parameters.

`open_pretrained` reads ``config.json`` (the `GPTConfig` it describes, or a refusal naming what
is not supported) and the safetensors headers, and checks that every tensor the model needs is
there with the shape it needs, before any data is read. `load_params` then reads each
checkpoint tensor once a job (`shardlib.hf.rows`): every process reads the rows its own devices
hold, in positioned reads, places them in the checkpoint's dtype, and one compiled program per
parameter converts them to the parameter dtype, reorders and stacks them, and reshards them to
the parameter's sharding; a parameter whose devices are all this process's (one process) has
each device's shard sliced on the host from the tensor mapped once instead, converted on its
device with no collective (on CPU devices: written once in host memory the device then uses,
`shardlib.hf.local_rows`). No process ever holds a whole model in
host memory, only one slice a reading thread (or one mapped checkpoint tensor) and its devices' rows
of the tensor being converted.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import jax
import numpy as np

from shardlib.hf import architectures as arch_lib
from shardlib.hf import rows
from shardlib.hf.json_files import read_object
from shardlib.hf.safetensors_io import TensorFile
from shardlib.models import GPTConfig

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Buffers some exporters saved alongside the weights: recomputed from the config, never read.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


class PretrainedError(ValueError):
    """A model directory that cannot be read as asked: one line naming the file or tensor."""

    user_facing = True


@dataclasses.dataclass
class Pretrained:
    """An opened Hugging Face model directory: its config, and where each tensor lies."""

    directory: Path
    hf_config: dict[str, Any]
    architecture: arch_lib.Architecture
    model_config: GPTConfig
    files: dict[str, TensorFile]  # checkpoint tensor name -> the file holding it

    def describe(self) -> str:
        c = self.model_config
        return (f"{self.architecture.name} from {self.directory} ({c.n_layers} layers, d_model {c.d_model}, "
                f"{c.n_heads} heads / {c.n_kv_heads} kv, vocab {c.vocab_size})")


def is_pretrained_dir(path: str | os.PathLike[str] | None) -> bool:
    """Whether ``path`` is a Hugging Face model directory: a config.json beside safetensors weights
    (a `shardlib train` run directory has a config.json too, and checkpoints instead)."""
    if path is None:
        return False
    directory = Path(path).expanduser()
    return (directory / "config.json").is_file() and any((directory / n).is_file() for n in (SINGLE, INDEX))


def read_hf_config(directory: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(directory).expanduser() / "config.json"
    return read_object(path, PretrainedError, f"{path.parent} is not a Hugging Face model directory: it has no config.json")


def open_pretrained(directory: str | os.PathLike[str], *, seq_len: int | None = None) -> Pretrained:
    """The model directory ``directory``, checked: config supported, every tensor present and of
    the shape the config implies, no tensor the model would ignore. ``seq_len``: the longest
    sequence the run will see (a sliding attention window is applied only past its length)."""
    directory = Path(directory).expanduser()
    hf_config = read_hf_config(directory)
    source = str(directory / "config.json")
    architecture = arch_lib.architecture_of(hf_config, source)
    model_config = arch_lib.to_gpt_config(hf_config, source, seq_len=seq_len)
    files = _tensor_files(directory)
    _check_layer_count(directory, model_config, files)
    pretrained = Pretrained(directory, hf_config, architecture, model_config, files)
    _check_tensors(pretrained)
    return pretrained


def _tensor_files(directory: Path) -> dict[str, TensorFile]:
    """Checkpoint tensor name -> its file, from the index or the single file."""
    if (directory / INDEX).is_file():
        try:
            weight_map = json.loads((directory / INDEX).read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError) as err:
            raise PretrainedError(f"{directory / INDEX} is not a safetensors index (no weight_map: "
                                  f"{type(err).__name__} {' '.join(str(err).split())[:200]})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                       for k, v in weight_map.items()):
            raise PretrainedError(f"{directory / INDEX}: weight_map must be an object of tensor name -> file name "
                                  "strings, as transformers writes it")
        opened: dict[str, TensorFile] = {}
        for name in sorted(set(weight_map.values())):
            if Path(name).name != name:  # an index may only name files beside it
                raise PretrainedError(f"{directory / INDEX} names {name!r}, which is not a file in {directory}")
            if not (directory / name).is_file():
                raise PretrainedError(f"{directory / INDEX} lists {name}, which is missing from {directory}")
            opened[name] = TensorFile(directory / name)
        files = {}
        for tensor, name in weight_map.items():
            if tensor not in opened[name].entries:
                raise PretrainedError(f"{directory / INDEX} places {tensor!r} in {name}, which does not hold it")
            files[tensor] = opened[name]
        return files
    if (directory / SINGLE).is_file():
        single = TensorFile(directory / SINGLE)
        return {name: single for name in single.entries}
    other = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".h5", ".msgpack"))
    hint = (f"; it has {', '.join(other)}: save it as safetensors first (transformers: "
            "model.save_pretrained(dir, safe_serialization=True)), pickled weights are never loaded") if other else ""
    raise PretrainedError(f"{directory} has neither {SINGLE} nor {INDEX}{hint}")


def _expected(config: GPTConfig, arch: arch_lib.Architecture | None = None
              ) -> dict[str, tuple[arch_lib.TensorMap, tuple[int, ...]]]:
    """Checkpoint tensor name -> (its map, the shape it must have) for a model of ``config``."""
    shapes = _param_shapes(config)
    expected = {}
    for t in arch_lib.tensors_for(config, arch):
        shape = t.placement.hf_shape(shapes[t.path][t.stacked:])
        if t.fused:  # one tensor for all the parts: their rows together
            shape = (sum(arch_lib.FUSED_TENSORS[p].placement.hf_shape(shapes[p][1:])[0] for p in t.fused), *shape[1:])
        for name in arch_lib.hf_names(t, *shapes[t.path][:t.stacked]):
            expected[name] = (t, shape)
    return expected


def _check_layer_count(directory: Path, config: GPTConfig, files: dict[str, TensorFile]) -> None:
    """num_hidden_layers against the layers the files hold, before a name is built for each layer
    (a config claiming 10^8 layers would otherwise build 10^9 names first)."""
    layers = {name.split(".")[2] for name in files if name.startswith("model.layers.") and name.count(".") > 2}
    if config.n_layers != len(layers):
        raise PretrainedError(f"{directory / 'config.json'}: num_hidden_layers is {config.n_layers}, and the weights "
                              f"hold {len(layers)} layers: the config is not that of these weights")


def _check_tensors(pretrained: Pretrained) -> None:
    expected = _expected(pretrained.model_config, pretrained.architecture)
    missing = [name for name in expected if name not in pretrained.files]
    if missing:
        raise PretrainedError(f"{pretrained.directory} lacks {len(missing)} tensor(s) its config.json implies, first "
                              f"{missing[0]!r}: the weights are not those of this config")
    for name, (_, shape) in expected.items():
        found = pretrained.files[name].shape(name)
        if pretrained.files[name].dtype(name).kind != "f" and pretrained.files[name].dtype(name).name != "bfloat16":
            raise PretrainedError(f"{pretrained.files[name].path}: tensor {name!r} is stored as "
                                  f"{pretrained.files[name].dtype(name)}, not a floating-point type a weight can be")
        if tuple(found) != shape:
            raise PretrainedError(f"{pretrained.directory}: tensor {name!r} has shape {list(found)}, and config.json "
                                  f"implies {list(shape)}")
    tied_head = pretrained.model_config.tie_embeddings and "lm_head.weight" in pretrained.files
    extra = [n for n in pretrained.files if n not in expected and not n.endswith(IGNORED_SUFFIXES)
             and not (tied_head and n == "lm_head.weight")]
    if extra:
        raise PretrainedError(f"{pretrained.directory} holds {len(extra)} tensor(s) the {pretrained.architecture.name} "
                              f"model would not use, first {extra[0]!r}: a different model, or an option shardlib "
                              "does not reproduce")


@functools.lru_cache(maxsize=16)
def _param_shapes(config: GPTConfig) -> Mapping[str, tuple[int, ...]]:
    """Parameter path -> shape, from the abstract model (nothing allocated). Traced once per config
    (about a second on a CPU): open_pretrained and load_params ask for the same model's shapes."""
    from shardlib.models import trainable
    from shardlib.sharding.rules import path_str

    flat = jax.tree_util.tree_flatten_with_path(trainable(config).abstract())[0]
    return MappingProxyType({path_str(path): tuple(leaf.shape) for path, leaf in flat})


def load_params(pretrained: Pretrained, shardings: Any, dtype: Any = np.float32) -> dict[str, Any]:
    """The parameter tree of ``pretrained``'s model, each tensor placed in its sharding of
    ``shardings`` (a tree like the model's parameters: `Layout.param_shardings`) as ``dtype``.

    Every process calls it; each reads its devices' share of every checkpoint tensor's rows, once,
    and the devices convert and reshard them (`shardlib.hf.rows`; in one process, no reshard:
    `shardlib.hf.local_rows`)."""
    from shardlib.sharding.rules import path_str

    flat, treedef = jax.tree_util.tree_flatten_with_path(shardings)
    by_path = {path_str(path): sharding for path, sharding in flat}
    shapes = _param_shapes(pretrained.model_config)
    maps = {t.path: t for t in arch_lib.fused_maps(arch_lib.tensors_for(pretrained.model_config,
                                                                         pretrained.architecture), shapes)}
    if set(by_path) != set(maps):
        raise PretrainedError(f"the shardings given are not those of {pretrained.describe()}: they name "
                              f"{sorted(set(by_path) ^ set(maps))[:3]}")
    leaves = rows.load(pretrained, [(maps[p], shapes[p], by_path[p]) for p in by_path], np.dtype(dtype))
    return jax.tree_util.tree_unflatten(treedef, leaves)
