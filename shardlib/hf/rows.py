"""A Hugging Face checkpoint read once a job: each process reads its share of every tensor's rows.

Under zero3 a matrix's shard is a column block of the checkpoint's row-major ``[out, in]``
tensor, so reading each device's shard from the file touches every page of the tensor and every
process reads the whole checkpoint. Here the job's devices, in the mesh's order, split each
checkpoint tensor's rows (its first dim) evenly; each process reads the rows its own devices
hold, each byte once, in positioned reads on `READ_THREADS` threads (one contiguous range per
process when a process's devices are consecutive in the mesh, as `make_mesh` orders them), and
places them on those devices in the checkpoint's dtype. One compiled program per parameter then
converts them on the devices, reorders them into shardlib's layout (the tensor's
`shardlib.hf.architectures.Placement`), stacks the layers, and reshards them to the parameter's
sharding (XLA's all-to-all or gather where the two layouts cross).

That resharding path is for a parameter whose devices span processes (a process's rows feed
other processes' devices); where this process holds all of a parameter's devices (always, in one
process) `shardlib.hf.local_rows` slices each device's shard on the host instead, with no
collective.

Host memory holds one slice per reading thread (a device's rows of one tensor); a device holds
the rows of the tensor being converted (one layer of a stacked parameter, written into the
stack in place) beside the shards already placed.
"""

from __future__ import annotations

import functools
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from shardlib.hf import local_rows, stacks

READ_THREADS = 8


def load(pretrained: Any, tensors: list[tuple[Any, tuple[int, ...], Any]], dtype: np.dtype) -> list[jax.Array]:
    """Each ``(TensorMap, parameter shape, sharding)`` of ``tensors`` as a global array in ``dtype``,
    read from ``pretrained``'s files a process's share of rows at a time (module docstring)."""
    placed: list[jax.Array] = []
    # in one process's hands whole: each device's shard sliced on the host (`shardlib.hf.local_rows`)
    local = [local_rows.reads(pretrained, t, shape) if local_rows.applies(t, shape, sharding) else []
             for t, shape, sharding in tensors]
    local = [reads if len({f.dtype(n) for f, n, *_ in reads}) == 1 else [] for reads in local]  # one dtype: one program
    with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="shardlib-hf-read") as pool, \
            ThreadPoolExecutor(1, thread_name_prefix="shardlib-hf-compile") as compiler:
        on_host = [bool(reads) and local_rows.in_host_memory(sharding) for (_, _, sharding), reads in zip(tensors, local)]
        compiled = [compiler.submit(local_rows.programs, t, shape, sharding, dtype, reads[0][0].dtype(reads[0][1]))
                    if reads and not cpu else None for (t, shape, sharding), reads, cpu in zip(tensors, local, on_host)]
        host = local_rows.read_ahead([read for reads in local for read in reads])
        try:
            for (t, shape, sharding), program, cpu in zip(tensors, compiled, on_host):
                if placed:  # one parameter assembling while the next is read: its rows are freed before more are read
                    placed[-1].block_until_ready()
                placed.append(local_rows.host_parameter(t, shape, sharding, host, pool, dtype) if cpu
                              else local_rows.parameter(t, shape, sharding, host, pool, program) if program
                              else _parameter(pretrained, t, shape, sharding, dtype, pool))
        finally:  # the read-ahead thread stops here, whatever a parameter raised
            host.close()
    return placed


