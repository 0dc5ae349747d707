"""``--eval-data FILE``: validation on a file of its own, read as ``--data`` is (text, a token file,
or instruction examples through the same tokenizer); the training data is then all of ``--data``,
none of it held out."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from shardlib.run.config import TrainConfig, TrainConfigError


def _whole(split: tuple[Any, Any]) -> Any:
    """A (train, held-out) split joined back into the one array (pair for rows) it was cut from:
    the held-out part is the tail, so joining restores the file's order."""
    train, held = split
    if isinstance(train, tuple):
        return tuple(np.concatenate([a, b]) for a, b in zip(train, held))
    return np.concatenate([train, held])


def loaded(config: TrainConfig, load: Callable[[TrainConfig], tuple[Any, Any]]) -> tuple[Any, Any]:
    """(train, validation) of ``config``: ``load(config)``'s split, or with ``--eval-data`` all of
    ``--data`` to train on and all of the eval file to validate on."""
    if config.eval_data is None:
        return load(config)
    train = _whole(load(config))
    try:
        validation = _whole(load(dataclasses.replace(config, data=config.eval_data)))
    except TrainConfigError as err:
        message = str(err).split(": ", 1)[1] if ": " in str(err) else str(err)
        raise TrainConfigError("eval_data", message) from None
    if isinstance(train, tuple) != isinstance(validation, tuple):
        kinds = {True: "instruction examples (.jsonl)", False: "a token stream (text or token ids)"}
        raise TrainConfigError("eval_data", f"{config.eval_data} is {kinds[isinstance(validation, tuple)]} and --data "
                                            f"is {kinds[isinstance(train, tuple)]}: validate on data of the same kind")
    if len(validation[0] if isinstance(validation, tuple) else validation) == 0:
        raise TrainConfigError("eval_data", f"{config.eval_data} holds no data to validate on")
    return train, validation


def refuse_with_pipeline(config: TrainConfig) -> None:
    """A Grain pipeline brings its own data: ``--eval-data`` would be read by nothing."""
    if config.eval_data is not None:
        raise TrainConfigError("eval_data", "validates beside the built-in loaders; with a Grain pipeline, evaluate "
                                            "your own validation pipeline (docs/data.md) and drop --eval-data")
