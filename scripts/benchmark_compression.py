"""Gradient compression and mixed precision: bytes on the wire, loss reached, step-time ratio.

    python scripts/benchmark_compression.py [--steps 100] [--markdown]

Trains the tiny GPT with dp on 8 simulated devices for each gradient compression (none, bf16,
int8) and precision (f32, bf16), all in one process, and prints the gradient-reduction bytes per
step (pre-optimisation HLO: XLA:CPU upcasts bf16 collectives to float32 when it optimises; GPU
and TPU keep them), the final loss, and the median step time relative to the uncompressed f32 run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import numpy as np
    import optax

    from shardlib.models import get_config, trainable
    from shardlib import build, make_layout, make_mesh
    from shardlib.runtime.data import ByteBatches, load_text
    from shardlib.tools.report import collective_stats, format_bytes, format_markdown, format_table

    config = get_config("tiny")
    corpus = np.frombuffer(load_text(None), np.uint8)
    source = ByteBatches(corpus, args.batch_size, 32, seed=0, process_index=0, process_count=1)
    batches = [source.batch(step) for step in range(args.steps)]
    mesh = make_mesh({"data": 8})
    runs = [("none", "f32"), ("bf16", "f32"), ("int8", "f32"), ("none", "bf16")]
    rows, reference = [], None
    for compression, precision in runs:
        model_config = dataclasses.replace(config, compute_dtype="bfloat16" if precision == "bf16" else "float32")
        model = trainable(model_config)
        program = build(model, optax.adamw(3e-3), make_layout(model, "dp", mesh),
                        precision=precision, grad_compression=compression)
        shapes = {k: ((args.batch_size, 32), jnp.int32) for k in ("inputs", "targets")}
        lowered = program.step.lower(program.abstract_state(), program.abstract_batch(shapes))
        wire = collective_stats(lowered).total_bytes
        state = program.init(jax.random.key(0))
        times, losses = [], []
        for rows_ in batches:
            start = time.perf_counter()
            state, metrics = program.step(state, rows_)
            losses.append(float(metrics["loss"]))  # blocks: the step time includes the step
            times.append(time.perf_counter() - start)
        step_time = statistics.median(times[5:])
        reference = reference or (wire, step_time, np.mean(losses[-10:]))
        rows.append({
            "compression": compression, "precision": precision,
            "bytes/step": format_bytes(wire), "bytes vs f32": f"{wire / reference[0]:.3f}",
            "loss (last 10)": f"{np.mean(losses[-10:]):.4f}",
            "loss vs f32": f"{np.mean(losses[-10:]) / reference[2]:.4f}",
            "step time vs f32": f"{step_time / reference[1]:.2f}",
        })
    print(format_markdown(rows) if args.markdown else format_table(rows))


if __name__ == "__main__":
    main()
