"""Packed rows: several examples concatenated into each row of ``seq_len`` tokens, with document masks.

An instruction example of ``L`` tokens padded to a row of ``seq_len + 1`` gives ``L - 1`` real
(input, target) positions and ``seq_len - L + 1`` of padding. Packing places the ``L - 1``
positions of several examples side by side in one row instead: each keeps its own inputs,
targets and loss mask, so no target crosses a document (the last token of a document is only a
target, never an input predicting the next one), and two more arrays say where each document is:

* ``segment_ids`` int32[rows, seq_len]: 1, 2, ... for the documents of a row in order, 0 for the
  padding left at its end. Attention lets a query see a key only when their ids are equal
  (`models.gpt.causal_attention`), so a document sees nothing of its neighbours; padding sees
  only padding, and its loss mask is 0.
* ``positions`` int32[rows, seq_len]: 0, 1, ... restarting at each document (rotary positions),
  0 on padding.

A packed row therefore computes, for every counted target, exactly what the padded row of the
same example computes, and a batch's loss (the mean over its counted targets) is the same.
Examples are placed best-fit decreasing (each, longest first, into the fullest row it fits),
once per split; `PackedBatches` then draws whole packed rows in shuffled epochs
(`shardlib.runtime.epochs`), a pure function of ``(seed, step)`` like `RowBatches`.
"""

from typing import NamedTuple

import numpy as np

from shardlib.runtime.data import ByteBatches
from shardlib.runtime.epochs import epoch_rows
from shardlib.runtime.rows import evenly_spaced

KEYS = ("inputs", "targets", "loss_mask", "segment_ids", "positions")


class Packed(NamedTuple):
    """Packed rows, each array [rows, seq_len] (`KEYS`): the batch keys a packed run's loss reads."""

    inputs: np.ndarray
    targets: np.ndarray
    loss_mask: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray


def best_fit(sizes: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins of example indices: each size (longest first) goes to the bin with the least room that
    still holds it, a new bin when none does. ``sizes`` are in [1, capacity]."""
    if len(sizes) and (sizes.min() < 1 or sizes.max() > capacity):
        raise ValueError(f"sizes to pack lie in [1, {capacity}], got [{sizes.min()}, {sizes.max()}]")
    by_room: list[list[int]] = [[] for _ in range(capacity + 1)]  # by_room[r]: bins with r free positions
    count = np.zeros(capacity + 1, np.int64)
    bins: list[list[int]] = []
    for index in np.argsort(-sizes, kind="stable"):
        size = int(sizes[index])
        fits = np.flatnonzero(count[size:])
        if len(fits):
            room = size + int(fits[0])
            b = by_room[room].pop()
            count[room] -= 1
        else:
            room, b = capacity, len(bins)
            bins.append([])
        bins[b].append(int(index))
        by_room[room - size].append(b)
        count[room - size] += 1
    return bins


def pack(tokens: np.ndarray, mask: np.ndarray, lengths: np.ndarray) -> Packed:
    """The padded instruction rows (``tokens`` uint[N, T + 1], ``mask`` float32[N, T], each
    example's token count ``lengths`` int[N]) as packed rows of ``T`` positions; an example of
    fewer than two tokens has no target and is left out."""
    seq_len = tokens.shape[1] - 1
    sizes = np.minimum(np.asarray(lengths, np.int64), seq_len + 1) - 1
    kept = np.flatnonzero(sizes > 0)
    bins = best_fit(sizes[kept], seq_len)
    shape = (len(bins), seq_len)
    out = Packed(np.zeros(shape, np.int32), np.zeros(shape, np.int32), np.zeros(shape, np.float32),
                 np.zeros(shape, np.int32), np.zeros(shape, np.int32))
    for row, members in enumerate(bins):
        start = 0
        for segment, member in enumerate(members, 1):
            example, n = kept[member], int(sizes[kept[member]])
            here = slice(start, start + n)
            out.inputs[row, here] = tokens[example, :n]
            out.targets[row, here] = tokens[example, 1:n + 1]
            out.loss_mask[row, here] = mask[example, :n]
            out.segment_ids[row, here] = segment
            out.positions[row, here] = np.arange(n)
            start += n
    return out


def _take(packed: Packed, picked: np.ndarray) -> dict[str, np.ndarray]:
    return {key: array[picked] for key, array in zip(KEYS, packed)}


class PackedBatches(ByteBatches):
    """``global_batch_size`` packed rows a step, each row once per epoch (as `RowBatches` draws
    examples); ``batch(step)`` gives this process's rows under `KEYS`."""

    def __init__(self, packed: Packed, global_batch_size: int, *, seed: int = 0, start_step: int = 0,
                 process_index: int | None = None, process_count: int | None = None,
                 data_parallel_size: int | None = None) -> None:
        rows, seq_len = packed.inputs.shape
        super().__init__(np.zeros(seq_len + 1, np.int32), global_batch_size, seq_len, seed=seed,
                         start_step=start_step, process_index=process_index, process_count=process_count,
                         data_parallel_size=data_parallel_size)
        if rows == 0:
            raise ValueError("no packed rows: the training examples hold no targets")
        self.packed = packed

    def batch(self, step: int) -> dict[str, np.ndarray]:
        return _take(self.packed, self._picked(step)[self.rows])

    def pad_fraction(self, step: int) -> float:
        """Padding positions over all positions of the global batch of ``step`` (0-based)."""
        return float(np.mean(self.packed.segment_ids[self._picked(step)] == 0))

    def _picked(self, step: int) -> np.ndarray:
        return epoch_rows(self.seed, step, self.global_batch_size, len(self.packed.inputs))


def val_packed_batches(packed: Packed, global_batch_size: int, num_batches: int, *, process_index: int,
                       process_count: int, data_parallel_size: int | None = None) -> list[dict[str, np.ndarray]]:
    """Up to ``num_batches`` fixed validation batches of packed rows evenly spaced over the held-out ones."""
    return [_take(packed, picked) for picked in evenly_spaced(
        len(packed.inputs), global_batch_size, num_batches, process_index=process_index,
        process_count=process_count, data_parallel_size=data_parallel_size)]
