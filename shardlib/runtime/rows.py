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
    ``batch(step)`` gives this process's rows as ``inputs``, ``targets`` and ``loss_mask`` (float32[., T]).
    ``lengths`` (int[N], each example's tokens before padding) gives `pad_fraction`."""

    def __init__(self, tokens: np.ndarray, mask: np.ndarray, global_batch_size: int, *, seed: int = 0,
                 start_step: int = 0, process_index: int | None = None, process_count: int | None = None,
                 data_parallel_size: int | None = None, lengths: np.ndarray | None = None) -> None:
        if tokens.ndim != 2 or mask.shape != (tokens.shape[0], tokens.shape[1] - 1):
            raise ValueError(f"rows of shape {tokens.shape} need a mask of shape {(tokens.shape[0], tokens.shape[1] - 1)}, "
                             f"got {mask.shape}")
        super().__init__(tokens.reshape(-1), global_batch_size, tokens.shape[1] - 1, seed=seed, start_step=start_step,
                         process_index=process_index, process_count=process_count,
                         data_parallel_size=data_parallel_size)
        self.tokens, self.mask, self.lengths = tokens, mask, lengths

    def batch(self, step: int) -> dict[str, np.ndarray]:
        return _rows(self.tokens, self.mask, self._picked(step)[self.rows])

    def pad_fraction(self, step: int) -> float | None:
        """Padding positions over all positions of the global batch of ``step`` (0-based); None
        without the examples' lengths."""
        return None if self.lengths is None else pad_fraction(self.lengths[self._picked(step)], self.seq_len)

    def _picked(self, step: int) -> np.ndarray:
        return epoch_rows(self.seed, step, self.global_batch_size, len(self.tokens))


def split_rows(*arrays: np.ndarray, val_fraction: float = 0.05) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    """((train tokens, mask, ...), (validation tokens, mask, ...)): the last ``val_fraction`` of the
    examples (at least one, when there are two or more) held out, from each array alike."""
    n = len(arrays[0])
    cut = n - (min(n - 1, max(1, round(n * val_fraction))) if n > 1 else 0)
    return tuple(a[:cut] for a in arrays), tuple(a[cut:] for a in arrays)


def val_row_batches(tokens: np.ndarray, mask: np.ndarray, global_batch_size: int, num_batches: int, *,
                    process_index: int, process_count: int, data_parallel_size: int | None = None
                    ) -> list[dict[str, np.ndarray]]:
    """Up to ``num_batches`` fixed validation batches of rows evenly spaced over the held-out examples."""
    return [_rows(tokens, mask, picked) for picked in evenly_spaced(
        len(tokens), global_batch_size, num_batches, process_index=process_index, process_count=process_count,
        data_parallel_size=data_parallel_size)]


def evenly_spaced(n: int, global_batch_size: int, num_batches: int, *, process_index: int, process_count: int,
                  data_parallel_size: int | None = None) -> list[np.ndarray]:
    """This process's row indices of up to ``num_batches`` fixed batches spread over ``n`` held-out rows."""
    check_batch_size(global_batch_size, process_count, data_parallel_size)
    if n == 0:
        return []
    count = max(1, min(num_batches, n // global_batch_size or 1))
    picked = np.linspace(0, n - 1, num=count * global_batch_size).round().astype(np.int64)
    rows = local_rows(global_batch_size, process_index, process_count)
    return [step[rows] for step in picked.reshape(count, -1)]


def pad_fraction(lengths: np.ndarray, seq_len: int) -> float:
    """Padding positions over all positions of padded rows holding examples of ``lengths`` tokens."""
    real = np.minimum(np.asarray(lengths, np.int64), seq_len + 1) - 1
    return float(1.0 - np.clip(real, 0, None).sum() / (len(real) * seq_len))
