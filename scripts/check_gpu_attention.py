"""On a GPU: the fused cuDNN attention (``GPTConfig(attention="cudnn")``) against the written-out
float32 attention ("einsum") and jax.nn.dot_product_attention's XLA path, in bf16 with GQA.

Prints each path's loss and its worst relative gradient error (norm of the difference over the
norm of the einsum gradient, over all parameters). bf16 carries about 3 significant digits, so
errors of 1e-2 are rounding; a wrong mask or head grouping shows as errors of order 1.
The CPU test of the XLA path is tests/test_models.py; cuDNN needs a GPU.

  python scripts/check_gpu_attention.py
"""

from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def gradients(config, batch):
    import jax
    from flax import nnx

    from shardlib.models import build, next_token_loss

    with nnx.use_eager_sharding(False):
        model = build(config, nnx.Rngs(0))
    grad_fn = jax.jit(lambda m, b: nnx.value_and_grad(next_token_loss, has_aux=True)(m, b))
    (loss, _), grads = grad_fn(model, batch)
    return float(loss), jax.tree.leaves(nnx.state(grads, nnx.Param))


def main() -> int:
    import jax
    import jax.numpy as jnp

    from shardlib.backend import platform_of
    from shardlib.models import get_config

    platform = platform_of(jax.devices())

    for name in ("tiny", "small"):
        config = get_config(name)
        config = dataclasses.replace(config, compute_dtype="bfloat16", n_kv_heads=config.n_heads // 2)
        tokens = jax.random.randint(jax.random.key(1), (4, config.max_seq_len + 1), 0, config.vocab_size)
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
        ref_loss, ref = gradients(config, batch)
        for attention in ("xla", "cudnn") if platform == "gpu" else ("xla",):
            loss, grads = gradients(dataclasses.replace(config, attention=attention), batch)
            worst = max(float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) for a, b in zip(grads, ref))
            print(f"{name}: {attention} loss {loss:.6f} vs einsum {ref_loss:.6f}; worst gradient rel. error {worst:.2e}")
    if platform != "gpu":
        print(f"cudnn: not checked, it needs a GPU (backend: {platform})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
