"""Examples drawn without replacement, in shuffled epochs, as a pure function of (seed, step).

Position ``p`` of the endless stream of examples is example ``order(e)[p % n]`` of epoch
``e = p // n``, where ``order(e)`` is a permutation of the ``n`` examples seeded by (seed, e). Step
``s`` of a global batch of ``B`` takes positions ``s B .. s B + B - 1``: every example is seen
once per epoch, a resumed run (or another process) computes the same rows from the step alone,
and a batch that runs past an epoch's end takes the rest from the next epoch's order.
"""

from __future__ import annotations

import functools

import numpy as np


@functools.lru_cache(maxsize=2)  # the epoch a step is in, and the next one a batch may run into
def epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    """The order of the ``n`` examples in ``epoch``: a permutation from a fixed hash
    (``SeedSequence.generate_state``, as `shardlib.runtime.data.train_window_starts`), so that
    NumPy's generator algorithms changing cannot change which examples an old run read."""
    keys = np.random.SeedSequence([seed, epoch, 0x45]).generate_state(n, dtype=np.uint64)
    order = np.argsort(keys, kind="stable")
    order.flags.writeable = False
    return order


def epoch_rows(seed: int, step: int, global_batch_size: int, n: int) -> np.ndarray:
    """The ``global_batch_size`` example indices of step ``step`` (0-based) over ``n`` examples."""
    if seed < 0 or step < 0 or n < 1:
        raise ValueError(f"seed and step must be non-negative and n positive, got {seed}, {step}, {n}")
    positions = np.arange(step * global_batch_size, (step + 1) * global_batch_size, dtype=np.int64)
    epochs = positions // n
    out = np.empty_like(positions)
    for epoch in np.unique(epochs):
        here = epochs == epoch
        out[here] = epoch_order(seed, int(epoch), n)[positions[here] % n]
    return out


def steps_for_epochs(epochs: float, examples: int, global_batch_size: int) -> int:
    """The steps that read ``epochs`` passes over ``examples`` (rounded up to a whole batch)."""
    return max(1, -(-int(round(epochs * examples)) // global_batch_size))
