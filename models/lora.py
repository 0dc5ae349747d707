"""LoRA adapters on the decoder's projections (Hu et al., "LoRA: Low-Rank Adaptation of Large
Language Models", 2021), in the layout PEFT saves them.

An adapted projection ``y = x W`` becomes ``y = x W + scale * (x A) B`` with ``A: [in..., rank]``
(uniform in ``±1 / sqrt(fan_in)``, PEFT's default) and ``B: [rank, out...]`` (zeros), so an adapter
starts as the identity of the base model. Both are ``nnx.LoRAParam``: `models.gpt.trainable`
trains them alone (``from_nnx(wrt=nnx.LoRAParam)``: the base gets no update and no optimizer
state, and is stored in the compute dtype). Their logical names are the weight's input names then
``lora_rank``, and ``lora_rank`` then its output names, so a strategy shards them by the same rules
as the weight they adapt; ``lora_rank`` itself is never split (no rule names it).

The low-rank path runs as two small matmuls, never as a merged ``W + scale A B``: the base
weight's gradient (``x^T dy``, a third of a full fine-tune's FLOPs) is never formed.

QLoRA (``LoraConfig.base``, Dettmers et al., 2023): every projection of the frozen base is stored
as ``int8`` codes (`quantise` also gives NF4's, which do not train yet) with one scale per output
channel (absmax; stored, as the rest of the frozen base, in the compute dtype), quantised and
dequantised by Qwix (``qwix.quantize`` / ``qwix.dequantize``, Google's JAX quantisation library).
The codes keep the weight's logical names and the scales its output names, so both are sharded by
the weight's rules; the matmul reads ``codes * scale`` in the compute dtype.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .configs import GPTConfig, LoraConfig

RANK = "lora_rank"
# Per `--lora-targets` name: the submodule of a block, its weight, how many leading dims of the
# weight are the projection's input, and the module PEFT names (``target_modules``).
TARGETS: dict[str, tuple[str, str, int, str]] = {
    "q": ("attn", "wq", 1, "q_proj"),
    "k": ("attn", "wk", 1, "k_proj"),
    "v": ("attn", "wv", 1, "v_proj"),
    "o": ("attn", "wo", 2, "o_proj"),
    "gate": ("mlp", "w_gate", 1, "gate_proj"),
    "up": ("mlp", "w_up", 1, "up_proj"),
    "down": ("mlp", "w_down", 1, "down_proj"),
}


def attach(module: nnx.Module, config: GPTConfig, rngs: nnx.Rngs) -> None:
    """Give ``module`` (a block's Attention or GatedMLP, its weights already made) the adapters of
    its weights that ``config.lora`` targets."""
    if config.lora is None:
        return
    for target in config.lora.targets:
        _, weight, n_in, _ = TARGETS[target]
        w = getattr(module, weight, None)
        if w is None:
            continue
        names = tuple(w.out_sharding)
        shape = w[...].shape
        fan_in = math.prod(shape[:n_in])
        bound = 1.0 / math.sqrt(fan_in)
        a = jax.random.uniform(rngs.params(), (*shape[:n_in], config.lora.rank), jnp.float32, -bound, bound)
        setattr(module, f"{weight}_lora_a", nnx.LoRAParam(a, out_sharding=(*names[:n_in], RANK)))
        setattr(module, f"{weight}_lora_b", nnx.LoRAParam(jnp.zeros((config.lora.rank, *shape[n_in:]), jnp.float32),
                                                         out_sharding=(RANK, *names[n_in:])))
    module.lora_scale = config.lora.scale
    if config.lora.base is not None:
        _quantise_module(module, config.lora.base)


def _quantise_module(module: nnx.Module, base: str) -> None:
    """Replace each projection weight of ``module`` by its codes and per-output-channel scales."""
    for _, weight, n_in, _ in TARGETS.values():
        w = getattr(module, weight, None)
        if w is None:
            continue
        names = tuple(w.out_sharding)
        codes, scale = quantise(w[...], n_in, base)
        setattr(module, weight, nnx.Param(codes, out_sharding=names))
        setattr(module, f"{weight}{SCALE}", nnx.Param(scale, out_sharding=names[n_in:]))
    module.lora_base = base


SCALE = "_scale"  # the suffix of a quantised weight's scales


def missing_quantiser() -> str | None:
    """What to install for QLoRA when Qwix is missing; None when it is there."""
    import importlib.util

    if importlib.util.find_spec("qwix") is None:
        return "needs Qwix, which is not installed: pip install 'shardlib[qlora]'"
    return None


def quantise(w: jax.Array, n_in: int, base: str, stacked: int = 0) -> tuple[jax.Array, jax.Array]:
    """``(codes, scale)`` of ``w`` (``stacked`` leading dims of layers, then ``n_in`` input dims,
    then output dims): symmetric absmax per output channel, int8 codes ``round(w / s)`` with
    ``s = absmax / 127`` (``base="int8"``) or NF4's 4-bit level indices with ``s = absmax``
    (``"nf4"``); the scale float32, shaped like the stacked and output dims."""
    import qwix

    out = tuple(range(stacked)) + tuple(range(stacked + n_in, w.ndim))
    if base == "int8":  # s = absmax / 127 (Qwix's bound is 127.5): codes in [-127, 127], a channel's largest
        # weight exactly on +-127 rather than on the tie +-127.5, which the division's last bit would decide
        q = qwix.quantize(w.astype(jnp.float32), jnp.int8, channelwise_axes=out,
                          calibration_method=f"absmax,{127.5 / 127!r}")
    else:
        q = qwix.quantize(w.astype(jnp.float32), base, channelwise_axes=out)
    return q.qvalue, q.scale.reshape([w.shape[i] for i in out])


def dequantise(codes: jax.Array, scale: jax.Array, base: str, dtype: Any, stacked: int = 0) -> jax.Array:
    """``codes * scale`` in ``dtype``: the weight `quantise` stored (scale cast to ``dtype`` first)."""
    import qwix

    n_in = codes.ndim - scale.ndim
    shape = (*scale.shape[:stacked], *(1,) * n_in, *scale.shape[stacked:])
    qtype = None if base == "int8" else base
    return qwix.dequantize(qwix.QArray(codes, scale.astype(dtype).reshape(shape), qtype=qtype))


def weight(module: nnx.Module, name: str, dtype: Any) -> jax.Array:
    """The projection weight ``name`` of ``module`` in ``dtype``: dequantised under QLoRA."""
    w = getattr(module, name)[...]
    scale = getattr(module, f"{name}{SCALE}", None)
    if scale is None:
        return w.astype(dtype)
    return dequantise(w, scale[...], module.lora_base, dtype)


def adapted(module: nnx.Module, weight: str, x: jax.Array, y: jax.Array) -> jax.Array:
    """``y = x W`` plus ``scale * (x A) B`` of ``weight``'s adapter, in ``x``'s dtype (``y`` as it
    is without one); ``x``'s last dims are the projection's input."""
    a = getattr(module, f"{weight}_lora_a", None)
    if a is None:
        return y
    a, b = a[...].astype(x.dtype), getattr(module, f"{weight}_lora_b")[...].astype(x.dtype)
    low = jnp.tensordot(x, a, axes=a.ndim - 1)
    return y + jnp.tensordot(low, b, axes=1) * jnp.asarray(module.lora_scale, x.dtype)


def with_stored_base(model: Any, config: GPTConfig) -> Any:
    """``model`` (a `shardlib.Model` of a LoRA decoder) whose ``init`` gives the frozen base in
    ``config.compute_dtype``, as the step stores it, so that its abstract parameters are what a
    checkpoint of the run holds (`export`, `generate`)."""
    import dataclasses

    def init(key: jax.Array) -> Any:  # QLoRA's integer codes stay as they are
        return jax.tree.map(lambda x, frozen: x.astype(config.compute_dtype)
                            if frozen and jnp.issubdtype(x.dtype, jnp.floating) else x, model.init(key), model.frozen)

    return dataclasses.replace(model, init=init)


def is_adapter(path: str) -> bool:
    """Whether the parameter at ``path`` (``blocks/attn/wq_lora_a``) is an adapter's A or B."""
    return path.endswith(("_lora_a", "_lora_b"))


def merged(params: Any, config: GPTConfig) -> Any:
    """``params`` of a LoRA decoder as the plain decoder's: each adapted weight replaced by
    ``W + scale A B`` in float32, the adapters dropped (what `export --hf` writes); under QLoRA
    ``W`` is the dequantised base (codes x scales), the weights the run trained against."""
    out = dict(params)
    out["blocks"] = blocks = {name: dict(sub) for name, sub in params["blocks"].items()}
    if config.lora.base is not None:  # QLoRA: the base as the run computed with it, dequantised
        for sub, weight, _, _ in TARGETS.values():
            if f"{weight}{SCALE}" in blocks.get(sub, {}):
                scale = blocks[sub].pop(f"{weight}{SCALE}")
                blocks[sub][weight] = _dequantised(blocks[sub][weight], scale, config.lora.base)
    for target in config.lora.targets:
        sub, weight, _, _ = TARGETS[target]
        a, b = blocks[sub].pop(f"{weight}_lora_a"), blocks[sub].pop(f"{weight}_lora_b")
        blocks[sub][weight] = _merge(blocks[sub][weight], a, b, config.lora.scale)
    return out


@functools.partial(jax.jit, static_argnums=2)
def _dequantised(codes: jax.Array, scale: jax.Array, base: str) -> jax.Array:
    return dequantise(codes, scale, base, jnp.float32, stacked=1)


@functools.partial(jax.jit, static_argnums=3)
def _merge(w: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    layers, rank = a.shape[0], a.shape[-1]
    low = jnp.einsum("lir,lro->lio", a.astype(jnp.float32).reshape(layers, -1, rank),
                     b.astype(jnp.float32).reshape(layers, rank, -1))
    return w.astype(jnp.float32) + scale * low.reshape(w.shape)


def peft_tensors(a: Any, b: Any) -> tuple[Any, Any]:
    """One layer's adapter as PEFT stores it: ``lora_A.weight [rank, in]`` and ``lora_B.weight
    [out, rank]``, the input and output dims flattened as the Hugging Face weight flattens them
    (heads-major, `shardlib.hf.architectures`)."""
    rank = a.shape[-1]
    return a.reshape(-1, rank).T, b.reshape(rank, -1).T


def from_peft_tensors(lora_a: Any, lora_b: Any, a_shape: tuple[int, ...], b_shape: tuple[int, ...]) -> tuple[Any, Any]:
    """`peft_tensors` inverted: one layer's A and B in shardlib's shapes."""
    return lora_a.T.reshape(a_shape), lora_b.T.reshape(b_shape)


def describe(config: LoraConfig) -> str:
    """``LoRA rank 8, alpha 16 on q,v`` (``QLoRA ... over an int8 base``): for the run header and the plan."""
    alpha = config.rank if config.alpha is None else config.alpha
    kind = "LoRA" if config.base is None else "QLoRA"
    base = "" if config.base is None else f" over an {config.base} base"
    return f"{kind} rank {config.rank}, alpha {alpha:g} on {','.join(config.targets)}{base}"
