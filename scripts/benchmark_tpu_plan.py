"""Large models on TPU v5p slices, planned with the real TPU compiler (`shardlib plan --topology`).

    python scripts/benchmark_tpu_plan.py [--rows llama-7b@v5p:4x4x4 ...] [--strategies zero3 hsdp fsdp_tp]
                                         [--cache-dir DIR] [--markdown]

Each row compiles the bf16 train step of a model for every chip of a TPU topology (libtpu on this
host; nothing runs, nothing is allocated) and prints what the compiled program says: peak HBM a
chip (XLA:TPU's buffer assignment, tiled layouts included) against the chip's 95 GiB, whether it
fits, persistent state a chip, collective bytes a chip sends per step by kind, the roofline MFU on
the v5p profile (`shardlib.tools.hardware`), and the compile time. One sequence a chip at the
model's full context. Compiles take minutes a row; the plan's compile cache makes a rerun quick.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

# model @ topology: 64 chips is a v5p-128 slice in Cloud TPU's names (which count TensorCores), 256 a v5p-512.
DEFAULT_ROWS = ("llama-7b@v5p:4x4x4", "llama-7b@v5p:4x8x8", "70b@v5p:4x8x8")
DEFAULT_STRATEGIES = ("zero3", "hsdp", "fsdp_tp")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=list(DEFAULT_ROWS), metavar="MODEL@TOPOLOGY")
    parser.add_argument("--strategies", nargs="+", default=list(DEFAULT_STRATEGIES))
    parser.add_argument("--cache-dir", help="where compiled candidates are kept (default: the plan's)")
    parser.add_argument("--markdown", action="store_true", help="print one markdown table at the end")
    args = parser.parse_args()

    from shardlib.runtime.devices import simulate_cpu_devices

    simulate_cpu_devices(1)
    import jax

    from shardlib.tools.plan import Planner
    from shardlib.tools.plan_cli import plan_cache_dir
    from shardlib.tools.plan_report import compiler_versions
    from shardlib.text import format_bytes

    cache_dir = plan_cache_dir(args.cache_dir)
    lines = []
    for row in args.rows:
        model, topology = row.split("@")
        planner = Planner(model, topology=topology, precision="bf16", cache_dir=cache_dir)
        for strategy in args.strategies:
            start = time.perf_counter()
            r = planner.candidate(strategy)
            wall = time.perf_counter() - start
            if r.error:
                line = f"| {model} | {topology} ({r.devices}) | {strategy} | error: {r.error[:120]} |"
            else:
                kinds = {k: v for k, v in r.collective_bytes.items() if v}
                line = (f"| {model} | {topology} ({r.devices}) | {strategy} | {r.mesh_text} | "
                        f"{format_bytes(r.peak_bytes)} | {'yes' if r.fits else 'no'} | "
                        f"{format_bytes(r.persistent_bytes)} | "
                        + ", ".join(f"{k} {format_bytes(v)}" for k, v in kinds.items())
                        + f" | {r.mfu:.0%} | {wall:.0f} s |")
                for note in r.notes:
                    print(f"  note ({model}, {topology}, {strategy}): {note}", flush=True)
            print(line, flush=True)
            lines.append(line)
    versions = compiler_versions("tpu")
    if args.markdown:
        print(f"\njax {versions['jax']}, libtpu {versions['libtpu']}, {jax.devices()[0].platform} host, bf16, "
              "one sequence a chip at the model's context")
        print("| model | topology (chips) | strategy | mesh | peak HBM a chip | fits 95 GiB | persistent a chip | "
              "collective bytes a chip per step | est. MFU | compile |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
