"""shardlib's compiled decoding against transformers' ``generate``: same checkpoint, same CPU, greedy.

A random-weight Llama (shallow and narrow so that it runs on a small CPU, but with a full-size
vocabulary: the shape where a prefill that computed the head at every prompt position hurt) is
saved by transformers; both sides load it in float32 and continue the same random prompts of
``--prompt-len`` tokens by ``--new-tokens`` tokens, greedy, no stop id, at each ``--batch``. The
two alternate round by round (machine load hits both alike); each side's time is its minimum over
``--rounds`` rounds of one whole ``generate`` call (prefill and decoding), and tokens/s counts the
new tokens of every row. shardlib's compile time (its first call, less a compiled call) is
printed apart. Both sides' token ids are compared: the ratio is only printed for equal outputs.

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
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per row (default 32)")
    parser.add_argument("--batch", default="1,8", help="batch sizes, comma-separated (default 1,8)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--ff", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per side (the minimum is kept)")
    args = parser.parse_args()

    import jax
    import numpy as np
    import torch
    import transformers

    from shardlib.hf.load import load_params, open_pretrained
    from shardlib.models import trainable
    from shardlib.models.decoding import generate
    from shardlib.models.gpt import from_params
    from shardlib.sharding.layout import make_layout
    from shardlib.sharding.mesh import make_mesh

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
          f"vocab {args.vocab}; prompts of {args.prompt_len} tokens + {args.new_tokens} new, greedy, float32")
    print("| batch | shardlib tokens/s | transformers tokens/s | ratio | shardlib compile s |")
    print("|---:|---:|---:|---:|---:|")
    for batch in (int(b) for b in args.batch.split(",")):
        prompts = np.random.RandomState(batch).randint(0, args.vocab, (batch, args.prompt_len)).astype(np.int32)

        def run_ours() -> np.ndarray:
            out = generate(ours, prompts, args.new_tokens, rng=jax.random.key(0), temperature=0.0)
            return np.asarray(jax.block_until_ready(out))[:, args.prompt_len:]

        def run_theirs() -> np.ndarray:
            with torch.inference_mode():
                ids = torch.tensor(prompts, dtype=torch.long)
                out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                                         min_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None,
                                         pad_token_id=0)
            return out[:, args.prompt_len:].numpy()

        start = time.perf_counter()
        first = run_ours()
        first_call = time.perf_counter() - start
        times: dict[str, list[float]] = {"ours": [], "theirs": []}
        for round_ in range(args.rounds):
            for side, fn in (("ours", run_ours), ("theirs", run_theirs))[::1 if round_ % 2 == 0 else -1]:
                start = time.perf_counter()
                got = fn()
                times[side].append(time.perf_counter() - start)
                if side == "theirs" and not np.array_equal(got, first):
                    raise SystemExit(f"batch {batch}: shardlib's tokens differ from transformers' "
                                     f"({int((got != first).sum())} of {got.size})")
        best = {side: min(t) for side, t in times.items()}
        rate = {side: batch * args.new_tokens / t for side, t in best.items()}
        print(f"| {batch} | {rate['ours']:.1f} | {rate['theirs']:.1f} | {rate['ours'] / rate['theirs']:.2f}x | "
              f"{first_call - best['ours']:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
