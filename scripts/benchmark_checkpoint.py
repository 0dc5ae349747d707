"""How long a checkpoint save blocks the training loop, and what the integrity digests cost.

    python scripts/benchmark_checkpoint.py [--model small] [--strategy zero3] [--repeats 5]
    python scripts/benchmark_checkpoint.py --model 1b --digest-only [--params-only]

Saves (default): three Checkpointers save the same TrainState (8 simulated CPU devices unless an
accelerator is present): synchronous, async, and async with the digests switched off. For each
repeat, in rotating order: the time ``save`` takes to return (what the loop waits for), and for
the async ones the time until the write has committed (``wait``). Then the restore of the last
step, and the part of it spent verifying the digests. Prints medians.

``--digest-only`` measures only the digests of the state (no save), for a model whose state and
its host copy would not both fit in memory: the time to dispatch them (what ``save`` adds to
the loop) and the time until they are computed (device work, read in Orbax's background thread).
``--params-only`` digests the parameters alone (initialised without the optimizer state).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _digest_timing(state, repeats: int) -> tuple[float, float, float]:
    """(seconds of the first digest, compile included; median dispatch seconds, median seconds
    until the digests are on the host)."""
    from shardlib.runtime.checkpoint_digests import digest_arrays, digest_hex

    t0 = time.perf_counter()
    digest_hex(*digest_arrays(state))  # compiles: what a run's first save adds once
    first = time.perf_counter() - t0
    dispatch, total = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        paths, digests = digest_arrays(state)
        t1 = time.perf_counter()
        digest_hex(paths, digests)
        t2 = time.perf_counter()
        dispatch.append(t1 - t0)
        total.append(t2 - t0)
    return first, statistics.median(dispatch), statistics.median(total)


@contextlib.contextmanager
def _digests_off():
    """Save without array digests (the baseline); such a checkpoint is for timing only."""
    from shardlib.runtime import checkpoint_digests

    real = checkpoint_digests.digest_arrays
    checkpoint_digests.digest_arrays = lambda tree: ([], None)
    try:
        yield
    finally:
        checkpoint_digests.digest_arrays = real


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--strategy", default="zero3")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cpu-devices", type=int, default=8)
    parser.add_argument("--digest-only", action="store_true", help="time the digests only, no save")
    parser.add_argument("--params-only", action="store_true", help="with --digest-only: the parameters alone")
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
    if args.digest_only and args.params_only:
        shardings = jax.tree.map(lambda a: a.sharding, program.abstract_state().params)
        state = {"params": jax.jit(model.init, out_shardings=shardings)(jax.random.key(0))}
    else:
        state = program.init(jax.random.key(0))
    jax.block_until_ready(state)
    n_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    what = "parameters" if args.digest_only and args.params_only else "state"
    head = (f"model {args.model} ({param_count(get_config(args.model)) / 1e6:.2f}M params), {args.strategy} on "
            f"{len(jax.devices())} {jax.default_backend()} devices, {what} {format_bytes(n_bytes)} "
            f"in {len(jax.tree.leaves(state))} arrays, {args.repeats} repeats (median)")

    first, dispatch, digest = _digest_timing(state, args.repeats)
    if args.digest_only:
        print(head)
        print(format_markdown([{"digests": what, "first, compile included (s)": first,
                                "dispatch, blocks the loop (s)": dispatch, "computed (s)": digest,
                                "GB/s": n_bytes / digest / 1e9}]))
        return

    modes = ("sync", "async", "async, no digests")
    blocking: dict[str, list[float]] = {mode: [] for mode in modes}
    commit: dict[str, list[float]] = {mode: [] for mode in modes}
    restore, verify = [], []
    with tempfile.TemporaryDirectory() as tmp:
        managers = {mode: Checkpointer(Path(tmp) / str(i), keep=2, async_save=mode != "sync")
                    for i, mode in enumerate(modes)}
        for step in range(args.repeats + 1):  # step 0 warms up all three (first-save setup, compiles)
            order = modes[step % 3:] + modes[: step % 3]
            for mode in order:
                ckpt = managers[mode]
                with _digests_off() if mode.endswith("no digests") else contextlib.nullcontext():
                    t0 = time.perf_counter()
                    ckpt.save(step, state, data_state={"step": step, "seed": 0}, config={"model": args.model}, force=True)
                    t1 = time.perf_counter()
                    ckpt.wait()
                    t2 = time.perf_counter()
                if step:
                    blocking[mode].append(t1 - t0)
                    commit[mode].append(t2 - t0)
        reader = managers["async"]
        abstract = program.abstract_state()
        for i in range(args.repeats + 1):
            t0 = time.perf_counter()
            restored, _, _ = reader.restore(abstract, step=args.repeats)
            jax.block_until_ready(restored)
            t1 = time.perf_counter()
            reader.verify(args.repeats, restored)
            t2 = time.perf_counter()
            if i:
                restore.append(t1 - t0)
                verify.append(t2 - t1)
            del restored
        for ckpt in managers.values():
            ckpt.close()

    med = lambda xs: statistics.median(xs)
    print(head)
    print(format_markdown([{"save": mode, "blocks the loop (s)": med(blocking[mode]),
                            "until committed (s)": med(commit[mode])} for mode in modes]))
    print(format_markdown([
        {"digests": "at save: dispatch (on the loop's path)", "seconds": dispatch},
        {"digests": "at save: computed (background thread)", "seconds": digest},
        {"digests": "restore, verified (total)", "seconds": med(restore)},
        {"digests": "restore: of which verifying", "seconds": med(verify)},
    ]))
    print(f"ratio sync / async blocking time: {med(blocking['sync']) / med(blocking['async']):.1f}x; "
          f"digests add {med(blocking['async']) - med(blocking['async, no digests']):+.3f} s to the async save's "
          f"blocking time and {med(commit['async']) - med(commit['async, no digests']):+.3f} s until committed")


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
