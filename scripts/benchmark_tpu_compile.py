"""How long XLA:TPU takes to compile a one-layer bf16 GPT's zero3 step, by model width (issue 43 §2).

    python scripts/benchmark_tpu_compile.py [--seq-len 8192] [--topology v5p:2x2x2] [--repeats 1]

Compiles (libtpu on this host; nothing runs) the step of
`tests/test_tpu_compile.py::test_tpu_bf16_attention_at_8192_tokens_on_v5p_is_the_kernel_in_linear_memory`
(one row a chip, the splash kernel's forward, shardlib's tiled backward) at the width that test had
(d_model 256, 2 heads of 128, d_ff 512, vocabulary 256) and at the one it has (1 head of 128,
d_ff and vocabulary 128), and the flash backward loop alone on one chip. Prints this process's CPU
seconds per compile (the minimum over ``--repeats``; ``jax.clear_caches()`` between) and ratios.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WIDTHS = {"wide (2 heads, d_ff 512, vocab 256)": (2, 512, 256), "narrow (1 head, d_ff 128, vocab 128)": (1, 128, 128)}


def cpu_seconds(lower, repeats: int) -> float:
    import jax

    best = float("inf")
    for _ in range(repeats):
        jax.clear_caches()
        start = time.process_time()
        lower().compile()
        best = min(best, time.process_time() - start)
    return best


def step(chips, seq: int, heads: int, d_ff: int, vocab: int):
    import jax.numpy as jnp

    from shardlib import build, make_layout, make_mesh
    from shardlib.models import GPTConfig, trainable
    from shardlib.step.precision import get_precision
    from tests.helpers import optimizer

    config = GPTConfig(vocab_size=vocab, d_model=heads * 128, n_layers=1, n_heads=heads, d_ff=d_ff,
                       max_seq_len=seq, compute_dtype="bfloat16")
    model = trainable(config)
    prog = build(model, optimizer(), make_layout(model, "zero3", make_mesh({"fsdp": len(chips)}, devices=chips)),
                 precision=get_precision("bf16"))
    shape = ((len(chips), seq), jnp.int32)
    return lambda: prog.step.lower(prog.abstract_state(), prog.abstract_batch({"inputs": shape, "targets": shape}))


def flash_backward(chip, seq: int):
    """The tiled flash backward (`shardlib.model.flash.unfold`) alone: 2 heads of 128, causal."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from shardlib.model import flash

    def sds(*shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(chip))

    def run(q, k, v, do, lse, delta):
        pos = jnp.arange(seq)
        return flash.unfold(q, k, v, flash.Mask(pos, pos, True), do, lse, delta)

    q, k, stat = sds(1, 2, 1, seq, 128), sds(1, 2, seq, 128), sds(1, 2, 1, seq, dtype=jnp.float32)
    return lambda: jax.jit(run).trace(q, k, k, q, stat, stat).lower()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--topology", default="v5p:2x2x2")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    from shardlib.runtime.devices import topology_devices

    chips = topology_devices(args.topology)
    base = None
    for name, (heads, d_ff, vocab) in WIDTHS.items():
        seconds = cpu_seconds(step(chips, args.seq_len, heads, d_ff, vocab), args.repeats)
        base = base or seconds
        print(f"step {name} at {args.seq_len} tokens: {seconds:.1f} CPU s ({seconds / base:.2f}x)", flush=True)
    seconds = cpu_seconds(flash_backward(chips[0], args.seq_len), args.repeats)
    print(f"flash backward loop alone at {args.seq_len} tokens: {seconds:.1f} CPU s ({seconds / base:.3f}x)", flush=True)


if __name__ == "__main__":
    main()
