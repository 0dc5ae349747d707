"""A Hugging Face checkpoint placed where one process holds every device of a parameter.

When all of a parameter's devices belong to this process (always, in one process), no device
needs rows another process read, so no resharding program is needed: the checkpoint tensor is
mapped once, read-only (`TensorFile.map_rows`: no copy into a buffer, the kernel reads its pages
ahead while the tensor before it is placed), its dims grouped as shardlib's but kept in the
checkpoint's order, so each device's block is whole rows or a run of each row (`hf_layout`). Each
block is placed in the checkpoint's dtype on its device in shardlib's dim order, in parallel
threads, straight from the mapping: the transfer reorders the dims (PJRT's tiled transpose of the
strided host view, about a copy's cost), where a transpose inside the converting program cost 4x
the conversion on XLA:CPU. One program per parameter shape then converts each device's block on
that device (the input split as the output: no collectives), writing a stacked parameter's layer
into its stack in place.

Where the devices are CPU devices their memory is the host's, so `host_parameter` skips the
programs (compiling them, a zero fill of each stack and a copy of each layer into it cost more
than the conversion): each device's shard is allocated once, uninitialized, each layer's
transposed block is converted by NumPy straight into its place in it (bit for bit XLA's
conversion), and the array is handed to the device without a copy (the CPU client aliases a
page-aligned buffer). One task a device transposes its block and converts it, so one thread
converts while another transposes; a layer's transfers, then its conversions, as two phases kept
about one core busy (BENCHMARKS.md).

Host memory holds the mapped pages of the checkpoint tensor being placed (page cache, dropped from
the process when the next is taken) and its device slices; the devices hold one layer's slices
beside the shards already placed.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from shardlib.backend import platform_of
from shardlib.hf import stacks

# (TensorFile, tensor name, first row, row count): one checkpoint tensor's rows, read whole
Read = tuple[Any, str, int, int]


def applies(t: Any, shape: tuple[int, ...], sharding: Any) -> bool:
    """Whether this process holds every device of ``sharding`` and the stacked dims (layers,
    experts) are whole on each device, so each layer's slices write into the stack locally."""
    if not isinstance(sharding, NamedSharding) or not sharding.is_fully_addressable:
        return False
    return all(s is None for s in tuple(sharding.spec)[:t.stacked])


def in_host_memory(sharding: NamedSharding) -> bool:
    """Whether ``sharding``'s devices keep their arrays in this process's memory (CPU devices):
    `host_parameter` writes their shards directly."""
    return platform_of(sharding.mesh) == "cpu"


def reads(pretrained: Any, t: Any, shape: tuple[int, ...]) -> list[Read]:
    """The checkpoint tensors of parameter ``t`` (of ``shape``), in the order `parameter` takes them."""
    from shardlib.hf.architectures import hf_names

    names = hf_names(t, *shape[:t.stacked])
    part = t.placement.hf_shape(tuple(shape[t.stacked:]))[0] if t.fused else None
    return [(pretrained.files[n], n, t.row_offset, part or pretrained.files[n].shape(n)[0]) for n in names]


def read_ahead(items: list[Read]) -> Iterator[np.ndarray]:
    """Each of ``items`` whole, in order, without a copy (`TensorFile.map_rows`): the next one is
    mapped (the kernel starts reading its pages) before the caller places the current one, and the
    current one is unmapped when the caller takes the next."""
    current = None
    for file, name, start, count in items:
        ahead = file.map_rows(name, start, start + count)
        if current is not None:
            yield current
        current = ahead
    if current is not None:
        yield current


def programs(t: Any, shape: tuple[int, ...], sharding: NamedSharding, dtype: np.dtype, stored: np.dtype) -> tuple:
    """Parameter ``t``'s programs, compiled for its checkpoint tensors' dtype ``stored`` (`load`
    compiles each parameter's on another thread while the ones before it are read and placed):
    ``(convert,)``, or ``(empty, put)`` for a stacked one (`shardlib.hf.stacks.stacker`)."""
    layer_shape = tuple(shape[t.stacked:])
    layer = NamedSharding(sharding.mesh, P(*tuple(sharding.spec)[t.stacked:len(shape)]))
    placed = jax.ShapeDtypeStruct(layer_shape, stored, sharding=layer)
    return _compiled(t.stacked, tuple(shape), np.dtype(dtype), sharding, placed)


@functools.lru_cache(maxsize=None)
def _compiled(stacked: int, shape: tuple[int, ...], dtype: np.dtype, sharding: NamedSharding, placed: Any) -> tuple:
    if not stacked:
        return (_converter(dtype, sharding).lower(placed).compile(),)
    empty, put = stacks.stacker(shape, dtype, sharding, stacked)
    stack = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    return empty.lower().compile(), put.lower(stack, placed, *(0,) * stacked).compile()


def parameter(t: Any, shape: tuple[int, ...], sharding: Any, tensors: Iterator[np.ndarray], pool: ThreadPoolExecutor,
              compiled: Future) -> jax.Array:
    """Parameter ``t`` from its checkpoint tensors (the next ones of ``tensors``), by the programs
    of ``compiled`` (`programs`: they convert to the parameter's dtype)."""
    layer_shape = tuple(shape[t.stacked:])
    layer = NamedSharding(sharding.mesh, P(*tuple(sharding.spec)[t.stacked:len(shape)]))
    hf_shape, hf_sharding, inverse = hf_layout(t, layer_shape, layer)
    slices = lambda host: _slices(host, hf_shape, hf_sharding, inverse, layer, pool)
    if not t.stacked:
        return compiled.result()[0](slices(next(tensors)))
    stack = None
    for index in np.ndindex(*shape[:t.stacked]):
        block = slices(next(tensors))  # copied while the devices convert the last
        if stack is None:
            empty, put = compiled.result()
            stack = empty()
        stack.block_until_ready()  # the last layer's blocks freed before this one's are converted
        stack = put(stack, block, *index)
    return stack


