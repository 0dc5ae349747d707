"""Step time of shardlib's train step against a hand-written `jax.jit` step, per strategy.

The baseline is what a user would write without shardlib: ``jax.jit`` of ``value_and_grad`` of
the same model's loss plus the same optax update, with the same input/output shardings (taken
from shardlib's layout) and donation, and nothing else: plain GSPMD, no shard_map, no
non-finite skip, no grad-norm metric. Both programs run on the same simulated devices in one
process, interleaved (shardlib, baseline, shardlib, ...), so machine load hits both alike; the
reported ratio is the median of the per-repeat ratios shardlib / baseline (goal: <= 1.03).

Also printed per program: per-device peak bytes (XLA buffer assignment), collective bytes sent
per device per step (optimised HLO, ring volumes) and collectives run per step (loop trips
counted; what gradient buckets, ``build(bucket_bytes=)``, bring down).

  python scripts/benchmark.py                       # 7 strategies, "small" GPT, batch 32, 8 devices
  python scripts/benchmark.py --markdown            # a table for BENCHMARKS.md
  python scripts/benchmark.py --model tiny --repeats 1 --strategies dp zero3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import add_shape_arguments, load, machine  # noqa: E402

STRATEGIES = ("dp", "zero1", "zero2", "zero3", "tp", "fsdp_tp", "hsdp")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(parser)
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default: 8)")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per program (default: 7)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per program (default: 2)")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), metavar="S")
    parser.add_argument("--bucket-mb", type=float, default=None, metavar="MB",
                        help="shardlib's bucket_bytes in MiB (0: one collective per tensor; default: build's)")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table (for BENCHMARKS.md)")
    return parser.parse_args(argv)


def baseline_step(model: Any, tx: Any, program: Any, batch_sharding: Any) -> Any:
    """The hand-written step: jit(value_and_grad(loss) + optax update) with shardlib's shardings."""
    import jax
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from shardlib.step import TrainState

    def step(state: TrainState, batch: dict[str, jax.Array]):
        (loss, aux), grads = jax.value_and_grad(lambda p: model.loss(p, batch, None), has_aux=True)(state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return TrainState(state.step + 1, params, opt_state), {"loss": loss, **aux}

    replicated = NamedSharding(program.mesh, P())
    return jax.jit(step, in_shardings=(program.state_sharding, batch_sharding),
                   out_shardings=(program.state_sharding, replicated), donate_argnums=(0,))


def _figures(compiled: Any, n_devices: int) -> dict[str, int]:
    from shardlib.tools.hlo import collective_stats
    from shardlib.tools.memory import memory_stats, peak_bytes

    stats = collective_stats(compiled.as_text(), num_devices=n_devices)
    return {"peak": peak_bytes(memory_stats(compiled)), "comm": stats.total_bytes,
            "collectives": sum(stats.count_by_kind().values())}


def _time(fn: Any, state: Any, batch: Any) -> tuple[Any, float]:
    import jax

    start = time.perf_counter()
    state, metrics = fn(state, batch)
    jax.block_until_ready((state, metrics))
    return state, time.perf_counter() - start


def bench_strategy(name: str, args: argparse.Namespace, config: Any, model: Any, batch_np: dict) -> dict[str, Any]:
    """Compile both programs for one strategy, then time them interleaved."""
    import jax
    import optax

    from shardlib import build, make_layout, make_mesh
    from shardlib.tools.plan_candidates import default_mesh

    sizes = default_mesh(name, args.devices, config)
    mesh = make_mesh(sizes, devices=jax.devices()[: args.devices])
    layout = make_layout(model, name, mesh)
    tx = optax.adamw(1e-3)
    buckets = {} if args.bucket_mb is None else {"bucket_bytes": int(args.bucket_mb * 2**20)}
    program = build(model, tx, layout, **buckets)
    batch = jax.device_put(batch_np, layout.batch_sharding(batch_np))

    states = {"shardlib": program.init(jax.random.key(0)), "baseline": program.init(jax.random.key(0))}
    ours = program.step.lower(states["shardlib"], batch).compile()
    theirs = baseline_step(model, tx, program, layout.batch_sharding(batch_np)).lower(states["baseline"], batch).compile()
    fns = {"shardlib": ours, "baseline": theirs}
    times: dict[str, list[float]] = {"shardlib": [], "baseline": []}
    for repeat in range(args.warmup + args.repeats):
        for key in ("shardlib", "baseline") if repeat % 2 == 0 else ("baseline", "shardlib"):
            states[key], seconds = _time(fns[key], states[key], batch)
            if repeat >= args.warmup:
                times[key].append(seconds)
    ratios = [a / b for a, b in zip(times["shardlib"], times["baseline"])]
    return {
        "strategy": name,
        "mesh": ",".join(f"{k}={v}" for k, v in sizes.items() if v > 1),
        "shardlib_s": statistics.median(times["shardlib"]),
        "baseline_s": statistics.median(times["baseline"]),
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        **{f"shardlib_{k}": v for k, v in _figures(ours, args.devices).items()},
        **{f"baseline_{k}": v for k, v in _figures(theirs, args.devices).items()},
    }


def render(rows: Sequence[dict[str, Any]], markdown: bool) -> str:
    from shardlib.tools.report import format_bytes, format_markdown, format_table

    table = [{
        "strategy": r["strategy"], "mesh": r["mesh"],
        "shardlib s/step": f"{r['shardlib_s']:.3f}", "jit s/step": f"{r['baseline_s']:.3f}",
        "ratio (median)": f"{r['ratio']:.3f}", "ratio range": f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}",
        "shardlib peak/dev": format_bytes(r["shardlib_peak"]), "jit peak/dev": format_bytes(r["baseline_peak"]),
        "shardlib comm/step": format_bytes(r["shardlib_comm"]), "jit comm/step": format_bytes(r["baseline_comm"]),
        "shardlib collectives/step": r["shardlib_collectives"], "jit collectives/step": r["baseline_collectives"],
    } for r in rows]
    return format_markdown(table) if markdown else format_table(table)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from shardlib.tools.plan_candidates import check_strategy, setup_devices

    setup_devices(args.devices)
    import jax
    import numpy as np

    from shardlib.models import get_config, trainable
    from shardlib.step.reduce import DEFAULT_BUCKET_BYTES

    names = [check_strategy(s) for s in args.strategies]
    if len(jax.devices()) < args.devices:
        raise SystemExit(f"benchmark: needs {args.devices} devices, the backend has {len(jax.devices())}")
    config = get_config(args.model)
    seq_len = args.seq_len or config.max_seq_len
    model = trainable(config)
    bucket_mb = DEFAULT_BUCKET_BYTES / 2**20 if args.bucket_mb is None else args.bucket_mb
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab_size, size=(args.batch_size, seq_len + 1), dtype=np.int32)
    batch_np = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    print(f"# {args.model} GPT, global batch {args.batch_size} x {seq_len} tokens, {args.repeats} timed steps "
          f"per program after {args.warmup} warm-up; shardlib buckets {bucket_mb:g} MiB; {machine()}", flush=True)
    rows = []
    for name in names:
        rows.append(bench_strategy(name, args, config, model, batch_np))
        if not args.markdown:
            print(f"  {name}: ratio {rows[-1]['ratio']:.3f}", flush=True)
    print(f"# at the end: {load()}")
    print(render(rows, args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
