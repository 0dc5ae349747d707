"""Decoder configurations and the closed-form numbers derived from them.

Parameter counts and FLOPs come from formulas, not from building a model, so planning a 13B
run costs nothing; tests check the formulas against the real (abstract) model.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # configs stay importable without JAX
    from .rope_scaling import DynamicRope, LinearRope, YarnRope


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """A GPT/Llama-style decoder: RMSNorm, rotary attention (optionally GQA), SwiGLU MLP."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    n_kv_heads: int | None = None  # None: same as n_heads (plain multi-head attention)
    max_seq_len: int = 1024
    rope_theta: float = 10_000.0
    compute_dtype: Any = "float32"  # anything jnp.dtype accepts; params stay float32
    remat: bool = True
    # What a rematerialised block keeps for the backward pass (`models.gpt.REMAT_POLICIES`):
    # "full" nothing (recompute the block), "save_dots" every projection's output,
    # "save_dots_except_mlp_in" all but the MLP's input projections (MaxText's best v5p runs),
    # "offload_dots" every projection's output in host memory. Ignored when ``remat`` is False.
    remat_policy: str = "full"
    norm_eps: float = 1e-5
    # "einsum": scores written out in float32 (any backend); "blocked": the same, 32 queries at a time,
    # each block recomputed in the backward pass (a 32 x T slice of the scores live, not T x T);
    # "cudnn": jax.nn.dot_product_attention's fused kernel (GPU only; never materialises the T x T
    # scores); "xla": that function's XLA path; "flash": an online softmax over query x key tiles,
    # forward and backward, tiles above the diagonal never computed (`shardlib.model.attention.flash`,
    # memory linear in T, any backend); "splash": JAX's Pallas splash kernel (TPU, bf16;
    # `shardlib.model.splash`, flash where a shape does not fit it). "auto": the
    # step's backend policy's (`shardlib.backend.BackendPolicy.attention`, docs/backends.md: cudnn on
    # GPU where the activations are bf16 / fp16, the kernel's dtypes; einsum elsewhere and outside a
    # shardlib step), but flash for sequences of `FLASH_MIN_SEQ` or more where that is the einsum.
    attention: str = "auto"
    # The variations of the published Llama-family checkpoints (`shardlib.hf`, docs/pretrained.md);
    # the defaults are the reference decoder's own choices.
    attention_head_dim: int | None = None  # None: d_model // n_heads (Llama 3.x and Gemma give it explicitly)
    tie_embeddings: bool = False  # the head is the input table transposed (Gemma, Llama 3.2 1B/3B)
    qkv_bias: bool = False  # biases on the query, key and value projections (Qwen2)
    norm_offset: float = 0.0  # RMSNorm multiplies by (offset + scale): 1.0 for Gemma, whose scales start at 0
    embed_scale: bool = False  # the embeddings times sqrt(d_model) (Gemma)
    mlp_activation: str = "silu"  # the gate's activation: "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU)
    # Llama 3.1's frequency-dependent rotary scaling, or linear / dynamic / YaRN (`models.rope_scaling`)
    rope_scaling: RopeScaling | LinearRope | DynamicRope | YarnRope | None = None
    qk_norm: bool = False  # RMSNorm over each head's queries and keys before the rotation (Qwen3)
    # Gemma 2's attention: scores times query_scale ** -0.5 (query_pre_attn_scalar) instead of head_dim's,
    # tanh soft-capped at attn_softcap, each layer's keys limited to its window (layer_windows, one per
    # layer, 0: every earlier key); the logits soft-capped at final_softcap; sandwich_norm adds the
    # post-attention and post-MLP norms. Windows run in every attention but "blocked"; the soft-cap in all but
    # "blocked" and jax.nn.dot_product_attention's ("xla", "cudnn").
    query_scale: float | None = None
    attn_softcap: float | None = None
    layer_windows: tuple[int, ...] | None = None
    final_softcap: float | None = None
    sandwich_norm: bool = False
    local_rope_theta: float | None = None  # Gemma 3: the windowed layers' rope base (unscaled); rope_theta the others'
    # Low-rank adapters on the projections (`models.lora`): the other parameters are frozen.
    lora: LoraConfig | None = None

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION:
            raise ValueError(f"attention={self.attention!r} is not one of {ATTENTION}")
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"remat_policy={self.remat_policy!r} is not one of {REMAT_POLICIES}")
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ValueError(f"mlp_activation={self.mlp_activation!r} is not one of {tuple(MLP_ACTIVATIONS)}")
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.attention_head_dim is None and self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {self.head_dim}")
        if self.layer_windows is not None and len(self.layer_windows) != self.n_layers:
            raise ValueError(f"layer_windows has {len(self.layer_windows)} entries for n_layers={self.n_layers}")
        if self.attn_softcap and self.attention in ("blocked", "xla", "cudnn"):
            raise ValueError(f"attention={self.attention!r} cannot run attention soft-capping (attn_softcap, Gemma 2): "
                             "use 'flash', 'splash', 'einsum' or 'auto'")
        if self.attention == "blocked" and self.layer_windows and any(self.layer_windows):
            raise ValueError("attention='blocked' cannot run sliding windows (layer_windows): use 'flash', or 'auto'")

    @property
    def custom_attention(self) -> bool:
        """Whether attention needs the einsum path's window, soft-cap or query scale (Gemma 2)."""
        return bool(self.layer_windows and any(self.layer_windows)) or bool(self.attn_softcap) or bool(self.query_scale)

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.d_model // self.n_heads


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama 3.1's rotary scaling (``rope_type: llama3``): wavelengths longer than
    ``original_max_len / low_freq_factor`` are stretched ``factor`` times, shorter than
    ``original_max_len / high_freq_factor`` kept, and those between interpolated smoothly."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_len: int


