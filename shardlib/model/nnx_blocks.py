"""NNX: ZeRO-3 one block at a time for a module that never calls `gather_layer` (`shardlib.model.blocks`).

Inside the step, each block's class is swapped for a subclass whose ``__call__`` runs the
original under ``nnx.remat`` with the block's parameters gathered inside: the gathered weights
live while the block runs, and the backward pass gathers them again (and, under
``block_recompute="block"``, reruns the whole block; `shardlib.model.blocks.RECOMPUTE`), whose
transpose reduce-scatters the block's gradients. Every other method, ``isinstance`` and
the parent's code stay as written. The parameters outside every block are gathered up front.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from shardlib.model import blocks as blocks_lib
from shardlib.model import hooks


def gather_per_block(module: Any, blocks: Sequence[str]) -> None:
    """Make ``module`` (bound inside the step, its sharded parameters stamped with their specs)
    gather everything outside ``blocks`` now and each block when its call runs; the blocks are
    left as they are when none of their parameters is stored split (dp, zero1, zero2, or blocks
    too small to split)."""
    from flax import nnx

    nodes = {"/".join(map(str, path)): node for path, node in nnx.iter_graph(module)}
    stamped = {path: v.get_metadata()[hooks.SPEC_METADATA] for path, v in nodes.items()
               if isinstance(v, nnx.Variable) and v.get_metadata().get(hooks.SPEC_METADATA)}
    hooks.gather_into([nodes[p] for p, (name, _) in stamped.items() if blocks_lib.block_of(name, blocks) is None])
    if blocks_lib.sharded(blocks, dict(stamped.values())):
        for path in blocks:
            object.__setattr__(nodes[path], "__class__", _gathering(type(nodes[path])))


@functools.cache
def _gathering(cls: type) -> type:
    """``cls`` whose ``__call__`` gathers the block's parameters inside ``nnx.remat`` (with the
    step's `shardlib.model.blocks.remat_policy`)."""
    from flax import nnx

    call = cls.__call__

    def __call__(self, *args, **kwargs):
        arrays, rebuild = blocks_lib.split_static((args, kwargs), _is_node)

        def body(block, arrays):
            args, kwargs = rebuild(arrays)
            replaced = hooks.gather_into(_variables(block))
            try:
                return call(block, *args, **kwargs)
            finally:  # the remat's state out holds the shards, not the gathered weights
                hooks.restore(replaced)

        return nnx.remat(body, policy=blocks_lib.remat_policy(hooks.block_recompute()))(self, arrays)

    namespace = {"__call__": __call__, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                 "__doc__": cls.__doc__}
    return type(cls)(cls.__name__, (cls,), namespace)


def _variables(module: Any) -> list[Any]:
    from flax import nnx

    return [node for _, node in nnx.iter_graph(module) if isinstance(node, nnx.Variable)]


def _is_node(x: Any) -> bool:
    from flax import nnx

    return isinstance(x, (nnx.Module, nnx.Variable))
