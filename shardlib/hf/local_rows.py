"""A Hugging Face checkpoint placed where one process holds every device of a parameter.

When all of a parameter's devices belong to this process (always, in one process), no device
needs rows another process read, so no resharding program is needed: the checkpoint tensor is
read once (its rows split over `READ_THREADS` positioned reads into one buffer), each device's
shard is sliced out of it on the host (a NumPy view in shardlib's layout, copied once) and placed
in the checkpoint's dtype on its device, in parallel threads, and one program per parameter
shape converts it to the parameter's dtype with the same sharding in and out (each device on its
own: no collectives), writing a stacked parameter's layer into its stack in place. The next
checkpoint tensor is read while the devices convert the current one.

Host memory holds two checkpoint tensors (the one placed, the one read ahead) and the current
one's device slices; the devices hold one layer's slices beside the shards already placed.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

# (TensorFile, tensor name, first row, row count): one checkpoint tensor's rows, read whole
Read = tuple[Any, str, int, int]


def applies(t: Any, shape: tuple[int, ...], sharding: Any) -> bool:
    """Whether this process holds every device of ``sharding`` and the stacked dims (layers,
    experts) are whole on each device, so each layer's slices write into the stack locally."""
    if not sharding.is_fully_addressable:
        return False
    if not t.stacked:
        return True
    return isinstance(sharding, NamedSharding) and all(s is None for s in tuple(sharding.spec)[:t.stacked])


def reads(pretrained: Any, t: Any, shape: tuple[int, ...]) -> list[Read]:
    """The checkpoint tensors of parameter ``t`` (of ``shape``), in the order `parameter` takes them."""
    from shardlib.hf.architectures import hf_names

    names = hf_names(t, *shape[:t.stacked])
    part = t.placement.hf_shape(tuple(shape[t.stacked:]))[0] if t.fused else None
    return [(pretrained.files[n], n, t.row_offset, part or pretrained.files[n].shape(n)[0]) for n in names]


def read_ahead(items: list[Read], pool: ThreadPoolExecutor, threads: int) -> Iterator[np.ndarray]:
    """Each of ``items`` read whole, in order, the next one read (by another thread) while the
    caller places the current one."""
    with ThreadPoolExecutor(1, thread_name_prefix="shardlib-hf-ahead") as ahead:
        pending: Future | None = ahead.submit(_read, *items[0], pool, threads) if items else None
        for k in range(len(items)):
            current = pending.result()
            pending = ahead.submit(_read, *items[k + 1], pool, threads) if k + 1 < len(items) else None
            yield current


def _read(file: Any, name: str, start: int, count: int, pool: ThreadPoolExecutor, threads: int) -> np.ndarray:
    """Rows ``start:start + count`` of ``name``, split over ``threads`` reads of the pool into one buffer."""
    shape = file.shape(name)
    out = np.empty((count, *shape[1:]), file.dtype(name))
    step = -(-count // threads) if count else 1
    cuts = [(a, min(a + step, count)) for a in range(0, count, step)]
    list(pool.map(lambda c: file.read_rows(name, start + c[0], start + c[1], out=out[c[0]:c[1]]), cuts))
    return out


def parameter(t: Any, shape: tuple[int, ...], sharding: Any, dtype: np.dtype, tensors: Iterator[np.ndarray],
              pool: ThreadPoolExecutor) -> jax.Array:
    """Parameter ``t`` from its checkpoint tensors (the next ones of ``tensors``), in ``dtype``."""
    from shardlib.hf.rows import _stacker

    layer_shape = tuple(shape[t.stacked:])
    if not t.stacked:
        return _converter(layer_shape, np.dtype(dtype), sharding)(_slices(next(tensors), t, layer_shape, sharding, pool))
    layer = NamedSharding(sharding.mesh, P(*tuple(sharding.spec)[t.stacked:len(shape)]))
    empty, put = _stacker(tuple(shape), np.dtype(dtype), sharding, t.stacked)
    stack = empty()
    for index in np.ndindex(*shape[:t.stacked]):
        stack = put(stack, _slices(next(tensors), t, layer_shape, layer, pool), *index)
        stack.block_until_ready()  # this layer's slices freed before the one after the next is read
    return stack


def _slices(host: np.ndarray, t: Any, shape: tuple[int, ...], sharding: Any, pool: ThreadPoolExecutor) -> jax.Array:
    """The checkpoint tensor ``host`` as shardlib's tensor of ``shape`` in ``sharding``, in the
    checkpoint's dtype: each device's shard sliced from a view of it and placed, in threads."""
    order = [d for group in t.placement.groups for d in group]
    view = host.reshape([shape[d] for d in order]).transpose([order.index(d) for d in range(len(shape))])
    boxes = sharding.addressable_devices_indices_map(shape)
    put = lambda item: jax.device_put(np.ascontiguousarray(view[item[1]]), item[0])
    return jax.make_array_from_single_device_arrays(shape, sharding, list(pool.map(put, boxes.items())))


@functools.lru_cache(maxsize=None)
def _converter(shape: tuple[int, ...], dtype: np.dtype, sharding: Any):
    """``x.astype(dtype)`` with ``sharding`` in and out: each device converts its own shard."""
    return jax.jit(lambda x: x.astype(dtype), in_shardings=sharding, out_shardings=sharding)