# The projections LoRA can adapt, by the name `--lora-targets` uses, in the order PEFT lists them.
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
# QLoRA: how the frozen projections may be stored (`models.lora.quantise`); None: the compute dtype.
# NF4 quantises (`models.lora.quantise`) but does not train: its uint4 codes have no dtype promotion
# in JAX (the step's update adds a zero to every frozen leaf) and no Orbax checkpoint format.
LORA_BASES = ("int8",)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """LoRA (Hu et al., 2021) on the ``targets`` projections: ``W x + (alpha / rank) B A x``, with
    ``A`` and ``B`` the only trained parameters (`models.lora`)."""

    rank: int
    alpha: float | None = None  # None: the rank (a scale of 1)
    targets: tuple[str, ...] = LORA_TARGETS
    # QLoRA: every projection of the frozen base stored quantised ("int8"); None: the compute dtype
    base: str | None = None

    def __post_init__(self) -> None:
        if self.base == "nf4":
            raise ValueError("LoRA base 'nf4' is not supported yet: its uint4 codes neither pass the step's update "
                             "(JAX does not promote 4-bit integers) nor save in Orbax checkpoints; use int8")
        if self.base is not None and self.base not in LORA_BASES:
            raise ValueError(f"LoRA base {self.base!r}: use one of {', '.join(LORA_BASES)} (or none: the compute dtype)")
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank must be a positive integer, got {self.rank!r}")
        if self.alpha is not None and not self.alpha > 0:
            raise ValueError(f"LoRA alpha must be positive, got {self.alpha!r}")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown or not self.targets or len(set(self.targets)) != len(self.targets):
            raise ValueError(f"LoRA targets {','.join(self.targets) or '(none)'}: name each of "
                             f"{','.join(LORA_TARGETS)} at most once, at least one")
        object.__setattr__(self, "targets", tuple(t for t in LORA_TARGETS if t in self.targets))

    @property
    def scale(self) -> float:
        return (self.rank if self.alpha is None else self.alpha) / self.rank


# Rematerialisation policies by name, least recompute last (`models.gpt.REMAT_POLICIES` builds them);
# "none" is ``remat=False``.
REMAT_POLICIES = ("full", "save_dots_except_mlp_in", "save_dots", "offload_dots")

# The gate activations of the gated MLP, by name (`models.gpt.GatedMLP`).
MLP_ACTIVATIONS = ("silu", "gelu_tanh")


