"""ZeRO++ under zero3: qwZ (int8 weight gather) and qgZ (int8 gradient reduce-scatter) against
plain zero3, over several seeds: loss reached and bytes sent per step.

    python scripts/benchmark_zeropp.py [--model small] [--steps 100] [--seeds 3] [--markdown]

Trains the GPT preset with zero3 on 8 simulated devices (fsdp=8) for each variant and seed, all
in one process, and prints the mean loss of the last 10 steps, its relative difference from
zero3 of the same seed, and the all-gather and gradient reduce-scatter bytes one device sends
per step (optimised HLO, loop trip counts included; qgZ's reduce-scatter is an all-to-all of
int8 blocks and scales).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_common import add_shape_arguments, machine  # noqa: E402

VARIANTS = {  # name -> build options
    "zero3": {},
    "zero3 + qwZ": {"weight_gather": "int8"},
    "zero3 + qgZ": {"grad_compression": "int8"},
    "zero3 + qwZ + qgZ": {"weight_gather": "int8", "grad_compression": "int8"},
}


def _runs(model, layout, options, seeded_batches):
    """Per seed (mean loss of the last 10 steps, gather bytes, gradient bytes) of one variant;
    the step is compiled once and run for every seed."""
    import jax
    import numpy as np
    import optax

    from shardlib import build
    from shardlib.tools.hlo import collective_stats

    program = build(model, optax.adamw(3e-3), layout, **options)
    compiled = program.compile_step(program.init(jax.random.key(0)), seeded_batches[0][0])
    sent = collective_stats(compiled).bytes_by_kind()
    out = []
    for seed, batches in enumerate(seeded_batches):
        state, losses = program.init(jax.random.key(seed)), []
        for rows in batches:
            state, metrics = compiled(state, rows)
            losses.append(float(metrics["loss"]))
        out.append((float(np.mean(losses[-10:])), sent["all-gather"], sent["reduce-scatter"] + sent["all-to-all"]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(parser)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np

    from shardlib import make_layout, make_mesh
    from shardlib.models import get_config, trainable
    from shardlib.runtime.data import ByteBatches, load_text
    from shardlib.tools.report import format_bytes, format_markdown, format_table

    config = get_config(args.model)
    seq = args.seq_len or config.max_seq_len
    model = trainable(config)
    layout = make_layout(model, "zero3", make_mesh({"fsdp": 8}))
    corpus = np.frombuffer(load_text(None), np.uint8)
    sources = [ByteBatches(corpus, args.batch_size, seq, seed=seed, process_index=0, process_count=1)
               for seed in range(args.seeds)]
    seeded_batches = [[source.batch(step) for step in range(args.steps)] for source in sources]
    results = {name: _runs(model, layout, options, seeded_batches) for name, options in VARIANTS.items()}
    base = results["zero3"]
    rows = []
    for name, runs in results.items():
        rel = [run[0] / ref[0] - 1 for run, ref in zip(runs, base)]
        rows.append({
            "variant": name, "loss per seed": " / ".join(f"{r[0]:.4f}" for r in runs),
            "rel. diff vs zero3 (max abs)": f"{max(abs(r) for r in rel):.2%}",
            "all-gather/step": f"{format_bytes(runs[0][1])} ({runs[0][1] / base[0][1]:.3f}x)",
            "grad reduce-scatter/step": f"{format_bytes(runs[0][2])} ({runs[0][2] / base[0][2]:.3f}x)",
        })
    print(format_markdown(rows) if args.markdown else format_table(rows))
    print(f"\n{args.model}, batch {args.batch_size} x {seq}, {args.steps} steps, seeds 0..{args.seeds - 1}, "
          f"adamw(3e-3), fsdp=8; loss = mean of the last 10 steps; {machine()}")


if __name__ == "__main__":
    main()
