"""Host memory and time of a Hugging Face import: shardlib's sharded read against transformers' load.

    python scripts/benchmark_hf_import.py                   # TinyLlama-1.1B shapes, bf16, 8 devices, zero3
    python scripts/benchmark_hf_import.py --model tiny --markdown --rounds 1

Writes a Llama-shaped checkpoint with random bf16 weights in several safetensors shards (streamed,
one tensor at a time), then measures, each in a fresh child process of this run, ``--rounds``
times (the two loaders alternating, so both see the same load from other jobs):

* ``shardlib``: `shardlib.hf.load.load_params` onto 8 simulated CPU devices under zero3, the
  parameters in float32 (the master copy a fine-tune keeps), and the bytes its reader read
  (`TensorFile.bytes_read`: each checkpoint byte once a job, `shardlib.hf.rows`);
* ``transformers``: ``AutoModelForCausalLM.from_pretrained(dir, dtype=float32)`` on the CPU.

For each: the minimum over the rounds of its wall time and of its CPU time (all threads: on a
shared machine the CPU time is what the loader itself spent, the wall time what it waited too),
and the largest peak resident set (``ru_maxrss``) of its rounds, next to the process's own share
of the state (the f32 parameters its devices hold: on simulated CPU devices, all of them) and the
largest tensor; then shardlib / transformers of each. The goal: shardlib's peak at most that share plus one tensor, whatever
the checkpoint's size; on a GPU or TPU host the share is the host's staging of its shards only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def write_checkpoint(model: str, directory: Path, shard_mb: float) -> dict:
    """Random bf16 weights of ``model``'s shapes as a Llama checkpoint, a tensor at a time."""
    import ml_dtypes
    import numpy as np

    from shardlib.hf import architectures as arch_lib
    from shardlib.hf.save import _assign_files, _tensor_order
    from shardlib.hf.safetensors_io import TensorWriter
    from shardlib.hf.load import INDEX, _param_shapes
    from shardlib.models import get_config

    config = get_config(model)
    shapes = _param_shapes(config)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    arch = arch_lib.export_architecture(config)
    entries = [(t.hf_name(layer) if layer is not None else t.name, bf16,
                t.placement.hf_shape(shapes[t.path][t.stacked:]))
               for t, layer in _tensor_order(config, arch)]
    files = _assign_files(entries, int(shard_mb * 2**20))
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for file_name in dict.fromkeys(files.values()):
        with open(directory / file_name, "wb") as f:
            mine = [e for e in entries if files[e[0]] == file_name]
            writer = TensorWriter(f, mine, metadata={"format": "pt"})
            for name, dtype, shape in mine:
                value = 1.0 if name.endswith("norm.weight") else 0.02
                writer.add(name, (rng.standard_normal(shape, np.float32) * value).astype(dtype))
            writer.close()
    (directory / "config.json").write_text(json.dumps(arch_lib.from_gpt_config(config, dtype="bfloat16")))
    if len(set(files.values())) > 1:
        (directory / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": files}))
    largest = max(math.prod(shape) for _, _, shape in entries)
    return {"params": sum(math.prod(shape) for _, _, shape in entries), "files": len(set(files.values())),
            "largest_f32": largest * 4, "bytes": sum(math.prod(shape) * 2 for _, _, shape in entries)}


def measure_shardlib(directory: str, devices: int, strategy: str) -> dict:
    from shardlib.runtime.devices import simulate_cpu_devices

    simulate_cpu_devices(devices)
    import jax

    from shardlib import make_layout, make_mesh
    from shardlib.hf.load import load_params, open_pretrained
    from shardlib.models import trainable
    from shardlib.sharding.strategies import get_strategy

    baseline = rss()
    start, cpu = time.perf_counter(), time.process_time()
    pretrained = open_pretrained(directory)
    strategy = get_strategy(strategy)
    layout = make_layout(trainable(pretrained.model_config), strategy, make_mesh(dict(strategy.default_mesh)))
    params = load_params(pretrained, layout.param_shardings())
    jax.block_until_ready(params)
    return {"seconds": time.perf_counter() - start, "cpu": time.process_time() - cpu, "baseline": baseline,
            "bytes_read": sum(f.bytes_read for f in set(pretrained.files.values()))}


def measure_transformers(directory: str) -> dict:
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    baseline = rss()
    start, cpu = time.perf_counter(), time.process_time()
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    del model
    return {"seconds": seconds, "cpu": cpu, "baseline": baseline}


def rss() -> int:
    """This process's resident set now (bytes): what the libraries took before the load starts."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def child(kind: str, args: argparse.Namespace, directory: Path) -> dict:
    """One measurement in a fresh process: its result and its peak RSS."""
    out = subprocess.run([sys.executable, __file__, "--child", kind, "--dir", str(directory), "--devices",
                          str(args.devices), "--strategy", args.strategy], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def best(measured: list[dict]) -> dict:
    """One loader's rounds: its shortest wall and CPU times, and the round with the largest growth
    (its peak and its own baseline)."""
    worst = max(measured, key=lambda m: m["peak_rss"] - m["baseline"])
    return {**worst, "seconds": min(m["seconds"] for m in measured), "cpu": min(m["cpu"] for m in measured)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="1b", help="shardlib.models config whose shapes are written (default 1b)")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--strategy", default="zero3")
    parser.add_argument("--shard-mb", type=float, default=500.0, help="safetensors shard size (default 500 MiB)")
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per loader; minimum time kept (default 3)")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--child", choices=["shardlib", "transformers"], help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = (measure_shardlib(args.dir, args.devices, args.strategy) if args.child == "shardlib"
                  else measure_transformers(args.dir))
        result["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(json.dumps(result))
        return
    kinds = ("shardlib", "transformers")
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "checkpoint"
        written = write_checkpoint(args.model, directory, args.shard_mb)
        rounds = []
        for k in range(args.rounds):  # alternating which goes first: the same load from other jobs on both
            order = kinds if k % 2 == 0 else kinds[::-1]
            rounds.append({kind: child(kind, args, directory) for kind in order})
            r = rounds[-1]
            print(f"round {k + 1}: shardlib {r['shardlib']['seconds']:.1f} s ({r['shardlib']['cpu']:.1f} s CPU), "
                  f"transformers {r['transformers']['seconds']:.1f} s ({r['transformers']['cpu']:.1f} s CPU): "
                  f"{r['shardlib']['seconds'] / r['transformers']['seconds']:.2f}x", flush=True)
    results = {kind: best([r[kind] for r in rounds]) for kind in kinds}
    share = written["params"] * 4  # the f32 parameters this process's (simulated) devices hold
    gib = 2**30
    rows = [(kind, r["seconds"], r["cpu"], r["peak_rss"] / gib, (r["peak_rss"] - r["baseline"]) / gib,
             (r["peak_rss"] - r["baseline"]) / (share + written["largest_f32"])) for kind, r in results.items()]
    print(f"model {args.model}: {written['params'] / 1e9:.2f}B params, bf16 checkpoint in {written['files']} shards; "
          f"{args.strategy} over {args.devices} CPU devices; f32 share {share / gib:.2f} GiB + largest tensor "
          f"{written['largest_f32'] / gib:.2f} GiB; best of {args.rounds} fresh processes each")
    if args.markdown:
        print("| loader | wall s | CPU s | peak RSS GiB | growth during the load GiB | growth / (share + one tensor) |\n"
              "|---|---|---|---|---|---|")
        for kind, seconds, cpu, peak, growth, ratio in rows:
            print(f"| {kind} | {seconds:.1f} | {cpu:.1f} | {peak:.2f} | {growth:.2f} | {ratio:.2f} |")
    else:
        for kind, seconds, cpu, peak, growth, ratio in rows:
            print(f"{kind:13s} {seconds:7.1f} s ({cpu:.1f} s CPU)   peak RSS {peak:6.2f} GiB (+{growth:.2f} during the "
                  f"load)   {ratio:.2f} x (share + one tensor)")
    read = results["shardlib"]["bytes_read"]
    print(f"shardlib's reader read {read / gib:.3f} GiB of the {written['bytes'] / gib:.3f} GiB checkpoint "
          f"({read / written['bytes']:.3f}x; one process: all of it, once)")
    print(f"shardlib / transformers: time {rows[0][1] / rows[1][1]:.2f}x (best of each), CPU time "
          f"{rows[0][2] / rows[1][2]:.2f}x, peak RSS {rows[0][3] / rows[1][3]:.2f}x, growth {rows[0][4] / rows[1][4]:.2f}x")

if __name__ == "__main__":
    main()
