"""Local SGD against synchronous data parallelism: loss after N steps, same data, one process.

    python scripts/benchmark_local_sgd.py [--steps 100] [--batch-size 16] [--optimizer adamw|sgd]
                                          [--seeds 0 1] [--only NAME ...] [--markdown]

Trains the tiny GPT on the training split of the corpus that ships with CPython (8 simulated CPU
devices), once with data parallelism (``build``, dp over data=8) and once per local SGD variant
below, every run on the same batches from the same initialisation, and prints, for each run,
ratios against the dp run of the same seed:

* ``eval``: held-out loss (the last 5% of the corpus, 8 batches of 64 x 32) of the *consensus*
  parameters after the last step (``program.consensus(state)``: the replicas' mean, which is
  what a checkpoint or an export ships; with ``steps`` a multiple of H it is also every replica);
* ``train@sync``: the mean training loss over the last 20 steps of the steps that start from
  freshly synchronised parameters (every H-th step), against dp's training loss on those steps;
* ``train last 10``: the mean training loss of the last 10 steps (mid-period for local SGD: each
  replica's loss on its own rows, averaged over replicas), the figure first reported for issue 6.

Variants: ``R`` replicas (data=8 with the dp layout: 8 replicas of 1 device; data=2 fsdp=4 with
hsdp: 2 replicas of 4 devices), ``H`` local steps between averages, ``W`` synchronous warm-up
steps (post-local SGD), ``avg-opt`` (inner optimizer state averaged at each sync), ``nesterov``
(DiLoCo's outer Nesterov, 0.7 / 0.9). ``bytes vs dp`` is the parameter-sized traffic over ``data``
of the whole run against synchronous training's (one gradient all-reduce per step).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

SEQ, VAL_BATCH, VAL_BATCHES = 32, 64, 8

# name: (replicas, H, sync_warmup, average_opt_state, outer nesterov)
VARIANTS = {
    "R=8 H=1": (8, 1, 0, False, False),
    "R=2 H=1": (2, 1, 0, False, False),
    "R=8 H=4": (8, 4, 0, False, False),
    "R=8 H=4 avg-opt": (8, 4, 0, True, False),
    "R=8 H=4 W=4": (8, 4, 4, False, False),
    "R=8 H=4 W=8": (8, 4, 8, False, False),
    "R=8 H=4 W=12": (8, 4, 12, False, False),
    "R=8 H=4 W=20": (8, 4, 20, False, False),
    "R=8 H=4 W=20 avg-opt": (8, 4, 20, True, False),
    "R=2 H=4": (2, 4, 0, False, False),
    "R=2 H=4 avg-opt": (2, 4, 0, True, False),
    "R=2 H=4 W=8": (2, 4, 8, False, False),
    "R=2 H=4 W=20": (2, 4, 20, False, False),
    "R=2 H=4 W=20 avg-opt": (2, 4, 20, True, False),
    "R=8 H=4 nesterov": (8, 4, 0, False, True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--only", nargs="+", default=None, help="variant names to run (default: all)")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    import optax

    from shardlib.models import get_config, trainable
    from shardlib import build, make_layout, make_mesh
    from shardlib.runtime.data import ByteBatches, load_text, split_train_val, val_batches
    from shardlib.step.local_sgd import build_local_sgd
    from shardlib.tools.report import format_markdown, format_table

    variants = {k: v for k, v in VARIANTS.items() if args.only is None or k in args.only}
    model = trainable(get_config("tiny"))
    train, val = split_train_val(load_text(None))
    held_out = val_batches(val, VAL_BATCH, SEQ, VAL_BATCHES, process_index=0, process_count=1)
    tx = optax.adamw(3e-3) if args.optimizer == "adamw" else optax.sgd(0.5)
    layouts = {8: make_layout(model, "dp", make_mesh({"data": 8})),
               2: make_layout(model, "hsdp", make_mesh({"data": 2, "fsdp": 4}))}

    abstract = model.abstract()
    n_params = sum(x.size for x in jax.tree.leaves(abstract))
    opt_floats = sum(x.size for x in jax.tree.leaves(jax.eval_shape(tx.init, abstract)) if x.dtype.kind == "f")

    def traffic(h: int, warmup: int, avg_opt: bool) -> float:
        """Bytes over ``data`` in the run against dp's: W gradient all-reduces, then one all-reduce
        of the parameters (and, with avg-opt, of the optimizer state) per H steps."""
        syncs = (args.steps - warmup) // h
        return (warmup + syncs * (1 + (opt_floats / n_params if avg_opt else 0))) / args.steps

    def eval_loss(evaluate, params) -> float:
        return float(np.mean([float(evaluate(params, b)["loss"]) for b in held_out]))

    rows = []
    for seed in args.seeds:
        source = ByteBatches(train, args.batch_size, SEQ, seed=seed, process_index=0, process_count=1)
        batches = [source.batch(step) for step in range(args.steps)]
        key = jax.random.key(seed)

        dp = build(model, tx, layouts[8])
        state, dp_losses = dp.init(key), []
        for batch in batches:
            state, metrics = dp.step(state, batch)
            dp_losses.append(float(metrics["loss"]))
        dp_losses = np.array(dp_losses)
        dp_eval = eval_loss(dp.evaluate, state.params)
        rows.append({"seed": seed, "run": "dp (synchronous)", "eval": f"{dp_eval:.4f}", "eval vs dp": "1.000",
                     "train@sync vs dp": "1.000", "train last 10 vs dp": "1.000", "bytes vs dp": "1.000", "s": ""})

        for name, (replicas, h, warmup, avg_opt, nesterov) in variants.items():
            start = time.perf_counter()
            program = build_local_sgd(model, tx, layouts[replicas], sync_every=h, sync_warmup=warmup,
                                      average_opt_state=avg_opt,
                                      outer_tx=optax.sgd(0.7, momentum=0.9, nesterov=True) if nesterov else None)
            state, losses = program.init(key), []
            for batch in batches:
                state, metrics = program.step(state, batch)
                losses.append(float(metrics["loss"]))
            losses = np.array(losses)
            local_eval = eval_loss(program.evaluate, program.consensus(state))
            # 0-based step s starts from synchronised parameters when s <= W or (s - W) % H == 0.
            after_sync = [s for s in range(args.steps - 20, args.steps) if s <= warmup or (s - warmup) % h == 0]
            rows.append({
                "seed": seed, "run": name, "eval": f"{local_eval:.4f}", "eval vs dp": f"{local_eval / dp_eval:.3f}",
                "train@sync vs dp": f"{losses[after_sync].mean() / dp_losses[after_sync].mean():.3f}",
                "train last 10 vs dp": f"{losses[-10:].mean() / dp_losses[-10:].mean():.3f}",
                "bytes vs dp": f"{traffic(h, warmup, avg_opt):.3f}",
                "s": f"{time.perf_counter() - start:.0f}",
            })
            print(rows[-1], flush=True)

    print(f"\ntiny GPT, {args.optimizer}, global batch {args.batch_size} x {SEQ}, {args.steps} steps")
    print(format_markdown(rows) if args.markdown else format_table(rows))


if __name__ == "__main__":
    main()