ATTENTION = ("auto", "einsum", "blocked", "flash", "xla", "cudnn", "splash")

CONFIGS: dict[str, GPTConfig] = {
    # For tests: every dimension is small and divisible by 4 or 8.
    "tiny": GPTConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, d_ff=128, max_seq_len=64),
    # Default CLI run: byte-level, ~3.5M params, learns visibly within a few hundred CPU steps.
    "small": GPTConfig(vocab_size=256, d_model=256, n_layers=4, n_heads=8, d_ff=768, max_seq_len=128),
    # GPT-2 small shapes; SwiGLU with d_ff=2048 (= 8/3 d) has GPT-2's 85M non-embedding params.
    # The head is untied, so the total is ~162M rather than GPT-2's 124M.
    "gpt2-small": GPTConfig(
        vocab_size=50304, d_model=768, n_layers=12, n_heads=12, d_ff=2048, max_seq_len=1024
    ),
    # TinyLlama-1.1B shapes (grouped-query attention, 4 kv heads).
    "1b": GPTConfig(
        vocab_size=32000, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, d_ff=5632, max_seq_len=2048
    ),
    "llama-7b": GPTConfig(
        vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, d_ff=11008, max_seq_len=2048, norm_eps=1e-6
    ),
    "13b": GPTConfig(
        vocab_size=32000, d_model=5120, n_layers=40, n_heads=40, d_ff=13824, max_seq_len=2048, norm_eps=1e-6
    ),
    # Llama-2-70B shapes (Touvron et al., 2023): grouped-query attention with 8 kv heads.
    "70b": GPTConfig(
        vocab_size=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672, max_seq_len=4096,
        norm_eps=1e-5,
    ),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig(GPTConfig):
    """A decoder whose MLPs are mixtures of ``n_experts`` SwiGLU experts (``d_ff`` each), each
    token routed to its ``top_k`` best (`models.moe`, docs/moe.md). An expert takes at most
    ``capacity = ceil(capacity_factor * top_k * seq / n_experts)`` tokens of a sequence; the rest
    of its assignments are dropped (the residual stream carries those tokens on). The loss adds
    ``aux_loss_coef`` times the Switch/GShard load-balancing loss and ``z_loss_coef`` times the
    router z-loss (ST-MoE), each summed over the layers."""

    n_experts: int = 4
    top_k: int = 1
    capacity_factor: float = 1.25
    # True: no capacity and nothing dropped; each expert takes all its assignments, sorted into
    # variable-sized groups for one grouped matmul (`jax.lax.ragged_dot`), over any `expert` axis
    # (`shardlib.model.experts.dispatch_sorted`: ragged all-to-all on TPU / GPU, padded on CPU).
    dropless: bool = False
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 1e-3
    # The top-k gates divided by their sum: None (GShard) when top_k > 1; True always (Mixtral, so a
    # top-1 gate is 1); False never (Qwen's norm_topk_prob false: the softmax probabilities as they are).
    norm_topk_prob: bool | None = None
    # A shared expert every token runs through, a SwiGLU of this width scaled by sigmoid(x w) (Qwen2-MoE); 0: none.
    shared_d_ff: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} needs at least that many experts, got n_experts={self.n_experts}")
        if self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor={self.capacity_factor} must be positive")
        if self.shared_d_ff < 0:
            raise ValueError(f"shared_d_ff={self.shared_d_ff} must be 0 (no shared expert) or positive")

    @property
    def renormalizes(self) -> bool:
        """Whether the chosen experts' gates are divided by their sum (`norm_topk_prob`)."""
        return self.top_k > 1 if self.norm_topk_prob is None else self.norm_topk_prob

    def capacity(self, seq_len: int) -> int:
        """Slots per expert per sequence: ``ceil(capacity_factor * top_k * seq_len / n_experts)``, at least 1."""
        return max(1, math.ceil(self.capacity_factor * self.top_k * seq_len / self.n_experts))


