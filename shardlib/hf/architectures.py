"""The Hugging Face architectures shardlib reads and writes, as data (over 600 lines: one table of families and their tensors, read and written from the same rows).

Each `Architecture` says how a ``config.json`` becomes a `GPTConfig` (the reference decoder has
the Llama family's maths: RMSNorm, rotary attention in the ``rotate_half`` layout, GQA, a gated
MLP) and which of the family's options it changes. `TENSORS` maps every parameter of the decoder
to its tensor in the checkpoint and the `Placement` between the two layouts (PyTorch's
``Linear`` stores ``[out, in]``; shardlib splits heads out as their own axes). Anything a
checkpoint asks for that is not reproduced exactly is refused by name (`UnsupportedModel`), never
approximated.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from shardlib.models import GPTConfig, MoEConfig
from shardlib.models import rope_scaling as rope_scaling_lib
from shardlib.models.configs import RopeScaling


class UnsupportedModel(ValueError):
    """A checkpoint shardlib cannot reproduce exactly: one line naming the field and what is supported."""

    user_facing = True


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One ``architectures`` entry of ``config.json``: its defaults and the options it fixes."""

    name: str
    model_type: str
    tie_embeddings: bool  # ``tie_word_embeddings`` when config.json leaves it out (the family's default)
    qkv_bias: bool = False  # the family always has q/k/v biases (Qwen2)
    gemma: bool = False  # (1 + w) norms, embeddings times sqrt(d), GeGLU
    sliding_window_key: str | None = None  # the config field of a sliding attention window, checked against seq len
    sliding_window_switch: str | None = None  # the field that turns that window on, where there is one (Qwen2)
    qk_norm: bool = False  # RMSNorm of each head's queries and keys before the rotation (Qwen3)
    gemma2: bool = False  # soft-capping, query_pre_attn_scalar, sliding/full layer_types, sandwich norms
    gemma3: bool = False  # Gemma 2's layers without soft-caps by default, a local rope base on sliding layers
    moe: str | None = None  # the experts' tensor layout (`MOE_TENSORS`: "mixtral" or "qwen"); None: a dense MLP
    fused: bool = False  # q/k/v in one qkv_proj, gate and up in one gate_up_proj (Phi-3)


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("LlamaForCausalLM", "llama", tie_embeddings=False),
    Architecture("MistralForCausalLM", "mistral", tie_embeddings=False, sliding_window_key="sliding_window"),
    Architecture("Qwen2ForCausalLM", "qwen2", tie_embeddings=False, qkv_bias=True,
                 sliding_window_key="sliding_window", sliding_window_switch="use_sliding_window"),
    Architecture("GemmaForCausalLM", "gemma", tie_embeddings=True, gemma=True),
    Architecture("Gemma2ForCausalLM", "gemma2", tie_embeddings=True, gemma=True, gemma2=True),
    Architecture("Gemma3ForCausalLM", "gemma3_text", tie_embeddings=True, gemma=True, gemma2=True, gemma3=True,
                 qk_norm=True),
    Architecture("Qwen3ForCausalLM", "qwen3", tie_embeddings=False, qk_norm=True,
                 sliding_window_key="sliding_window", sliding_window_switch="use_sliding_window"),
    Architecture("Phi3ForCausalLM", "phi3", tie_embeddings=False, sliding_window_key="sliding_window", fused=True),
    Architecture("MixtralForCausalLM", "mixtral", tie_embeddings=False, sliding_window_key="sliding_window",
                 moe="mixtral"),
    Architecture("Qwen2MoeForCausalLM", "qwen2_moe", tie_embeddings=False, qkv_bias=True, moe="qwen",
                 sliding_window_key="sliding_window", sliding_window_switch="use_sliding_window"),
    Architecture("Qwen3MoeForCausalLM", "qwen3_moe", tie_embeddings=False, qk_norm=True, moe="qwen",
                 sliding_window_key="sliding_window", sliding_window_switch="use_sliding_window"),
)}

# The gate activations config.json names, as `GPTConfig.mlp_activation` (Gemma's "gelu" is its
# tanh approximation, as its reference implementation reads it).
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
GEMMA_ACTIVATIONS = {**ACTIVATIONS, "gelu": "gelu_tanh"}
ROPE_TYPES = ("default", "llama3", "linear", "dynamic", "yarn")
# Fields that would change the maths, with the value shardlib reproduces.
MUST_BE = {"attention_bias": False, "mlp_bias": False, "partial_rotary_factor": 1.0, "quantization_config": None}


def architecture_of(config: Mapping[str, Any], source: str) -> Architecture:
    """The `Architecture` of a config.json's ``architectures``, or a refusal listing the supported ones."""
    names = config.get("architectures") or []
    known = [ARCHITECTURES[n] for n in names if n in ARCHITECTURES]
    if not known:
        raise UnsupportedModel(f"{source}: architecture {names or config.get('model_type')!r} is not supported; "
                               f"shardlib reads {', '.join(ARCHITECTURES)}")
    return known[0]


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _positive_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


