"""MoE balance over training with the load-balancing (aux) loss on and off, as a markdown table.

Trains `moe-tiny` (4 experts, top-1, capacity factor 2) on the bundled text with its experts over
``expert=4`` simulated CPU devices, once with ``aux_loss_coef`` 0.01 (the config's), 1.0 and 0,
and prints, per window of steps, the busiest expert's tokens over the mean (worst layer), the
coefficient of variation of the tokens per expert, the assignments dropped at capacity, and the
aux loss (1.0 is a perfectly even router). Run: ``python scripts/benchmark_moe.py [--steps N]``.

``--dispatch`` instead compiles one MoE layer's forward pass on one row of T = 4k-32k tokens at a
Mixtral-like shape (8 experts, top-2) and a DeepSeek-like one (256 experts, top-8), both with
capacity factor 1.25, their experts' d_ff and a small d_model (the fraction does not depend on
it: both costs scale with it), in two ways: GShard's one-hot dispatch (before, written
in tests/test_moe.py) and the sort-based one (`models.moe`, after). Per row: the temporaries, and the dispatch
cost as a fraction of the experts' FLOPs, both from the compiled programs: (layer - experts alone
on the same ``[E, capacity, d]`` buffer) / experts alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


def dispatch_table(lengths: list[int]) -> str:
    import jax
    from flax import nnx

    from shardlib.models import MoEConfig
    from shardlib.models.moe import MoE
    from shardlib.tools.flops import flops_per_step
    from tests.test_moe import _gshard_reference as gshard_reference  # the one-hot formulas (before)

    # (experts, top_k, d_ff): Mixtral-8x7B's experts, DeepSeek-V3's routed experts
    shapes = {"Mixtral-like (E=8, k=2, d_ff=14336)": (8, 2, 14336), "DeepSeek-like (E=256, k=8, d_ff=2048)": (256, 8, 2048)}
    lines = ["| shape | T | temporaries, one-hot | sorted | dispatch / expert FLOPs, one-hot | sorted |",
             "|---|---|---|---|---|---|"]
    for name, (e, k, d_ff) in shapes.items():
        for seq in lengths:
            config = MoEConfig(vocab_size=256, d_model=64, n_layers=1, n_heads=4, d_ff=d_ff, max_seq_len=seq,
                               n_experts=e, top_k=k)
            with nnx.use_eager_sharding(False):
                layer = MoE(config, rngs=nnx.Rngs(0))
            x = jax.ShapeDtypeStruct((1, seq, config.d_model), "float32")
            slots = jax.ShapeDtypeStruct((e, config.capacity(seq), config.d_model), "float32")
            experts = flops_per_step(jax.jit(layer.experts).lower(slots).compile())
            row = []
            for run in (lambda x: gshard_reference(layer, x)[0], lambda x: layer(x)[0]):
                compiled = jax.jit(run).lower(x).compile()
                row.append((compiled.memory_analysis().temp_size_in_bytes, flops_per_step(compiled) / experts - 1))
            lines.append(f"| {name} | {seq} | {row[0][0] / 2**20:.0f} MiB | {row[1][0] / 2**20:.1f} MiB | "
                         f"{row[0][1]:.0%} | {row[1][1]:.0%} |")
            print(lines[-1], flush=True)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dispatch", action="store_true", help="dispatch memory and FLOPs against T, before/after")
    parser.add_argument("--lengths", default="4096,8192,16384,32768")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--window", type=int, default=50)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=32)
    args = parser.parse_args()
    if args.dispatch:
        return print(dispatch_table([int(n) for n in args.lengths.split(",")]))
    runs = {coef: balance(coef, args.steps, args.batch, args.seq) for coef in (1.0, 0.01, 0.0)}
    print(table(runs, args.window))


if __name__ == "__main__":
    main()
