"""One process of a multi-process test job: train the tiny GPT through the library API, print JSON.

Run under ``shardlib launch`` (or with the SHARDLIB_* variables set by hand). Every process
prints one line ``RESULT {json}`` with its per-step losses; the tests compare them with the
same run in one process. ``--die-at S --victim P``: process P SIGKILLs itself before step S,
to test that the others stop within the documented bound (``--how raise``: raise instead).

``multihost_worker.py cli RECORD_DIR train FLAGS...`` runs ``shardlib.cli.main(["train", FLAGS...])``,
the very function behind ``python -m shardlib.cli train``, with three read-only taps, and writes
``RECORD_DIR/p<process>.json``: the window start offsets (example ids) of the rows this process
loaded at each step, how many times this process tokenized text into a token cache, and a digest
of the final TrainState (for a ``--resume-from`` run that trains no further steps, the restored
state). See `run_cli_recorded`. ``multihost_worker.py cli-runs SPEC.json`` makes several such runs
one after another in one process, each waiting for files that other processes' runs write (see
`run_cli_runs`).
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

from shardlib.runtime import distributed  # noqa: E402  (imports jax, starts no backend)

BATCH, SEQ, SEED = 16, 32, 0
DEFAULT_MESHES = ("fsdp=-1", "data=2,fsdp=4")


def train_losses(
    mesh_text: str, steps: int, strategy: str = "zero3", before_step: Callable[[int], None] | None = None,
    on_program: Callable[..., None] | None = None,
) -> tuple[list[float], str]:
    """Per-step losses of ``steps`` AdamW steps of the tiny GPT, and the mesh's device map;
    ``on_program(program, batch)`` sees the program and the last global batch after training."""
    import jax
    import numpy as np
    import optax

    from shardlib.models import get_config, trainable
    from shardlib import build, make_layout, make_mesh
    from shardlib.runtime.data import ByteBatches, load_text, to_global

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
    if on_program is not None:
        on_program(program, batch)
    return losses, distributed.device_map(mesh)


def cross_process_collectives(program, batch) -> list[list]:
    """[kind, runs per step] of every collective of the compiled step whose replica groups join
    devices of different processes (group ids index the mesh's devices in order)."""
    from shardlib.tools.hlo import collective_stats

    process = [d.process_index for d in program.mesh.devices.flat]
    records = collective_stats(program.compile_step(program.abstract_state(), batch).as_text(),
                               num_devices=len(process)).records
    crossing = [r for r in records if r.replica_groups is None
                or any(len({process[i] for i in group}) > 1 for group in r.replica_groups)]
    return sorted([r.kind, r.multiplicity] for r in crossing)


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
    parser.add_argument("--mesh", action="append", help="mesh to train on (repeatable), optionally STRATEGY@MESH "
                        "(default zero3; zero3_hpz also reports its cross-process collectives); "
                        "default: fsdp=-1 and data=2,fsdp=4")
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
    for run in args.mesh or DEFAULT_MESHES:
        strategy, _, mesh_text = run.rpartition("@")
        found = {}
        inspect = (lambda p, b: found.update(crossing=cross_process_collectives(p, b))) if strategy == "zero3_hpz" else None
        losses, device_map = train_losses(mesh_text, args.steps, strategy or "zero3", maybe_die, inspect)
        results[run] = {"losses": losses, "device_map": device_map, **found}
    print("RESULT " + json.dumps({"process": info.process_id, "processes": info.num_processes, "runs": results}), flush=True)
    return 0


def state_digest(state: object) -> dict[str, dict]:
    """Path -> sha256 of the gathered bytes, float64 sum, shape and dtype of every state leaf.

    One jit reshards the whole tree to fully replicated (every process then holds all of it),
    so the digest is the same whether the state lives on 1 process or on several.
    """
    import hashlib

    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from shardlib.sharding.rules import path_str

    leaves = jax.tree.leaves(state)
    mesh = next(x.sharding.mesh for x in leaves if isinstance(getattr(x, "sharding", None), NamedSharding))
    replicated = jax.jit(lambda tree: tree, out_shardings=NamedSharding(mesh, P()))(state)
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(replicated)[0]:
        host = np.ascontiguousarray(np.asarray(leaf.addressable_data(0)))
        out[path_str(path)] = {"sha256": hashlib.sha256(host.tobytes()).hexdigest(), "shape": list(host.shape),
                               "dtype": host.dtype.name, "sum": float(host.astype(np.float64).sum())}
    return out


def run_cli_recorded(record_dir: str, cli_args: list[str]) -> int:
    """``shardlib.cli.main(cli_args)`` with taps on the train loader, the token cache's writer and
    `train`'s result: `run_cli_runs` with one run.

    The loader tap is a `ByteBatches` subclass that notes, per step, the window starts of the
    rows it returns and checks that the returned rows really are the corpus at those starts, so
    the ids are what the process read, not a recomputation beside it. `shardlib.run.train` imports
    ``ByteBatches`` from `shardlib.runtime.data` when a run builds its loader, and `shardlib.run.train.run` calls the
    module's ``train``; both are replaced here. If train.py stops looking them up that way, the
    record has no ids (or no file) and the tests fail loudly rather than pass. The token cache tap
    counts calls of `shardlib.hf.token_cache.stream` (the one writer of a text's ids to its cache),
    which `shardlib.hf.tokenizer` looks up on the module at each call.
    """
    return run_cli_runs([{"record": record_dir, "args": cli_args}])


def run_cli_runs(runs: list[dict], wait_s: float = 1200.0) -> int:
    """Several recorded ``shardlib.cli.main`` runs, one after another in this process (see
    `run_cli_recorded` for the taps): each run is ``{"record": DIR, "args": [...], "after": [FILE...]}``,
    started once every ``after`` file exists (another process's run finished). Each run writes its
    own ``DIR/p<process>.json`` (its ids, token-cache writes and final state only), then, once
    `shardlib.cli.main` has returned (the run's directory released), ``DIR/p<process>.done``.
    Stops at the first run that fails, with its exit code.
    """
    import jax
    import numpy as np

    from shardlib import cli
    from shardlib.hf import token_cache
    from shardlib.runtime import data
    from shardlib.run import train as train_module

    current: dict = {}

    class RecordingBatches(data.ByteBatches):
        def batch(self, step: int) -> data.Batch:
            out = super().batch(step)
            n_starts = len(self.data) - self.seq_len
            starts = data.train_window_starts(self.seed, step, self.global_batch_size, n_starts)[self.rows]
            expected = self.data[starts[:, None] + np.arange(self.seq_len)]
            if not np.array_equal(out["inputs"], expected):
                raise AssertionError(f"step {step}: the loaded rows are not the corpus windows at {starts.tolist()}")
            current["ids"][step] = starts.tolist()
            return out

    original_stream = token_cache.stream

    def counted_stream(*args, **kwargs):
        current["tokenized"].append(1)
        return original_stream(*args, **kwargs)

    original_train = train_module.train

    def recorded_train(config, **kwargs):  # notes=: the run's record lines (`shardlib.run.train.run`)
        result = original_train(config, **kwargs)
        ids, tokenized = current["ids"], current["tokenized"]
        record = {"process": jax.process_index(), "processes": jax.process_count(),
                  "devices": jax.device_count(), "local_devices": jax.local_device_count(),
                  "steps": result.steps, "tokenized": len(tokenized), "ids": {str(k): v for k, v in sorted(ids.items())},
                  "digest": state_digest(result.state)}
        path = os.path.join(current["record"], f"p{jax.process_index()}.json")
        os.makedirs(current["record"], exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(record, f)
        return result

    data.ByteBatches = RecordingBatches
    token_cache.stream = counted_stream
    train_module.train = recorded_train
    for run in runs:
        deadline = time.monotonic() + wait_s
        while not all(os.path.exists(path) for path in run.get("after", ())):
            if time.monotonic() > deadline:
                print(f"gave up after {wait_s:.0f} s waiting for {run['after']}", file=sys.stderr, flush=True)
                return 1
            time.sleep(0.2)
        current.update(record=run["record"], ids={}, tokenized=[])
        code = cli.main(run["args"])
        if code:
            return code
        if len(runs) > 1:
            with open(os.path.join(run["record"], f"p{jax.process_index()}.done"), "w"):
                pass
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["cli"]:
        if len(sys.argv) < 4:
            sys.exit("usage: multihost_worker.py cli RECORD_DIR train FLAGS...")
        sys.exit(run_cli_recorded(sys.argv[2], sys.argv[3:]))
    if sys.argv[1:2] == ["cli-runs"]:  # the runs of a JSON file, in order (see `run_cli_runs`)
        with open(sys.argv[2], encoding="utf-8") as f:
            sys.exit(run_cli_runs(json.load(f)))
    sys.exit(distributed.finish(main()))
