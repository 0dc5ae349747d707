"""CPU seconds of one XLA:TPU step compile of tests/test_tpu_compile.py, at the model width it had and
at the one it has (issue 47).

    python scripts/benchmark_tpu_test_width.py [--cases zero3:bf16,zero3:f32,tp:bf16] [--repeats 1]

Each case (a name of that test's STRATEGIES or OPTIONS, and a precision) is compiled for its v5e 2x4
slice (libtpu on this host; nothing runs) with the test's own build, at d_model 512, d_ff 1024,
vocabulary 256 (before) and with the test's CONFIG (after). Prints CPU seconds per compile (the
minimum over ``--repeats``, `benchmark_tpu_compile.cpu_seconds`) and the ratio after / before.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.benchmark_tpu_compile import cpu_seconds  # noqa: E402

BEFORE = {"vocab_size": 256, "d_model": 512, "n_layers": 2, "n_heads": 4, "d_ff": 1024, "max_seq_len": 128,
          "attention_head_dim": None}


def lowering(chips, config, name: str, precision: str):
    """The test's case ``name`` for ``config``, as a function that lowers it."""
    from tests import test_tpu_compile as t

    return lambda: t.lower_case(chips, config, name, precision)[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="zero3:bf16,zero3:f32,tp:bf16")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    from shardlib.runtime.devices import topology_devices
    from tests import test_tpu_compile as t

    chips = topology_devices(t.TOPOLOGY)
    cpu_seconds(lowering(chips, t.CONFIG, "dp", "f32"), 1)  # the first compile's one-off costs
    for case in args.cases.split(","):
        name, precision = case.split(":")
        before = cpu_seconds(lowering(chips, dataclasses.replace(t.CONFIG, **BEFORE), name, precision), args.repeats)
        after = cpu_seconds(lowering(chips, t.CONFIG, name, precision), args.repeats)
        print(f"{name} {precision}: before {before:.1f} CPU s, after {after:.1f} CPU s ({after / before:.2f}x)",
              flush=True)


if __name__ == "__main__":
    main()