CONFIGS.update({
    # For tests: 4 experts (one per device of an expert=4 mesh), top-1 routing.
    "moe-tiny": MoEConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=2, d_ff=32, max_seq_len=64,
                          n_experts=4, top_k=1),
    # A small byte-level MoE: 8 experts, top-2 routing (GShard), ~4M parameters.
    "moe-small": MoEConfig(vocab_size=256, d_model=256, n_layers=4, n_heads=8, d_ff=512, max_seq_len=128,
                           n_experts=8, top_k=2),
    # Mixtral-8x7B's shapes (Jiang et al., 2024): 8 experts of d_ff 14336, top-2, GQA with 8 kv heads.
    "mixtral-8x7b": MoEConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336,
                              max_seq_len=32768, rope_theta=1e6, n_experts=8, top_k=2),
    # DeepSeekMoE-16B's routed experts (Dai et al., 2024): 64 small experts of d_ff 1408, top-6. Its 2
    # shared experts and dense first layer are not built (every layer routed: 16.4B parameters).
    "deepseek-moe-16b": MoEConfig(vocab_size=102400, d_model=2048, n_layers=28, n_heads=16, d_ff=1408,
                                  max_seq_len=4096, n_experts=64, top_k=6),
})


def get_config(name: str) -> GPTConfig:
    """The named configuration; an unknown name lists the known ones."""
    try:
        return CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown model config {name!r}; known configs: {', '.join(CONFIGS)}") from None


def _layer_params(config: GPTConfig) -> int:
    d, hd = config.d_model, config.head_dim
    attention = d * hd * (2 * config.n_heads + 2 * config.n_kv_heads)  # wq, wo, wk, wv
    if config.qkv_bias:
        attention += hd * (config.n_heads + 2 * config.n_kv_heads)
    if config.qk_norm:
        attention += 2 * hd
    mlp = 3 * d * config.d_ff  # w_gate, w_up, w_down
    if isinstance(config, MoEConfig):  # every expert's SwiGLU, the router, a shared expert and its gate
        mlp = config.n_experts * mlp + d * config.n_experts
        mlp += (3 * d * config.shared_d_ff + d) if config.shared_d_ff else 0
    norms = (4 if config.sandwich_norm else 2) * d
    return attention + mlp + norms


def param_count(config: GPTConfig) -> int:
    """Exact number of parameters of ``GPT(config)``."""
    embeddings = (1 if config.tie_embeddings else 2) * config.vocab_size * config.d_model  # input table, head
    return embeddings + config.n_layers * _layer_params(config) + config.d_model + lora_param_count(config)


def lora_shapes(config: GPTConfig) -> dict[str, tuple[int, int]]:
    """Per LoRA target: (the projection's input size, its output size), as PyTorch's ``Linear`` has them."""
    d, f, q, kv = config.d_model, config.d_ff, config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    return {"q": (d, q), "k": (d, kv), "v": (d, kv), "o": (q, d), "gate": (d, f), "up": (d, f), "down": (f, d)}


def lora_param_count(config: GPTConfig) -> int:
    """The adapters' parameters (``rank * (in + out)`` per adapted projection and layer): what trains."""
    if config.lora is None:
        return 0
    shapes = lora_shapes(config)
    return config.n_layers * config.lora.rank * sum(sum(shapes[t]) for t in config.lora.targets)


def flops_per_token(config: GPTConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token (forward + backward), the PaLM appendix B estimate.

    ``6 N + 12 L H Q T``: N counts every parameter that takes part in a matmul (all of them
    except the input embedding table, which is a lookup), L layers, H heads of size Q, T the
    sequence length. The attention term counts the full T x T score matrix (no causal
    discount), as PaLM and most MFU reports do. Remat recomputation is not counted.
    """
    seq_len = config.max_seq_len if seq_len is None else seq_len
    n_matmul = param_count(config) - (0 if config.tie_embeddings else config.vocab_size * config.d_model)
    if isinstance(config, MoEConfig):  # a token runs through top_k of the experts only
        n_matmul -= config.n_layers * (config.n_experts - config.top_k) * 3 * config.d_model * config.d_ff
    attention = 12 * config.n_layers * config.n_heads * config.head_dim * seq_len
    return float(6 * n_matmul + attention)
