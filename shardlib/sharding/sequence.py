"""Where each token of a sequence lives under context parallelism (the `context` mesh axis).

The sequence of length T is cut into chunks and device ``i`` of the ``C`` context devices holds
its chunks side by side:

* contiguous: chunk ``i`` of ``C`` (positions ``i*T/C ...``). Under a causal mask the last device
  attends to the whole sequence and the first to its own chunk only: about 2x the mean work.
* balanced (head-tail, the default): chunks ``i`` and ``2C-1-i`` of ``2C``, one early and one
  late, so every device attends to as many earlier tokens as every other.

The step reorders each batch leaf's sequence dim by `order` before splitting it over `context`
(the data pipeline's order is untouched), and model code gets each token's true position from
`positions` (RoPE, the causal mask). A loss that is a mean over tokens is unchanged by the order.
"""

from __future__ import annotations

import numpy as np


def chunks_of(device: int, size: int, balanced: bool) -> tuple[int, ...]:
    """The chunk indices device ``device`` of ``size`` holds, in order (of ``2*size`` chunks when balanced)."""
    return (device, 2 * size - 1 - device) if balanced else (device,)


def order(seq_len: int, size: int, balanced: bool) -> np.ndarray:
    """The permutation of ``range(seq_len)`` that lays the sequence out device after device:
    ``x[:, order]`` split into ``size`` equal parts gives each device its chunks."""
    if size == 1 or not balanced:
        return np.arange(seq_len)
    width = seq_len // (2 * size)
    return np.concatenate([np.arange(c * width, (c + 1) * width)
                           for d in range(size) for c in chunks_of(d, size, balanced)])


def positions(device, local_len: int, size: int, balanced: bool, xp=np):
    """The global positions of device ``device``'s ``local_len`` tokens (``device`` may be traced:
    ``xp=jax.numpy``)."""
    if size == 1:
        return xp.arange(local_len)
    if not balanced:
        return device * local_len + xp.arange(local_len)
    width = local_len // 2
    first = device * width + xp.arange(width)
    second = (2 * size - 1 - device) * width + xp.arange(width)
    return xp.concatenate([first, second])
