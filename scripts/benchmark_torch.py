"""shardlib's train step against PyTorch DDP and FSDP2 on the same CPU, same model, same batch.

Both sides train shardlib's `small` byte-level GPT (RMSNorm, rotary attention, SwiGLU MLP,
untied head; the PyTorch module below has the same parameters, count printed) with AdamW on a
global batch of 32 x 128 tokens:

  shardlib dp     vs  DDP (gloo)
  shardlib zero2  vs  FSDP2 `fully_shard(..., reshard_after_forward=False)` per block, then the root
  shardlib zero3  vs  FSDP2 `fully_shard` per block, then the root

shardlib runs in this process on 8 simulated CPU devices; PyTorch runs as 8 gloo ranks with one
thread each (`torch.set_num_threads(1)`), started by this script. The two alternate round by round
(the order flips every round) so machine load hits both alike; the ratio printed is the median
over rounds of (median shardlib step time / median torch step time): below 1, shardlib is faster.

  python scripts/benchmark_torch.py                  # dp, zero2, zero3; a few minutes on 2 cores
  python scripts/benchmark_torch.py --markdown       # a table for BENCHMARKS.md
  python scripts/benchmark_torch.py --model tiny --strategies dp --rounds 1 --steps 1

PyTorch is an optional extra used only by this script: `pip install -e ".[bench]"`.

Differences that remain (same shapes and parameter count): PyTorch attention is
`F.scaled_dot_product_attention(is_causal=True)` (what a PyTorch user writes), whose CPU kernel
never holds the whole score matrix; shardlib's model runs its "blocked" attention here for the
same reason (32 queries' scores at a time; `--attention einsum` writes out the whole masked
matrix, the config's default); the PyTorch initialisation is its modules' defaults
(not shardlib's fan-in scaling); with remat on (the config's default) both sides recompute each
block and the head in the backward pass (`torch.utils.checkpoint`, non-reentrant); shardlib's step
also computes the gradient norm and skips non-finite updates, which PyTorch's loop does not.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import queue
import socket
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import add_shape_arguments, machine as _machine  # noqa: E402

try:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
except ImportError:  # `--help` still works; main() stops with a one-line message
    torch = None
    _Module: Any = object
else:
    _Module = nn.Module

# shardlib strategy -> the PyTorch wrapping it is compared with
PAIRS = {"dp": "DDP", "zero2": "FSDP2 (no reshard)", "zero3": "FSDP2"}
MISSING_TORCH = ("benchmark_torch: PyTorch is not installed; install the CPU wheel with "
                 "`pip install torch==2.13.0` (or `pip install -e '.[bench]'`)")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(parser)
    parser.add_argument("--ranks", type=int, default=8, help="simulated devices = torch ranks (default: 8)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per side per round (default: 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per side per round (default: 1)")
    parser.add_argument("--rounds", type=int, default=3, help="shardlib/torch rounds per strategy (default: 3)")
    parser.add_argument("--strategies", nargs="+", default=list(PAIRS), choices=list(PAIRS), metavar="S",
                        help=f"any of {', '.join(PAIRS)} (default: all)")
    parser.add_argument("--no-remat", action="store_true",
                        help="turn off rematerialisation on both sides (default: the config's, on)")
    parser.add_argument("--attention", default="blocked",
                        help="shardlib's attention (models/configs.py ATTENTION; default: blocked, which like "
                             "PyTorch's CPU scaled_dot_product_attention never holds the whole score matrix)")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table (for BENCHMARKS.md)")
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- the PyTorch model


def _rope(x: Any, sin: Any, cos: Any) -> Any:
    """Rotate the two halves of each head (x: [batch, seq, heads, head_dim]), as models/gpt.py does."""
    x1, x2 = x.chunk(2, dim=-1)
    sin, cos = sin[None, :, None, :], cos[None, :, None, :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class TorchAttention(_Module):
    """Causal self-attention with rotary embeddings; wq/wk/wv/wo with no biases, like shardlib's."""

    def __init__(self, cfg: dict):
        super().__init__()
        d, self.heads, self.kv_heads = cfg["d_model"], cfg["n_heads"], cfg["n_kv_heads"]
        self.head_dim = d // self.heads
        self.wq = nn.Linear(d, self.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.heads * self.head_dim, d, bias=False)

    def forward(self, x: Any, sin: Any, cos: Any) -> Any:
        b, t, _ = x.shape
        q = _rope(self.wq(x).view(b, t, self.heads, self.head_dim), sin, cos).transpose(1, 2)
        k = _rope(self.wk(x).view(b, t, self.kv_heads, self.head_dim), sin, cos).transpose(1, 2)
        v = self.wv(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class TorchBlock(_Module):
    """Pre-norm block: x + attn(norm(x)), then x + w_down(silu(x w_gate) * (x w_up))."""

    def __init__(self, cfg: dict):
        super().__init__()
        d, f = cfg["d_model"], cfg["d_ff"]
        self.attn_norm = nn.RMSNorm(d, eps=cfg["norm_eps"])
        self.attn = TorchAttention(cfg)
        self.mlp_norm = nn.RMSNorm(d, eps=cfg["norm_eps"])
        self.w_gate = nn.Linear(d, f, bias=False)
        self.w_up = nn.Linear(d, f, bias=False)
        self.w_down = nn.Linear(f, d, bias=False)

    def forward(self, x: Any, sin: Any, cos: Any) -> Any:
        x = x + self.attn(self.attn_norm(x), sin, cos)
        h = self.mlp_norm(x)
        return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


class TorchGPT(_Module):
    """Embedding -> blocks -> RMSNorm -> untied head; float32 logits, mean cross-entropy."""

    def __init__(self, cfg: dict, remat: bool):
        super().__init__()
        d, vocab = cfg["d_model"], cfg["vocab_size"]
        self.remat = remat
        self.embedding = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(TorchBlock(cfg) for _ in range(cfg["n_layers"]))
        self.final_norm = nn.RMSNorm(d, eps=cfg["norm_eps"])
        self.lm_head = nn.Linear(d, vocab, bias=False)
        head_dim, theta = d // cfg["n_heads"], cfg["rope_theta"]
        inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.arange(cfg["max_seq_len"], dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("sin", angles.sin(), persistent=False)
        self.register_buffer("cos", angles.cos(), persistent=False)

    def _head(self, x: Any) -> Any:
        return self.lm_head(self.final_norm(x))

    def _call(self, fn: Any, *args: Any) -> Any:
        """Recompute ``fn`` in the backward pass when remat is on, as shardlib's model does."""
        if self.remat:
            return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)

    def forward(self, inputs: Any, targets: Any) -> Any:
        t = inputs.shape[1]
        sin, cos = self.sin[:t], self.cos[:t]
        x = self.embedding(inputs)
        for block in self.blocks:
            x = self._call(block, x, sin, cos)
        logits = self._call(self._head, x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def torch_param_count(cfg: dict) -> int:
    """Parameters of the PyTorch model, built on the meta device (no memory, no init)."""
    with torch.device("meta"):
        return sum(p.numel() for p in TorchGPT(cfg, remat=False).parameters())


# ----------------------------------------------------------------------------- the PyTorch ranks


def _wrap(model: Any, pair: str) -> Any:
    """DDP, or FSDP2 per block then the root (reshard_after_forward=False for the zero2 pair)."""
    if pair == "dp":
        # Gradients as views of DDP's buckets: no second gradient copy (DDP's documented option).
        return torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    reshard = pair == "zero3"
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    return fully_shard(model, mesh=mesh, reshard_after_forward=reshard)


def _local_bytes(tensor: Any) -> int:
    """Bytes this rank holds for a tensor (a DTensor's local shard)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def _state_bytes(model: Any, optimizer: Any) -> dict[str, int]:
    """Per-rank parameter, gradient and AdamW-state bytes, from the local shards' sizes."""
    params = list(model.parameters())
    return {
        "params": sum(_local_bytes(p) for p in params),
        "grads": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
        "opt": sum(_local_bytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)),
    }


def _rss(field: str) -> int:
    """``VmRSS`` or ``VmHWM`` (peak) of this process in bytes, from /proc/self/status (Linux).

    Not ``resource.getrusage``'s ``ru_maxrss``: Linux keeps it across fork + exec, so a spawned
    rank starts with the parent JAX process's high-water mark (about 0.8 GiB here).
    """
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024  # reported in kB


def _reset_peak_rss() -> int:
    """Restart VmHWM from the current RSS (Linux >= 4.0, `man 5 proc`: clear_refs 5); returns that RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _rss("VmRSS")


def _torch_steps(model: Any, optimizer: Any, batch: tuple[Any, Any], warmup: int, steps: int) -> list[float]:
    """Run warm-up then timed steps; each timed step ends at a barrier, so it is the slowest rank's."""
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        model(*batch).backward()
        optimizer.step()
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def _step_peak_bytes(model: Any, optimizer: Any, batch: tuple[Any, Any]) -> int:
    """Tensor bytes live at the peak of one training step: CPU's stand-in for CUDA's
    ``torch.cuda.max_memory_allocated`` (which has no CPU version), comparable with XLA's buffer
    assignment on the shardlib side.

    The gradients are dropped before the profiled step, so every byte live at its start is a
    parameter or optimizer-state tensor (`_state_bytes`); the profiler's ``profile_memory`` events
    carry the running total of what the step allocates minus what it frees ("Total Allocated",
    counted from the profiler's start), and its maximum is the step's high-water mark above that.
    Tensors outside the model and optimizer (the batch, rotary tables, FSDP's small buffers) are
    not counted; a pre-existing tensor freed during the step is not subtracted (an upper bound).
    """
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    optimizer.zero_grad(set_to_none=True)
    at_start = sum(_state_bytes(model, optimizer).values())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(*batch).backward()
        optimizer.step()
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        events = json.load(open(trace.name))["traceEvents"]
    running = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    return at_start + max(running, default=0)


def torch_worker(rank: int, world: int, port: int, pair: str, cfg: dict, remat: bool,
                 tokens: Any, commands: Any, results: Any) -> None:
    """One gloo rank: build, wrap, then run (warmup, steps) commands until None; report memory."""
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rss_before = _reset_peak_rss()  # torch and gloo loaded, no model yet
    torch.manual_seed(0)
    model = _wrap(TorchGPT(cfg, remat), pair)
    # optax.adamw(1e-3)'s defaults, so both sides run the same update
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-4)
    local = torch.from_numpy(tokens).long().chunk(world)[rank]
    batch = (local[:, :-1].contiguous(), local[:, 1:].contiguous())
    while (command := commands.get()) is not None:
        times = _torch_steps(model, optimizer, batch, *command)
        if rank == 0:
            results.put(("times", times))
    rest = _state_bytes(model, optimizer)  # after the timed steps, before the profiled one
    results.put(("memory", rank, {**rest, "peak": _step_peak_bytes(model, optimizer, batch)}, _rss("VmHWM"), rss_before))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TorchRanks:
    """The 8 gloo ranks of one strategy, alive across rounds and driven through per-rank queues."""

    def __init__(self, pair: str, cfg: dict, remat: bool, tokens: Any, world: int):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # never fork a process that runs JAX
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(world)]
        port = _free_port()
        self.procs = [ctx.Process(target=torch_worker, daemon=True,
                                  args=(r, world, port, pair, cfg, remat, tokens, self.commands[r], self.results))
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def _get(self) -> tuple:
        """The next result; a rank that died stops the benchmark with its exit code."""
        while True:
            try:
                return self.results.get(timeout=5)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(self.procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise SystemExit(f"benchmark_torch: torch rank {dead[0][0]} exited with code {dead[0][1]} "
                                     "(its traceback is above)")

    def run(self, warmup: int, steps: int) -> list[float]:
        for q in self.commands:
            q.put((warmup, steps))
        return self._get()[1]

    def close(self) -> dict[str, int]:
        """Stop the ranks; rank 0's state bytes, the largest step peak (`_step_peak_bytes`) and
        peak RSS over ranks, and the largest growth of a rank's peak RSS over its RSS before the
        model was built."""
        for q in self.commands:
            q.put(None)
        reports = sorted(self._get()[1:] for _ in self.procs)
        for p in self.procs:
            p.join()
        return {**reports[0][1], "peak": max(r[1]["peak"] for r in reports), "rss": max(r[2] for r in reports),
                "rss_growth": max(r[2] - r[3] for r in reports)}


# ----------------------------------------------------------------------------- the shardlib side


class ShardlibSide:
    """One strategy's compiled shardlib step and its state, kept across rounds."""

    def __init__(self, strategy: str, model: Any, config: Any, tokens: Any, ranks: int):
        import jax
        import optax

        from shardlib import build, make_layout, make_mesh
        from shardlib.tools.plan_candidates import default_mesh

        mesh = make_mesh(default_mesh(strategy, ranks, config), devices=jax.devices()[:ranks])
        layout = make_layout(model, strategy, mesh)
        program = build(model, optax.adamw(1e-3), layout)
        batch_np = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
        self.batch = jax.device_put(batch_np, layout.batch_sharding(batch_np))
        self.state = program.init(jax.random.key(0))
        self.compiled = program.step.lower(self.state, self.batch).compile()

    def run(self, warmup: int, steps: int) -> list[float]:
        import jax

        times = []
        for i in range(warmup + steps):
            start = time.perf_counter()
            self.state, metrics = self.compiled(self.state, self.batch)
            jax.block_until_ready((self.state, metrics))
            if i >= warmup:
                times.append(time.perf_counter() - start)
        return times

    def memory(self) -> dict[str, int]:
        """Device 0's parameter, gradient and optimizer-state bytes, and XLA's peak for the step.

        Gradients are reduced into the optimizer-state layout (``shardlib/step/reduce.py``), so
        their per-device bytes are those of Adam's first moment.
        """
        import jax
        import optax

        from shardlib.tools.memory import memory_stats, peak_bytes

        def local(tree: Any) -> int:
            return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))

        opt_state = self.state.opt_state
        return {"params": local(self.state.params), "grads": local(optax.tree_utils.tree_get(opt_state, "mu")),
                "opt": local(opt_state), "peak": peak_bytes(memory_stats(self.compiled))}


