"""What `TrainProgram.step` and `TrainProgram.evaluate` accept as a batch, and where its leaves go.

A batch is any pytree of arrays a training loop already has: a dict, a nested dict, a tuple
``(images, labels)``, a NamedTuple or a ``flax.struct.dataclass``; numpy arrays, arrays on one
device, or arrays the user sharded. Every leaf with a dimension leads with the rows, which the
step splits over the data-parallel devices; a scalar leaf (a ``temperature``, a loss weight) is
handed whole to every device. Anything else is refused here, naming the leaf, before JAX would
fail inside the step with the leaf's name lost.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from shardlib.sharding import rules as rules_lib
from shardlib.sharding.layout import Layout, restrict

__all__ = ["check", "place", "shardings", "specs"]


def _leaves(batch: Any) -> list[tuple[str, Any]]:
    """(name, leaf) pairs, named as parameters are (``inputs/tokens``, ``0`` for a tuple's first)."""
    return [(f"batch {rules_lib.path_str(path)!r}", x) for path, x in jax.tree_util.tree_leaves_with_path(batch)]


def _leaf_spec(layout: Layout, x: Any) -> P:
    """Rows over the data-parallel axes; a scalar replicated."""
    return layout.batch_spec(np.ndim(x)) if np.ndim(x) else P()


def specs(layout: Layout, batch: Any) -> Any:
    """The ``shard_map`` in_specs of ``batch`` (over the batch axes only)."""
    return jax.tree.map(lambda x: restrict(_leaf_spec(layout, x), layout.batch_axes), batch)


def shardings(layout: Layout, batch: Any) -> Any:
    """Where each leaf of ``batch`` lives during the step."""
    return jax.tree.map(lambda x: NamedSharding(layout.mesh, _leaf_spec(layout, x)), batch)


def place(layout: Layout, batch: Any) -> Any:
    """``batch`` in the step's shardings. jit refuses arrays committed to devices outside the mesh
    (one device, a smaller mesh of the user's), and compiles the step again for every new input
    sharding (numpy one step, the user's sharding the next); so every leaf is put in place first."""
    def one(x, sharding):
        if isinstance(x, jax.ShapeDtypeStruct) or (isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim)):
            return x
        return jax.device_put(x, sharding)

    return jax.tree.map(one, batch, shardings(layout, batch))


def _row_count(leaves: list[tuple[str, Any]]) -> tuple[str, int] | None:
    """The first leaf with rows and its row count; every leaf with rows must have as many."""
    for name, x in leaves:
        if not hasattr(x, "shape") and not isinstance(x, (int, float, bool, np.generic)):
            raise TypeError(f"{name} is a {type(x).__name__}; a batch holds arrays (numpy or jax) and "
                            "scalars only: keep other values out of it (close over them in the loss)")
    rows = [(name, np.shape(x)) for name, x in leaves if np.ndim(x)]
    if len({shape[0] for _, shape in rows}) > 1:
        raise ValueError(
            f"the leaves of the batch lead with different row counts: {', '.join(f'{n} {s}' for n, s in rows)}; "
            "the step splits every leaf by its leading dimension over the data-parallel devices, so all need "
            "the same number of rows: pass a per-step constant as a scalar (shape (), given whole to every "
            "device) or close over it in the loss function")
    return (rows[0][0], rows[0][1][0]) if rows else None


def check(layout: Layout, batch: Any, microbatches: int = 1) -> None:
    """Refuse a batch the step cannot split: leaves that are not arrays, leaves whose row counts
    differ, rows the data-parallel devices (x microbatches) cannot split evenly."""
    leaves = _leaves(batch)
    _check_pipelined(layout, batch, leaves)
    first = _row_count(leaves)
    if first is None:
        return
    name, size = first
    n = layout.batch_size_multiple * microbatches
    if size % n:
        from shardlib.runtime.data import nearest_multiples

        axes = "x".join(a for a in layout.batch_axes if layout.mesh.shape[a] > 1) or "none"
        what = f"the {layout.batch_size_multiple} data-parallel devices (mesh axes {axes})"
        if microbatches > 1:
            what += f" times {microbatches} microbatches"
        raise ValueError(f"{name} has {size} rows, which {what} cannot split evenly; use a multiple "
                         f"of {n}: {nearest_multiples(size, n)} rows in the global batch")


def _check_pipelined(layout: Layout, batch: Any, leaves: list[tuple[str, Any]]) -> None:
    """The pipeline cuts microbatches from a flat dict of row arrays (`shardlib.step.pipeline`)."""
    if layout.pipeline_stages == 1:
        return
    flat = isinstance(batch, Mapping) and all(np.ndim(v) for v in batch.values())
    if not flat or len(leaves) != len(batch):
        raise ValueError(f"the pipelined step (pipe={layout.pipeline_stages}) takes a flat dict of arrays "
                         "with rows as its batch (no nesting, tuples or scalars); flatten the batch, or use pipe=1")
