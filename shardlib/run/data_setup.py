"""The data a run reads: text or a token file, through ``--tokenizer`` when given, checked against
the model's vocabulary, and this process's loaders of it (the built-in ones or a Grain pipeline)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from shardlib.run.config import TrainConfig, TrainConfigError


def batch_shapes(config: TrainConfig, masked: bool = False) -> dict[str, Any]:
    """The batch the loader yields: inputs and targets, and with instruction rows a ``loss_mask``
    (packed: with ``segment_ids`` and ``positions``)."""
    import numpy as np

    keys = ("inputs", "targets") + (("segment_ids", "positions") if masked and config.pack else ())
    shapes = {k: ((config.batch_size, config.seq_len), np.int32) for k in keys}
    if masked:
        shapes["loss_mask"] = ((config.batch_size, config.seq_len), np.float32)
    return shapes


def own_vocab(config: TrainConfig) -> int:
    """The vocabulary a token file is checked against: only ``--vocab-size`` knows it for the user's model."""
    from shardlib.runtime.tokens import is_token_file

    if config.vocab_size is not None:
        check_vocab_flag(config)
        return config.vocab_size
    if is_token_file(config.data):
        raise TrainConfigError("vocab_size", "with your own --model and a token file, give the tokenizer's vocabulary "
                                             "size (--vocab-size V), which every token id is checked against")
    return 256


def check_vocab_flag(config: TrainConfig) -> None:
    """``--vocab-size`` sets a token file's vocabulary: refused with text, or below 2."""
    from shardlib.runtime.tokens import is_token_file

    if not is_token_file(config.data):
        raise TrainConfigError("vocab_size", "sets the vocabulary of a token file (--data FILE.bin or .npy); text "
                                             "is read as bytes (256 ids), so drop --vocab-size or pass a token file")
    if config.vocab_size < 2:
        raise TrainConfigError("vocab_size", f"must be at least 2, got {config.vocab_size}")


def tokenizer_for(config: TrainConfig, model_config):
    """``--tokenizer``, checked against the model's vocabulary, or None."""
    from shardlib.runtime.tokens import is_token_file

    if config.tokenizer is None:
        if config.init_from is not None and not is_token_file(config.data):  # bytes are not the model's ids
            raise TrainConfigError("init_from", f"{config.init_from}'s vocabulary is its tokenizer's, not bytes: pass "
                                                "--tokenizer (its tokenizer.json or directory) and --data (text or "
                                                ".jsonl), or --data a token file of its ids")
        return None
    from shardlib.hf.tokenizer import TokenizerError, check_vocab, load_tokenizer

    if is_token_file(config.data):
        raise TrainConfigError("tokenizer", "tokenizes text, and --data is a token file (already ids): drop one")
    if model_config is None:
        raise TrainConfigError("tokenizer", "checks its vocabulary against a reference decoder's (--init-from or a "
                                            "config name); with your own --model pass a token file and --vocab-size")
    try:
        tokenizer = load_tokenizer(config.tokenizer)
        check_vocab(tokenizer, model_config.vocab_size, config.init_from or f"model {config.model!r}")
    except TokenizerError as err:
        raise TrainConfigError("tokenizer", str(err)) from None
    return tokenizer


def load_data(config: TrainConfig, vocab_size: int, tokenizer=None, *, main: bool = True):
    """(train, validation) arrays: the bytes of text, or the ids of a token file (each below
    ``vocab_size``); with a tokenizer, text's ids (cached) or instruction rows, each a (tokens, mask).
    ``main``: this is the process that prints (process 0)."""
    from shardlib.runtime.data import load_text, split_train_val
    from shardlib.runtime.tokens import check_vocab, is_token_file, load_tokens

    if tokenizer is not None:
        return _tokenized_data(config, tokenizer, main)
    if Path(config.data or "").suffix.lower() == ".jsonl":
        raise TrainConfigError("data", "a .jsonl file is read as instruction examples, which need a tokenizer: add "
                                       "--tokenizer (the model's tokenizer.json or its directory)")

    if config.token_dtype != TrainConfig.token_dtype and Path(config.data or "").suffix.lower() != ".bin":
        raise TrainConfigError("token_dtype", "sets the element type of a raw .bin token file (a .npy file carries "
                                              "its own, text is bytes); drop it or pass a .bin file")
    try:
        if not is_token_file(config.data):
            return split_train_val(load_text(config.data))
        tokens = load_tokens(config.data, config.token_dtype)
        check_vocab(tokens, vocab_size, config.data)
        return split_train_val(tokens)
    except (ValueError, OSError) as err:
        field = "vocab_size" if "--vocab-size" in str(err) else "data"
        raise TrainConfigError(field, str(err)) from None


