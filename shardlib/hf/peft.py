"""LoRA adapters in and out as PEFT saves them: ``adapter_config.json`` beside
``adapter_model.safetensors``, which ``peft.PeftModel.from_pretrained(base, dir)`` loads onto the
Hugging Face model the run started from.

PEFT stores one ``lora_A.weight [rank, in]`` and ``lora_B.weight [out, rank]`` per adapted
``Linear`` and layer, named after the module (``base_model.model.model.layers.{i}.self_attn.q_proj``);
shardlib's adapters are stacked over the layers with the heads as their own axes
(`models.lora`), so each is cut per layer and flattened as the base weight is. Only what shardlib
reproduces exactly is read back: plain LoRA (no DoRA, rsLoRA, per-layer ranks, biases or extra
trained modules); anything else is refused by name.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from shardlib.hf.json_files import read_object
from shardlib.hf.safetensors_io import SafetensorsFileError, TensorFile, TensorWriter
from shardlib.hf.save import check_target, commit, write_marker
from shardlib.models import GPTConfig
from shardlib.models import lora as lora_lib
from shardlib.models.configs import LoraConfig
from shardlib.runtime.files import AtomicDir
from shardlib.runtime.host import to_host

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_SUBMODULE = {"attn": "self_attn", "mlp": "mlp"}
# adapter_config.json fields whose other values change the maths shardlib reproduces.
_MUST_BE = {"peft_type": "LORA", "use_dora": False, "use_rslora": False, "bias": "none", "fan_in_fan_out": False,
            "layers_to_transform": None, "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {}}


class AdapterError(ValueError):
    """An adapter directory that cannot be read or written as asked: one line naming the file or field."""

    user_facing = True


def tensor_name(target: str, layer: int, which: str) -> str:
    """PEFT's name of layer ``layer``'s ``lora_A`` / ``lora_B`` (``which``) of ``target`` (``q``, ``down``, ...)."""
    sub, _, _, module = lora_lib.TARGETS[target]
    return f"base_model.model.model.layers.{layer}.{_SUBMODULE[sub]}.{module}.lora_{which}.weight"


def adapter_config(lora: LoraConfig, base: str | None) -> dict[str, Any]:
    """The ``adapter_config.json`` of ``lora`` (PEFT fills the fields it leaves out with its defaults)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
            "r": lora.rank, "lora_alpha": lora.rank if lora.alpha is None else lora.alpha,
            "target_modules": [lora_lib.TARGETS[t][3] for t in lora.targets], "lora_dropout": 0.0,
            "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "init_lora_weights": True, "inference_mode": True, "layers_to_transform": None,
            "modules_to_save": None}


def save_adapter(params: Mapping[str, Any], config: GPTConfig, out: str | os.PathLike[str], *,
                 base: str | None = None) -> tuple[Path, int]:
    """Write the adapters of ``params`` (a LoRA decoder's parameter tree, sharded or not) to the
    PEFT directory ``out``, in float32; ``base`` is recorded as ``base_model_name_or_path``.
    Written under a temporary name beside ``out`` and renamed onto it when complete; ``out`` may be
    new, empty or an earlier adapter export. Returns (directory, tensors written). Call on every
    process (the gathers are collective); process 0 writes."""
    if config.lora is None:
        raise AdapterError("this run trained no LoRA adapters (no --lora-rank): export the whole model with --hf")
    out_dir = check_target(out)  # new, empty, or an earlier export that wrote every file in it
    entries, arrays = [], []
    for target in config.lora.targets:
        sub, weight, _, _ = lora_lib.TARGETS[target]
        a_all = to_host(params["blocks"][sub][f"{weight}_lora_a"]).astype(np.float32)
        b_all = to_host(params["blocks"][sub][f"{weight}_lora_b"]).astype(np.float32)
        for layer in range(config.n_layers):
            for which, array in zip("AB", lora_lib.peft_tensors(a_all[layer], b_all[layer])):
                entries.append((tensor_name(target, layer, which), np.dtype(np.float32), array.shape))
                arrays.append(np.ascontiguousarray(array))
    order = sorted(range(len(entries)), key=lambda k: entries[k][0])
    if jax.process_index() != 0:
        return out_dir, len(entries)
    staging = AtomicDir(out_dir, what="a LoRA adapter export")
    try:
        with staging.open(WEIGHTS_FILE) as file:
            writer = TensorWriter(file, [entries[k] for k in order], metadata={"format": "pt"})
            for k in order:
                writer.add(entries[k][0], arrays[k])
            writer.close()
        staging.write(CONFIG_FILE, json.dumps(adapter_config(config.lora, base), indent=2) + "\n")
        write_marker(staging)
        commit(staging, out_dir)
    except BaseException:
        staging.discard()
        raise
    return out_dir, len(entries)