# ----------------------------------------------------------------------------- rounds and report


def bench_strategy(strategy: str, args: argparse.Namespace, config: Any, tokens: Any) -> dict[str, Any]:
    """Start the torch ranks, compile shardlib's step meanwhile, then alternate rounds."""
    from shardlib.models import trainable

    ranks = TorchRanks(strategy, dataclasses.asdict(config), config.remat, tokens, args.ranks)
    ours = ShardlibSide(strategy, trainable(config), config, tokens, args.ranks)
    sides = {"shardlib": ours.run, "torch": ranks.run}
    medians: dict[str, list[float]] = {"shardlib": [], "torch": []}
    for r in range(args.rounds):
        for key in ("shardlib", "torch") if r % 2 == 0 else ("torch", "shardlib"):
            medians[key].append(statistics.median(sides[key](args.warmup, args.steps)))
    ratios = [a / b for a, b in zip(medians["shardlib"], medians["torch"])]
    return {"strategy": strategy, "ratio": statistics.median(ratios), "ratios": ratios,
            "shardlib_s": statistics.median(medians["shardlib"]), "torch_s": statistics.median(medians["torch"]),
            "shardlib_mem": ours.memory(), "torch_mem": ranks.close()}


def _verdict(row: dict[str, Any]) -> str:
    """The issue's target: median ratio <= 0.85 at equal or lower per-device memory, at rest
    (parameters + gradients + optimizer state) and at the step's peak, each judged."""
    ours, theirs = row["shardlib_mem"], row["torch_mem"]
    checks = (("time", row["ratio"] <= 0.85), ("memory at rest", _model_state(ours) <= _model_state(theirs)),
              ("peak memory", ours["peak"] <= theirs["peak"]))
    misses = [what for what, ok in checks if not ok]
    return "met" if not misses else "missed: " + ", ".join(misses)


