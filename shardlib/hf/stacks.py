"""A stacked parameter (layers, or layers x experts) built a layer at a time on its devices.

Both Hugging Face readers (`shardlib.hf.rows` across processes, `shardlib.hf.local_rows` in one
process on an accelerator's devices; on CPU devices it writes host buffers instead) write each
layer's converted tensor into the stack in place (donated), so a device holds one layer's
conversion in flight beside the stack, never a second copy of the parameter.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np


@functools.lru_cache(maxsize=None)
def stacker(shape: tuple[int, ...], dtype: np.dtype, sharding: Any, stacked: int = 1):
    """(``empty()``: a stack of zeros in ``sharding``, ``put(stack, layer, *index)``: the layer (or a
    layer's expert) at ``index`` of the ``stacked`` leading dims written into it in place)."""
    import jax.numpy as jnp

    empty = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)

    def write(stack, layer, *index):
        at = (*index, *(0,) * (len(shape) - stacked))
        layer = layer.astype(dtype).reshape((1,) * stacked + layer.shape)  # a no-op when converted already
        return jax.lax.dynamic_update_slice(stack, layer, at)

    put = jax.jit(write, out_shardings=sharding, donate_argnums=0)
    return empty, put