def saved_lora(run_config: Mapping[str, Any]) -> LoraConfig | None:
    """The `LoraConfig` a run trained, as its saved config records it (``lora``); None without."""
    saved = run_config.get("lora")
    if not isinstance(saved, Mapping):
        return None
    return LoraConfig(rank=saved["rank"], alpha=saved.get("alpha"), targets=tuple(saved["targets"]),
                      base=saved.get("base"))


def read_adapter_config(directory: str | os.PathLike[str]) -> LoraConfig:
    """The `LoraConfig` of a PEFT adapter directory, or an `AdapterError` naming the file and the
    field shardlib does not reproduce."""
    path = Path(directory).expanduser() / CONFIG_FILE
    config = read_object(path, AdapterError, f"{path.parent} is not a PEFT adapter directory: it has no {CONFIG_FILE}")
    for field, value in _MUST_BE.items():
        if config.get(field, value) not in (value, None if value == {} else value):
            raise AdapterError(f"{path}: {field}={config[field]!r} is not supported (shardlib reproduces "
                               f"{field}={value!r})")
    modules = config.get("target_modules")
    by_module = {entry[3]: name for name, entry in lora_lib.TARGETS.items()}
    if not isinstance(modules, list) or not modules or any(m not in by_module for m in modules):
        raise AdapterError(f"{path}: target_modules={modules!r}; shardlib adapts a list of "
                           f"{', '.join(by_module)}")
    try:
        return LoraConfig(rank=config.get("r"), alpha=float(config.get("lora_alpha", 8)),
                          targets=tuple(by_module[m] for m in modules))
    except (ValueError, TypeError) as err:
        raise AdapterError(f"{path}: {err}") from None


def read_adapters(directory: str | os.PathLike[str], config: GPTConfig) -> dict[str, np.ndarray]:
    """The adapters of a PEFT directory as float32 arrays of shardlib's stacked shapes, by
    parameter path (``blocks/attn/wq_lora_a``); every tensor checked against ``config``'s model."""
    from shardlib.models import trainable
    from shardlib.sharding.rules import path_str

    path = Path(directory).expanduser() / WEIGHTS_FILE
    try:
        file = TensorFile(path)
    except (OSError, SafetensorsFileError) as err:
        raise AdapterError(f"{path}: {err}") from None
    shapes = {path_str(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(trainable(config).abstract())}
    out, expected = {}, set()
    for target in config.lora.targets:
        sub, weight, _, _ = lora_lib.TARGETS[target]
        a_path, b_path = f"blocks/{sub}/{weight}_lora_a", f"blocks/{sub}/{weight}_lora_b"
        a_shape, b_shape = shapes[a_path][1:], shapes[b_path][1:]
        layers_a, layers_b = [], []
        for layer in range(config.n_layers):
            names = tensor_name(target, layer, "A"), tensor_name(target, layer, "B")
            expected.update(names)
            want = (config.lora.rank, int(np.prod(a_shape[:-1]))), (int(np.prod(b_shape[1:])), config.lora.rank)
            for name, like in zip(names, want):
                if name not in file.entries:
                    raise AdapterError(f"{path} has no tensor {name!r}: an adapter of another model or targets")
                if file.shape(name) != like:
                    raise AdapterError(f"{path}: {name} is {list(file.shape(name))}, this model's is {list(like)}")
            a, b = lora_lib.from_peft_tensors(file.read(names[0]).astype(np.float32),
                                              file.read(names[1]).astype(np.float32), a_shape, b_shape)
            layers_a.append(a)
            layers_b.append(b)
        out[a_path], out[b_path] = np.stack(layers_a), np.stack(layers_b)
    extra = sorted(set(file.entries) - expected)
    if extra:
        raise AdapterError(f"{path} holds {len(extra)} tensor(s) this model's adapters would not use, first "
                           f"{extra[0]!r}")
    return out