def _model_state(mem: dict[str, int]) -> int:
    return mem["params"] + mem["grads"] + mem["opt"]


def render(rows: Sequence[dict[str, Any]], markdown: bool) -> str:
    from shardlib.tools.report import format_bytes, format_markdown, format_table

    table = [{
        "shardlib": r["strategy"], "torch": PAIRS[r["strategy"]],
        "shardlib s/step": f"{r['shardlib_s']:.3f}", "torch s/step": f"{r['torch_s']:.3f}",
        "ratio (median)": f"{r['ratio']:.3f}", "ratio range": f"{min(r['ratios']):.2f}-{max(r['ratios']):.2f}",
        "shardlib p+g+opt/dev": format_bytes(_model_state(r["shardlib_mem"])),
        "torch p+g+opt/rank": format_bytes(_model_state(r["torch_mem"])),
        "shardlib XLA peak/dev": format_bytes(r["shardlib_mem"]["peak"]),
        "torch step peak/rank": format_bytes(r["torch_mem"]["peak"]),
        "torch peak RSS/rank (growth)": f"{format_bytes(r['torch_mem']['rss'])} "
                                       f"({format_bytes(r['torch_mem']['rss_growth'])})",
        "target (<= 0.85x, <= memory)": _verdict(r),
    } for r in rows]
    return format_markdown(table) if markdown else format_table(table)


