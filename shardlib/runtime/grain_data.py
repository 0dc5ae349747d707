"""Global batches from a Grain pipeline, process-sharded, resumable exactly across a change of process count.

Grain (the JAX ecosystem's loader; ``pip install shardlib[data]``) keeps its position in an
iterator whose state is opaque to us: it can be restored exactly, but not split or joined. So the
stream is cut into S *logical shards* fixed for the life of a run (default S: the process count
of its first start), each a Grain pipeline of its own with its own iterator state. Every global
batch takes B/S examples from each shard in shard order; process p of P owns the shards
[p*S/P, (p+1)*S/P), which are exactly its rows [p*B/P, (p+1)*B/P) of the batch (the rows
`shardlib.runtime.data.to_global` expects), and reads nothing else.

A checkpoint holds the state of every shard (each process contributes its own; `Checkpointer`
merges them on restore), so a run resumed on P' processes (any P' dividing S: an elastic
shrink from 2 to 1, say) rebuilds the same S shards at the same positions: no example is
lost or read twice.

When to use which loader (docs/data.md): the built-in `ByteBatches` is stateless (batch k is a
pure function of the seed and k) and needs no dependency; use Grain for data that needs a
pipeline (records on disk, decoding, per-example transforms, multiprocessing workers).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np

from shardlib.runtime.data import check_batch_size, local_rows

EXTRA_HINT = "pip install shardlib[data]"
STATE_FORMAT = "grain-shards/1"


class Shard(NamedTuple):
    """Which logical shard a pipeline reads: pass to ``grain.sharding.ShardOptions(index, count)`` or slice
    a ``MapDataset`` with ``[index::count]``."""

    index: int
    count: int


def require_grain() -> Any:
    """The ``grain`` module, or an ImportError that names the extra to install."""
    try:
        import grain
    except ImportError:
        raise ImportError(f"Grain data pipelines need the `grain` package, which is optional: {EXTRA_HINT} "
                          "(or pip install 'grain>=0.2.12,<0.3')") from None
    return grain


def _iterator_state(iterator: Any) -> Any:
    """JSON for an iterator's state: an IterDataset's is a dict, a DataLoader's is JSON bytes (kept as text)."""
    state = iterator.get_state()
    return {"text": state.decode("utf-8")} if isinstance(state, bytes) else state


def _set_iterator_state(iterator: Any, state: Any) -> None:
    iterator.set_state(state["text"].encode("utf-8") if isinstance(state, dict) and set(state) == {"text"} else state)


def _stack(examples: list[Any]) -> Any:
    """One array per key (or one array) with the examples along a new first axis."""
    if isinstance(examples[0], Mapping):
        return {key: np.stack([np.asarray(e[key]) for e in examples]) for key in examples[0]}
    return np.stack([np.asarray(e) for e in examples])


class GrainBatches:
    """This process's rows of each global batch, read from S logical Grain shards.

    ``pipeline``: a function ``Shard -> grain.IterDataset | grain.DataLoader`` yielding single
    examples (a dict of arrays, or an array; no batching op: the batch is assembled here), or
    one such object already sharded by process (``grain.sharding.ShardByJaxProcess()``), which
    resumes on the same process count only. ``shards``: S (default: the process count). Iterate
    it, and pass ``state()`` as the checkpoint's ``data_state``; after a restore, ``restore(state)``.
    """

    def __init__(self, pipeline: Callable[[Shard], Any] | Any, global_batch_size: int, *, shards: int | None = None,
                 process_index: int | None = None, process_count: int | None = None,
                 data_parallel_size: int | None = None) -> None:
        require_grain()
        import jax

        self.process_index = jax.process_index() if process_index is None else process_index
        self.process_count = jax.process_count() if process_count is None else process_count
        self._make = pipeline if callable(pipeline) and not hasattr(pipeline, "__iter__") else None
        self._given = None if self._make is not None else pipeline
        check_batch_size(global_batch_size, self.process_count, data_parallel_size)
        self.global_batch_size = global_batch_size
        self.rows = local_rows(global_batch_size, self.process_index, self.process_count)
        self.step = 0
        self._reshard(shards or self.process_count)

    def _reshard(self, count: int) -> None:
        """Own the shards [p*S/P, (p+1)*S/P) of ``count``; their iterators start at their beginnings."""
        if self._given is not None and count != self.process_count:
            raise ValueError(f"GrainBatches: this state has {count} data shards but the job has {self.process_count} "
                             "processes, and a pipeline passed as one object is this process's shard only; pass a "
                             "function Shard -> pipeline instead, so any process count can rebuild the shards")
        if count % self.process_count or self.global_batch_size % count:
            raise ValueError(f"GrainBatches: {count} data shards cannot be split over {self.process_count} processes "
                             f"with a batch of {self.global_batch_size}: the process count must divide the shard count, "
                             "and the shard count the batch size")
        per_process = count // self.process_count
        self.shard_count = count
        self.shards = list(range(self.process_index * per_process, (self.process_index + 1) * per_process))
        self._iterators = {s: iter(self._given if self._given is not None else self._make(Shard(s, count)))
                           for s in self.shards}

    @property
    def local_batch_size(self) -> int:
        return self.rows.stop - self.rows.start

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        per_shard = self.global_batch_size // self.shard_count
        examples = []
        for s in self.shards:
            for _ in range(per_shard):
                try:
                    examples.append(next(self._iterators[s]))
                except StopIteration:
                    raise StopIteration(f"data shard {s} of {self.shard_count} ran out at step {self.step}") from None
        self.step += 1
        return _stack(examples)

    def state(self) -> dict[str, Any]:
        """JSON: the step (batches taken) and the Grain state of each shard this process owns."""
        return {"format": STATE_FORMAT, "step": self.step, "shard_count": self.shard_count,
                "shards": {str(s): _iterator_state(self._iterators[s]) for s in self.shards}}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (a checkpoint's data state, every shard's merged): the next batch is the
        one after the save, on any process count that divides the shard count."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"GrainBatches.restore: not a Grain data state (format {state.get('format')!r}); was the "
                             "checkpoint saved with another loader's state?")
        self._reshard(int(state["shard_count"]))
        missing = [s for s in self.shards if str(s) not in state["shards"]]
        if missing:
            raise ValueError(f"GrainBatches.restore: the checkpoint has no state for data shard(s) {missing}")
        for s in self.shards:
            _set_iterator_state(self._iterators[s], state["shards"][str(s)])
        self.step = int(state["step"])
