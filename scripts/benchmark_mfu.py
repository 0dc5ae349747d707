"""Tokens/s and model FLOP utilisation (MFU) of shardlib's train step on the accelerator present.

MFU = model FLOPs per step / (step time x devices x dense bf16 peak per device). Model FLOPs
are `shardlib.models.flops_per_token` (6 N + 12 L H Q T, no remat recomputation) times the
tokens of the global batch; the peak is the hardware profile's (`shardlib.tools.flops`). A CPU
has no peak figure, so there MFU is "n/a" and the run is a smoke test of the script: the
`tiny` model on 8 simulated devices. On a GPU the model's attention is the fused cuDNN kernel
unless ``--attention`` says otherwise (docs/gpu.md has the commands and the results table).

  python scripts/benchmark_mfu.py                              # 1b, bf16, zero3 (tiny on a CPU)
  python scripts/benchmark_mfu.py --xla-gpu-overlap            # the same with XLA's overlap flags
  python scripts/benchmark_mfu.py --vs-jit                     # also: step time over a plain jax.jit step
  python scripts/benchmark_mfu.py --model tiny --steps 3 --batch-size 8 --seq-len 32
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CPU_DEVICES = 8
PER_DEVICE_BATCH = 8  # default global batch = this x devices


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from shardlib.models.configs import ATTENTION
    from shardlib.run.config import PRECISIONS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="models.CONFIGS name (default: 1b on an accelerator, tiny on CPU)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (default: 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after the compile (default: 2)")
    parser.add_argument("--batch-size", type=int,
                        help=f"global sequences per step (default: {PER_DEVICE_BATCH} per device)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's max_seq_len)")
    parser.add_argument("--strategy", default="zero3", help="parallelism strategy, default mesh (default: zero3)")
    parser.add_argument("--precision", default="bf16", choices=list(PRECISIONS), help="compute dtype (default: bf16)")
    parser.add_argument("--xla-gpu-overlap", action="store_true",
                        help="set XLA's GPU overlap flags first (shardlib.runtime.xla_flags.set_gpu_overlap_flags)")
    parser.add_argument("--attention", choices=list(ATTENTION),
                        help="models.GPTConfig.attention (default: the backend policy's, docs/backends.md: cudnn, "
                             "the fused kernel, on a GPU in bf16/fp16; else einsum)")
    parser.add_argument("--remat", action=argparse.BooleanOptionalAction, default=True,
                        help="recompute each layer's forward in the backward pass (default: on)")
    parser.add_argument("--vs-jit", action="store_true",
                        help="also time a hand-written jax.jit step of the same model (scripts/benchmark.py's "
                             "baseline) and print shardlib's step time over it")
    args = parser.parse_args(argv)
    for name in ("steps", "warmup", "batch_size", "seq_len"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "warmup" else 1):
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value}")
    return args


def setup(args: argparse.Namespace) -> str | None:
    """XLA flags (if asked), then the devices: the accelerator if there is one, else 8 simulated CPUs."""
    from shardlib.run.train import setup_devices
    from shardlib.runtime.xla_flags import set_gpu_overlap_flags

    note = set_gpu_overlap_flags() if args.xla_gpu_overlap else None
    setup_devices(CPU_DEVICES)  # its note ("--cpu-devices ignored" on a GPU) names train's flag, not ours
    return note


def build_program(args: argparse.Namespace, model_config: Any) -> Any:
    """The train program: the strategy's default mesh over every device, AdamW, ``--precision``."""
    import optax

    from shardlib import build, get_strategy, make_layout, make_mesh
    from shardlib.models import trainable

    strategy = get_strategy(args.strategy)
    model = trainable(model_config)
    layout = make_layout(model, strategy, make_mesh(dict(strategy.default_mesh)))
    return build(model, optax.adamw(1e-4), layout, precision=args.precision)


