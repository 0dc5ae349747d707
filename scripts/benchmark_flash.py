"""Causal flash attention's speed, as ratios measured in one process (BENCHMARKS.md, issue 43).

* ``op``: forward + backward of `shardlib.model.attention.causal_flash` at ``--seq-len`` tokens
  (one row, ``--heads`` heads of ``--head-dim``) against the same tiled call with every key
  visible (``flash(..., causal=False)``: every tile computed) and against the dense causal einsum
  (`models.gpt.causal_attention`). Goal: causal <= 0.6x all-visible at 4096 tokens.
* ``step``: one compiled train step of a GPT (``--heads`` heads of ``--head-dim``, 2 layers,
  one row) with ``attention="flash"`` against ``attention="einsum"``. Goal: <= 0.75x at 4096.
* ``sweep``: flash / einsum forward + backward over ``--lengths``, the measurement
  ``FLASH_MIN_SEQ`` is set from (the shortest length from which flash is not slower).
* ``window``: forward + backward at ``--seq-len`` tokens with a sliding ``--window`` (issue 46):
  windowed flash (the tiles the window hides never computed) against the causal flash and
  against the windowed einsum (`causal_attention(window=)`, the whole [T x T] scores).

Each figure is the minimum over ``--repeats`` runs after a warm-up, in wall seconds or with
``--cpu-time`` this process's CPU seconds (the CPU is shared; ratios in one process are what
compare).

    python scripts/benchmark_flash.py [--seq-len 4096] [--only op,step,sweep,window] [--window 512]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from models.gpt import causal_attention  # noqa: E402
from shardlib import build, make_layout, make_mesh  # noqa: E402
from shardlib.model import attention as attention_lib  # noqa: E402
from shardlib.model import flash as flash_lib  # noqa: E402
from shardlib.models import GPTConfig, trainable  # noqa: E402


CLOCK = time.perf_counter  # --cpu-time: time.process_time, this process's CPU seconds (all threads)


def race(calls, repeats: int) -> list[float]:
    """Minimum seconds (`CLOCK`) of each ``call()`` over ``repeats`` rounds, after one warm-up;
    the calls take turns within a round, so a burst of load elsewhere hits them alike."""
    for call in calls:
        jax.block_until_ready(call())
    times = [[] for _ in calls]
    for _ in range(repeats):
        for call, spent in zip(calls, times):
            start = CLOCK()
            jax.block_until_ready(call())
            spent.append(CLOCK() - start)
    return [min(spent) for spent in times]


def fwd_bwd(attend):
    """jit of the forward + backward of ``attend(q, k, v)`` (the gradient of sum(out * w))."""
    return jax.jit(lambda q, k, v, w: jax.grad(lambda q, k, v: (attend(q, k, v) * w).sum(), argnums=(0, 1, 2))(q, k, v))


def operands(seq_len: int, heads: int, head_dim: int, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(0), 4)
    return tuple(jax.random.normal(key, (1, seq_len, heads, head_dim), dtype) for key in keys)


def all_visible(q, k, v):
    pos = jnp.arange(q.shape[1])
    return attention_lib.flash(q, k, v, pos, pos, False)


def op(args) -> None:
    x = operands(args.seq_len, args.heads, args.head_dim)
    causal, visible, einsum = race([lambda f=fwd_bwd(f): f(*x) for f in (attention_lib.causal_flash, all_visible,
                                                                         causal_attention)], args.repeats)
    print(f"op T={args.seq_len} {args.heads} heads of {args.head_dim}, tiles {flash_lib.QUERY_BLOCK}x"
          f"{flash_lib.KEY_BLOCK}, fwd+bwd: causal flash {causal:.3f} s, all keys visible {visible:.3f} s, "
          f"dense causal einsum {einsum:.3f} s")
    print(f"  causal / all-visible = {causal / visible:.2f} (goal <= 0.6); causal flash / einsum = {causal / einsum:.2f}")


def stepper(attention: str, args):
    """A call of one compiled train step of the benchmark's GPT with ``attention``."""
    config = GPTConfig(vocab_size=256, d_model=args.heads * args.head_dim, n_layers=2, n_heads=args.heads,
                       d_ff=4 * args.heads * args.head_dim, max_seq_len=args.seq_len, attention=attention)
    program = build(trainable(config), optax.sgd(0.1), make_layout(trainable(config), "dp", make_mesh({"data": 1})))
    tokens = np.random.default_rng(0).integers(0, 256, (1, args.seq_len), dtype=np.int32)
    batch = {"inputs": tokens, "targets": tokens}
    held = [program.init(jax.random.key(0))]

    def call():  # the step donates its state: carry the new one on
        held[0], metrics = program.step(held[0], batch)
        return metrics

    return call


def step(args) -> None:
    flash, einsum = race([stepper("flash", args), stepper("einsum", args)], args.repeats)
    print(f"step GPT T={args.seq_len} d_model={args.heads * args.head_dim} 2 layers, one row: "
          f"flash {flash:.3f} s, einsum {einsum:.3f} s, flash / einsum = {flash / einsum:.2f} (goal <= 0.75)")


def sweep(args) -> None:
    print(f"sweep {args.heads} heads of {args.head_dim}, fwd+bwd, flash / einsum (FLASH_MIN_SEQ = "
          f"{attention_lib.FLASH_MIN_SEQ}):")
    for seq_len in args.lengths:
        x = operands(seq_len, args.heads, args.head_dim)
        flash, einsum = race([lambda f=fwd_bwd(f): f(*x) for f in (attention_lib.causal_flash, causal_attention)],
                             args.repeats)
        print(f"  T={seq_len}: flash {flash:.3f} s, einsum {einsum:.3f} s, ratio {flash / einsum:.2f}")


def window(args) -> None:
    x = operands(args.seq_len, args.heads, args.head_dim)
    w = args.window
    calls = (lambda q, k, v: attention_lib.causal_flash(q, k, v, window=w), attention_lib.causal_flash,
             lambda q, k, v: causal_attention(q, k, v, window=w))
    windowed, causal, einsum = race([lambda f=fwd_bwd(f): f(*x) for f in calls], args.repeats)
    print(f"window T={args.seq_len} window={w} {args.heads} heads of {args.head_dim}, tiles {flash_lib.QUERY_BLOCK}x"
          f"{flash_lib.KEY_BLOCK}, fwd+bwd: windowed flash {windowed:.3f} s, causal flash {causal:.3f} s, "
          f"windowed einsum {einsum:.3f} s")
    print(f"  windowed flash / causal flash = {windowed / causal:.2f}; windowed flash / windowed einsum = "
          f"{windowed / einsum:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[512, 1024, 2048, 4096])
    parser.add_argument("--only", default="op,step,sweep")
    parser.add_argument("--window", type=int, default=512, help="the sliding window of the ``window`` measure")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time this process's CPU seconds, not wall seconds (steadier on a loaded machine)")
    parser.add_argument("--block", type=int, default=None, help="QUERY_BLOCK = KEY_BLOCK (default the module's)")
    args = parser.parse_args()
    if args.cpu_time:
        global CLOCK
        CLOCK = time.process_time
    if args.block:
        flash_lib.QUERY_BLOCK = flash_lib.KEY_BLOCK = args.block
    for name in args.only.split(","):
        {"op": op, "step": step, "sweep": sweep, "window": window}[name](args)


if __name__ == "__main__":
    main()
