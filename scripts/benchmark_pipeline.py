"""Pipeline parallelism: step time over the unpipelined step, and the measured vs theoretical bubble.

    python scripts/benchmark_pipeline.py [--model small] [--stages 2] [--markdown]

All in one process on 8 devices (simulated CPU devices when there is no accelerator), dp over
the devices a pipeline does not use, AdamW, the same global batch for the ratio:

* ratio: median step time of ``pipe=S`` with M microbatches over the unpipelined dp step.
* bubble: with a fixed microbatch size a pipelined step takes ``fixed + M x tick``, where the
  slope of step time over M is one steady tick (one microbatch's forward and backward on every
  stage, the head on the last, the embedding gradient on the first). The intercept ``fixed``
  holds the bubble slots plus the once-per-step work (optimizer update, the embedding/head
  gradient sum over ``pipe``). On real devices a bubble slot is idle time on the critical path,
  S - 1 ticks in all. Simulated CPU devices share the cores, so there the step time is the
  total work of all devices, and a bubble slot (a forward only or a backward only, with no head)
  costs less than a steady tick: ``fixed / tick`` below S - 1 is possible on CPU.

On simulated CPU devices the stages share two cores, so a pipeline cannot be faster than one
device doing everything; the ratio there shows overhead, not speed-up. Per-device bytes and the
collective-permute bytes are machine-independent.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--rows", type=int, default=1, help="rows per microbatch per data-parallel device")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per configuration (after one warm-up)")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()

    import jax

    jax.config.update("jax_num_cpu_devices", 8)  # CPU only: simulated devices when there is no accelerator
    import numpy as np
    import optax

    from shardlib.models import get_config, trainable
    from shardlib import build, make_layout, make_mesh
    from shardlib.step import pipeline
    from shardlib.tools import report
    from shardlib.runtime.data import ByteBatches, load_text

    model = trainable(get_config(args.model))
    devices = jax.devices()[:8]
    corpus = np.frombuffer(load_text(None), np.uint8)
    S = args.stages
    data = len(devices) // S

    def timed(sizes, microbatches, rows, schedule="1f1b"):
        mesh = make_mesh(sizes, devices=devices)
        layout = make_layout(model, "dp", mesh)
        pipelined = layout.pipeline_stages > 1
        program = build(model, optax.adamw(1e-3), layout, microbatches=microbatches if pipelined else None,
                        schedule=schedule)
        source = ByteBatches(corpus, rows, args.seq_len, seed=0, process_index=0, process_count=1)
        batch = {k: jax.device_put(v, s) for (k, v), s in zip(source.batch(0).items(),
                                                               layout.batch_sharding(source.batch(0)).values())}
        compiled = program.compile_step(program.abstract_state(), batch)
        state = program.init(jax.random.key(0))
        times = []
        for i in range(args.steps + 1):
            start = time.perf_counter()
            state, metrics = compiled(state, batch)
            jax.block_until_ready(metrics["loss"])
            if i:
                times.append(time.perf_counter() - start)
        stats = report.collective_stats(compiled)
        return statistics.median(times), report.memory_stats(compiled), stats.bytes_by_kind()["collective-permute"]

    rows = []
    ticks = {}
    for schedule in ("1f1b", "gpipe"):
        for m in args.microbatches:
            batch_rows = args.rows * m * data
            t_pipe, mem, permute = timed({"pipe": S, "data": data}, m, batch_rows, schedule)
            t_flat, flat_mem, _ = timed({"data": len(devices)}, None, batch_rows)
            ticks[(schedule, m)] = t_pipe
            rows.append({"schedule": schedule, "M": m, "global batch": batch_rows,
                         "pipe step ms": t_pipe * 1e3, "dp step ms": t_flat * 1e3, "ratio": t_pipe / t_flat,
                         "bubble (theory)": f"{pipeline.bubble_fraction(S, m):.1%}",
                         "params+opt / device": report.format_bytes(mem.argument_bytes),
                         "dp params+opt": report.format_bytes(flat_mem.argument_bytes),
                         "temp / device": report.format_bytes(mem.temp_bytes),
                         "permute / step": report.format_bytes(permute)})
    for schedule in ("1f1b", "gpipe"):
        ms = np.array(args.microbatches, float)
        ts = np.array([ticks[(schedule, m)] for m in args.microbatches])
        slope, intercept = np.polyfit(ms, ts, 1)
        for row in rows:
            if row["schedule"] == schedule:
                m = row["M"]
                row["fixed / tick"] = f"{intercept / slope:.2f} (bubble: {S - 1} on devices)"
                row["fixed part"] = f"{intercept / ticks[(schedule, m)]:.1%}"
    columns = ["schedule", "M", "global batch", "pipe step ms", "dp step ms", "ratio", "bubble (theory)",
               "fixed / tick", "fixed part", "params+opt / device", "dp params+opt", "temp / device", "permute / step"]
    device = devices[0]
    print(f"{args.model}, pipe={S} x data={data} vs data={len(devices)}, {len(devices)} x {device.platform} "
          f"({device.device_kind}), seq {args.seq_len}, {args.rows} row(s) per microbatch per replica")
    print(report.format_markdown(rows, columns) if args.markdown else report.format_table(rows, columns))


if __name__ == "__main__":
    main()
