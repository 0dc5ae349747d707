"""Bounded staleness and streaming DiLoCo against their synchronous forms: loss after N steps.

    python scripts/benchmark_staleness.py [--steps 100] [--seeds 0 1 2] [--taus 0 1 2]
                                          [--delays 0 1 2] [--optimizer adamw|sgd] [--markdown]

Trains the tiny GPT (8 simulated CPU devices, one process) on the training split of the corpus
that ships with CPython, every run of a seed on the same batches from the same initialisation:

* ``dp tau=T``: ``build(..., staleness=T)``, dp over data=8; T=0 is synchronous data parallelism.
* ``DiLoCo D=d``: ``build_local_sgd``, 2 replicas of 4 devices (hsdp, data=2 x fsdp=4), H=4,
  outer Nesterov (0.7, 0.9), ``outer_delay=d``; d=0 is DiLoCo's blocking sync.

Columns: ``eval`` is the held-out loss (the last 5% of the corpus, 8 batches of 64 x 32) of the
parameters after the last step (DiLoCo: the replicas' mean), ``last 10`` the mean training loss of
the last 10 steps, each against the synchronous run of the same seed and family; ``data bytes /
step`` the bytes one device sends per step in the compiled programs (DiLoCo: the sync's per H
steps, spread); ``reduction waits for compute``: whether the step's gradient all-reduce depends
on the step's batch in the optimised HLO (`shardlib.tools.hlo.reductions_waiting`), i.e.
must wait for the forward and backward pass (DiLoCo: whether the outer all-reduce blocks).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

SEQ, VAL_BATCH, VAL_BATCHES, H = 32, 64, 8, 4


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--taus", type=int, nargs="*", default=[0, 1, 2])
    parser.add_argument("--delays", type=int, nargs="*", default=[0, 1, 2])
    parser.add_argument("--markdown", action="store_true")
    return parser.parse_args()


def _train(program, batches, key, eval_params):
    """-> (per-step losses, held-out loss of ``eval_params(final state)``)."""
    import numpy as np

    state, losses = program.init(key), []
    for batch in batches:
        state, metrics = program.step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses), eval_params(state)


def _stale_runs(args, model, tx, layout, batches, key, held_out):
    """One row per tau: the dp program with that staleness."""
    import jax

    from shardlib import build
    from shardlib.tools.hlo import reductions_waiting

    for tau in args.taus:
        program = build(model, tx, layout, staleness=tau)
        compiled = program.compile_step(program.abstract_state(), program.abstract_batch(
            {k: (v.shape, v.dtype) for k, v in batches[0].items()}))
        _, waiting = reductions_waiting(compiled.as_text(), len(jax.tree.leaves(program.abstract_state())))
        losses, held = _train(program, batches, key, lambda s: held_out(program.evaluate, s.params))
        yield f"dp tau={tau}", losses, held, _bytes(compiled), "yes" if waiting else "no"


def _diloco_runs(args, model, tx, layout, batches, key, held_out):
    """One row per outer delay: DiLoCo R=2 H=4 with outer Nesterov."""
    import optax

    from shardlib.step.local_sgd import build_local_sgd

    for delay in args.delays:
        program = build_local_sgd(model, tx, layout, sync_every=H, outer_delay=delay,
                                  outer_tx=optax.sgd(0.7, momentum=0.9, nesterov=True))
        sync = program.compile_sync(program.abstract_state())
        losses, held = _train(program, batches, key,
                              lambda s: held_out(program.evaluate, program.consensus(s)))
        waits = "yes (blocking sync)" if delay == 0 else f"no (in step +{delay})"
        yield f"DiLoCo D={delay}", losses, held, _bytes(sync) / H, waits


def _bytes(compiled) -> float:
    from shardlib.tools.report import collective_stats

    return collective_stats(compiled).total_bytes


def main() -> None:
    args = _arguments()
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    import optax

    from bench_common import machine
    from shardlib import make_layout, make_mesh
    from shardlib.models import get_config, trainable
    from shardlib.runtime.data import ByteBatches, load_text, split_train_val, val_batches
    from shardlib.tools.report import format_markdown, format_table

    model = trainable(get_config("tiny"))
    train, val = split_train_val(load_text(None))
    windows = val_batches(val, VAL_BATCH, SEQ, VAL_BATCHES, process_index=0, process_count=1)
    held_out = lambda evaluate, params: float(np.mean([float(evaluate(params, b)["loss"]) for b in windows]))
    tx = optax.adamw(3e-3) if args.optimizer == "adamw" else optax.sgd(0.5)
    families = ((_stale_runs, make_layout(model, "dp", make_mesh({"data": 8}))),
                (_diloco_runs, make_layout(model, "hsdp", make_mesh({"data": 2, "fsdp": 4}))))
    rows = []
    for seed in args.seeds:
        source = ByteBatches(train, args.batch_size, SEQ, seed=seed, process_index=0, process_count=1)
        batches = [source.batch(step) for step in range(args.steps)]
        for runs, layout in families:
            base = None
            for name, losses, held, sent, waits in runs(args, model, tx, layout, batches, jax.random.key(seed),
                                                        held_out):
                base = base or (held, losses[-10:].mean())
                rows.append({"seed": seed, "run": name, "eval": f"{held:.4f}", "eval vs sync": f"{held / base[0]:.3f}",
                             "last 10 vs sync": f"{losses[-10:].mean() / base[1]:.3f}",
                             "data bytes / step": f"{sent:,.0f}", "reduction waits for compute": waits})
                print(rows[-1], flush=True)

    print(f"\ntiny GPT, {args.optimizer}, global batch {args.batch_size} x {SEQ}, {args.steps} steps; {machine()}")
    print(format_markdown(rows) if args.markdown else format_table(rows))


if __name__ == "__main__":
    main()
