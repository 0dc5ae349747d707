"""CPU seconds and assertion margins of tests/test_tpu_scale.py's 64-chip zero3 compile at model widths
(issue 47).

    python scripts/benchmark_tpu_scale_width.py [--widths 512:1024:512,128:512:512] [--one-stage]

Each width is d_model:d_ff:vocab (4 heads of 128, 2 layers, bf16, as the test's CONFIG), compiled as
the test does (`test_tpu_scale._zero3_stats`) for v5p:4x4x4 with the TPU policy's options and with
them off (libtpu on this host; nothing runs). Prints the CPU seconds of the policy compile and
each figure the test asserts on, with its bound: the step's bytes over the ZeRO volume
(N-1)/N (2 x 2 + 4) Psi (<= 1.1), the gathered all-reduces over the all-gathers (< 0.01), the
all-reduces over the reduce-scatters (< 0.05), and with the options off the all-gathers (== 0) and
the all-reduces over the policy's all-gathers (>= 1). ``--one-stage`` also compiles the step with the
whole-slice reduce-scatters left to the compiler (`staged.stages_for` answering none): the volume
ratio the 1.1 bound must reject. ``--hsdp`` adds the four-slice hsdp plan's DCN bytes against
the ring volume the test asserts to 1%.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from unittest import mock

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def config_of(width: str):
    from tests import test_tpu_scale as t

    d_model, d_ff, vocab = (int(x) for x in width.split(":"))
    return dataclasses.replace(t.CONFIG, d_model=d_model, d_ff=d_ff, vocab_size=vocab, attention_head_dim=128)


def zero3(chips, config, options=None):
    """(CPU seconds, collective stats) of the test's zero3 compile for ``config``."""
    import jax

    from tests import test_tpu_scale as t

    jax.clear_caches()
    start = time.process_time()
    with mock.patch.object(t, "CONFIG", config):
        stats = t._zero3_stats(chips, options)
    return time.process_time() - start, stats


def margins(chips, config, one_stage: bool) -> str:
    import jax
    import numpy as np

    from shardlib.sharding import staged
    from tests import test_tpu_scale as t

    n = t.N
    gathered = lambda stats: sum(r.bytes_per_step for r in stats.records if r.gathered)  # noqa: E731
    seconds, policy = zero3(chips, config)
    kinds = policy.bytes_by_kind()
    psi = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(t.trainable(config).abstract()))
    volume = (n - 1) / n * (2 * 2 + 4) * psi
    off_seconds, off = zero3(chips, config, t.OFF)
    off_kinds = off.bytes_by_kind()
    line = (f"psi {psi:,}: policy compile {seconds:.1f} CPU s (off {off_seconds:.1f}); bytes/volume "
            f"{sum(kinds.values()) / volume:.3f} (<= 1.1); gathered/all-gather "
            f"{gathered(policy) / kinds['all-gather']:.4f} (< 0.01); all-reduce/reduce-scatter "
            f"{kinds['all-reduce'] / kinds['reduce-scatter']:.4f} (< 0.05); "
            f"off: all-gather {off_kinds['all-gather']} (== 0), all-reduce/policy all-gather "
            f"{off_kinds['all-reduce'] / kinds['all-gather']:.3f} (>= 1), gathered {gathered(off)} (> 0)")
    if one_stage:
        with mock.patch.object(staged, "stages_for", lambda *a, **k: {}):
            _, single = zero3(chips, config)
        line += f"; one stage: bytes/volume {sum(single.bytes_by_kind().values()) / volume:.3f} (must exceed 1.1)"
    return line


def hsdp(config) -> str:
    import jax
    import numpy as np

    from shardlib.tools.plan import Planner
    from tests import test_tpu_scale as t

    start = time.process_time()
    row = Planner(config, topology="v5e:2x2", slices=4, precision="bf16", batch_size=16).candidate(
        "hsdp", {"data": 4, "fsdp": 4})
    seconds = time.process_time() - start
    psi = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(t.trainable(config).abstract()))
    expected = 2 * 3 / 4 * 4 * psi / 4
    return (f"hsdp 4 slices: {seconds:.1f} CPU s, DCN bytes / ring volume {row.inter_domain_bytes / expected:.4f} "
            f"(1 to 1%; the two-slice guess would be {(2 * 1 / 2) / (2 * 3 / 4):.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="512:1024:512,128:512:512")
    parser.add_argument("--one-stage", action="store_true")
    parser.add_argument("--hsdp", action="store_true")
    args = parser.parse_args()
    from tests import test_tpu_scale as t
    from tests.helpers import tpu_chips

    chips = tpu_chips(t.SLICE)
    zero3(chips, config_of("128:512:512"))  # the first compile's one-off costs
    for width in args.widths.split(","):
        config = config_of(width)
        print(f"d_model:d_ff:vocab {width}: {margins(chips, config, args.one_stage)}", flush=True)
        if args.hsdp:
            print(f"  {hsdp(config)}", flush=True)


if __name__ == "__main__":
    main()
