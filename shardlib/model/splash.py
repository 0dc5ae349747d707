"""The TPU policy's attention for bf16: JAX's Pallas splash attention kernel, inside the step.

The step's ``shard_map`` is manual over the batch axes and checks which manual axes each value
varies over; the kernel's ``pallas_call`` builds its outputs without them, so JAX refuses it
there. It therefore runs in an inner ``shard_map`` over the remaining (automatic) mesh axes with
``check_vma=False``: the heads split over ``tensor`` when the key/value heads divide (tensor
parallelism), whole otherwise. The backward pass is shardlib's tiled flash loop
(`shardlib.model.flash.unfold`, hidden tiles skipped) from the kernel's log-sum-exp, in a
``custom_vjp``: the kernel's own backward, differentiated inside the inner ``shard_map``, expects
cotangents without the manual axes that the step's carry, and jax 0.10.2 refuses them.

Masks: the kernel's ``CausalMask``, or its ``LocalMask`` for a sliding window, and its
``SegmentIds`` for packed documents. A kernel's mask is static (its block map is built when it is
made), so a window that is traced (one per layer under the layers' scan, Gemma 2) needs the values
it can take, ``windows=``: one kernel is made per value and ``lax.switch`` runs this layer's.

GQA: the kernel takes fewer key/value heads than query heads, so K/V are never repeated. Blocks
are the largest of 512, 256, 128 dividing the sequence. A shape the kernel does not take (a
sequence not a multiple of 128, keys of another length than the queries) runs shardlib's flash
attention instead, said once per shape.
"""

from __future__ import annotations

import functools
import math
import sys

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from shardlib import compat
from shardlib.model import attention as attention_lib
from shardlib.model import flash as flash_lib
from shardlib.model import hooks

HEAD_AXIS = "tensor"
BLOCKS = (512, 256, 128)
INTERPRET = False  # run the kernel in Pallas's interpreter (any backend): the CPU tests' numerics

_SAID: set[tuple] = set()


def block(seq_len: int) -> int | None:
    """The splash block for ``seq_len`` tokens: the largest of `BLOCKS` dividing it."""
    return next((b for b in BLOCKS if seq_len % b == 0), None)


def misfit(q: jax.Array, k: jax.Array) -> str | None:
    """Why the kernel cannot take these operands, or None."""
    policy = hooks.backend_policy()
    if policy is None or policy.attention != "splash":  # the TPU policy's attention
        return "not inside a shardlib step on TPU"
    t = q.shape[1]
    if block(t) is None:
        return f"sequence {t} is not a multiple of {BLOCKS[-1]}"
    if k.shape[1] != t:
        return f"keys ({k.shape[1]}) and queries ({t}) differ in length"
    return None


def say_fallback(q: jax.Array, why: str) -> None:
    """Once per shape: the kernel is not used, and why."""
    if (q.shape, why) not in _SAID:
        _SAID.add((q.shape, why))
        print(f"shardlib: attention: the Pallas splash kernel does not take q {tuple(q.shape)} ({why}); "
              "running shardlib's flash attention instead", file=sys.stderr)


def _kernel(heads: int, seq_len: int, window: int, softcap: float | None):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

    b = block(seq_len)
    sizes = kernel_lib.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b)
    shape = (seq_len, seq_len)
    # LocalMask (left, right): query i sees keys i - left .. i + right, so (window - 1, 0) is causal
    # and keys after i - window
    one = mask_lib.LocalMask(shape, (window - 1, 0), 0) if window > 0 else mask_lib.CausalMask(shape)
    return jax.vmap(kernel_lib.make_splash_mha(mask_lib.MultiHeadMask([one] * heads), block_sizes=sizes,
                                               head_shards=1, q_seq_shards=1, save_residuals=True,
                                               attn_logits_soft_cap=softcap, interpret=INTERPRET))