def host_parameter(t: Any, shape: tuple[int, ...], sharding: NamedSharding, tensors: Iterator[np.ndarray],
                   pool: ThreadPoolExecutor, dtype: np.dtype) -> jax.Array:
    """Parameter ``t`` in ``dtype`` on CPU devices (`in_host_memory`): each device's shard is a
    host buffer written once, a layer's block at a time transposed (PJRT's transfer, as `_slices`)
    and converted into its place by one task, then placed without a copy; no program compiled or
    run (module docstring)."""
    _trim_heap()
    layer_shape = tuple(shape[t.stacked:])
    layer = NamedSharding(sharding.mesh, P(*tuple(sharding.spec)[t.stacked:len(shape)]))
    hf_shape, hf_sharding, inverse = hf_layout(t, layer_shape, layer)
    boxes = sharding.addressable_devices_indices_map(tuple(shape))
    shards = {device: _host_buffer(tuple(len(range(*b.indices(n))) for b, n in zip(box, shape)), np.dtype(dtype))
              for device, box in boxes.items()}
    hf_boxes = hf_sharding.addressable_devices_indices_map(hf_shape)
    for index in np.ndindex(*shape[:t.stacked]):  # () once for an unstacked parameter: the whole shard
        view = next(tensors).reshape(hf_shape)

        def place(device: Any, box: tuple) -> None:
            # float to float (`open_pretrained` refuses other dtypes); bit for bit XLA's convert, NaN
            # and subnormals included. "unsafe": NumPy gives bfloat16 no kind to cast within.
            block = jax.device_put(view[box].transpose(inverse), device)
            np.copyto(shards[device][index], np.asarray(block), casting="unsafe")

        list(pool.map(place, hf_boxes.keys(), hf_boxes.values()))
    placed = [jax.device_put(shards[device], device) for device in boxes]
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, placed)


def _trim_heap() -> None:
    """The C heap's free pages handed back to the kernel (glibc's ``malloc_trim``; nothing where
    the C library has none): the reading threads' arenas otherwise keep the last parameter's freed
    block copies, 0.12 GiB more peak at TinyLlama's shapes (growth 1.06x share + one tensor
    against 1.03x trimmed, BENCHMARKS.md)."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


def _host_buffer(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialized array in its own private anonymous mapping: page-aligned, so the CPU client
    places it without a copy, and faulted in 4 KiB pages as it is written. Not NumPy's allocator,
    which advises huge pages for a large array: on a host whose memory is fragmented each huge
    page fault compacts memory first, and a fresh process's load took 1.5x the CPU time that way
    (BENCHMARKS.md); unmapped when the device array drops it."""
    size = math.prod(shape)
    mapping = mmap.mmap(-1, max(size * dtype.itemsize, 1), flags=mmap.MAP_PRIVATE)
    return np.frombuffer(mapping, dtype, count=size).reshape(shape)


def hf_layout(t: Any, shape: tuple[int, ...], sharding: NamedSharding
              ) -> tuple[tuple[int, ...], NamedSharding, tuple[int, ...]]:
    """(shape, sharding, order back to shardlib's dims) of shardlib's tensor of ``shape`` and
    ``sharding`` with its dims in the checkpoint's order: the checkpoint tensor reshaped (a view),
    split as shardlib's, so each device's box is a block of it and only the transpose is left."""
    order = [d for group in t.placement.groups for d in group]
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    inverse = tuple(order.index(d) for d in range(len(shape)))
    return (tuple(shape[d] for d in order), NamedSharding(sharding.mesh, P(*[spec[d] for d in order])), inverse)


def _slices(host: np.ndarray, shape: tuple[int, ...], sharding: NamedSharding, inverse: tuple[int, ...],
            out: NamedSharding, pool: ThreadPoolExecutor) -> jax.Array:
    """The checkpoint tensor ``host``, seen as ``shape`` (a reshape of it) split by ``sharding``, as
    the global array of its dims put in the order ``inverse`` (shardlib's layout) in ``out``, in the
    checkpoint's dtype: each device's block (whole rows, or a run of each row) placed transposed
    straight from ``host``, in threads. Copying the block out first, so the transpose reads a
    contiguous block, measured more CPU time and 0.1 GiB more peak (BENCHMARKS.md)."""
    view = host.reshape(shape)
    boxes = sharding.addressable_devices_indices_map(shape)
    put = lambda item: jax.device_put(view[item[1]].transpose(inverse), item[0])
    target = tuple(shape[d] for d in inverse)
    return jax.make_array_from_single_device_arrays(target, out, list(pool.map(put, boxes.items())))


@functools.lru_cache(maxsize=None)
def _converter(dtype: np.dtype, sharding: Any):
    """``x`` converted to ``dtype`` in ``sharding``: each device converts its own block (the input
    split the same way)."""
    return jax.jit(lambda x: x.astype(dtype), out_shardings=sharding)
