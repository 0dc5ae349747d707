"""How long a checkpoint save blocks the training loop: async vs synchronous, same state, one run.

    python scripts/benchmark_checkpoint.py [--model small] [--strategy zero3] [--repeats 5]

Both Checkpointers save the same TrainState (8 simulated CPU devices unless an accelerator is
present). For each repeat, in alternating order: the time ``save`` takes to return (what the
loop waits for), and for the async one also the time until the write has committed
(``wait``). Prints medians and the ratio sync / async of the blocking time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--strategy", default="zero3")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cpu-devices", type=int, default=8)
    args = parser.parse_args()

    from shardlib.run.train import setup_devices

    setup_devices(args.cpu_devices)
    import jax

    from shardlib.models import get_config, param_count, trainable
    from shardlib import build, get_strategy, make_layout, make_mesh
    from shardlib.runtime.checkpoint import Checkpointer
    from shardlib.tools.report import format_bytes, format_markdown
    from shardlib.run.setup import lr_schedule, optimizer
    from shardlib.run.train import TrainConfig

    config = TrainConfig(model=args.model, strategy=args.strategy)
    model = trainable(get_config(args.model))
    mesh = make_mesh(dict(get_strategy(args.strategy).default_mesh))
    program = build(model, optimizer(config, model, lr_schedule(config)), make_layout(model, args.strategy, mesh))
    state = program.init(jax.random.key(0))
    jax.block_until_ready(state)
    n_bytes = sum(x.nbytes for x in jax.tree.leaves(state))

    blocking: dict[str, list[float]] = {"async": [], "sync": []}
    commit: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        managers = {mode: Checkpointer(Path(tmp) / mode, keep=2, async_save=mode == "async") for mode in blocking}
        for step in range(args.repeats + 1):  # step 0 warms up both (first-save setup, compiles)
            order = ("async", "sync") if step % 2 else ("sync", "async")
            for mode in order:
                ckpt = managers[mode]
                t0 = time.perf_counter()
                ckpt.save(step, state, data_state={"step": step, "seed": 0}, config={"model": args.model}, force=True)
                t1 = time.perf_counter()
                ckpt.wait()
                t2 = time.perf_counter()
                if step:
                    blocking[mode].append(t1 - t0)
                    if mode == "async":
                        commit.append(t2 - t0)
        for ckpt in managers.values():
            ckpt.close()

    med = {mode: statistics.median(times) for mode, times in blocking.items()}
    print(f"model {args.model} ({param_count(get_config(args.model)) / 1e6:.2f}M params), {args.strategy} on "
          f"{len(jax.devices())} {jax.default_backend()} devices, state {format_bytes(n_bytes)}, "
          f"{args.repeats} saves each (median)")
    print(format_markdown([{"save": "synchronous", "blocks the loop (s)": med["sync"], "until committed (s)": med["sync"]},
                           {"save": "async", "blocks the loop (s)": med["async"],
                            "until committed (s)": statistics.median(commit)}]))
    print(f"ratio sync / async blocking time: {med['sync'] / med['async']:.1f}x")


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
