"""What `TrainProgram.step` and `TrainProgram.evaluate` accept as a batch, and where its leaves go.

A batch is any pytree of arrays a training loop already has: a dict, a nested dict, a tuple
``(images, labels)``, a NamedTuple or a ``flax.struct.dataclass``; numpy arrays, arrays on one
device, or arrays the user sharded. Every leaf with a dimension leads with the rows, which the
step splits over the data-parallel devices; a scalar leaf (a ``temperature``, a loss weight) is
handed whole to every device. Anything else is refused here, naming the leaf, before JAX would
fail inside the step with the leaf's name lost.

A batch whose leaves count different things (a graph batch's nodes, edges and graphs) cannot be
split by rows: the user pads one batch per data-parallel device, stacks them, and passes
``per_device(stacked)``; each device's loss gets its own batch, the device axis dropped (`local`),
as a ``jax.pmap`` step gets it.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from shardlib.sharding import rules as rules_lib
from shardlib.sharding import sequence as sequence_lib
from shardlib.sharding.layout import Layout, restrict

__all__ = ["PerDevice", "check", "local", "per_device", "place", "refuse_donated", "shardings", "specs"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PerDevice:
    """Leaves that lead with one entry per data-parallel device (x microbatches), each a whole batch
    of its own: the step hands device d its entry with that axis dropped."""

    batch: Any

    def __getattr__(self, name: str) -> Any:
        """Only the step unwraps it (`local`): a loss handed one elsewhere (``pmap_step``, a call of
        ``model.loss`` of your own) would fail on ``graphs.nodes`` naming no cause."""
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(_WRAPPED.format(name=name))

    def __getitem__(self, key: Any) -> Any:
        raise TypeError(_WRAPPED.format(name=key))


_WRAPPED = ("{name!r}: this is a shardlib.step.batch.per_device batch, which only program.step and program.evaluate hand to "
            "the loss as each device's own; elsewhere pass the stacked batch's entries yourself "
            "(jax.tree.map(lambda x: x[d], stacked))")


def per_device(batch: Any) -> PerDevice:
    """Mark ``batch`` as already split per device: every leaf leads with the data-parallel device
    count (times ``grad_accum``), as a ``jax.pmap`` loop stacks it. For batches whose leaves count
    different things (padded graphs: nodes, edges, graphs), which no row split can keep whole."""
    return PerDevice(batch)


def _is_per_device(x: Any) -> bool:
    return isinstance(x, PerDevice)


def local(batch: Any) -> Any:
    """Inside the step: each ``per_device`` part as this device's own batch (its leading entry,
    the one this device holds, without the device axis); other leaves as they are."""
    def one(x):
        return jax.tree.map(lambda leaf: leaf[0], x.batch) if _is_per_device(x) else x

    return jax.tree.map(one, batch, is_leaf=_is_per_device)


def _leaves(batch: Any) -> list[tuple[str, Any]]:
    """(path, leaf) pairs, paths written as parameters' are (``inputs/tokens``, ``0`` for a tuple's first);
    a python list of numbers is one leaf, so that it is refused by its own path, not number by number."""
    return [(rules_lib.path_str(path), x)
            for path, x in jax.tree_util.tree_leaves_with_path(batch, is_leaf=_is_number_list)]


_NUMBER = (int, float, bool, np.generic)


def _is_number_list(x: Any) -> bool:
    """A (nested) python list of numbers: token ids a tokenizer returned, rows not yet made an array."""
    return isinstance(x, list) and bool(x) and all(isinstance(i, _NUMBER) or _is_number_list(i) for i in x)


def _is_float(dtype: np.dtype) -> bool:
    """bfloat16 and float8 (ml_dtypes) are numpy kind 'V', like a structured array, but floats to JAX."""
    return jax.numpy.issubdtype(dtype, jax.numpy.floating)


def _refuse_number_list(name: str, x: list) -> None:
    """JAX reads a list as a pytree: each number would become a scalar leaf, given whole to every
    device, and the model would get a list instead of an array. Say what to pass instead."""
    try:
        shape = np.shape(x)
    except ValueError:  # numpy refuses ragged nesting
        raise TypeError(f"batch {name!r} is a python list of rows of different lengths; a batch holds arrays: "
                        "pad the rows to one length (with an attention mask for the padding, e.g. a tokenizer's "
                        f"padding='max_length') and pass np.asarray(...) as {name!r}") from None
    raise TypeError(f"batch {name!r} is a python list (shape {shape}); a batch holds arrays: pass "
                    f"np.asarray(...) as {name!r} (JAX reads a list as a pytree, one scalar leaf per number)")


def _leaf_spec(layout: Layout, x: Any) -> P:
    """Rows over the data-parallel axes; a scalar replicated."""
    return layout.batch_spec(np.ndim(x)) if np.ndim(x) else P()


def specs(layout: Layout, batch: Any) -> Any:
    """The ``shard_map`` in_specs of ``batch`` (over the batch axes only)."""
    return jax.tree.map(lambda x: restrict(_leaf_spec(layout, x), layout.batch_axes), batch)


def in_context_order(layout: Layout, batch: Any) -> Any:
    """Under balanced context parallelism: every leaf's sequence dim (dim 1) reordered so that its
    split over `context` gives each device one early and one late chunk (`shardlib.sharding.sequence`).
    Inside the jitted step, so the data pipeline's order is untouched; a loss that is a mean over
    tokens does not see the order, and the model takes positions from `shardlib.model.attention.positions`."""
    if layout.context_size == 1 or not layout.context_balance:
        return batch

    def one(x):
        if np.ndim(x) < 2:
            return x
        return jax.numpy.take(x, sequence_lib.order(x.shape[1], layout.context_size, True), axis=1)

    return jax.tree.map(one, batch)


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

    _refuse_host_rows_across_processes(batch)
    return jax.tree.map(one, batch, shardings(layout, batch))


def _refuse_host_rows_across_processes(batch: Any) -> None:
    """In a multi-process job a host array with rows is ambiguous (this process's rows, or the
    whole batch on every process?), and device_put would read it as the whole batch: refuse it."""
    if jax.process_count() == 1:
        return
    host = [name for name, x in _leaves(batch) if np.ndim(x) and not isinstance(x, (jax.Array, jax.ShapeDtypeStruct))]
    if host:
        raise TypeError(
            f"in a multi-process job ({jax.process_count()} processes) the step takes global jax.Arrays, and "
            f"batch {', '.join(map(repr, host))} are host arrays: make each from this process's rows with "
            "jax.tree.map(lambda x, s: jax.make_array_from_process_local_data(s, x), batch, "
            "program.layout.batch_sharding(batch)), or shardlib.runtime.data.to_global for a dict of rows")


def refuse_donated(tree: Any, name: str) -> None:
    """A step donates its input state (its buffers become the new state's). Passing that state again,
    the usual slip of ``program.step(state, batch)`` without ``state, metrics = ``, crashes the whole
    process on XLA:CPU (jaxlib 0.10.2 segfaults on a donated buffer) instead of raising: refuse it."""
    deleted = [rules_lib.path_str(path) for path, x in jax.tree_util.tree_leaves_with_path(tree)
               if isinstance(x, jax.Array) and x.is_deleted()]
    if deleted:
        more = f" (and {len(deleted) - 1} more)" if len(deleted) > 1 else ""
        raise ValueError(
            f"{name} {deleted[0]!r}{more}: donated to an earlier program.step, which reuses its memory for the "
            "state it returns: pass the latest state (state, metrics = program.step(state, batch); "
            "program.evaluate(state.params, ...)), or build(..., donate=False) to keep old states alive")


def _check_leaf(name: str, x: Any) -> None:
    """Numpy and jax arrays and scalars only. A torch or TensorFlow tensor (a tokenizer's
    return_tensors='pt', a DataLoader's batch) has a shape but no dtype JAX reads: say how to convert."""
    if isinstance(x, list):
        _refuse_number_list(name, x)
    if isinstance(x, (np.ndarray, np.generic)) and x.dtype.kind in "OSUMmV" and not _is_float(x.dtype):
        raise TypeError(f"batch {name!r} is a numpy array of dtype {x.dtype}, which JAX cannot hold (numbers and "
                        "bools only): drop it from the batch (a datasets column of text or ids: remove_columns, or "
                        f"with_format('numpy', columns=[...])), or encode it as numbers")
    if isinstance(x, (np.ndarray, np.generic)):
        _refuse_wrapping_ints(name, x)
    if isinstance(x, (np.ndarray, jax.Array, jax.ShapeDtypeStruct) + _NUMBER):
        return
    package = type(x).__module__.split(".")[0]
    kind = type(x).__name__ if package == "builtins" else f"{package}.{type(x).__name__}"
    if hasattr(x, "shape"):
        raise TypeError(f"batch {name!r} is a {kind}; a batch holds numpy or jax arrays: pass np.asarray(...) as "
                        f"{name!r} (x.numpy() for a torch or TensorFlow tensor, return_tensors='np' from a tokenizer)")
    raise TypeError(f"batch {name!r} is a {kind}; a batch holds arrays (numpy or jax) and "
                    "scalars only: keep other values out of it (close over them in the loss)")


def _refuse_wrapping_ints(name: str, x: np.ndarray | np.generic) -> None:
    """Without jax_enable_x64, JAX stores int64 as int32 and wraps larger values without a word: a
    recommender's hashed ids (``5_000_000_123 % 50_000`` is 123, wrapped it is 32827) would silently
    look up other rows. Refuse values the 32-bit dtype cannot hold."""
    stored = jax.dtypes.canonicalize_dtype(x.dtype)
    if x.dtype.kind not in "iu" or not x.size or stored == x.dtype:  # no pass over the values unless narrowed
        return
    held = np.iinfo(stored)
    low, high = np.min(x), np.max(x)
    if low < held.min or high > held.max:
        bad = high if high > held.max else low
        raise ValueError(f"batch {name!r} holds {x.dtype} values such as {bad}, which JAX stores as {held.dtype} "
                         f"(jax_enable_x64 is off) by wrapping them silently ({bad} becomes {bad.astype(held.dtype)}): "
                         f"reduce them on the host first (ids % table_size for hashed ids), or turn on "
                         "jax.config.update('jax_enable_x64', True)")


def _first_rows(rows: list[tuple[str, Any]]) -> dict[str, Any]:
    """The first leaf with rows, by path (none for a batch of scalars); every leaf with rows must have as many."""
    rows = [(name, x) for name, x in rows if np.ndim(x)]
    if len({np.shape(x)[0] for _, x in rows}) > 1:
        named = ", ".join(f"batch {name!r} {np.shape(x)}" for name, x in rows)
        keys = [name for name, x in rows if _is_raw_key(x)]
        raise ValueError(
            f"the leaves of the batch lead with different row counts: {named}; "
            "the step splits every leaf by its leading dimension over the data-parallel devices, so all need "
            "the same number of rows: pass a per-step constant as a scalar (shape (), given whole to every "
            "device) or close over it in the loss function; leaves that count different things (a graph "
            "batch's nodes, edges and graphs) need one padded batch per device, stacked and passed as "
            "shardlib.step.batch.per_device(batch)" + (f". {_key_advice(keys[0])}" if keys else ""))
    return dict(rows[:1])


def _parts(batch: Any) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
    """(path, leaf) pairs of the leaves split by rows, and of the leaves of ``per_device`` parts."""
    rows, devices = [], []
    is_leaf = lambda x: _is_per_device(x) or _is_number_list(x)
    for path, x in jax.tree_util.tree_leaves_with_path(batch, is_leaf=is_leaf):
        name = rules_lib.path_str(path)
        if _is_per_device(x):
            devices += [(f"{name}/{inner}" if name else inner, leaf) for inner, leaf in _leaves(x.batch)]
        else:
            rows.append((name, x))
    return rows, devices


def _check_per_device(layout: Layout, devices: list[tuple[str, Any]], microbatches: int) -> None:
    """A ``per_device`` leaf leads with exactly one entry per device (x microbatches): any other
    count would hand a device several batches, or part of one."""
    n = layout.batch_size_multiple * microbatches
    for name, x in devices:
        if not np.ndim(x) or np.shape(x)[0] != n:
            axes = " x ".join(a for a in layout.batch_axes if layout.mesh.shape[a] > 1) or "none"
            times = f" x {microbatches} microbatches (device d's microbatch i is entry d*{microbatches}+i)" if microbatches > 1 else ""
            raise ValueError(
                f"per_device batch {name!r} has shape {np.shape(x)}; a per_device batch leads with one entry per "
                f"data-parallel device: {n} ({layout.batch_size_multiple} devices, mesh axes {axes}{times}). "
                f"Pad one batch per device to the same shapes and stack them (np.stack(..., axis=0)); "
                "a value the same on every device goes beside the per_device part, not in it")


# jraph's GraphsTuple: nodes, edges and graphs counted apart, senders/receivers indexing the nodes.
_GRAPH_FIELDS = frozenset({"senders", "receivers", "n_node"})


def _refuse_split_graphs(rows: list[tuple[str, Any]], layout: Layout) -> None:
    """A graph batch split by rows loses its graphs (a device gets some nodes, some edges, indices
    into other devices' nodes), even where the counts happen to agree: refuse it with the fix."""
    if not _GRAPH_FIELDS <= {name.rsplit("/", 1)[-1] for name, x in rows if np.ndim(x)}:
        return
    raise ValueError(
        f"the batch holds a graph batch ({', '.join(sorted(_GRAPH_FIELDS))}: jraph's GraphsTuple), which the step "
        f"cannot split by rows over the {layout.batch_size_multiple} data-parallel devices: graphs would be cut "
        "apart and senders / receivers would index other devices' nodes. Pad one graph batch per device "
        "(jraph.pad_with_graphs, the same sizes on every device), stack them (np.stack per leaf) and pass "
        "shardlib.step.batch.per_device(graphs): each device's loss gets its own GraphsTuple, as under jax.pmap")


def _is_raw_key(x: Any) -> bool:
    """A ``jax.random.PRNGKey``: two uint32 words."""
    return np.shape(x) == (2,) and np.dtype(x.dtype) == np.uint32


def _key_advice(name: str) -> str:
    return (f"batch {name!r} looks like a random key: a key in the batch reaches every device alike, so each "
            "draws the same numbers for its own rows (the same dropout mask on every device); draw from the "
            "step's key instead, which differs per device: from_functions(..., takes_call=True) and call.key, "
            "or rngs={'dropout': ...} from from_linen / from_nnx")


def _warn_keys(layout: Layout, leaves: list[tuple[str, Any]]) -> None:
    """A typed key (``jax.random.key``) is a scalar leaf, so it passes as one: warn that every device
    gets it, once per program and leaf (under ``simplefilter("always")`` it would repeat every step)."""
    warned = _warned_keys(layout)
    for name, x in leaves:
        if name not in warned and hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            warned.add(name)
            warnings.warn(_key_advice(name), UserWarning, stacklevel=5)  # the caller of program.step


# The batch leaves warned about as keys, by id of the program's layout (dropped with the layout).
_WARNED_KEYS: dict[int, set[str]] = {}


def _warned_keys(layout: Layout) -> set[str]:
    if id(layout) not in _WARNED_KEYS:
        _WARNED_KEYS[id(layout)] = set()
        weakref.finalize(layout, _WARNED_KEYS.pop, id(layout), None)
    return _WARNED_KEYS[id(layout)]


def check(layout: Layout, batch: Any, microbatches: int = 1) -> None:
    """Refuse a batch the step cannot split: leaves that are not arrays, leaves whose row counts
    differ, rows the data-parallel devices (x microbatches) cannot split evenly, a graph batch
    split by rows, a ``per_device`` part without one entry per device (x microbatches)."""
    _check_pipelined(layout, batch, _leaves(batch))
    rows, devices = _parts(batch)  # per_device leaves named by their path inside the part
    for name, x in rows + devices:
        _check_leaf(name, x)
    _refuse_split_graphs(rows, layout)
    # the divisibility message is the one the CLI's batches get
    layout.check_batch(_first_rows(rows), microbatches=microbatches)
    _check_per_device(layout, devices, microbatches)
    _warn_keys(layout, rows + devices)


def _check_pipelined(layout: Layout, batch: Any, leaves: list[tuple[str, Any]]) -> None:
    """The pipeline cuts microbatches from a flat dict of row arrays (`shardlib.step.pipeline`)."""
    if layout.pipeline_stages == 1:
        return
    flat = isinstance(batch, Mapping) and all(np.ndim(v) for v in batch.values())
    if not flat or len(leaves) != len(batch):
        raise ValueError(f"the pipelined step (pipe={layout.pipeline_stages}) takes a flat dict of arrays "
                         "with rows as its batch (no nesting, tuples or scalars); flatten the batch, or use pipe=1")