# Fields read from config.json, each with what it must be when present (null: the default).
FIELD_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "head_dim": (lambda v: v is None or (_positive_int(v) and v % 2 == 0), "a positive even integer (rotary pairs)"),
    "num_key_value_heads": (lambda v: v is None or _positive_int(v), "a positive integer"),
    "max_position_embeddings": (_positive_int, "a positive integer"),
    "rope_theta": (_positive_number, "a positive number"),
    "rms_norm_eps": (_positive_number, "a positive number"),
    "rope_scaling": (lambda v: v is None or isinstance(v, Mapping), "an object (or null)"),
    "rope_parameters": (lambda v: v is None or isinstance(v, Mapping), "an object (or null)"),
    "tie_word_embeddings": (lambda v: isinstance(v, bool), "true or false"),
    "query_pre_attn_scalar": (_positive_number, "a positive number"),
    "attn_logit_softcapping": (lambda v: v is None or _positive_number(v), "a positive number (or null)"),
    "final_logit_softcapping": (lambda v: v is None or _positive_number(v), "a positive number (or null)"),
    "layer_types": (lambda v: v is None or (isinstance(v, list) and all(t in LAYER_TYPES for t in v)),
                    "a list of 'sliding_attention' / 'full_attention'"),
}
LAYER_TYPES = ("sliding_attention", "full_attention")
# Gemma 2's defaults (transformers' Gemma2Config) where its config.json leaves a field out.
GEMMA2_DEFAULTS = {"query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                   "sliding_window": 4096}
# Gemma 3's (Gemma3TextConfig): no soft-caps, five sliding layers to a full one, local and global rope bases.
GEMMA3_DEFAULTS = {"query_pre_attn_scalar": 256, "attn_logit_softcapping": None, "final_logit_softcapping": None,
                   "sliding_window": 4096}
GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


def _check_fields(config: Mapping[str, Any], source: str) -> None:
    """Each field of `FIELD_RULES` that is present has the type and range it must have."""
    for field, (ok, what) in FIELD_RULES.items():
        if field in config and not ok(config[field]):
            raise UnsupportedModel(f"{source}: {field} must be {what}, got {config[field]!r}")
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if _positive_int(heads) and _positive_int(kv) and heads % kv:
        raise UnsupportedModel(f"{source}: num_key_value_heads={kv} does not divide num_attention_heads={heads}")
    rope = config.get("rope_parameters") or {}
    for field in ("rope_theta",):
        if field in rope and not _positive_number(rope[field]):
            raise UnsupportedModel(f"{source}: rope_parameters.{field} must be a positive number, got {rope[field]!r}")


def rope_parameters(config: Mapping[str, Any]) -> dict[str, Any]:
    """``rope_parameters`` (transformers 5) or the older ``rope_theta`` + ``rope_scaling``, as one dict."""
    given = config.get("rope_parameters")
    if isinstance(given, Mapping) and given:
        return dict(given)
    scaling = dict(config.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    return {"rope_theta": config.get("rope_theta", 10_000.0), "rope_type": "default", **scaling}


def to_gpt_config(config: Mapping[str, Any], source: str, *, seq_len: int | None = None) -> GPTConfig:
    """The `GPTConfig` of a Hugging Face ``config.json`` (``source`` names it in errors).

    ``seq_len``: the longest sequence the run will see, checked against a sliding attention window
    (shorter than the window, sliding changes nothing; longer, it is refused)."""
    arch = architecture_of(config, source)
    _check_fields(config, source)
    for field, value in MUST_BE.items():
        if config.get(field, value) != value:
            raise UnsupportedModel(f"{source}: {field}={config[field]!r} is not supported (shardlib reproduces "
                                   f"{field}={value!r})")
    rope, local_theta = gemma3_rope(config, source) if arch.gemma3 else (rope_parameters(config), None)
    if arch.fused and rope.get("rope_type", "default") != "default":  # transformers reads su / yarn as longrope
        raise UnsupportedModel(f"{source}: Phi-3's rope type {rope.get('rope_type')!r} (its LongRoPE: short / long "
                               "factors) is not supported; shardlib reproduces Phi-3 with the default rope (the 4k "
                               "models)")
    if rope.get("rope_type", "default") not in ROPE_TYPES:
        raise UnsupportedModel(f"{source}: rope type {rope.get('rope_type')!r} is not supported; shardlib reproduces "
                               f"{' and '.join(ROPE_TYPES)}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModel(f"{source}: partial_rotary_factor={rope['partial_rotary_factor']} is not supported")
    windows = _sliding_windows(arch, config, source, seq_len)
    activations = GEMMA_ACTIVATIONS if arch.gemma else ACTIVATIONS
    act = config.get("hidden_activation") if arch.gemma and config.get("hidden_activation") else config.get("hidden_act", "silu")
    if act not in activations:
        raise UnsupportedModel(f"{source}: hidden_act={act!r} is not supported; shardlib reproduces "
                               f"{', '.join(activations)}")
    d, heads = _int(config, "hidden_size", source), _int(config, "num_attention_heads", source)
    head_dim = config.get("head_dim")
    moe = moe_fields(arch, config, source) if arch.moe else {}
    return (MoEConfig if moe else GPTConfig)(
        **moe,
        vocab_size=_int(config, "vocab_size", source),
        d_model=d,
        n_layers=_int(config, "num_hidden_layers", source),
        n_heads=heads,
        n_kv_heads=config.get("num_key_value_heads") or heads,
        d_ff=_int(config, "moe_intermediate_size" if arch.moe == "qwen" else "intermediate_size", source),
        max_seq_len=config.get("max_position_embeddings", 2048),  # checked by FIELD_RULES
        rope_theta=float(rope.get("rope_theta", 10_000.0)),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        attention_head_dim=head_dim if head_dim and head_dim != d // heads else None,
        tie_embeddings=bool(config.get("tie_word_embeddings", arch.tie_embeddings)),
        qkv_bias=arch.qkv_bias and config.get("qkv_bias", True) is not False,  # Qwen2-MoE names it
        norm_offset=1.0 if arch.gemma else 0.0,
        embed_scale=arch.gemma,
        mlp_activation=activations[act],
        rope_scaling=_rope_scaling(rope, config, source, seq_len),
        qk_norm=arch.qk_norm,
        **(_gemma2_fields(config, source, arch) if arch.gemma2 else {}),
        local_rope_theta=local_theta,
        **({"layer_windows": windows} if windows else {}),
    )


def moe_fields(arch: Architecture, config: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The `MoEConfig` fields of Mixtral's / Qwen's MoE config.json: the routing as transformers
    computes it (softmax over the experts in float32, top-k, the gates renormalised always for
    Mixtral, by ``norm_topk_prob`` for Qwen), dropless (transformers drops nothing), Qwen2-MoE's
    shared expert; the router's balance loss only where transformers adds one
    (``output_router_logits``), no z-loss. Dense layers among the sparse ones, and router jitter,
    are refused by name."""
    # Mixtral's name, Qwen's (which transformers 5 writes as Mixtral's for Qwen3-MoE)
    experts_key = "num_experts" if arch.moe == "qwen" and "num_experts" in config else "num_local_experts"
    if config.get("router_jitter_noise"):
        raise UnsupportedModel(f"{source}: router_jitter_noise={config['router_jitter_noise']!r} is not supported "
                               "(shardlib's router adds no noise in training): set it to 0")
    if config.get("decoder_sparse_step", 1) != 1 or config.get("mlp_only_layers"):
        raise UnsupportedModel(f"{source}: decoder_sparse_step={config.get('decoder_sparse_step', 1)!r} / "
                               f"mlp_only_layers={config.get('mlp_only_layers')!r} make some layers dense, which "
                               "shardlib's MoE decoder does not build (every layer routed): decoder_sparse_step 1, "
                               "mlp_only_layers []")
    shared = config.get("shared_expert_intermediate_size") if arch.model_type == "qwen2_moe" else 0
    if shared is not None and (not isinstance(shared, int) or shared < 0):
        raise UnsupportedModel(f"{source}: shared_expert_intermediate_size must be a non-negative integer, got {shared!r}")
    norm = True if arch.moe == "mixtral" else config.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise UnsupportedModel(f"{source}: norm_topk_prob must be true or false, got {norm!r}")
    aux = config.get("router_aux_loss_coef", 0.001) if config.get("output_router_logits") else 0.0
    return dict(n_experts=_int(config, experts_key, source), top_k=_int(config, "num_experts_per_tok", source),
                dropless=True, norm_topk_prob=norm, shared_d_ff=shared or 0, aux_loss_coef=float(aux), z_loss_coef=0.0)


def gemma3_rope(config: Mapping[str, Any], source: str) -> tuple[dict[str, Any], float]:
    """Gemma 3's rope: the full layers' parameters (scaling included) and the sliding layers' base,
    from transformers 5's ``rope_parameters`` nested by layer type or 4.x's ``rope_theta`` +
    ``rope_scaling`` + ``rope_local_base_freq``. A scaled sliding-layer rope is refused."""
    nested = config.get("rope_parameters") or {}
    if any(k in nested for k in GEMMA3_THETA):
        full = {"rope_type": "default", "rope_theta": GEMMA3_THETA["full_attention"],
                **dict(nested.get("full_attention") or {})}
        local = {"rope_type": "default", "rope_theta": GEMMA3_THETA["sliding_attention"],
                 **dict(nested.get("sliding_attention") or {})}
    else:
        full = rope_parameters({"rope_theta": GEMMA3_THETA["full_attention"], **config})
        local = {"rope_type": "default", "rope_theta": config.get("rope_local_base_freq",
                                                                  GEMMA3_THETA["sliding_attention"])}
    if local.get("rope_type", "default") != "default":
        raise UnsupportedModel(f"{source}: rope_parameters.sliding_attention type {local['rope_type']!r} is not "
                               "supported (shardlib reproduces the default rope on Gemma 3's sliding layers)")
    for label, part in (("full_attention", full), ("sliding_attention", local)):
        if not _positive_number(part.get("rope_theta")):
            raise UnsupportedModel(f"{source}: rope_parameters.{label}.rope_theta must be a positive number, "
                                   f"got {part.get('rope_theta')!r}")
    return full, float(local["rope_theta"])


def _gemma2_fields(config: Mapping[str, Any], source: str, arch: Architecture) -> dict[str, Any]:
    """Gemma 2's attention and norms as `GPTConfig` fields: each layer's window from ``layer_types``
    (default: sliding on even layers, as transformers fills it in), the two soft-caps, the query scale."""
    get = {k: config.get(k, v) for k, v in (GEMMA3_DEFAULTS if arch.gemma3 else GEMMA2_DEFAULTS).items()}
    if config.get("use_bidirectional_attention"):
        raise UnsupportedModel(f"{source}: use_bidirectional_attention is not supported (shardlib's decoder is causal)")
    n = _int(config, "num_hidden_layers", source)
    pattern = config.get("sliding_window_pattern", 6) if arch.gemma3 else 2  # transformers' defaults
    if not _positive_int(pattern):
        raise UnsupportedModel(f"{source}: sliding_window_pattern must be a positive integer, got {pattern!r}")
    types = config.get("layer_types") or [LAYER_TYPES[0] if (i + 1) % pattern else LAYER_TYPES[1] for i in range(n)]
    if len(types) != n:
        raise UnsupportedModel(f"{source}: layer_types has {len(types)} entries for num_hidden_layers={n}")
    window = get["sliding_window"]
    if "sliding_attention" in types and not _positive_int(window):
        raise UnsupportedModel(f"{source}: sliding_window must be a positive integer for its sliding_attention layers, "
                               f"got {window!r}")
    return dict(query_scale=float(get["query_pre_attn_scalar"]), attn_softcap=get["attn_logit_softcapping"],
                final_softcap=get["final_logit_softcapping"], sandwich_norm=True,
                layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types))


def _int(config: Mapping[str, Any], field: str, source: str) -> int:
    value = config.get(field)
    if not isinstance(value, int) or value < 1:
        raise UnsupportedModel(f"{source}: {field} must be a positive integer, got {value!r}")
    return value


def _rope_scaling(rope: Mapping[str, Any], config: Mapping[str, Any], source: str, seq_len: int | None) -> Any:
    """The `GPTConfig.rope_scaling` of a checkpoint's rope parameters, as transformers computes each type."""
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return None
    if kind == "llama3":
        return _llama3_scaling(rope, source)
    factor = rope.get("factor")
    if not _positive_number(factor):
        raise UnsupportedModel(f"{source}: rope type {kind!r} needs a positive number 'factor', got {factor!r}")
    if kind == "linear":
        return rope_scaling_lib.LinearRope(factor=float(factor))
    max_len = config.get("max_position_embeddings", 2048)
    if kind == "dynamic":
        if seq_len is not None and seq_len > max_len:
            raise UnsupportedModel(f"{source}: rope type 'dynamic' raises its base per forward past "
                                   f"max_position_embeddings={max_len}, which shardlib does not reproduce; a sequence "
                                   f"of {seq_len} tokens would need it: use at most {max_len} tokens (--seq-len)")
        return rope_scaling_lib.DynamicRope(factor=float(factor), max_len=max_len)
    return _yarn_scaling(rope, float(factor), source)


def _yarn_scaling(rope: Mapping[str, Any], factor: float, source: str) -> Any:
    original = rope.get("original_max_position_embeddings")
    if not _positive_int(original):
        raise UnsupportedModel(f"{source}: rope type 'yarn' needs a positive integer "
                               f"'original_max_position_embeddings', got {original!r}")
    for field in ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        if rope.get(field) is not None and not _positive_number(rope[field]):
            raise UnsupportedModel(f"{source}: rope_parameters.{field} must be a positive number, got {rope[field]!r}")
    attention = rope.get("attention_factor")
    if attention is None:
        attention = rope_scaling_lib.yarn_attention_factor(factor, rope.get("mscale"), rope.get("mscale_all_dim"))
    return rope_scaling_lib.YarnRope(factor=factor, original_max_len=original, attention_factor=float(attention),
                                     beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                                     truncate=bool(rope.get("truncate", True)))


def _llama3_scaling(rope: Mapping[str, Any], source: str) -> RopeScaling:
    try:
        return RopeScaling(factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                           high_freq_factor=float(rope["high_freq_factor"]),
                           original_max_len=int(rope["original_max_position_embeddings"]))
    except KeyError as err:
        raise UnsupportedModel(f"{source}: rope type 'llama3' needs {err.args[0]!r} in its parameters") from None
    except (TypeError, ValueError) as err:
        raise UnsupportedModel(f"{source}: rope type 'llama3' takes numbers for factor, low_freq_factor, "
                               f"high_freq_factor and original_max_position_embeddings ({err})") from None


def _sliding_windows(arch: Architecture, config: Mapping[str, Any], source: str,
                     seq_len: int | None) -> tuple[int, ...] | None:
    """Mistral's and Qwen's sliding window as `GPTConfig.layer_windows`: on every layer (Mistral) or
    on those of ``layer_types`` (Qwen: by default the layers from ``max_window_layers`` on), as
    transformers fills them in. None where no window can matter: none configured, or a run whose
    ``seq_len`` fits in it (full causal attention is the same there, and keeps the flash kernel)."""
    if arch.sliding_window_key is None or (arch.sliding_window_switch and not config.get(arch.sliding_window_switch)):
        return None
    window = config.get(arch.sliding_window_key)
    if window is None or (seq_len is not None and seq_len <= window):
        return None
    if not _positive_int(window):
        raise UnsupportedModel(f"{source}: {arch.sliding_window_key} must be a positive integer, got {window!r}")
    n = _int(config, "num_hidden_layers", source)
    types = config.get("layer_types")
    if not types:
        first = config.get("max_window_layers", 28) if arch.sliding_window_switch else 0
        if not isinstance(first, int) or first < 0:
            raise UnsupportedModel(f"{source}: max_window_layers must be a non-negative integer, got {first!r}")
        types = [LAYER_TYPES[0] if i >= first else LAYER_TYPES[1] for i in range(n)]
    if len(types) != n:
        raise UnsupportedModel(f"{source}: layer_types has {len(types)} entries for num_hidden_layers={n}")
    windows = tuple(window if t == LAYER_TYPES[0] else 0 for t in types)
    return windows if any(windows) else None


def legacy_rope_fields(rope: Mapping[str, Any]) -> dict[str, Any]:
    """``rope_parameters`` as transformers 4.x (and the vLLM / llama.cpp converters) read it:
    ``rope_theta`` beside ``rope_scaling`` (null for the default rope, else the parameters with both
    ``rope_type`` and the older ``type`` key). Without them a 4.x reader runs θ = 10000 unscaled."""
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    if scaling.get("rope_type", "default") == "default":
        return {"rope_theta": rope["rope_theta"], "rope_scaling": None}
    return {"rope_theta": rope["rope_theta"], "rope_scaling": {**scaling, "type": scaling["rope_type"]}}


def from_gpt_config(config: GPTConfig, arch: Architecture | None = None, base: Mapping[str, Any] | None = None,
                    dtype: str = "float32") -> dict[str, Any]:
    """A ``config.json`` for ``config``: ``base`` (the imported one, its other fields kept) updated
    with every field that `to_gpt_config` reads, or a Llama config for a model born in shardlib."""
    arch = arch or export_architecture(config)
    rope: dict[str, Any] = {"rope_theta": config.rope_theta, "rope_type": "default"}
    if config.rope_scaling is not None and not isinstance(config.rope_scaling, RopeScaling):
        rope.update(config.rope_scaling.to_hf())
    elif config.rope_scaling is not None:
        s = config.rope_scaling
        rope.update(rope_type="llama3", factor=s.factor, low_freq_factor=s.low_freq_factor,
                    high_freq_factor=s.high_freq_factor, original_max_position_embeddings=s.original_max_len)
    activation = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}[config.mlp_activation]
    out = {k: v for k, v in (base or {}).items() if k not in ("rope_scaling", "rope_theta", "hidden_activation",
                                                               "torch_dtype")}
    out.update(architectures=[arch.name], model_type=arch.model_type, vocab_size=config.vocab_size,
               hidden_size=config.d_model, num_hidden_layers=config.n_layers,
               num_attention_heads=config.n_heads, num_key_value_heads=config.n_kv_heads,
               intermediate_size=config.d_ff, max_position_embeddings=config.max_seq_len,
               rms_norm_eps=config.norm_eps, head_dim=config.head_dim, hidden_act=activation,
               tie_word_embeddings=config.tie_embeddings, rope_parameters=rope, dtype=dtype, torch_dtype=dtype,
               **legacy_rope_fields(rope))
    if arch.name == "LlamaForCausalLM":
        out.update(attention_bias=False, mlp_bias=False)
    if arch.gemma:
        out.update(hidden_activation=activation)
    if arch.gemma2:
        windows = config.layer_windows or ()
        scalar = config.query_scale  # transformers' Gemma2Config takes an int
        out.update(query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar, attn_logit_softcapping=config.attn_softcap,
                   final_logit_softcapping=config.final_softcap,
                   layer_types=[LAYER_TYPES[0] if w else LAYER_TYPES[1] for w in windows])
        if any(windows):
            out.update(sliding_window=max(windows))
    if arch.moe:
        out.update(moe_config_fields(config, arch, base))
    if arch.gemma3:  # both of transformers 5's nested rope and 4.x's fields
        out.update(rope_parameters={"full_attention": rope, "sliding_attention": {
            "rope_type": "default", "rope_theta": config.local_rope_theta}}, rope_local_base_freq=config.local_rope_theta)
    return out


def export_architecture(config: GPTConfig) -> Architecture:
    """The architecture a model born in shardlib is written as: Llama, or Mixtral for an MoE
    decoder whose routing Mixtral computes (gates renormalised, no shared expert, plain attention);
    an MoE decoder no transformers class reproduces is refused by name."""
    if not isinstance(config, MoEConfig):
        return ARCHITECTURES["LlamaForCausalLM"]
    why = [what for what, differs in (
        (f"top_k={config.top_k} gates not renormalised (norm_topk_prob), which Mixtral always does",
         not config.renormalizes), ("a shared expert", config.shared_d_ff > 0),
        ("q/k norms", config.qk_norm), ("q/k/v biases", config.qkv_bias)) if differs]
    if why:
        raise UnsupportedModel(f"this MoE model has {why[0]}: MixtralForCausalLM, the layout of an MoE model born in "
                               "shardlib, would compute it differently (an imported Qwen MoE exports as itself)")
    return ARCHITECTURES["MixtralForCausalLM"]


def moe_config_fields(config: MoEConfig, arch: Architecture, base: Mapping[str, Any] | None) -> dict[str, Any]:
    """The MoE fields of a Mixtral / Qwen MoE config.json, as `moe_fields` reads them back."""
    out: dict[str, Any] = {"num_experts_per_tok": config.top_k, "router_jitter_noise": 0.0,
                           "output_router_logits": bool(config.aux_loss_coef)}
    if config.aux_loss_coef:
        out["router_aux_loss_coef"] = config.aux_loss_coef
    if arch.moe == "mixtral" or "num_local_experts" in (base or {}):
        out["num_local_experts"] = config.n_experts
    if arch.moe == "mixtral":
        return out
    out.update(num_experts=config.n_experts, moe_intermediate_size=config.d_ff, norm_topk_prob=config.renormalizes,
               decoder_sparse_step=1, mlp_only_layers=[],
               intermediate_size=(base or {}).get("intermediate_size", config.d_ff))  # the (unused) dense layers'
    if arch.model_type == "qwen2_moe":
        out.update(shared_expert_intermediate_size=config.shared_d_ff, qkv_bias=config.qkv_bias)
    return out


# --------------------------------------------------------------------------------------------
# Tensors: where each parameter of the decoder lies in the checkpoint
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Placement:
    """How one of shardlib's tensors (one layer's, for stacked parameters) lies in its checkpoint
    tensor: split the checkpoint's dims into ``groups`` (dim i into the shardlib dims listed at
    ``groups[i]``, outermost first), then order those dims as shardlib's. Reads and writes are
    reshapes and transposes, so a round trip is bit-exact."""

    groups: tuple[tuple[int, ...], ...]  # per checkpoint dim: the shardlib dims it holds, outermost first

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(math.prod(shape[d] for d in group) for group in self.groups)

    def to_hf(self, array: Any) -> Any:
        """shardlib's whole tensor -> the checkpoint's."""
        order = [d for group in self.groups for d in group]
        return array.transpose(order).reshape(self.hf_shape(array.shape))

    def read(self, shape: tuple[int, ...], box: tuple[slice, ...], read_hf: Callable[[tuple[Any, ...]], Any]) -> Any:
        """The ``box`` of shardlib's tensor (of ``shape``), reading exactly the checkpoint elements
        that hold it: ``read_hf(index)`` gets, per checkpoint dim, a slice, or the indices (in
        order) where a shard cuts an inner dim, such as one device's part of every head."""
        box = tuple(slice(*b.indices(n)[:2]) for b, n in zip(box, shape))
        index = []
        for group in self.groups:
            ranges = [np.arange(box[d].start, box[d].stop) for d in group]
            flat = np.ravel_multi_index(np.meshgrid(*ranges, indexing="ij"), [shape[d] for d in group]).reshape(-1)
            contiguous = flat.size and flat[-1] - flat[0] == flat.size - 1
            index.append(slice(int(flat[0]), int(flat[-1]) + 1) if contiguous else flat)
        block = read_hf(tuple(index))
        order = [d for group in self.groups for d in group]
        block = block.reshape([box[d].stop - box[d].start for d in order])
        return block.transpose([order.index(d) for d in range(len(shape))])


SAME_1D, SAME_2D = Placement(((0,),)), Placement(((0,), (1,)))
LINEAR = Placement(((1,), (0,)))  # ours [in, out], PyTorch's [out, in]
TO_HEADS = Placement(((1, 2), (0,)))  # ours [d, heads, head_dim], PyTorch's [heads * head_dim, d]
FROM_HEADS = Placement(((2,), (0, 1)))  # ours [heads, head_dim, d], PyTorch's [d, heads * head_dim]
BIAS_HEADS = Placement(((0, 1),))  # ours [heads, head_dim], PyTorch's [heads * head_dim]


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """A parameter of the decoder (``path`` in its tree; ``per_layer``: stacked over the layers,
    one checkpoint tensor a layer, ``{i}`` in ``name``) and its checkpoint tensor."""

    path: str
    name: str
    placement: Placement
    per_layer: bool = True
    when: Callable[[GPTConfig], bool] = lambda config: True
    per_expert: bool = False  # stacked over the layers and the experts: one tensor per layer ``{i}`` and expert ``{j}``
    # Parameters whose checkpoint rows follow each other in one tensor (Phi-3's qkv_proj), in order;
    # ``row_offset``: where this one's rows start (`fused_maps` sets it from the shapes)
    fused: tuple[str, ...] = ()
    row_offset: int = 0

    @property
    def stacked(self) -> int:
        """How many leading dims of the parameter index its checkpoint tensors (layers, experts)."""
        return 2 if self.per_expert else int(self.per_layer)

    def hf_name(self, index: tuple[int, ...]) -> str:
        """The checkpoint tensor at ``index`` (layer, expert) of the stacked dims."""
        return self.name.format(**dict(zip("ij", index)))


TENSORS: tuple[TensorMap, ...] = (
    TensorMap("embedding", "model.embed_tokens.weight", SAME_2D, per_layer=False),
    TensorMap("blocks/attn_norm/scale", "model.layers.{i}.input_layernorm.weight", SAME_1D),
    TensorMap("blocks/attn/wq", "model.layers.{i}.self_attn.q_proj.weight", TO_HEADS),
    TensorMap("blocks/attn/wk", "model.layers.{i}.self_attn.k_proj.weight", TO_HEADS),
    TensorMap("blocks/attn/wv", "model.layers.{i}.self_attn.v_proj.weight", TO_HEADS),
    TensorMap("blocks/attn/bq", "model.layers.{i}.self_attn.q_proj.bias", BIAS_HEADS, when=lambda c: c.qkv_bias),
    TensorMap("blocks/attn/bk", "model.layers.{i}.self_attn.k_proj.bias", BIAS_HEADS, when=lambda c: c.qkv_bias),
    TensorMap("blocks/attn/bv", "model.layers.{i}.self_attn.v_proj.bias", BIAS_HEADS, when=lambda c: c.qkv_bias),
    TensorMap("blocks/attn/q_norm/scale", "model.layers.{i}.self_attn.q_norm.weight", SAME_1D, when=lambda c: c.qk_norm),
    TensorMap("blocks/attn/k_norm/scale", "model.layers.{i}.self_attn.k_norm.weight", SAME_1D, when=lambda c: c.qk_norm),
    TensorMap("blocks/attn/wo", "model.layers.{i}.self_attn.o_proj.weight", FROM_HEADS),
    TensorMap("blocks/mlp_norm/scale", "model.layers.{i}.post_attention_layernorm.weight", SAME_1D,
              when=lambda c: not c.sandwich_norm),
    # Gemma 2's sandwich: post_attention_layernorm is the attention branch's output norm there
    TensorMap("blocks/attn_post_norm/scale", "model.layers.{i}.post_attention_layernorm.weight", SAME_1D,
              when=lambda c: c.sandwich_norm),
    TensorMap("blocks/mlp_norm/scale", "model.layers.{i}.pre_feedforward_layernorm.weight", SAME_1D,
              when=lambda c: c.sandwich_norm),
    TensorMap("blocks/mlp_post_norm/scale", "model.layers.{i}.post_feedforward_layernorm.weight", SAME_1D,
              when=lambda c: c.sandwich_norm),
    TensorMap("blocks/mlp/w_gate", "model.layers.{i}.mlp.gate_proj.weight", LINEAR, when=lambda c: not _is_moe(c)),
    TensorMap("blocks/mlp/w_up", "model.layers.{i}.mlp.up_proj.weight", LINEAR, when=lambda c: not _is_moe(c)),
    TensorMap("blocks/mlp/w_down", "model.layers.{i}.mlp.down_proj.weight", LINEAR, when=lambda c: not _is_moe(c)),
    TensorMap("final_norm/scale", "model.norm.weight", SAME_1D, per_layer=False),
    TensorMap("lm_head", "lm_head.weight", LINEAR, per_layer=False, when=lambda c: not c.tie_embeddings),
)


def _is_moe(config: GPTConfig) -> bool:
    return isinstance(config, MoEConfig)


def _moe_maps(layer: str, router: str, experts: tuple[str, str, str], shared: str | None = None) -> tuple[TensorMap, ...]:
    """An MoE layer's tensors under ``model.layers.{i}.<layer>``: the router ``[E, d]``, each expert's
    gate / up / down projections (``experts.{j}.<name>.weight``), and a shared expert with its gate."""
    prefix = f"model.layers.{{i}}.{layer}"
    maps = [TensorMap("blocks/moe/router/w_router", f"{prefix}.{router}.weight", LINEAR)]
    maps += [TensorMap(f"blocks/moe/experts/{w}", f"{prefix}.experts.{{j}}.{name}.weight", LINEAR, per_expert=True)
             for w, name in zip(("w_gate", "w_up", "w_down"), experts)]
    if shared:
        maps += [TensorMap(f"blocks/moe/shared/{w}", f"{prefix}.{shared}.{name}.weight", LINEAR,
                           when=lambda c: c.shared_d_ff > 0)
                 for w, name in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj"))]
        maps.append(TensorMap("blocks/moe/shared_gate", f"{prefix}.{shared}_gate.weight", LINEAR,
                              when=lambda c: c.shared_d_ff > 0))
    return tuple(maps)


# Each MoE layout's tensors (`Architecture.moe`): Mixtral's w1 / w3 / w2 are gate / up / down.
MOE_TENSORS: dict[str, tuple[TensorMap, ...]] = {
    "mixtral": _moe_maps("block_sparse_moe", "gate", ("w1", "w3", "w2")),
    "qwen": _moe_maps("mlp", "gate", ("gate_proj", "up_proj", "down_proj"), shared="shared_expert"),
}


def _fused_maps() -> dict[str, TensorMap]:
    """Phi-3's fused projections: q, k, v rows stacked in ``qkv_proj``, gate then up in ``gate_up_proj``."""
    qkv, gate_up = ("blocks/attn/wq", "blocks/attn/wk", "blocks/attn/wv"), ("blocks/mlp/w_gate", "blocks/mlp/w_up")
    maps = {p: TensorMap(p, "model.layers.{i}.self_attn.qkv_proj.weight", TO_HEADS, fused=qkv) for p in qkv}
    return {**maps, **{p: TensorMap(p, "model.layers.{i}.mlp.gate_up_proj.weight", LINEAR, fused=gate_up)
                       for p in gate_up}}


FUSED_TENSORS = _fused_maps()


def fused_maps(maps: list[TensorMap], shapes: Mapping[str, tuple[int, ...]]) -> list[TensorMap]:
    """``maps`` with each fused part's ``row_offset``: the checkpoint rows of the parts before it,
    from the parameters' ``shapes``."""
    rows = lambda p: FUSED_TENSORS[p].placement.hf_shape(tuple(shapes[p][1:]))[0]  # noqa: E731
    return [dataclasses.replace(t, row_offset=sum(rows(p) for p in t.fused[:t.fused.index(t.path)]))
            if t.fused else t for t in maps]


def tensors_for(config: GPTConfig, arch: Architecture | None = None) -> list[TensorMap]:
    """The `TENSORS` a model of ``config`` has; an MoE model's experts in ``arch``'s layout
    (default: the architecture it is exported as, `export_architecture`)."""
    maps = [t for t in TENSORS if t.when(config)]
    if arch is not None and arch.fused:
        maps = [FUSED_TENSORS.get(t.path, t) for t in maps]
    if _is_moe(config):
        layout = (arch or export_architecture(config)).moe
        if layout is None:
            raise UnsupportedModel(f"{arch.name} has no experts: an MoE model cannot be written as one")
        at = next(k for k, t in enumerate(maps) if t.path == "final_norm/scale")  # after the layers' other tensors
        maps[at:at] = [t for t in MOE_TENSORS[layout] if t.when(config)]
    return maps


def hf_names(t: TensorMap, n_layers: int = 0, n_experts: int = 0) -> list[str]:
    """The checkpoint tensor(s) behind ``t``: one a layer when it is stacked, one a layer and expert
    for an expert's."""
    if t.per_expert:
        return [t.hf_name((i, j)) for i in range(n_layers) for j in range(n_experts)]
    return [t.hf_name((i,)) for i in range(n_layers)] if t.per_layer else [t.name]
