"""MoE balance over training with the load-balancing (aux) loss on and off, as a markdown table.

Trains `moe-tiny` (4 experts, top-1, capacity factor 2) on the bundled text with its experts over
``expert=4`` simulated CPU devices, once with ``aux_loss_coef`` 0.01 (the config's), 1.0 and 0,
and prints, per window of steps, the busiest expert's tokens over the mean (worst layer), the
coefficient of variation of the tokens per expert, the assignments dropped at capacity, and the
aux loss (1.0 is a perfectly even router). Run: ``python scripts/benchmark_moe.py [--steps N]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def balance(aux_loss_coef: float, steps: int, batch: int, seq: int) -> list[dict[str, float]]:
    import jax
    import numpy as np
    import optax

    from shardlib import build, make_layout, make_mesh
    from shardlib.models import get_config, trainable
    from shardlib.runtime.data import ByteBatches, load_text

    config = dataclasses.replace(get_config("moe-tiny"), aux_loss_coef=aux_loss_coef, capacity_factor=2.0)
    model = trainable(config)
    program = build(model, optax.adam(3e-3), make_layout(model, "dp", make_mesh("expert=4", devices=jax.devices()[:4])))
    source = ByteBatches(np.frombuffer(load_text(None), np.uint8), batch, seq, seed=0, process_index=0, process_count=1)
    state, out = program.init(jax.random.key(0)), []
    for step in range(steps):
        state, metrics = program.step(state, source.batch(step))
        out.append({k: float(v) for k, v in metrics.items()})
    return out


def table(runs: dict[float, list[dict[str, float]]], window: int) -> str:
    keys = ("expert_max_over_mean", "expert_cv", "tokens_dropped", "aux_loss", "ce_loss")
    lines = ["| aux coef | steps | max/mean | CV | dropped / step | aux loss | CE loss |",
             "|---|---|---|---|---|---|---|"]
    for coef, records in runs.items():
        for start in range(0, len(records), window):
            chunk = records[start:start + window]
            mean = {k: sum(r[k] for r in chunk) / len(chunk) for k in keys}
            lines.append(f"| {coef:g} | {start + 1}-{start + len(chunk)} | {mean['expert_max_over_mean']:.2f} | "
                         f"{mean['expert_cv']:.3f} | {mean['tokens_dropped']:.0f} | {mean['aux_loss']:.3f} | "
                         f"{mean['ce_loss']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--window", type=int, default=50)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=32)
    args = parser.parse_args()
    runs = {coef: balance(coef, args.steps, args.batch, args.seq) for coef in (1.0, 0.01, 0.0)}
    print(table(runs, args.window))


if __name__ == "__main__":
    main()
