"""CP memory against C with the balance ratio: the table in BENCHMARKS.md.

For C = 1, 2, 4, 8 context devices (simulated CPU devices, one sequence of ``--seq-len`` tokens,
a GPT small enough that attention's [T x T] scores dominate one device's temporaries), compile
the train step and print per device:

* temporaries: ``memory_analysis().temp_size_in_bytes`` of the compiled step;
* ring bytes: the collective-permute bytes the compiled HLO sends per step
  (`shardlib.tools.hlo.collective_stats`), against `ring_bytes_formula` (docs/context-parallel.md);
* balance: the attention FLOPs of the busiest device over the mean, from the chunk schedule the
  ring runs (`shardlib.model.attention.block_flops`), balanced and contiguous.

    python scripts/benchmark_context.py [--seq-len 2048]

``--lengths 4096,8192,16384,32768`` instead prints, at C = 4 (balanced ring), the temporaries and
the compiled FLOPs a device (XLA's ``cost_analysis``, which counts a ``while`` body once: the
key-block loop's FLOPs are under-counted) against the sequence length, and the dense
``[T/C x T/C]`` f32 scores of one hop that the ring held before its keys were blocked
(`shardlib.model.flash.KEY_BLOCK`).
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dataclasses  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from shardlib import build, make_layout, make_mesh  # noqa: E402
from shardlib.model import attention as attention_lib  # noqa: E402
from shardlib.model import flash as flash_lib  # noqa: E402
from shardlib.models import GPTConfig, trainable  # noqa: E402
from shardlib.tools.flops import flops_per_step  # noqa: E402
from shardlib.tools.hlo import collective_stats  # noqa: E402


def ring_bytes_formula(config: GPTConfig, seq_len: int, size: int) -> float:
    """Bytes one device sends per step in the ring, float32: per layer, K and V travel C-1 hops
    forward and again in the backward pass (2(C-1)/C of K+V each way), and their gradients C hops
    home (the whole of K and of V). The rematerialised forward reuses the ring's saved residuals
    (q, k, v, out, logsumexp), so it sends nothing."""
    kv = seq_len * config.n_kv_heads * config.head_dim * 4  # one of K, V: the whole sequence, bytes
    per_layer = 2 * 2 * (size - 1) / size * kv + (2 * kv if size > 1 else 0)
    return config.n_layers * per_layer


def compile_step(config: GPTConfig, seq_len: int, size: int, balanced: bool):
    model = trainable(config)
    layout = make_layout(model, "dp", make_mesh({"context": size}, devices=jax.devices()[:size]))
    layout = dataclasses.replace(layout, context_balance=balanced, context_attention="ring")
    program = build(model, optax.sgd(0.1), layout)
    batch = program.abstract_batch({k: ((1, seq_len), np.int32) for k in ("inputs", "targets")})
    return program.compile_step(program.abstract_state(), batch)


def measure(config: GPTConfig, seq_len: int, size: int, balanced: bool) -> tuple[int, float]:
    compiled = compile_step(config, seq_len, size, balanced)
    permutes = sum(r.bytes_per_step for r in collective_stats(compiled).records if r.kind == "collective-permute")
    return compiled.memory_analysis().temp_size_in_bytes, permutes


def lengths_table(lengths: list[int], size: int = 4) -> None:
    config = GPTConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, d_ff=128, max_seq_len=max(lengths))
    print(f"GPT d_model={config.d_model} layers={config.n_layers} heads={config.n_heads}, one sequence, "
          f"context={size} (balanced ring), float32, tiles {flash_lib.QUERY_BLOCK} x {flash_lib.KEY_BLOCK}")
    print("| T | temporaries / device | x (vs previous T) | compiled GFLOPs / device | one hop's dense scores |")
    print("|---|---|---|---|---|")
    previous = None
    for seq_len in lengths:
        compiled = compile_step(config, seq_len, size, balanced=True)
        temp = compiled.memory_analysis().temp_size_in_bytes
        flops = flops_per_step(compiled) or float("nan")
        dense = (seq_len // size) ** 2 * config.n_heads * 4
        growth = f"{temp / previous:.2f}" if previous else "-"
        print(f"| {seq_len} | {temp / 2**20:.1f} MiB | {growth} | {flops / 1e9:.1f} | {dense / 2**20:.0f} MiB |", flush=True)
        previous = temp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--lengths", help="comma-separated sequence lengths: memory and FLOPs against T at C=4")
    args = parser.parse_args()
    if args.lengths:
        return lengths_table([int(n) for n in args.lengths.split(",")])
    config = GPTConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, d_ff=128, max_seq_len=args.seq_len)
    print(f"GPT d_model={config.d_model} layers={config.n_layers} heads={config.n_heads}, one sequence of "
          f"T={args.seq_len}, ring attention, float32")
    print("| C | temporaries / device | x C (vs C=1) | ring bytes / step / device (HLO) | formula | "
          "balance, balanced | balance, contiguous |")
    print("|---|---|---|---|---|---|---|")
    base = None
    for size in (1, 2, 4, 8):
        temp, sent = measure(config, args.seq_len, size, balanced=True)
        base = base or temp
        ratio = lambda balanced: max(f := attention_lib.block_flops(size, balanced=balanced)) / np.mean(f)
        print(f"| {size} | {temp / 2**20:.1f} MiB | {temp * size / base:.2f} | {sent / 2**20:.2f} MiB | "
              f"{ring_bytes_formula(config, args.seq_len, size) / 2**20:.2f} MiB | {ratio(True):.2f} | {ratio(False):.2f} |")


if __name__ == "__main__":
    main()
