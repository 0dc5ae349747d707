"""One process of a multi-process test job: train the tiny GPT through the library API, print JSON.

Run under ``shardlib launch`` (or with the SHARDLIB_* variables set by hand). Every process
prints one line ``RESULT {json}`` with its per-step losses; the tests compare them with the
same run in one process. ``--die-at S --victim P``: process P SIGKILLs itself before step S,
to test that the others stop within the documented bound (``--how raise``: raise instead).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable

if __name__ == "__main__":  # the repository root, so `models` and `shardlib` import without install
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shardlib import distributed  # noqa: E402  (imports jax, starts no backend)

BATCH, SEQ, SEED = 16, 32, 0
DEFAULT_MESHES = ("fsdp=-1", "data=2,fsdp=4")


def train_losses(
    mesh_text: str, steps: int, strategy: str = "zero3", before_step: Callable[[int], None] | None = None
) -> tuple[list[float], str]:
    """Per-step losses of ``steps`` AdamW steps of the tiny GPT, and the mesh's device map."""
    import jax
    import numpy as np
    import optax

    from models import get_config, trainable
    from shardlib import build, make_layout, make_mesh
    from shardlib.data import ByteBatches, load_text, to_global

    model = trainable(get_config("tiny"))
    mesh = make_mesh(mesh_text)
    layout = make_layout(model, strategy, mesh)
    program = build(model, optax.adamw(3e-3, eps=1e-5, weight_decay=0.1), layout)
    source = ByteBatches(np.frombuffer(load_text(None), np.uint8), BATCH, SEQ, seed=SEED,
                         data_parallel_size=layout.batch_size_multiple)
    state = program.init(jax.random.key(SEED))
    losses = []
    for step in range(steps):
        if before_step is not None:
            before_step(step)
        local = source.batch(step)
        batch = to_global(local, layout.batch_sharding(local)["inputs"], rows=source.rows)
        state, metrics = program.step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, distributed.device_map(mesh)


def toy_loop(steps: int, before_step: Callable[[int], None]) -> list[float]:
    """A cheap stand-in for training (compiles in well under a second): one cross-process sum a step."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    total = jax.jit(lambda x: x.sum(), out_shardings=NamedSharding(mesh, P()))
    out = []
    for step in range(steps):
        before_step(step)
        local = np.full((jax.local_device_count(),), float(jax.process_index() + step), np.float32)
        out.append(float(total(jax.make_array_from_process_local_data(sharding, local))))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--mesh", action="append", help="mesh to train on (repeatable); default: fsdp=-1 and data=2,fsdp=4")
    parser.add_argument("--die-at", type=int, default=None, help="the victim fails before this step")
    parser.add_argument("--victim", type=int, default=1)
    parser.add_argument("--how", choices=("kill", "raise"), default="kill", help="SIGKILL itself, or raise an exception")
    parser.add_argument("--only-init", action="store_true", help="join, check devices, print the info, exit")
    parser.add_argument("--toy", action="store_true", help="run toy_loop instead of training (for failure tests)")
    args = parser.parse_args(argv)

    info = distributed.initialize()
    print(f"joined: {info.describe()}", flush=True)
    if args.only_init:
        return 0

    def maybe_die(step: int) -> None:
        if step == args.die_at and info.process_id == args.victim:
            print(f"FAILING {time.time()!r}: process {info.process_id} fails ({args.how}) before step {step}", flush=True)
            if args.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"process {info.process_id} raises before step {step} (as asked)")
        if args.die_at is not None:
            print(f"step {step}", flush=True)

    if args.toy:
        sums = toy_loop(args.steps, maybe_die)
        print("RESULT " + json.dumps({"process": info.process_id, "sums": sums}), flush=True)
        return 0
    results = {}
    for mesh_text in args.mesh or DEFAULT_MESHES:
        losses, device_map = train_losses(mesh_text, args.steps, before_step=maybe_die)
        results[mesh_text] = {"losses": losses, "device_map": device_map}
    print("RESULT " + json.dumps({"process": info.process_id, "processes": info.num_processes, "runs": results}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(distributed.finish(main()))
