"""LoRA against full fine-tuning under zero3 on 8 simulated CPU devices: step time (the minimum of
several timed steps, as a ratio measured in the same process), state bytes a device, and the bytes
one device sends per step.

    python scripts/benchmark_lora.py [--model small] [--rank 8] [--steps 8] [--precision bf16]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="small")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--precision", default="bf16")
    args = parser.parse_args()

    from shardlib.runtime.devices import simulate_cpu_devices

    simulate_cpu_devices(8)
    import jax
    import numpy as np
    import optax

    from shardlib import build, make_layout, make_mesh
    from shardlib.models import get_config, trainable
    from shardlib.models.configs import LoraConfig, lora_param_count, param_count
    from shardlib.tools.hlo import collective_stats

    base = get_config(args.model)
    seq = base.max_seq_len
    rows = np.random.RandomState(0).randint(0, base.vocab_size, (args.batch_size, seq + 1)).astype(np.int32)
    batch = {"inputs": rows[:, :-1], "targets": rows[:, 1:]}
    results = {}
    for name, lora in (("full", None), (f"LoRA r{args.rank}", LoraConfig(rank=args.rank))):
        config = dataclasses.replace(base, lora=lora)
        model = trainable(config)
        program = build(model, optax.adamw(1e-3), make_layout(model, "zero3", make_mesh({"fsdp": 8})),
                        precision=args.precision)
        state = program.init(jax.random.key(0))
        compiled = program.step.lower(state, batch).compile()
        sent = sum(r.bytes_per_step for r in collective_stats(compiled).records)
        state_bytes = sum(x.nbytes for x in jax.tree.leaves((state.params, state.opt_state))) / 8
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            state, metrics = program.step(state, batch)
            jax.block_until_ready(metrics["loss"])
            times.append(time.perf_counter() - start)
        trained = lora_param_count(config) if lora else param_count(config)
        results[name] = (min(times[1:]), state_bytes, sent, trained)
    full = results["full"]
    print(f"model {args.model} ({param_count(base):,} params), zero3 fsdp=8, {args.precision}, batch "
          f"{args.batch_size} x {seq}")
    print("| run | trains | step s (min) | state a device MiB | sent a step MiB |")
    print("|---|---|---|---|---|")
    for name, (step, state_bytes, sent, trained) in results.items():
        print(f"| {name} | {trained:,} | {step:.4f} | {state_bytes / 2**20:.2f} | {sent / 2**20:.2f} |")
    lora = results[f"LoRA r{args.rank}"]
    print(f"LoRA / full: step {lora[0] / full[0]:.2f}x, state {lora[1] / full[1]:.2f}x, sent {lora[2] / full[2]:.2f}x")


if __name__ == "__main__":
    main()
