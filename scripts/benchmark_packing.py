"""Packed rows against one padded example a row: real (non-padding) tokens per second of the GPT's
forward + backward pass (`models.gpt.next_token_loss`, einsum attention) on examples of 20 to 500
tokens (uniform), rows of 512 positions. Both in this process on the same examples: each way runs
its whole batches of ``--batch-size`` rows (every example once, but those of a last partial batch),
timed as the minimum of ``--repeats`` passes; the ratio is packed over padded.

    python scripts/benchmark_packing.py [--model tiny] [--examples 64] [--batch-size 8] [--repeats 3] [--cpu-devices 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="a built-in config (default tiny)")
    parser.add_argument("--examples", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--cpu-devices", type=int, default=1)
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from shardlib.models import gpt, get_config
    from shardlib.runtime.packing import pack

    seq = args.seq_len
    rng = np.random.default_rng(0)
    lengths = rng.integers(20, 501, size=args.examples)
    tokens = np.zeros((args.examples, seq + 1), np.uint32)
    mask = np.zeros((args.examples, seq), np.float32)
    for i, n in enumerate(lengths):
        tokens[i, :n] = rng.integers(1, 256, size=n)
        mask[i, n // 3:n - 1] = 1.0  # the first third a prompt
    padded = {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32), "loss_mask": mask}
    packed = pack(tokens, mask, lengths)._asdict()

    config = dataclasses.replace(get_config(args.model), attention="einsum", max_seq_len=seq, vocab_size=256)
    graphdef, params = nnx.split(gpt.build(config, 0))
    step = jax.jit(lambda p, b: jax.value_and_grad(lambda q: gpt.next_token_loss(nnx.merge(graphdef, q), b)[0])(p))

    def batches(rows: dict, real: np.ndarray) -> tuple[list[dict], int]:
        """Whole batches only (a training loader draws whole batches from the endless shuffled
        stream; a short last one would count padding no run has), and their real positions."""
        n = len(rows["inputs"]) // args.batch_size * args.batch_size
        return ([{k: jnp.asarray(v[i:i + args.batch_size]) for k, v in rows.items()} for i in range(0, n, args.batch_size)],
                int(real[:n].sum()))

    def best(todo: list[dict]) -> float:
        jax.block_until_ready(step(params, todo[0]))  # compile
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            for b in todo:
                jax.block_until_ready(step(params, b))
            times.append(time.perf_counter() - start)
        return min(times)

    print(f"{args.examples} examples of 20-500 tokens, rows of {seq}, batches of {args.batch_size} rows, model "
          f"{args.model!r} (einsum attention), {jax.devices()[0].platform}; real positions: a document's, not padding")
    speeds = {}
    for name, rows, real in (("padded", padded, lengths - 1), ("packed", packed, (packed["segment_ids"] > 0).sum(1))):
        todo, counted = batches(rows, real)
        seconds = best(todo)
        speeds[name] = counted / seconds
        print(f"{name}: {len(todo)} batches, padding {1 - counted / (len(todo) * args.batch_size * seq):.1%}, "
              f"{speeds[name]:,.0f} real tokens/s")
    print(f"packed / padded real tokens/s: {speeds['packed'] / speeds['padded']:.2f}x")


if __name__ == "__main__":
    main()