def _tokenized_data(config: TrainConfig, tokenizer, main: bool):
    """--data through --tokenizer: instruction rows from a .jsonl, else text as cached token ids."""
    from shardlib.hf.tokenizer import TokenizerError, instruction_rows, tokenize_text
    from shardlib.runtime.data import split_train_val
    from shardlib.runtime.rows import split_rows

    if config.data is None:
        raise TrainConfigError("tokenizer", "tokenizes --data, and none was given: pass --data TEXT_OR_JSONL")
    try:
        if Path(config.data).suffix.lower() == ".jsonl":
            rows = instruction_rows(tokenizer, config.data, config.seq_len)
            if rows.truncated:
                print(f"shardlib: note: {rows.truncated} of {len(rows.tokens)} examples are longer than --seq-len "
                      f"{config.seq_len} + 1 tokens and were cut", file=sys.stderr, flush=True)
            return split_rows(rows.tokens, rows.mask, rows.lengths)
        tokens, cache, cached = tokenize_text(tokenizer, config.data)
        if main:
            print(f"tokens     {len(tokens):,} ids {'read from' if cached else 'cached in'} {cache}", flush=True)
        return split_train_val(tokens)
    except (TokenizerError, ValueError, OSError) as err:
        raise TrainConfigError("data", str(err)) from None


def loaders(config: TrainConfig, layout, train_bytes, val_bytes):
    """This process's rows of each training batch, and its validation windows, checked against the mesh."""
    import jax

    from shardlib.run.packing import loaders as row_loaders
    from shardlib.runtime.data import ByteBatches, val_batches

    geometry = dict(data_parallel_size=layout.batch_size_multiple,
                    process_index=jax.process_index(), process_count=jax.process_count())
    if isinstance(train_bytes, tuple):  # instruction rows (tokens, mask)
        if config.record_examples:
            raise TrainConfigError("record_examples", "records window offsets of a text corpus; instruction examples "
                                                      "are whole rows: drop --record-examples")
        try:
            return row_loaders(config, train_bytes, val_bytes, geometry)
        except ValueError as err:
            raise TrainConfigError("batch_size", str(err)) from None
    try:
        loader = ByteBatches(train_bytes, config.batch_size, config.seq_len, seed=config.seed, **geometry)
        val_local = val_batches(val_bytes, config.batch_size, config.seq_len, None, **geometry)
        if len(val_local) > config.eval_batches:  # fewer windows, still spread over the whole split
            val_local = val_batches(val_bytes, config.batch_size, config.seq_len, config.eval_batches, **geometry)
    except ValueError as err:
        field = "batch_size" if "batch size" in str(err) else "seq_len" if "seq_len" in str(err) else "data"
        raise TrainConfigError(field, str(err)) from None
    return loader, val_local


def grain_loader(config: TrainConfig, layout, data):
    """A Grain pipeline (or a `GrainBatches`) as the loop's loader, its state saved with each checkpoint."""
    import jax

    from shardlib.run.grain_source import GrainLoader
    from shardlib.runtime.grain_data import GrainBatches

    if config.record_examples:
        raise TrainConfigError("record_examples", "records window offsets of the built-in loader; a Grain pipeline has "
                                                  "none: drop --record-examples and log an id field in the pipeline")
    try:
        batches = data if isinstance(data, GrainBatches) else GrainBatches(
            data, config.batch_size, data_parallel_size=layout.batch_size_multiple,
            process_index=jax.process_index(), process_count=jax.process_count())
    except ValueError as err:
        raise TrainConfigError("batch_size", str(err)) from None
    if batches.global_batch_size != config.batch_size:
        raise TrainConfigError("batch_size", f"is {config.batch_size}, but the GrainBatches given make batches of "
                                             f"{batches.global_batch_size}; make them agree")
    return GrainLoader(batches, seed=config.seed)