def _forward(q, k, v, segment_ids, window: int, softcap: float | None):
    """The kernel's causal attention of q [b, t, h, d] to k/v [b, t, n, d] within ``window`` (0:
    none) and the documents of ``segment_ids`` [b, t] (None: one), and its log-sum-exp [b, h, t]
    (natural log, of the scaled, capped scores)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib

    run = _kernel(q.shape[2], q.shape[1], window, softcap)
    q = q * (1.0 / math.sqrt(q.shape[-1]))  # the kernel does not scale
    ids = None if segment_ids is None else kernel_lib.SegmentIds(q=segment_ids, kv=segment_ids)
    out, (lse,) = run(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), segment_ids=ids)
    return out.transpose(0, 2, 1, 3), lse.reshape(lse.shape[:3])


def _free_axes() -> tuple[tuple[str, ...], int]:
    """The mesh axes not manual here (the inner shard_map's) and the size of `HEAD_AXIS`."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return (), 1
    free = tuple(a for a in mesh.axis_names if a not in mesh.manual_axes)
    return free, (mesh.shape[HEAD_AXIS] if HEAD_AXIS in free else 1)


def causal(q: jax.Array, k: jax.Array, v: jax.Array, *, segment_ids: jax.Array | None = None,
           window: jax.Array | int | None = None, windows: tuple[int, ...] | None = None,
           softcap: float | None = None) -> jax.Array:
    """Causal softmax(q k^T / sqrt(d)) v, forward by the splash kernel (the caller checked
    `misfit`), backward by shardlib's tiled flash loop from the kernel's log-sum-exp; within the
    documents of ``segment_ids``, ``window`` and ``softcap`` (as `shardlib.model.attention.attention`'s;
    a traced window must be one of the static ``windows``)."""
    return attention_lib.static_window(functools.partial(_causal, q, k, v, segment_ids, softcap=softcap), window,
                                       windows, "the Pallas splash kernel")


def _causal(q, k, v, segment_ids, window: int, softcap: float | None = None):
    free, tensor = _free_axes()
    split = tensor > 1 and k.shape[2] % tensor == 0
    if tensor > 1 and not split:
        say_fallback(q, f"{k.shape[2]} key/value heads do not split over {HEAD_AXIS}={tensor}: each device runs all heads")
    spec, lse_spec = (P(None, None, HEAD_AXIS), P(None, HEAD_AXIS)) if split else (P(), P())
    run = functools.partial(_forward, window=window, softcap=softcap)
    forward = run if not free else jax.shard_map(run, in_specs=(spec,) * 3 + (P(),), out_specs=(spec, lse_spec),
                                                  axis_names=set(free), check_vma=False)
    vary = tuple(sorted(compat.varying_axes(q) | compat.varying_axes(k) | compat.varying_axes(v)))

    # The inner shard_map's outputs carry no manual axes; typed as varying where q, k, v vary, so
    # that autodiff never takes them for replicated values (it would psum their cotangents).
    @jax.custom_vjp
    def attend(q, k, v, segment_ids):
        return _vary(forward(q, k, v, segment_ids)[0], vary)

    def primal(q, k, v, segment_ids):
        out, lse = (_vary(x, vary) for x in forward(q, k, v, segment_ids))
        return out, (q, k, v, segment_ids, out, lse)

    def grads(residuals, d_out):
        q, k, v, segment_ids, out, lse = residuals
        n = k.shape[2]
        qh, kh, vh, do = flash_lib.heads(q, n), flash_lib.kv_heads(k), flash_lib.kv_heads(v), flash_lib.heads(d_out, n)
        pos = jnp.arange(q.shape[1])
        mask = flash_lib.Mask(pos, pos, True, flash_lib.window_of(window), segment_ids, segment_ids, softcap)
        dq, dk, dv = flash_lib.unfold(qh, kh, vh, mask, do, lse.reshape(qh.shape[:4]).astype(jnp.float32),
                                      flash_lib.output_grads(flash_lib.heads(out, n), do))
        return (flash_lib.unheads(dq).astype(q.dtype), flash_lib.kv_heads(dk).astype(k.dtype),
                flash_lib.kv_heads(dv).astype(v.dtype), None)

    attend.defvjp(primal, grads)
    return attend(q, k, v, segment_ids)


def _vary(x, axes):
    missing = tuple(a for a in axes if a not in compat.varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x
