"""`shardlib plan --lora-rank`: the LoRA flags, the plan header's line on what trains, and the
flags of the `shardlib train` command the plan prints. The state a LoRA plan compiles (the frozen
base in the compute dtype, or as int8 / nf4 codes under ``--lora-base``, AdamW moments for the
adapters only) is the train step's own."""

from __future__ import annotations

import argparse
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lora-rank", type=int, metavar="R", help="plan LoRA fine-tuning: adapters of rank R train, "
                                                                   "the base is frozen in the compute dtype")
    parser.add_argument("--lora-alpha", type=float, metavar="A", help="with --lora-rank: LoRA's alpha")
    parser.add_argument("--lora-targets", metavar="NAMES", help="with --lora-rank: the adapted projections "
                                                               "(default q,k,v,o,gate,up,down)")
    parser.add_argument("--lora-base", choices=("int8", "nf4"), help="with --lora-rank: QLoRA, the frozen "
                                                                    "projections stored as int8 codes (nf4: not yet)")


def from_args(args: argparse.Namespace, error: type[ValueError]) -> Any:
    """``--lora-rank`` / ``--lora-alpha`` / ``--lora-targets`` as a `LoraConfig` (None without a rank)."""
    from shardlib.models.configs import LoraConfig

    if args.lora_rank is None:
        if args.lora_alpha is not None or args.lora_targets is not None or args.lora_base is not None:
            raise error("--lora-alpha, --lora-targets and --lora-base shape LoRA adapters: add --lora-rank R")
        return None
    if args.lora_base is not None:
        from shardlib.models.lora import missing_quantiser

        if missing_quantiser():
            raise error(f"--lora-base: {missing_quantiser()}")
    targets = {} if args.lora_targets is None else {"targets": tuple(t.strip() for t in args.lora_targets.split(","))}
    try:
        return LoraConfig(rank=args.lora_rank, alpha=args.lora_alpha, base=args.lora_base, **targets)
    except ValueError as err:
        raise error(f"--lora-{'base' if 'base' in str(err) else 'rank'}: {err}") from None


def header(config: Any, params: int) -> list[str]:
    """The plan header's line on what trains: none for full fine-tuning."""
    import jax.numpy as jnp

    from shardlib.models.configs import lora_param_count
    from shardlib.models.lora import describe

    if config.lora is None:
        return []
    stored = jnp.dtype(config.compute_dtype).name
    if config.lora.base is not None:
        stored += f", its projections as {config.lora.base} codes with per-channel scales"
    return [f"trains: {lora_param_count(config):,} of {params:,} parameters ({describe(config.lora)}); the base "
            f"frozen in {stored}, optimizer state for the adapters only"]


def train_flags(config: Any) -> list[str]:
    """The LoRA flags of the `shardlib train` command for ``config`` (defaults left out)."""
    from shardlib.models.configs import LORA_TARGETS

    lora = config.lora
    if lora is None:
        return []
    return [f"--lora-rank {lora.rank}", "" if lora.alpha is None else f"--lora-alpha {lora.alpha:g}",
            "" if lora.targets == LORA_TARGETS else f"--lora-targets {','.join(lora.targets)}",
            "" if lora.base is None else f"--lora-base {lora.base}"]
