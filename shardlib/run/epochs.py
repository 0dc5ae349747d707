"""``--epochs N``: the steps that read N passes over the training data, and a note when one batch
is more than the data (each step then repeats examples)."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from shardlib.run.config import DEFAULT_STEPS, TrainConfig, TrainConfigError


def apply(config: TrainConfig, train: Any, *, main: bool) -> TrainConfig:
    """``config`` with ``steps`` from ``--epochs`` over ``train`` (instruction rows: a (tokens, mask)
    pair, one example a row; text: token ids, ``--batch-size x --seq-len`` a step); notes go to stderr."""
    from shardlib.runtime.epochs import steps_for_epochs

    rows = isinstance(train, tuple)
    examples = len(train[0]) if rows else len(train)
    per_step = config.batch_size if rows else config.batch_size * config.seq_len
    if rows and main and config.verbose and 0 < examples < config.batch_size:
        print(f"shardlib: note: one batch of {config.batch_size} rows is more than the {examples} training examples: "
              "each step holds some of them more than once (--batch-size)", file=sys.stderr, flush=True)
    if config.epochs is None:
        return config
    if not config.epochs > 0:
        raise TrainConfigError("epochs", f"must be positive, got {config.epochs}")
    if config.steps != DEFAULT_STEPS:
        raise TrainConfigError("epochs", "sets the number of steps from the data: drop --steps")
    if examples == 0:
        raise TrainConfigError("epochs", "the training data is empty")
    steps = steps_for_epochs(config.epochs, examples, per_step)
    if main and config.verbose:
        what = (f"{examples:,} packed rows" if hasattr(train, "segment_ids") else f"{examples:,} examples") if rows else f"{examples:,} tokens (random windows)"
        print(f"shardlib: note: --epochs {config.epochs:g} over {what} is {steps:,} steps of {per_step:,}",
              file=sys.stderr, flush=True)
    return dataclasses.replace(config, steps=steps)


def refuse_with_pipeline(config: TrainConfig) -> None:
    """A Grain pipeline's length is its own: ``--epochs`` cannot count it."""
    if config.epochs is not None:
        raise TrainConfigError("epochs", "counts passes over --data; a Grain pipeline sets its own epochs "
                                         "(its repeat / num_epochs): give --steps")
