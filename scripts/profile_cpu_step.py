"""Where a data-parallel step's extra time goes on XLA:CPU: shardlib's step against the hand-written
``jax.jit`` step of scripts/benchmark.py and against a user's own ``jax.shard_map`` step of the
same model (no shardlib code: value_and_grad per device, pmean, the same optax update).

On a 2-core machine with 8 simulated devices the dp/zero1/zero2 steps measured a few % over the jit
step until their reductions read each weight gradient in the order its matmul writes it (BENCHMARKS.md,
docs/design.md); the user's ``shard_map`` step still does. This prints, per program:

- CPU time per step (user + system, all threads: what 2 shared cores actually spend), as the
  median ratio over the jit step, interleaved in one process;
- the dots XLA:CPU leaves outside its fused kernels, per step (loop trips counted): those run as
  Eigen contractions, split into tasks on the intra-op thread pool, where a fused (YNNPACK) dot
  runs as one kernel;
- tasks put on that thread pool per step, counted from a profiler trace (``--trace``).

  python scripts/profile_cpu_step.py --strategy zero1
  python scripts/profile_cpu_step.py --strategy dp --model tiny --repeats 3 --no-trace
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import add_shape_arguments, load, machine  # noqa: E402
from benchmark import baseline_step  # noqa: E402


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(parser)
    parser.add_argument("--strategy", default="zero1", help="dp, zero1 or zero2 (default: zero1)")
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default: 8)")
    parser.add_argument("--repeats", type=int, default=9, help="timed steps per program (default: 9)")
    parser.add_argument("--no-trace", dest="trace", action="store_false", help="skip the profiler trace")
    return parser.parse_args(argv)


def shard_map_step(model: Any, tx: Any, program: Any, batch_sharding: Any) -> Any:
    """What a user writes by hand for data parallelism with shard_map: replicated parameters, the
    batch split over every data-parallel device, gradients averaged with pmean."""
    import jax
    import optax
    from jax.sharding import PartitionSpec as P

    from shardlib.step import TrainState

    axes = tuple(name for name, size in program.mesh.shape.items() if size > 1)

    def local(params, batch):
        (loss, _), grads = jax.value_and_grad(lambda p: model.loss(p, batch, None), has_aux=True)(params)
        return jax.lax.pmean(loss, axes), jax.tree.map(lambda g: jax.lax.pmean(g, axes), grads)

    def step(state: TrainState, batch):
        whole = jax.tree.map(lambda _: P(), state.params)
        loss, grads = jax.shard_map(local, mesh=program.mesh, in_specs=(whole, P(axes)),
                                    out_specs=(P(), whole))(state.params, batch)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        return TrainState(state.step + 1, optax.apply_updates(state.params, updates), opt_state), {"loss": loss}

    return jax.jit(step, in_shardings=(program.state_sharding, batch_sharding),
                   out_shardings=(program.state_sharding, None), donate_argnums=(0,))


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def pool_tasks_per_step(programs: dict[str, Any], states: dict[str, Any], batch: Any, steps: int = 3) -> dict[str, float]:
    """Tasks scheduled on XLA's intra-op thread pool per step, from a profiler trace: the
    ``ThreadpoolListener::Record`` events inside each step's annotation."""
    import jax
    from jax.profiler import ProfileData

    windows: list[tuple[str, int, int]] = []
    with tempfile.TemporaryDirectory() as logdir:
        jax.profiler.start_trace(logdir)
        for _ in range(steps):
            for name, fn in programs.items():
                with jax.profiler.TraceAnnotation(f"step:{name}"):
                    states[name], metrics = fn(states[name], batch)
                    jax.block_until_ready((states[name], metrics))
        jax.profiler.stop_trace()
        (path,) = [os.path.join(d, f) for d, _, fs in os.walk(logdir) for f in fs if f.endswith(".xplane.pb")]
        profile = ProfileData.from_file(path)
    cpu = next(plane for plane in profile.planes if plane.name == "/host:CPU")
    lines = list(cpu.lines)
    for line in lines:
        windows += [(e.name[5:], e.start_ns, e.start_ns + e.duration_ns) for e in line.events if e.name.startswith("step:")]
    counts = dict.fromkeys(programs, 0)
    for line in lines:
        for event in line.events:
            if event.name == "ThreadpoolListener::Record":
                for name, start, end in windows:
                    if start <= event.start_ns < end:
                        counts[name] += 1
    return {name: count / steps for name, count in counts.items()}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from shardlib.tools.hlo_parse import unfused_dots
    from shardlib.tools.plan_candidates import setup_devices

    setup_devices(args.devices)
    import jax
    import numpy as np
    import optax

    from shardlib import build, make_layout, make_mesh
    from shardlib.models import get_config, trainable
    from shardlib.tools.plan_candidates import default_mesh

    config = get_config(args.model)
    seq_len = args.seq_len or config.max_seq_len
    model = trainable(config)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, size=(args.batch_size, seq_len + 1), dtype=np.int32)
    batch_np = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    mesh = make_mesh(default_mesh(args.strategy, args.devices, config), devices=jax.devices()[: args.devices])
    layout = make_layout(model, args.strategy, mesh)
    tx = optax.adamw(1e-3)
    program = build(model, tx, layout)
    sharding = layout.batch_sharding(batch_np)
    batch = jax.device_put(batch_np, sharding)
    steps = {"shardlib": program.step, "jit": baseline_step(model, tx, program, sharding),
             "user shard_map": shard_map_step(model, tx, program, sharding)}
    states = {name: program.init(jax.random.key(0)) for name in steps}
    compiled = {name: fn.lower(states[name], batch).compile() for name, fn in steps.items()}
    print(f"# {args.model} GPT, {args.strategy}, global batch {args.batch_size} x {seq_len}; {machine()}", flush=True)

    seconds: dict[str, list[float]] = {name: [] for name in compiled}
    for repeat in range(args.repeats + 2):
        order = list(compiled) if repeat % 2 == 0 else list(reversed(compiled))
        for name in order:
            start = cpu_seconds()
            states[name], metrics = compiled[name](states[name], batch)
            jax.block_until_ready((states[name], metrics))
            if repeat >= 2:
                seconds[name].append(cpu_seconds() - start)
    tasks = pool_tasks_per_step(compiled, states, batch) if args.trace else {}
    print(f"# at the end: {load()}")
    print(f"{'program':16s} {'CPU s/step':>10s} {'CPU vs jit':>10s} {'unfused dots/step':>18s} {'pool tasks/step':>16s}")
    for name in compiled:
        ratio = statistics.median(a / b for a, b in zip(seconds[name], seconds["jit"]))
        pool = f"{tasks[name]:.0f}" if name in tasks else "-"
        print(f"{name:16s} {statistics.median(seconds[name]):10.3f} {ratio:10.3f} "
              f"{unfused_dots(compiled[name].as_text()):18d} {pool:>16s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