def _parameter(pretrained: Any, t: Any, shape: tuple[int, ...], sharding: Any, dtype: np.dtype,
               pool: ThreadPoolExecutor) -> jax.Array:
    """One parameter; a stacked one a layer at a time into its stack (donated), so the devices hold
    one layer's conversion in flight, not the whole parameter's."""
    from shardlib.hf.architectures import hf_names

    stacked = tuple(shape[:t.stacked])  # (layers,) or (layers, experts): one checkpoint tensor each
    names = hf_names(t, *stacked)
    layer_shape = tuple(shape[t.stacked:])
    rows = _rows_sharding(sharding)
    part = t.placement.hf_shape(layer_shape)[0] if t.fused else None  # Phi-3's q, k, v in one qkv_proj
    hf_rows = part or pretrained.files[names[0]].shape(names[0])[0]
    read = lambda name: _rows(pretrained.files[name], name, rows, pool, t.row_offset, part)
    spec = tuple(sharding.spec) + (None,) * len(shape) if isinstance(sharding, NamedSharding) else ()
    if not t.stacked or not spec or spec[0] is not None:  # whole (a split layer dim: the stack at once)
        assemble = _assembler(t.placement.groups, layer_shape, stacked, hf_rows, np.dtype(dtype), sharding)
        return assemble(*[read(name) for name in names])
    layer = NamedSharding(sharding.mesh, P(*spec[t.stacked:len(shape)]))
    assemble = _assembler(t.placement.groups, layer_shape, (), hf_rows, np.dtype(dtype), layer)
    empty, put = stacks.stacker(tuple(shape), np.dtype(dtype), sharding, t.stacked)
    stack = empty()
    for index, name in zip(np.ndindex(*stacked), names):
        stack = put(stack, assemble(read(name)), *index)
        stack.block_until_ready()  # this layer's rows freed before the next layer's are read
    return stack


def _rows_sharding(sharding: Any) -> NamedSharding:
    """The first dim split over every device of ``sharding``'s mesh, in the mesh's order."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, P(tuple(sharding.mesh.axis_names)))
    devices = sorted(sharding.device_set, key=lambda d: (d.process_index, d.id))
    return NamedSharding(jax.sharding.Mesh(np.array(devices), ("rows",)), P("rows"))


def _rows(file: Any, name: str, rows: NamedSharding, pool: ThreadPoolExecutor, start: int = 0,
          count: int | None = None) -> jax.Array:
    """``name`` (its rows ``start`` to ``start + count``: one part of a fused tensor) split by rows
    over ``rows``' devices (padded with zero rows to an even split), each process reading and placing
    only its devices' rows, in the file's dtype."""
    shape = file.shape(name)
    count = shape[0] if count is None else count
    devices = list(rows.mesh.devices.flat)
    chunk = -(-count // len(devices))
    me = jax.process_index()

    def place(k: int) -> jax.Array:
        block = file.read_rows(name, start + min(k * chunk, count), start + min((k + 1) * chunk, count))
        if block.shape[0] < chunk:  # the last rows: padding, cut off on the device
            block = np.concatenate([block, np.zeros((chunk - block.shape[0], *shape[1:]), block.dtype)])
        return jax.device_put(block, devices[k])

    local = [k for k, d in enumerate(devices) if d.process_index == me]
    pieces = list(pool.map(place, local))
    return jax.make_array_from_single_device_arrays((chunk * len(devices), *shape[1:]), rows, pieces)


@functools.lru_cache(maxsize=None)
def _assembler(groups: tuple[tuple[int, ...], ...], layer_shape: tuple[int, ...], stacked: tuple[int, ...],
               hf_rows: int, dtype: np.dtype, sharding: Any):
    """The compiled program turning the row-split checkpoint tensor(s) of one parameter into it:
    padding cut, converted to ``dtype``, reordered into shardlib's layout, stacked into the
    ``stacked`` leading dims (layers, experts; () for one tensor), resharded to ``sharding``."""
    order = [d for group in groups for d in group]
    inverse = [order.index(d) for d in range(len(layer_shape))]

    def one(x: jax.Array) -> jax.Array:
        x = x[:hf_rows].astype(dtype)
        return x.reshape([layer_shape[d] for d in order]).transpose(inverse)

    def assemble(*parts: jax.Array) -> jax.Array:
        import jax.numpy as jnp

        ys = [one(x) for x in parts]
        return jnp.stack(ys).reshape(stacked + tuple(layer_shape)) if stacked else ys[0]

    assert math.prod(layer_shape) and len(order) == len(layer_shape)
    return jax.jit(assemble, out_shardings=sharding)
