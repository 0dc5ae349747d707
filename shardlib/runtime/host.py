"""Arrays brought whole to this host, from any layout and any number of processes."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def to_host(tree: Any) -> Any:
    """``tree`` with each array whole on this host as a NumPy array. An array split over several
    processes is all-gathered from them, a collective: call this on every process of the job, in
    the same order. May alias a CPU device buffer: keep the array alive while the result is used."""
    def whole(x: Any) -> np.ndarray:
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return np.asarray(jax.device_get(x))
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(whole, tree)
