"""``--pack``: instruction examples packed several to a row (`shardlib.runtime.packing`), the loaders
of packed and padded rows, and what refuses packing (in one line each, before anything compiles)."""

from __future__ import annotations

import sys
from typing import Any

from shardlib.run.config import TrainConfig, TrainConfigError


def refuse(config: TrainConfig, model_config: Any, layout: Any, *, pipeline: bool = False) -> None:
    """What ``--pack`` cannot run with: packed rows need a model that takes segment ids and a
    sequence that is not split (over a context axis) or cut into pipeline stages."""
    if not config.pack:
        return
    from shardlib.models import MoEConfig

    why = ("a Grain pipeline makes its own rows: pack them in the pipeline" if pipeline else
           "your own --model reads inputs, targets and loss_mask only, not segment ids" if model_config is None else
           "the MoE decoder does not take segment ids" if isinstance(model_config, MoEConfig) else
           f"the sequence is split over the context axis (size {layout.context_size})" if layout.context_size > 1 else
           f"pipeline stages (pipe={layout.pipeline_stages}) see no segment ids" if layout.pipeline_stages > 1 else None)
    if why is not None:
        raise TrainConfigError("pack", f"packs rows with segment ids, and {why}: drop --pack")


def apply(config: TrainConfig, train: Any, val: Any, *, main: bool) -> tuple[Any, Any]:
    """(train, validation) as `Packed` rows under ``--pack``, unchanged without it; a note says how
    much padding packing leaves against one padded example a row."""
    if not config.pack:
        return train, val
    if not isinstance(train, tuple):
        raise TrainConfigError("pack", "packs the examples of a .jsonl (instruction or chat rows); text and token "
                                       "files are read as full windows of --seq-len tokens, with no padding: drop --pack")
    from shardlib.runtime.packing import pack
    from shardlib.runtime.rows import pad_fraction

    packed_train, packed_val = pack(*train), pack(*val)
    if main and config.verbose:
        rows = len(packed_train.inputs)
        padded = pad_fraction(train[2], config.seq_len)
        left = float((packed_train.segment_ids == 0).mean()) if rows else 0.0
        print(f"shardlib: note: --pack: {len(train[0]):,} training examples in {rows:,} rows of {config.seq_len} "
              f"positions; padding {left:.1%} of positions (one example a row: {padded:.1%})", file=sys.stderr, flush=True)
    return packed_train, packed_val


def loaders(config: TrainConfig, train: Any, val: Any, geometry: dict[str, Any]) -> tuple[Any, list]:
    """The training loader and validation batches of instruction rows, packed or one example a row."""
    from shardlib.runtime.packing import Packed, PackedBatches, val_packed_batches
    from shardlib.runtime.rows import RowBatches, val_row_batches

    if isinstance(train, Packed):
        return (PackedBatches(train, config.batch_size, seed=config.seed, **geometry),
                val_packed_batches(val, config.batch_size, config.eval_batches, **geometry))
    return (RowBatches(*train[:2], config.batch_size, seed=config.seed, lengths=train[2], **geometry),
            val_row_batches(*val[:2], config.batch_size, config.eval_batches, **geometry))