def machine() -> str:
    return _machine(f"torch {torch.__version__}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if torch is None:
        raise SystemExit(MISSING_TORCH)
    from shardlib.tools.plan_candidates import setup_devices

    setup_devices(args.ranks)
    import numpy as np

    from shardlib.models import get_config, param_count

    config = dataclasses.replace(get_config(args.model), attention=args.attention)
    if args.no_remat:
        config = dataclasses.replace(config, remat=False)
    seq_len = args.seq_len or config.max_seq_len
    if args.batch_size % args.ranks:
        raise SystemExit(f"benchmark_torch: --batch-size {args.batch_size} does not divide over --ranks {args.ranks}")
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (args.batch_size, seq_len + 1), dtype=np.int32)
    print(f"# {args.model} GPT: shardlib {param_count(config):,} parameters, torch "
          f"{torch_param_count(dataclasses.asdict(config)):,}; global batch {args.batch_size} x {seq_len} tokens, "
          f"AdamW, remat {'on' if config.remat else 'off'}, shardlib attention {config.attention}; "
          f"{args.rounds} rounds of {args.warmup} warm-up + "
          f"{args.steps} timed steps per side; {machine()}", flush=True)
    rows = []
    for strategy in args.strategies:
        rows.append(bench_strategy(strategy, args, config, tokens))
        if not args.markdown:
            print(f"  {strategy} vs {PAIRS[strategy]}: ratio {rows[-1]['ratio']:.3f}", flush=True)
    print(render(rows, args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