def time_steps(program: Any, batch: dict[str, Any], steps: int, warmup: int,
               step_fn: Any = None) -> tuple[float, float]:
    """(compile seconds, seconds per step): ``steps`` steps dispatched back to back after ``warmup``.
    ``step_fn``: another step over the program's state and shardings (default: the program's)."""
    import jax

    state = program.init(jax.random.key(0))
    start = time.perf_counter()
    step = (step_fn or program.step).lower(state, batch).compile()
    compile_s = time.perf_counter() - start
    for _ in range(warmup):
        state, metrics = step(state, batch)
    jax.block_until_ready(state)
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, batch)
    jax.block_until_ready((state, metrics))
    return compile_s, (time.perf_counter() - start) / steps


def report(args: argparse.Namespace, model_config: Any, step_s: float, compile_s: float) -> list[str]:
    """The printed lines: model, devices, tokens/s, MFU (or why there is none)."""
    import jax

    from shardlib.models import flops_per_token, param_count
    from shardlib.tools.flops import mfu, peak_flops_for

    devices = jax.devices()
    tokens = args.batch_size * args.seq_len
    model_flops = flops_per_token(model_config, args.seq_len) * tokens
    peak = peak_flops_for(devices[0])
    utilisation = ("n/a (no peak figure for " + devices[0].platform + ")" if peak is None else
                   f"{mfu(model_flops, step_s, len(devices), peak):.1%} (of {peak / 1e12:.0f} TFLOP/s dense bf16 "
                   "per device)")
    return [
        f"model       {args.model} ({param_count(model_config) / 1e6:.1f}M params), {args.strategy}, {args.precision}, "
        f"{args.attention} attention, remat {'on' if args.remat else 'off'}",
        f"devices     {len(devices)} x {devices[0].platform} ({devices[0].device_kind}), jax {jax.__version__}",
        f"xla flags   {os.environ.get('XLA_FLAGS', '') or '(none)'}",
        f"batch       {args.batch_size} x {args.seq_len} tokens (global), {args.steps} timed steps",
        f"compile     {compile_s:.1f} s",
        f"step time   {step_s * 1e3:.1f} ms",
        f"tokens/s    {tokens / step_s:,.0f}",
        f"model FLOPs {model_flops / step_s / len(devices) / 1e12:.3f} TFLOP/s per device",
        f"MFU         {utilisation}",
    ]


def vs_jit(program: Any, batch: dict[str, Any], args: argparse.Namespace, step_s: float) -> str:
    """The same model and optimizer as a hand-written jit step (no shard_map, no non-finite skip,
    no grad-norm metric), timed the same way after shardlib's: the overhead on this accelerator."""
    import optax

    from benchmark import baseline_step

    sharding = program.layout.batch_sharding(batch)
    plain = baseline_step(program.model, optax.adamw(1e-4), program, sharding)
    _, plain_s = time_steps(program, batch, args.steps, args.warmup, step_fn=plain)
    return f"vs jit      {step_s / plain_s:.3f} (plain jax.jit step: {plain_s * 1e3:.1f} ms)"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    note = setup(args)
    import jax
    import numpy as np

    from shardlib.backend import policy_for
    from shardlib.models import get_config
    from shardlib.models.gpt import attention_for
    from shardlib.run.config import PRECISIONS

    policy = policy_for(jax.devices())  # the devices' backend policy (docs/backends.md)
    on_cpu = policy.platform == "cpu"
    args.model = args.model or ("tiny" if on_cpu else "1b")
    args.attention = args.attention or attention_for(policy, PRECISIONS[args.precision])
    model_config = dataclasses.replace(get_config(args.model), compute_dtype=PRECISIONS[args.precision],
                                       attention=args.attention, remat=args.remat)
    args.seq_len = args.seq_len or model_config.max_seq_len
    args.batch_size = args.batch_size or PER_DEVICE_BATCH * len(jax.devices())
    program = build_program(args, model_config)
    tokens = np.random.default_rng(0).integers(0, model_config.vocab_size, (args.batch_size, args.seq_len + 1),
                                               dtype=np.int32)
    batch_np = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    batch = jax.device_put(batch_np, program.layout.batch_sharding(batch_np))
    compile_s, step_s = time_steps(program, batch, args.steps, args.warmup)
    if note:
        print(f"note        {note}")
    print("\n".join(report(args, model_config, step_s, compile_s)), flush=True)
    if args.vs_jit:
        print(vs_jit(program, batch, args, step_s), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
