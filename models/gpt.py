"""A GPT/Llama-style decoder in Flax NNX whose every parameter carries logical axis names.

The blocks are stacked (leading ``"layers"`` axis) and run with ``jax.lax.scan`` so that a
strategy can gather one layer's weights at a time (``shardlib.model.hooks.gather_layer``) and XLA
compiles one block instead of ``n_layers`` copies. Parameters stay float32; matmuls run in
``config.compute_dtype``; norm statistics, softmax and logits are float32.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from . import lora as lora_lib
from .configs import GPTConfig, RopeScaling
from shardlib.model import attention as attention_lib
from shardlib.model import splash
from shardlib.model.hooks import backend_policy, constrain, gather_layer, global_mean
from shardlib.model import Stages

RESIDUAL = ("batch", "seq", "embed")
Initializer = Any  # jax.nn.initializers.Initializer


def named_param(rngs: nnx.Rngs, init: Initializer, shape: Sequence[int], names: Sequence[str]) -> nnx.Param:
    """A float32 parameter with one logical axis name per dimension."""
    if len(names) != len(shape):
        raise ValueError(f"{len(names)} logical names {tuple(names)} for a parameter of shape {tuple(shape)}")
    return nnx.Param(init(rngs.params(), tuple(shape), jnp.float32), out_sharding=tuple(names))


def fan_in_init(in_axis: int | Sequence[int], out_axis: int | Sequence[int], scale: float = 1.0) -> Initializer:
    """Variance ``scale / fan_in`` for multi-dimensional einsum kernels."""
    return nnx.initializers.variance_scaling(scale, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis)


def rope_tables(seq_len: int, head_dim: int, theta: float, positions: jax.Array | None = None,
                scaling: RopeScaling | None = None) -> tuple[jax.Array, jax.Array]:
    """(sin, cos), each float32[seq_len, head_dim // 2], for rotary position embeddings at
    ``positions`` (default: this device's tokens' positions in the whole sequence,
    `shardlib.model.attention.positions`: ``arange(seq_len)`` unless the sequence is split over a
    context axis); ``[batch, seq_len, head_dim // 2]`` for per-row positions ``[batch, seq_len]``
    (left-padded prompts, `shardlib.models.decoding`)."""
    inv_freq = rope_frequencies(head_dim, theta, scaling)
    positions = attention_lib.positions(seq_len) if positions is None else positions
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    factor = getattr(scaling, "attention_factor", 1.0)  # YaRN scales sin and cos (transformers' attention_scaling)
    if factor != 1.0:
        return jnp.sin(angles) * factor, jnp.cos(angles) * factor
    return jnp.sin(angles), jnp.cos(angles)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
    """float32[head_dim // 2]: ``1 / theta^(2i / head_dim)``, computed in that order in float32 as
    the Llama reference does (so imported checkpoints see the same angles), then Llama 3.1's
    scaling when given: long wavelengths divided by ``factor``, short ones kept, the band between
    interpolated. The other scalings compute their own (`models.rope_scaling`)."""
    if scaling is not None and not isinstance(scaling, RopeScaling):
        return scaling.frequencies(head_dim, theta)
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    if scaling is None:
        return inv_freq
    low_wavelen = scaling.original_max_len / scaling.low_freq_factor
    high_wavelen = scaling.original_max_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    stretched = jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * stretched / scaling.factor + smooth * stretched
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, smoothed, stretched)


def apply_rope(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    """Rotate the two halves of each head (x: [batch, seq, heads, head_dim]) by position: the
    ``rotate_half`` layout of the Hugging Face Llama family, so their q/k weights load unpermuted."""
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    sin, cos = ((t[None] if t.ndim == 2 else t)[:, :, None, :] for t in (sin, cos))  # shared or per-row positions
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class RMSNorm(nnx.Module):
    """Root-mean-square norm; statistics in float32 whatever the activation dtype. The output is
    multiplied by ``offset + scale``: Gemma stores its scales as offsets from 1 (``offset=1``, the
    scales start at 0)."""

    def __init__(self, dim: int, *, eps: float, rngs: nnx.Rngs, offset: float = 0.0, axis: str = "embed"):
        self.eps = eps
        self.offset = offset
        self.scale = named_param(rngs, nnx.initializers.zeros if offset else nnx.initializers.ones, (dim,), (axis,))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...] + self.offset if self.offset else self.scale[...]
        return (y * scale).astype(x.dtype)


class Attention(nnx.Module):
    """Causal self-attention with rotary embeddings; ``n_kv_heads < n_heads`` gives GQA."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        d, h, kv, hd = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim
        qkv_init = fan_in_init(in_axis=0, out_axis=(1, 2))
        self.wq = named_param(rngs, qkv_init, (d, h, hd), ("embed", "heads", "head_dim"))
        self.wk = named_param(rngs, qkv_init, (d, kv, hd), ("embed", "kv_heads", "head_dim"))
        self.wv = named_param(rngs, qkv_init, (d, kv, hd), ("embed", "kv_heads", "head_dim"))
        # Residual-branch outputs scaled by 1/sqrt(2 L) (GPT-2) so the stream's variance stays O(1).
        out_init = fan_in_init(in_axis=(0, 1), out_axis=2, scale=1.0 / (2 * config.n_layers))
        self.wo = named_param(rngs, out_init, (h, hd, d), ("heads", "head_dim", "embed"))
        if config.qkv_bias:
            self.bq = named_param(rngs, nnx.initializers.zeros, (h, hd), ("heads", "head_dim"))
            self.bk = named_param(rngs, nnx.initializers.zeros, (kv, hd), ("kv_heads", "head_dim"))
            self.bv = named_param(rngs, nnx.initializers.zeros, (kv, hd), ("kv_heads", "head_dim"))
        self.softcap = config.attn_softcap
        # the values a layer's (traced) window takes: the kernels whose masks are static need them
        self.windows = tuple(sorted(set(config.layer_windows))) if config.layer_windows else None
        self.scale = config.query_scale ** -0.5 if config.query_scale else None
        if config.qk_norm:  # per head, over head_dim (Qwen3)
            self.q_norm, self.k_norm = (RMSNorm(hd, eps=config.norm_eps, offset=config.norm_offset, rngs=rngs,
                                               axis="head_dim") for _ in range(2))
        self.implementation = config.attention
        lora_lib.attach(self, config, rngs)

    def __call__(self, x: jax.Array, sin: jax.Array, cos: jax.Array, window: jax.Array | None = None,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """``segment_ids`` (int32[batch, seq], packed rows): a query sees only the keys of its segment."""
        q, k, v = self.project(x, sin, cos)
        # shardlib's attention: the model's own kernel on a whole sequence, a ring or all-gather of
        # K/V when the sequence is split over a context axis
        local = functools.partial(_local_attention, self.implementation, windows=self.windows)
        if self.scale is not None:  # query_pre_attn_scalar: the queries scaled, the kernels scale by 1/sqrt(d)
            q = (q * (self.scale * math.sqrt(q.shape[-1]))).astype(q.dtype)
        out = attention_lib.attention(q, k, v, causal=True, local=local, segment_ids=segment_ids, window=window,
                                      softcap=self.softcap)
        return self.output(out)

    def project(self, x: jax.Array, sin: jax.Array, cos: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries, keys (both rotated) and values of ``x``: [batch, seq, (kv_)heads, head_dim]."""
        dtype = x.dtype
        q, k, v = (checkpoint_name(lora_lib.adapted(self, w, x, jnp.einsum(
            "btd,dhk->bthk", x, lora_lib.weight(self, w, dtype))), "qkv_proj") for w in ("wq", "wk", "wv"))
        if hasattr(self, "bq"):
            q, k, v = (y + b[...].astype(dtype) for y, b in ((q, self.bq), (k, self.bk), (v, self.bv)))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q = constrain(apply_rope(q, sin, cos), ("batch", "seq", "heads", "head_dim"))
        k = constrain(apply_rope(k, sin, cos), ("batch", "seq", "kv_heads", "head_dim"))
        return q, k, constrain(v, ("batch", "seq", "kv_heads", "head_dim"))

    def output(self, out: jax.Array) -> jax.Array:
        out = constrain(out, ("batch", "seq", "heads", "head_dim"))
        return checkpoint_name(lora_lib.adapted(
            self, "wo", out, jnp.einsum("bthk,hkd->btd", out, lora_lib.weight(self, "wo", out.dtype))), "out_proj")

    def cached(self, x: jax.Array, sin: jax.Array, cos: jax.Array, attend: Any,
               window: jax.Array | None = None) -> tuple[jax.Array, Any]:
        """Attention of ``x`` whose keys and values live in a KV cache: ``attend(q, k, v, window=,
        softcap=, scale=) -> (out, carry)`` stores the new keys and values and attends over them
        (`shardlib.models.decoding`: a prompt's prefill, one decoding step) with this layer's
        window and Gemma 2's soft-cap and scale (None: plain attention)."""
        q, k, v = self.project(x, sin, cos)
        out, carry = attend(q, k, v, window=window, softcap=self.softcap, scale=self.scale)
        return self.output(out), carry


def _local_attention(implementation: str, q: jax.Array, k: jax.Array, v: jax.Array, *,
                     segment_ids: jax.Array | None = None, window: jax.Array | int | None = None,
                     windows: tuple[int, ...] | None = None, softcap: float | None = None) -> jax.Array:
    """Causal attention over a whole sequence with ``GPTConfig.attention``'s implementation, within
    the documents of ``segment_ids`` and the sliding ``window``, scores soft-capped at ``softcap``
    (`shardlib.model.attention.attention`'s arguments; ``windows``: the values a traced window
    takes, for the kernels with static masks)."""
    implementation = resolve_attention(implementation, q.dtype, q.shape[1])
    if implementation == "splash":
        why = splash.misfit(q, k)
        if why is None:
            return splash.causal(q, k, v, segment_ids=segment_ids, window=window, windows=windows, softcap=softcap)
        splash.say_fallback(q, why)
        implementation = "flash" if q.shape[1] >= attention_lib.FLASH_MIN_SEQ else "einsum"
    if implementation in ("xla", "cudnn") and softcap:  # "auto" picked cuDNN (explicit: refused by GPTConfig)
        _say_once(f"shardlib: attention: jax.nn.dot_product_attention ({implementation}) takes no soft-cap "
                  f"(attn_softcap={softcap}); running shardlib's flash attention instead")
        implementation = "flash"
    if implementation == "flash":
        return attention_lib.causal_flash(q, k, v, segment_ids=segment_ids, window=window, softcap=softcap)
    if implementation == "einsum":
        return causal_attention(q, k, v, window=window, softcap=softcap, segment_ids=segment_ids)
    if implementation == "blocked":
        if window is not None or softcap:
            raise ValueError("attention='blocked' takes no sliding window or soft-cap: use 'flash'")
        return blocked_causal_attention(q, k, v, segment_ids=segment_ids)
    return fused_attention(implementation, q, k, v, segment_ids=segment_ids, window=window, windows=windows)


_SAID: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _SAID:
        _SAID.add(message)
        print(message, file=sys.stderr)


def fused_attention(implementation: str, q: jax.Array, k: jax.Array, v: jax.Array, *,
                    segment_ids: jax.Array | None = None, window: jax.Array | int | None = None,
                    windows: tuple[int, ...] | None = None) -> jax.Array:
    """``jax.nn.dot_product_attention`` ("cudnn" or "xla"), causal: a window as its
    ``local_window_size`` (left, right) = (window - 1, 0), i.e. keys i - window + 1 .. i (cuDNN's
    sliding window of ``window``); documents as a boolean ``mask`` [batch, 1, seq, seq] (the
    function takes no segment ids: the mask is quadratic in the sequence)."""
    mask = None if segment_ids is None else (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]

    def run(w: int) -> jax.Array:
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=implementation,
                                            local_window_size=(w - 1, 0) if w > 0 else None)

    return attention_lib.static_window(run, window, windows, f"jax.nn.dot_product_attention ({implementation})")


# The dtypes cuDNN's fused attention kernel takes.
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def resolve_attention(attention: str, dtype: Any, seq_len: int = 0) -> str:
    """``GPTConfig.attention`` as the implementation to run: "auto" is the backend policy of the
    step being traced (`shardlib.model.hooks.backend_policy`, decided by the step's devices), but
    einsum for activations cuDNN's kernel does not take (float32) and outside a shardlib step, and
    flash in place of the einsum from `shardlib.model.attention.FLASH_MIN_SEQ` tokens on."""
    if attention != "auto":
        return attention
    chosen = attention_for(backend_policy(), dtype)
    return "flash" if chosen == "einsum" and seq_len >= attention_lib.FLASH_MIN_SEQ else chosen


def attention_for(policy: Any, dtype: Any) -> str:
    """The attention a `shardlib.backend.BackendPolicy` (None: none, einsum) runs for activations
    of ``dtype``: its own, but einsum where that is cuDNN's and the dtype is not one it takes."""
    chosen = "einsum" if policy is None else policy.attention
    if chosen == "splash" and jnp.dtype(dtype) != jnp.bfloat16:  # the TPU policy's kernel, for bf16 activations
        return "einsum"
    return "einsum" if chosen == "cudnn" and jnp.dtype(dtype) not in CUDNN_DTYPES else chosen


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, offset: jax.Array | int = 0,
                     visible: jax.Array | None = None, *, window: jax.Array | int | None = None,
                     softcap: float | None = None, scale: float | None = None,
                     segment_ids: jax.Array | None = None) -> jax.Array:
    """softmax(q k^T / sqrt(d)) v under a causal mask, scores in float32; k/v may have fewer heads (GQA).

    Query i sits at position ``offset + i`` of the keys (0: the same sequence; a KV cache's keys
    are longer than the new queries) and sees keys 0 .. ``offset + i``, those of them that
    ``visible`` (bool[batch, keys]: a left-padded row's padding is not) allows. Gemma 2's options,
    as transformers computes them: ``scale`` replaces 1 / sqrt(d); ``softcap``: scores become
    ``softcap * tanh(scores / softcap)`` before the mask; ``window`` (> 0, may be traced): only the
    keys after ``offset + i - window`` are seen. ``segment_ids`` (int32[batch, seq], packed rows; the
    same sequence, offset 0): a query sees only the keys of its own segment."""
    batch, seq, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(batch, seq, kv_heads, heads // kv_heads, head_dim)  # query groups share a kv head
    scores = jnp.einsum("btngk,bsnk->bngts", q, k, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(head_dim) if scale is None else scores * scale
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    query_pos, key_pos = offset + jnp.arange(seq)[:, None], jnp.arange(k.shape[1])[None, :]
    causal = key_pos <= query_pos
    if window is not None:
        causal = causal & ((window <= 0) | (key_pos > query_pos - window))
    if visible is not None:
        causal = causal & visible[:, None, None, None, :]
    if segment_ids is not None:
        causal = causal & _same_segment(segment_ids, segment_ids)[:, None, None]
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bngts,bsnk->btngk", probs, v).reshape(batch, seq, heads, head_dim)


def _same_segment(query_ids: jax.Array, key_ids: jax.Array) -> jax.Array:
    """bool[batch, queries, keys]: where a query and a key lie in the same segment (packed rows)."""
    return query_ids[:, :, None] == key_ids[:, None, :]


def blocked_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, block: int = 32,
                             segment_ids: jax.Array | None = None) -> jax.Array:
    """`causal_attention` for ``block`` queries at a time (a divisor of the sequence length), each
    block's scores recomputed in the backward pass: one ``[block, seq]`` slice of the scores is live
    at a time instead of the whole ``[seq, seq]`` (what PyTorch's CPU ``scaled_dot_product_attention``
    also avoids), for the same result; ``segment_ids`` as `causal_attention`'s."""
    batch, seq, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    block = math.gcd(seq, block)
    blocks = q.reshape(batch, seq // block, block, heads, head_dim).swapaxes(0, 1)

    @jax.checkpoint
    def one(start: jax.Array, qb: jax.Array) -> jax.Array:
        qb = qb.reshape(batch, block, kv_heads, heads // kv_heads, head_dim)
        scores = jnp.einsum("btngk,bsnk->bngts", qb, k, preferred_element_type=jnp.float32) / math.sqrt(head_dim)
        causal = jnp.arange(seq)[None, :] <= start + jnp.arange(block)[:, None]
        if segment_ids is not None:
            ids = jax.lax.dynamic_slice_in_dim(segment_ids, start, block, axis=1)
            causal = causal & _same_segment(ids, segment_ids)[:, None, None]
        probs = jax.nn.softmax(jnp.where(causal, scores, jnp.finfo(jnp.float32).min), axis=-1).astype(q.dtype)
        return jnp.einsum("bngts,bsnk->btngk", probs, v).reshape(batch, block, heads, head_dim)

    out = jax.lax.map(lambda args: one(*args), (jnp.arange(0, seq, block), blocks))
    return out.swapaxes(0, 1).reshape(batch, seq, heads, head_dim)


# What a rematerialised block saves, by `GPTConfig.remat_policy` (the projections are tagged with
# `checkpoint_name`: qkv_proj, out_proj, mlp_in, mlp_out); None saves nothing.
_PROJECTIONS = ("qkv_proj", "out_proj", "mlp_in", "mlp_out")
REMAT_POLICIES = {
    "full": lambda: None,
    "save_dots": lambda: jax.checkpoint_policies.save_only_these_names(*_PROJECTIONS),
    "save_dots_except_mlp_in": lambda: jax.checkpoint_policies.save_only_these_names("qkv_proj", "out_proj", "mlp_out"),
    "offload_dots": lambda: jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=_PROJECTIONS, offload_src="device",
        offload_dst="pinned_host"),
}

# The gate activations by `GPTConfig.mlp_activation`: SwiGLU's and GeGLU's (tanh-approximated GELU, Gemma's).
GATE_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


class GatedMLP(nnx.Module):
    """Gated MLP: ``w_down(act(x w_gate) * (x w_up))``, SwiGLU with silu, GeGLU with gelu."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs, d_ff: int | None = None):
        d, f = config.d_model, d_ff or config.d_ff
        self.w_gate = named_param(rngs, fan_in_init(0, 1), (d, f), ("embed", "mlp"))
        self.w_up = named_param(rngs, fan_in_init(0, 1), (d, f), ("embed", "mlp"))
        self.w_down = named_param(rngs, fan_in_init(0, 1, scale=1.0 / (2 * config.n_layers)), (f, d), ("mlp", "embed"))
        self.activation = config.mlp_activation
        lora_lib.attach(self, config, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = x.dtype
        gate = checkpoint_name(lora_lib.adapted(
            self, "w_gate", x, jnp.einsum("btd,df->btf", x, lora_lib.weight(self, "w_gate", dtype))), "mlp_in")
        up = checkpoint_name(lora_lib.adapted(
            self, "w_up", x, jnp.einsum("btd,df->btf", x, lora_lib.weight(self, "w_up", dtype))), "mlp_in")
        hidden = constrain(GATE_ACTIVATIONS[self.activation](gate) * up, ("batch", "seq", "mlp"))
        return checkpoint_name(lora_lib.adapted(
            self, "w_down", hidden, jnp.einsum("btf,fd->btd", hidden, lora_lib.weight(self, "w_down", dtype))), "mlp_out")


class Block(nnx.Module):
    """Pre-norm decoder block: attention then MLP, each added to the residual stream."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        norm = functools.partial(RMSNorm, config.d_model, eps=config.norm_eps, offset=config.norm_offset, rngs=rngs)
        self.attn_norm = norm()
        self.attn = Attention(config, rngs=rngs)
        self.mlp_norm = norm()
        self.mlp = GatedMLP(config, rngs=rngs)
        if config.sandwich_norm:  # Gemma 2: each branch's output normed too, before it joins the stream
            self.attn_post_norm, self.mlp_post_norm = norm(), norm()

    def _post(self, name: str, y: jax.Array) -> jax.Array:
        return getattr(self, name)(y) if hasattr(self, name) else y

    def __call__(self, x: jax.Array, sin: jax.Array, cos: jax.Array, window: jax.Array | None = None,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        attended = self.attn(self.attn_norm(x), sin, cos, window, segment_ids)
        x = constrain(x + self._post("attn_post_norm", attended), RESIDUAL)
        return constrain(x + self._post("mlp_post_norm", self.mlp(self.mlp_norm(x))), RESIDUAL)

    def cached(self, x: jax.Array, sin: jax.Array, cos: jax.Array, attend: Any,
               window: jax.Array | None = None) -> tuple[jax.Array, Any]:
        """`__call__` with `Attention.cached`'s ``attend`` (generation); returns its carry too."""
        attended, carry = self.attn.cached(self.attn_norm(x), sin, cos, attend, window)
        x = x + self._post("attn_post_norm", attended)
        return x + self._post("mlp_post_norm", self.mlp(self.mlp_norm(x))), carry


def _stacked_blocks(config: GPTConfig, rngs: nnx.Rngs, block: type = Block) -> Block:
    """``n_layers`` blocks as one ``block`` whose parameters have a leading ``"layers"`` axis."""

    @nnx.split_rngs(splits=config.n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=config.n_layers, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(rngs: nnx.Rngs) -> Block:
        return block(config, rngs=rngs)

    return make(rngs)


def _stream_dtype(config: GPTConfig, weight_dtype: Any) -> jnp.dtype:
    """The residual stream's dtype: ``config.compute_dtype``, or the dtype the train step hands the
    weights in when that is narrower, so that ``build(..., precision="bf16")`` computes a float32
    config in bf16 instead of upcasting the bf16 weights again."""
    config_dtype, weight_dtype = jnp.dtype(config.compute_dtype), jnp.dtype(weight_dtype)
    return weight_dtype if jnp.finfo(weight_dtype).bits < jnp.finfo(config_dtype).bits else config_dtype


class GPT(nnx.Module):
    """Decoder-only language model: tokens int32[B, T] -> logits float32[B, T, vocab]."""

    block = Block  # the decoder layer (`models.moe.MoEGPT`'s routes its MLP to experts)

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        self.config = config
        d, vocab = config.d_model, config.vocab_size
        self.embedding = named_param(rngs, nnx.initializers.normal(1.0), (vocab, d), ("vocab", "embed"))
        self.blocks = _stacked_blocks(config, rngs, type(self).block)
        self.final_norm = RMSNorm(d, eps=config.norm_eps, offset=config.norm_offset, rngs=rngs)
        if not config.tie_embeddings:  # tied: the head is the embedding table, transposed
            self.lm_head = named_param(rngs, fan_in_init(0, 1), (d, vocab), ("embed", "vocab"))

    def __call__(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None) -> jax.Array:
        """Packed rows (`shardlib.runtime.packing`): ``segment_ids`` int32[B, T] keep attention
        within each document, ``positions`` int32[B, T] restart the rotary positions at each one."""
        return self.head(self.apply_blocks(self.embed(tokens), segment_ids=segment_ids, positions=positions))

    # The three pieces below are also the pipeline stages' pieces (`pipeline_stages`): the first
    # stage embeds, every stage runs its slice of the stacked blocks, the last stage runs the head.
    # Each group of weights is gathered (under ZeRO-3) inside the function that uses it, and that
    # function is rematerialised, so full weights are not kept for the backward pass.

    def embed(self, tokens: jax.Array) -> jax.Array:
        """int32[B, T] -> the residual stream [B, T, d_model] in the compute dtype."""
        # The lookup's backward needs no weights at all, so it is not rematerialised.
        table = gather_layer(self.embedding)[...]
        x = jnp.take(table, tokens, axis=0).astype(_stream_dtype(self.config, table.dtype))
        if self.config.embed_scale:  # Gemma: sqrt(d) rounded to the stream's dtype first, as its reference does
            x = x * jnp.asarray(math.sqrt(self.config.d_model), x.dtype)
        return constrain(x, RESIDUAL)

    def head(self, x: jax.Array) -> jax.Array:
        """Residual stream -> float32 logits [B, T, vocab]."""
        final_norm = nnx.split(self.final_norm)
        tied = self.config.tie_embeddings
        weights = self.embedding if tied else self.lm_head

        def head(x):
            norm = nnx.merge(final_norm[0], gather_layer(final_norm[1]))
            w = gather_layer(weights)[...].astype(x.dtype)
            logits = jnp.einsum("btd,vd->btv" if tied else "btd,dv->btv", norm(x), w, preferred_element_type=jnp.float32)
            cap = self.config.final_softcap  # Gemma 2
            return logits if cap is None else jnp.tanh(logits / cap) * cap

        if self.config.remat:
            head = jax.checkpoint(head)
        return constrain(head(x), ("batch", "seq", "vocab"))

    def apply_blocks(self, x: jax.Array, *, segment_ids: jax.Array | None = None,
                     positions: jax.Array | None = None) -> jax.Array:
        """Scan the stacked blocks (all of them, or one pipeline stage's slice) over the residual
        stream; ``segment_ids`` and per-row ``positions`` as `__call__`'s."""
        return self.scan_blocks(x, segment_ids=segment_ids, positions=positions)[0]

    def scan_blocks(self, x: jax.Array, *, segment_ids: jax.Array | None = None,
                    positions: jax.Array | None = None) -> tuple[jax.Array, Any]:
        """(the residual stream after the blocks, what each block returned beside it, stacked: an
        MoE block's routing stats; None for a dense one)."""
        tables = self.rope(x.shape[1], positions), self.local_rope(x.shape[1], positions)
        graphdef, stacked = nnx.split(self.blocks)

        def body(x: jax.Array, layer: tuple[nnx.State, jax.Array | None]) -> tuple[jax.Array, Any]:
            layer_state, window = layer
            block = nnx.merge(graphdef, gather_layer(layer_state))
            documents = {} if segment_ids is None else {"segment_ids": segment_ids}
            out = block(x, *layer_rope(window, *tables), window, **documents)
            return out if isinstance(out, tuple) else (out, None)

        if self.config.remat:  # prevent_cse is not needed inside scan
            body = jax.checkpoint(body, prevent_cse=False, policy=REMAT_POLICIES[self.config.remat_policy]())
        return jax.lax.scan(body, x, (stacked, self.windows(stacked)))

    def local_rope(self, seq_len: int, positions: jax.Array | None = None) -> tuple[jax.Array, jax.Array] | None:
        """Gemma 3: the windowed layers' own rope tables (their base, no scaling), or None."""
        c = self.config
        if c.local_rope_theta is None:
            return None
        return rope_tables(seq_len, c.head_dim, c.local_rope_theta, positions=positions)

    def windows(self, stacked: nnx.State) -> jax.Array | None:
        """int32[layers]: each layer's attention window (0: none), scanned beside its weights (Gemma 2)."""
        windows = self.config.layer_windows
        if windows is None:
            return None
        layers = jax.tree.leaves(stacked)[0].shape[0]
        if layers != len(windows):
            raise ValueError(f"per-layer attention windows need all {len(windows)} layers in one scan; a pipeline "
                             f"stage of {layers} is not supported for such a model (Gemma 2): drop the pipeline axis")
        return jnp.asarray(windows, jnp.int32)

    def rope(self, seq_len: int, positions: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """`rope_tables` of this model's head size, base and scaling."""
        c = self.config
        return rope_tables(seq_len, c.head_dim, c.rope_theta, positions=positions, scaling=c.rope_scaling)

def layer_rope(window: jax.Array | None, tables: tuple[jax.Array, jax.Array],
               local: tuple[jax.Array, jax.Array] | None) -> tuple[jax.Array, jax.Array]:
    """One layer's (sin, cos): the local tables on a windowed layer where the model has them (Gemma 3)."""
    if local is None or window is None:
        return tables
    return jnp.where(window > 0, local[0], tables[0]), jnp.where(window > 0, local[1], tables[1])


def build(config: GPTConfig, rngs: nnx.Rngs | int = 0) -> GPT:
    """A freshly initialised model (an int seed is turned into ``nnx.Rngs``)."""
    with nnx.use_eager_sharding(False):  # shardlib places the parameters (no mesh needed here)
        return GPT(config, rngs=nnx.Rngs(rngs) if isinstance(rngs, int) else rngs)


def from_params(config: GPTConfig, params: Any, cls: type[GPT] | None = None) -> GPT:
    """The decoder of ``config`` (a ``cls``, default `GPT`; `shardlib.models.from_params` picks the
    MoE decoder for an `MoEConfig`) holding ``params`` (its parameter tree as `shardlib.Model.abstract`
    lays it out: a checkpoint's, an import's), kept in whatever sharding they have."""
    cls = cls or GPT
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def next_token_loss(model: GPT, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean float32 cross-entropy of ``batch["targets"]`` given ``batch["inputs"]``; aux: accuracy.

    With a ``batch["loss_mask"]`` (1 where a target counts: an instruction's completion, 0 on its
    prompt and padding) the mean is over the counted targets of the whole batch (`global_mean`).
    With ``batch["segment_ids"]`` and ``batch["positions"]`` (packed rows, `shardlib.runtime.packing`)
    attention stays within each document and positions restart at each one."""
    logits = model(batch["inputs"], segment_ids=batch.get("segment_ids"), positions=batch.get("positions"))
    return logits_loss(logits, batch["targets"], batch.get("loss_mask"))


def logits_loss(logits: jax.Array, targets: jax.Array, mask: jax.Array | None = None
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    if mask is None:
        return losses.mean(), {"accuracy": correct.mean()}
    return global_mean(losses, mask), {"accuracy": global_mean(correct, mask)}


def pipeline_stages() -> Stages:
    """How a pipeline cuts the decoder: embed on the first stage, slices of ``blocks`` on every
    stage, final norm + head + loss on the last; same loss as `next_token_loss`."""
    return Stages(
        stacked="blocks",
        embed=lambda model, batch: model.embed(_unpacked(batch)["inputs"]),
        stage=lambda model, x: model.apply_blocks(x),
        head_loss=lambda model, x, batch: logits_loss(model.head(x), batch["targets"], batch.get("loss_mask")),
    )


def _unpacked(batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """``batch``, refused when it holds packed rows: a pipeline stage sees no segment ids."""
    if "segment_ids" in batch:
        raise ValueError("packed rows (batch['segment_ids'], --pack) do not run through pipeline stages: the stages "
                         "see no segment ids; drop --pack or the pipeline axis")
    return batch


def trainable(config: GPTConfig) -> Any:
    """The decoder as a `shardlib.Model` that gathers its own weights one layer at a time and can
    be cut into pipeline stages."""
    from shardlib.model import from_nnx

    model = from_nnx(lambda rngs: GPT(config, rngs=rngs), next_token_loss, gathers_params=True,
                     pipeline=pipeline_stages(), wrt=nnx.LoRAParam if config.lora is not None else None)
    return model if config.lora is None else lora_lib.with_stored_base(model, config)
