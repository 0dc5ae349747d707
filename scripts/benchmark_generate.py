"""shardlib's compiled decoding against transformers' ``generate``: same checkpoint, same CPU, greedy.

A random-weight Llama (shallow and narrow so that it runs on a small CPU, but with a full-size
vocabulary: the shape where a prefill that computed the head at every prompt position hurt) is
saved by transformers; both sides load it in float32 and continue the same random prompts of
``--prompt-len`` tokens by ``--new-tokens`` tokens, greedy, no stop id, at each ``--batch``. The
two alternate round by round (machine load hits both alike); each side's time is its minimum over
``--rounds`` rounds of one whole ``generate`` call (prefill and decoding), and tokens/s counts the
new tokens of every row. *Ratio by CPU time* divides the two sides' least process CPU time for
that call instead (a loaded machine's descheduling left out; with ``--threads 1``, the default,
the process is pinned to one core, since XLA:CPU used a second one despite its flags). The
prefill columns time the same call for one new token (the prompt's pass and its head; transformers'
``generate`` too computes the head at the last prompt position only, ``logits_to_keep=1``), the step
columns the CPU time of the rest of the call a new token. The head columns time the step's largest product alone,
[B, hidden] x [hidden, vocab] on the same weights: shardlib's compiled form (`models.decoding.step_head`'s
vocabulary-major product) against torch's ``F.linear`` of the head's weight (min CPU time). shardlib's
compile time (its first calls, less compiled calls) is printed apart. Both sides' token ids are
compared: a difference stops the run.

  python scripts/benchmark_generate.py                                   # 128k vocab, 2k prompts
  python scripts/benchmark_generate.py --vocab 1024 --prompt-len 32      # the tiny shape

Needs the ``bench`` extra (PyTorch, transformers).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import machine  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=128256, help="vocabulary size (default: Llama 3's 128256)")
    parser.add_argument("--prompt-len", type=int, default=2048, help="tokens per prompt (default 2048)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per row (default 64)")
    parser.add_argument("--batch", default="1,8", help="batch sizes, comma-separated (default 1,8)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--ff", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per side (the minimum is kept)")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads of each side (default 1, the process pinned to one core: on a shared "
                             "machine, torch's OpenMP regions "
                             "stall on descheduled threads, 30x slower steps measured at 2 threads under load; "
                             "0: each library's default)")
    args = parser.parse_args()
    if args.threads == 1:  # before jax starts its CPU client
        # XLA:CPU still ran on more than one core under these flags (6.5 s of CPU time in a 3.9 s
        # call, measured): one core for the whole process, so both sides get one
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_cpu_multi_thread_eigen=false",
                                            "intra_op_parallelism_threads=1"]).strip()
    elif args.threads > 1:
        os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                            f"intra_op_parallelism_threads={args.threads}"]).strip()

    import jax
    import numpy as np
    import torch
    import transformers

    from shardlib.hf.load import load_params, open_pretrained
    from shardlib.models import trainable
    from shardlib.models.decoding import generate
    from shardlib.models import from_params
    from shardlib.sharding.layout import make_layout
    from shardlib.sharding.mesh import make_mesh

    if args.threads:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "llama"
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ff,
                                          num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                          num_key_value_heads=args.kv_heads,
                                          max_position_embeddings=args.prompt_len + args.new_tokens)
        transformers.LlamaForCausalLM(config).save_pretrained(directory)
        reference = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        pretrained = open_pretrained(directory)
        layout = make_layout(trainable(pretrained.model_config), "dp",
                             make_mesh({"data": 1}, devices=jax.devices()[:1]))
        ours = from_params(pretrained.model_config, load_params(pretrained, layout.param_shardings()))

    print(f"# {machine(f'torch {torch.__version__}', f'transformers {transformers.__version__}')}")
    print(f"# Llama {args.layers} layers, hidden {args.hidden}, {args.heads} heads / {args.kv_heads} kv, ff {args.ff}, "
          f"vocab {args.vocab}; prompts of {args.prompt_len} tokens + {args.new_tokens} new, greedy, float32, "
          f"{args.threads or 'default'} thread(s) a side")
    print("| batch | shardlib tokens/s | transformers tokens/s | ratio | ratio by CPU time | shardlib prefill s "
          "| transformers prefill s | shardlib step ms | transformers step ms | shardlib head ms | torch head ms "
          "| shardlib compile s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batch in (int(b) for b in args.batch.split(",")):
        prompts = np.random.RandomState(batch).randint(0, args.vocab, (batch, args.prompt_len)).astype(np.int32)

        def run_ours(steps: int) -> np.ndarray:
            out = generate(ours, prompts, steps, rng=jax.random.key(0), temperature=0.0)
            return np.asarray(jax.block_until_ready(out))[:, args.prompt_len:]

        def run_theirs(steps: int) -> np.ndarray:
            with torch.inference_mode():
                ids = torch.tensor(prompts, dtype=torch.long)
                out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps,
                                         min_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0)
            return out[:, args.prompt_len:].numpy()

        start = time.perf_counter()
        first = {steps: run_ours(steps) for steps in (args.new_tokens, 1)}
        first_calls = time.perf_counter() - start
        times: dict[tuple[str, int], list[float]] = {}
        cpu_times: dict[tuple[str, int], list[float]] = {}
        for round_ in range(args.rounds):
            for side, fn in (("ours", run_ours), ("theirs", run_theirs))[::1 if round_ % 2 == 0 else -1]:
                for steps in (args.new_tokens, 1):
                    start, cpu = time.perf_counter(), time.process_time()
                    got = fn(steps)
                    times.setdefault((side, steps), []).append(time.perf_counter() - start)
                    cpu_times.setdefault((side, steps), []).append(time.process_time() - cpu)
                    if not np.array_equal(got, first[steps]):
                        raise SystemExit(f"batch {batch}: shardlib's tokens differ from transformers' "
                                         f"({int((got != first[steps]).sum())} of {got.size})")
        best = {key: min(t) for key, t in times.items()}
        rate = {side: batch * args.new_tokens / best[side, args.new_tokens] for side in ("ours", "theirs")}
        compile_s = first_calls - best["ours", args.new_tokens] - best["ours", 1]
        least_cpu = {key: min(t) for key, t in cpu_times.items()}
        by_cpu = least_cpu["theirs", args.new_tokens] / least_cpu["ours", args.new_tokens]
        step_ms = {side: 1e3 * (least_cpu[side, args.new_tokens] - least_cpu[side, 1]) / (args.new_tokens - 1)
                   for side in ("ours", "theirs")}
        head_ms = _head_products(ours, reference, batch, args.hidden, args.rounds)
        print(f"| {batch} | {rate['ours']:.1f} | {rate['theirs']:.1f} | {rate['ours'] / rate['theirs']:.2f}x | "
              f"{by_cpu:.2f}x | {best['ours', 1]:.2f} | {best['theirs', 1]:.2f} | {step_ms['ours']:.1f} | "
              f"{step_ms['theirs']:.1f} | {head_ms['ours']:.1f} | {head_ms['theirs']:.1f} | {compile_s:.1f} |", flush=True)
    return 0


def _head_products(ours, reference, batch: int, hidden: int, rounds: int) -> dict[str, float]:
    """Least CPU milliseconds of the head's product for ``batch`` rows on each side: shardlib's
    compiled vocabulary-major product, torch's ``F.linear`` on the checkpoint's head weight."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from shardlib.models.decoding import vocab_major_head

    h = np.random.RandomState(0).standard_normal((batch, hidden)).astype(np.float32)
    weights, h_ours, h_theirs = vocab_major_head(ours), jnp.asarray(h), torch.from_numpy(h)
    product = jax.jit(lambda w, x: jnp.einsum("vd,bd->vb", w, x, preferred_element_type=jnp.float32))
    runs = {"ours": lambda: jax.block_until_ready(product(weights, h_ours)),
            "theirs": lambda: torch.nn.functional.linear(h_theirs, reference.lm_head.weight)}
    best = {}
    with torch.inference_mode():
        for side, fn in runs.items():
            fn()
            cpu = []
            for _ in range(5 * rounds):
                start = time.process_time()
                fn()
                cpu.append(time.process_time() - start)
            best[side] = 1e3 * min(cpu)
    return best


if __name__ == "__main__":
    sys.exit(main())
