"""`shardlib train --lora-rank`: the flags turned into the model's `LoraConfig`, and the run's first
parameters: the Hugging Face base read into its shards in the compute dtype, beside adapters that
start fresh (the model's own initialisation: B zero, so step 0 is the base model) or from a PEFT
adapter (``--init-lora``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from shardlib.run.config import TrainConfig, TrainConfigError

DEFAULT_TARGETS = TrainConfig.lora_targets


def lora_config(config: TrainConfig, model_config: Any) -> Any:
    """The `LoraConfig` the flags ask for (None without ``--lora-rank`` / ``--init-lora``); what does
    not fit is named by its flag."""
    from shardlib.hf.peft import AdapterError, read_adapter_config
    from shardlib.models import MoEConfig
    from shardlib.models.configs import LoraConfig

    if config.lora_rank is None and config.init_lora is None:
        given = [field for field, set_ in (("lora_alpha", config.lora_alpha is not None),
                                           ("lora_targets", config.lora_targets != DEFAULT_TARGETS),
                                           ("lora_base", config.lora_base is not None)) if set_]
        if given:
            raise TrainConfigError(given[0], "shapes LoRA adapters: add --lora-rank R (or --init-lora PEFT_DIR)")
        return None
    field = "lora_rank" if config.lora_rank is not None else "init_lora"
    if config.init_from is None:
        raise TrainConfigError(field, "adapts a pretrained model, kept frozen: add --init-from HF_DIR")
    if isinstance(model_config, MoEConfig):
        raise TrainConfigError(field, "adapts the dense decoders' projections, not a mixture of experts")
    if config.lora_base is not None:
        from shardlib.models.lora import missing_quantiser

        try:
            LoraConfig(rank=1, base=config.lora_base)
        except ValueError as err:
            raise TrainConfigError("lora_base", str(err)) from None
        if missing_quantiser():
            raise TrainConfigError("lora_base", missing_quantiser())
    targets = tuple(t.strip() for t in config.lora_targets.split(",") if t.strip())
    try:
        flags = None if config.lora_rank is None else LoraConfig(rank=config.lora_rank, alpha=config.lora_alpha,
                                                                 targets=targets, base=config.lora_base)
    except ValueError as err:
        field = "lora_targets" if "targets" in str(err) else "lora_alpha" if "alpha" in str(err) else "lora_rank"
        raise TrainConfigError(field, str(err)) from None
    if config.init_lora is None:
        return flags
    try:
        adapter = dataclasses.replace(read_adapter_config(config.init_lora), base=config.lora_base)
    except AdapterError as err:
        raise TrainConfigError("init_lora", str(err)) from None
    if flags is None:
        if config.lora_alpha is not None or config.lora_targets != DEFAULT_TARGETS:
            raise TrainConfigError("init_lora", "takes rank, alpha and targets from the adapter: drop --lora-alpha / "
                                                "--lora-targets, or add --lora-rank to check them against it")
        return adapter
    if _normal(flags) != _normal(adapter):
        raise TrainConfigError("init_lora", f"{config.init_lora} holds {_text(adapter)}, and the flags ask for "
                                            f"{_text(flags)}: drop --lora-rank, --lora-alpha and --lora-targets "
                                            "to take the adapter's")
    return adapter


def _normal(lora: Any) -> tuple[int, float, tuple[str, ...]]:
    return lora.rank, lora.scale, lora.targets


def _text(lora: Any) -> str:
    return f"rank {lora.rank}, alpha {lora.scale * lora.rank:g} on {','.join(lora.targets)}"


def initial_params(run: Any) -> Any:
    """The parameters a LoRA run starts from, each in its sharding: the base from ``--init-from``'s
    files (each device reads its own shard, in the compute dtype), the adapters from
    ``--init-lora`` or the model's own initialisation with the run's seed."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from shardlib.hf.load import load_params
    from shardlib.models.lora import SCALE, is_adapter
    from shardlib.sharding.rules import path_str

    config = run.config
    shardings = run.layout.param_shardings()
    flat, treedef = jax.tree_util.tree_flatten_with_path(shardings)
    paths = [path_str(p) for p, _ in flat]
    by_path = dict(zip(paths, (s for _, s in flat)))
    # QLoRA: the weights read in the compute dtype (sharded as their codes), then quantised
    base_paths = [p for p in paths if not is_adapter(p) and not p.endswith(SCALE)]
    base_tree = {}
    for p in base_paths:  # the base model's tree (nested dicts, as `load_params` takes it)
        node = base_tree
        *parents, leaf = p.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = by_path[p]
    dtype = np.dtype(jnp.dtype(run.model_config.compute_dtype))
    base = {path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(load_params(run.pretrained, base_tree, dtype))}
    if run.model_config.lora.base is not None:
        base = _quantised(base, by_path, run.model_config)
    adapter_shardings = {p: by_path[p] for p in paths if is_adapter(p)}
    if config.init_lora is not None:
        from shardlib.hf.peft import AdapterError, read_adapters

        try:
            host = read_adapters(config.init_lora, run.model_config)
        except AdapterError as err:
            raise TrainConfigError("init_lora", str(err)) from None
        adapters = {p: jax.device_put(host[p], s) for p, s in adapter_shardings.items()}
    else:  # the model's init, of which XLA keeps only the adapters' part
        def fresh(key):
            tree = run.model.init(key)
            return {path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree) if is_adapter(path_str(p))}

        adapters = jax.jit(fresh, out_shardings=adapter_shardings)(jax.random.key(config.seed))
    merged = {**base, **adapters}
    return jax.tree_util.tree_unflatten(treedef, [merged[p] for p in paths])


def _quantised(base: dict[str, Any], shardings: dict[str, Any], model_config: Any) -> dict[str, Any]:
    """``base`` with each weight that has scales in ``shardings`` replaced by its codes and scales
    (`models.lora.quantise`, per layer and output channel), each in its own sharding; the float
    weight is donated, so one projection at a time is held twice."""
    import functools

    import jax

    from shardlib.models.lora import SCALE, TARGETS, quantise

    n_in = {weight: n for _, weight, n, _ in TARGETS.values()}
    out = dict(base)
    for path in [p for p in base if p + SCALE in shardings]:
        weight = path.rsplit("/", 1)[-1]
        fn = functools.partial(quantise, n_in=n_in[weight], base=model_config.lora.base, stacked=1)
        out[path], out[path + SCALE] = jax.jit(fn, donate_argnums=0, out_shardings=(
            shardings[path], shardings[path + SCALE]))(out.pop(path))
    return {p: x.astype(model_config.compute_dtype) if p.endswith(SCALE) else x for p, x in out.items()}


def describe(run: Any) -> str | None:
    """The run header's line on what trains: None for a run that trains every parameter."""
    import jax.numpy as jnp

    from shardlib.models.configs import lora_param_count
    from shardlib.models.lora import describe as describe_lora

    lora = getattr(run.model_config, "lora", None)
    if lora is None:
        return None
    trained = lora_param_count(run.model_config)
    frozen = run.n_params - trained
    source = f" from {run.config.init_lora}" if run.config.init_lora else ""
    stored = jnp.dtype(run.model_config.compute_dtype).name
    if lora.base is not None:
        stored = f"{stored}, the projections as {lora.base} codes with per-channel scales (QLoRA)"
    return (f"trains     {trained:,} of {run.n_params:,} parameters ({100 * trained / run.n_params:.2f}%): "
            f"{describe_lora(lora)}{source}; the other {frozen:,} frozen, stored in {stored}")
