"""A user's training loop on a Grain pipeline, run by tests/test_grain_data.py under `shardlib launch --elastic`.

    python tests/grain_worker.py --out DIR [--steps N] [--slow-process I:S]

Each step sums the global batch's example ids into a replicated counter (the state that is
checkpointed every 2 steps with the loader's state), and each process appends the ids of its own
rows to its examples file. A restart (same command) resumes from the newest checkpoint. At the end
process 0 writes ``DIR/total.json``: the counter, which equals the sum of every example read once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if __name__ == "__main__":  # the repository root, so `shardlib` imports without install
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shardlib.runtime import distributed  # noqa: E402  (imports jax, starts no backend)

BATCH, SHARD_SEED, RECORDS = 8, 7, 4096


def pipeline(shard):
    """Shard ``shard`` of a shuffled stream of example ids (what a user writes for Grain)."""
    import grain
    import numpy as np

    return (grain.MapDataset.range(RECORDS).shuffle(seed=SHARD_SEED)[shard.index::shard.count]
            .map(lambda i: {"id": np.int32(i)}).to_iter_dataset())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--slow-process", default="", help="I:S: process I sleeps S seconds a step")
    args = parser.parse_args()
    distributed.initialize()

    from pathlib import Path

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from shardlib import Checkpointer
    from shardlib.run.examples import examples_path
    from shardlib.runtime.data import to_global
    from shardlib.runtime.grain_data import GrainBatches

    out = Path(args.out)
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    rows, whole = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    batches = GrainBatches(pipeline, BATCH)
    ckpt = Checkpointer(out / "checkpoints", every=2, keep=3)
    state = {"total": jax.device_put(jnp.zeros((), jnp.int32), whole)}
    if ckpt.latest_step() is not None:
        state, data_state, _ = ckpt.restore({"total": jax.ShapeDtypeStruct((), jnp.int32, sharding=whole)})
        batches.restore(data_state)
    step_fn = jax.jit(lambda s, ids: {"total": s["total"] + ids.sum()}, out_shardings={"total": whole})
    slow_index, _, slow_s = args.slow_process.partition(":")
    log = examples_path(out, jax.process_index(), jax.process_count())
    with open(log, "a", encoding="utf-8") as examples:
        for step in range(batches.step + 1, args.steps + 1):
            local = next(batches)
            state = step_fn(state, to_global(local, rows, rows=batches.rows)["id"])
            examples.write(json.dumps({"step": step, "ids": local["id"].tolist()}) + "\n")
            examples.flush()
            ckpt.save(step, state, data_state=batches.state())
            if slow_index and int(slow_index) == jax.process_index():
                time.sleep(float(slow_s))
    if args.steps % 2:  # the last step, off the schedule
        ckpt.save(args.steps, state, data_state=batches.state(), force=True)
    ckpt.close()
    if jax.process_index() == 0:
        (out / "total.json").write_text(json.dumps({"total": int(state["total"])}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
