"""Batches of whole rows with a loss mask: instruction examples, each padded to one row.

Where `shardlib.runtime.data.ByteBatches` cuts random windows out of one long stream, an
instruction example must stay whole and only its completion may count, so each example is a row
of ``seq_len + 1`` tokens (padded) with a mask over its targets. Step ``s`` takes its rows from
shuffled epochs without replacement (`shardlib.runtime.epochs`), a pure function of ``(seed, s)``,
so resuming, process sharding and the parity with one process are those of the byte loader.
"""

from __future__ import annotations

import numpy as np

from shardlib.runtime.data import ByteBatches, check_batch_size, local_rows
from shardlib.runtime.epochs import epoch_rows


def _rows(tokens: np.ndarray, mask: np.ndarray, picked: np.ndarray) -> dict[str, np.ndarray]:
    chosen = tokens[picked].astype(np.int32)
    return {"inputs": chosen[:, :-1], "targets": chosen[:, 1:], "loss_mask": mask[picked]}


class RowBatches(ByteBatches):
    """``global_batch_size`` rows a step, each example of ``tokens`` (uint[N, T + 1]) once per epoch;
    ``batch(step)`` gives this process's rows as ``inputs``, ``targets`` and ``loss_mask`` (float32[., T])."""

    def __init__(self, tokens: np.ndarray, mask: np.ndarray, global_batch_size: int, *, seed: int = 0,
                 start_step: int = 0, process_index: int | None = None, process_count: int | None = None,
                 data_parallel_size: int | None = None) -> None:
        if tokens.ndim != 2 or mask.shape != (tokens.shape[0], tokens.shape[1] - 1):
            raise ValueError(f"rows of shape {tokens.shape} need a mask of shape {(tokens.shape[0], tokens.shape[1] - 1)}, "
                             f"got {mask.shape}")
        super().__init__(tokens.reshape(-1), global_batch_size, tokens.shape[1] - 1, seed=seed, start_step=start_step,
                         process_index=process_index, process_count=process_count,
                         data_parallel_size=data_parallel_size)
        self.tokens, self.mask = tokens, mask

    def batch(self, step: int) -> dict[str, np.ndarray]:
        picked = epoch_rows(self.seed, step, self.global_batch_size, len(self.tokens))
        return _rows(self.tokens, self.mask, picked[self.rows])


def split_rows(tokens: np.ndarray, mask: np.ndarray, val_fraction: float = 0.05
               ) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """((train tokens, mask), (validation tokens, mask)): the last ``val_fraction`` of the examples
    (at least one, when there are two or more) held out."""
    n_val = min(len(tokens) - 1, max(1, round(len(tokens) * val_fraction))) if len(tokens) > 1 else 0
    cut = len(tokens) - n_val
    return (tokens[:cut], mask[:cut]), (tokens[cut:], mask[cut:])


def val_row_batches(tokens: np.ndarray, mask: np.ndarray, global_batch_size: int, num_batches: int, *,
                    process_index: int, process_count: int, data_parallel_size: int | None = None
                    ) -> list[dict[str, np.ndarray]]:
    """Up to ``num_batches`` fixed validation batches of rows evenly spaced over the held-out examples."""
    check_batch_size(global_batch_size, process_count, data_parallel_size)
    if len(tokens) == 0:
        return []
    count = max(1, min(num_batches, len(tokens) // global_batch_size or 1))
    picked = np.linspace(0, len(tokens) - 1, num=count * global_batch_size).round().astype(np.int64)
    rows = local_rows(global_batch_size, process_index, process_count)
    return [_rows(tokens, mask, step[rows]) for step in picked.reshape(count, -1)]
