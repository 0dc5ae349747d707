"""The blocks ZeRO-3 gathers one at a time in a model that does not gather its own parameters.

A block is a member of a *stack*: sibling submodules holding the same parameters (relative paths
and shapes), as an unrolled ``for`` loop over transformer blocks builds them. The adapters gather
each block's parameters when its call runs, under remat whose policy (`RECOMPUTE`) keeps no
gathered weight, so the backward pass gathers them again and the step's peak holds one block's
weights, not the model's; the parameters outside every
block (embedding, final norm, head) are gathered once at the top of the step. This is PyTorch
FSDP2's ``fully_shard`` on each block, found from the parameter tree instead of written by hand.

Framework-free: the adapters give the parameter leaves as ``(path parts, shape, bytes)`` (`leaves_of`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from shardlib.sharding.rules import path_str

Leaf = tuple[tuple[str, ...], tuple[int, ...], int]  # a parameter: (path parts, shape, bytes)

# A stack is gathered block by block when it holds at least this share of the parameter bytes:
# a smaller one (a pair of identical norms) is not worth the gathers and recomputation it costs.
MIN_SHARE = 1 / 8

AUTO = "auto"

# What a block's backward pass recomputes (`build(block_recompute=)`), with the remat policy each is:
# "weights" keeps every matmul's output and recomputes the rest, which holds the weight gather and the
# elementwise work between matmuls (norms, activations, casts): the weights are gathered again from
# their shards, not kept, and the matmuls run once forward, as FSDP2 re-gathers in its backward.
# "block" keeps only the block's inputs and reruns the whole block: about one more forward pass.
RECOMPUTE = {"weights": jax.checkpoint_policies.dots_saveable, "block": None}


def remat_policy(mode: str) -> Callable[..., Any] | None:
    """The remat policy of ``mode`` (a key of `RECOMPUTE`), for ``nnx.remat`` / ``nn.remat``."""
    if mode not in RECOMPUTE:
        raise ValueError(f"block_recompute={mode!r}: pass one of {', '.join(map(repr, RECOMPUTE))}")
    return RECOMPUTE[mode]


def leaves_of(params: Any) -> list[Leaf]:
    """A parameter tree (arrays or ShapeDtypeStructs) as the leaves this module reads."""
    return [(tuple(path_str(path).split("/")), tuple(x.shape), int(np.prod(x.shape)) * x.dtype.itemsize)
            for path, x in jax.tree_util.tree_leaves_with_path(params)]


def stacks(leaves: Iterable[Leaf]) -> list[tuple[str, list[tuple[str, int]]]]:
    """Every stack as ``(parent path, [(member name, member bytes), ...])``, largest first."""
    subtrees: dict[tuple[str, ...], list[tuple[tuple[str, ...], tuple[int, ...], int]]] = {}
    for path, shape, size in leaves:
        for depth in range(len(path) - 1):  # every submodule above the leaf
            subtrees.setdefault(path[:depth + 1], []).append((path[depth + 1:], shape, size))
    found: dict[tuple[tuple[str, ...], Any], list[tuple[str, int]]] = {}
    for node, content in subtrees.items():
        signature = tuple(sorted((rest, shape) for rest, shape, _ in content))
        found.setdefault((node[:-1], signature), []).append((node[-1], sum(size for *_, size in content)))
    groups = [("/".join(parent), members) for (parent, _), members in found.items() if len(members) > 1]
    return sorted(groups, key=lambda g: -sum(size for _, size in g[1]))


def largest_stack(leaves: Sequence[Leaf]) -> tuple[str, list[int]]:
    """(its name, each block's bytes) of the largest stack; ``("", [])`` when there is none."""
    found = stacks(leaves)
    if not found:
        return "", []
    parent, members = found[0]
    first, last = (_join(parent, members[i][0]) for i in (0, -1))
    return f"{first!r} to {last!r}", [size for _, size in members]


def find_blocks(leaves: Sequence[Leaf]) -> tuple[str, ...]:
    """The paths of the members of every stack that holds at least `MIN_SHARE` of the bytes,
    largest stack first; a stack inside a chosen block (a block's query/key/value) is not
    chosen, nor one that holds a chosen block."""
    total = sum(size for *_, size in leaves)
    chosen: list[str] = []
    for parent, members in stacks(leaves):
        if total == 0 or sum(size for _, size in members) < MIN_SHARE * total:
            break
        paths = [_join(parent, name) for name, _ in members]
        if any(_nested(p, c) or _nested(c, p) for p in paths for c in chosen):
            continue
        chosen.extend(paths)
    return tuple(chosen)


def resolve(blocks: str | Sequence[str], leaves: Sequence[Leaf]) -> tuple[str, ...]:
    """``blocks`` as given to an adapter (`AUTO`, or submodule paths) checked against the parameters:
    each path must hold parameters, and no block may hold another."""
    if isinstance(blocks, str):
        if blocks != AUTO:
            raise ValueError(f"blocks={blocks!r}: pass 'auto' (every stack of identical blocks), a sequence of "
                             "submodule paths such as ('blocks/0', 'blocks/1'), or () to gather the whole model at once")
        return find_blocks(leaves)
    paths = tuple(str(b).strip("/") for b in blocks)
    held = {p: sum(size for path, _, size in leaves if _nested("/".join(path), p)) for p in paths}
    empty = [p for p, size in held.items() if not size]
    if empty:
        known = sorted({"/".join(path[:-1]) for path, *_ in leaves if len(path) > 1})
        raise ValueError(f"blocks names {', '.join(map(repr, empty))}, which hold no parameters; submodules that "
                         f"do: {', '.join(map(repr, known[:12]))}{' ...' if len(known) > 12 else ''}")
    nested = [(a, b) for a in paths for b in paths if a != b and _nested(a, b)]
    if nested:
        raise ValueError(f"blocks names {nested[0][0]!r} inside {nested[0][1]!r}: name each block once, "
                         "the outermost submodule that is gathered as one")
    return paths


def sharded(blocks: Sequence[str], specs: Mapping[str, Any]) -> bool:
    """Whether any parameter of ``blocks`` is stored split (``specs``: path -> spec over the batch
    axes): only then is a block gathered per call (under dp there is nothing to gather)."""
    return any(any(spec) for path, spec in specs.items() if any(_nested(path, b) for b in blocks))


def block_of(path: str, blocks: Sequence[str]) -> str | None:
    """The block holding the parameter at ``path``, or None."""
    return next((b for b in blocks if _nested(path, b)), None)


def _nested(path: str, block: str) -> bool:
    return path == block or path.startswith(block + "/")


def _join(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name


def split_static(tree: Any, is_node: Callable[[Any], bool] = lambda x: False) -> tuple[list[Any], Callable]:
    """The arrays (and framework nodes, ``is_node``) among a call's arguments, which remat traces,
    and a function putting them back among the rest: flags, sizes and None stay Python values, so
    ``if deterministic:`` still works inside the block."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_node)
    traced = [isinstance(x, (jax.Array, np.ndarray)) or is_node(x) for x in leaves]

    def rebuild(values: list[Any]) -> Any:
        it = iter(values)
        return jax.tree.unflatten(treedef, [next(it) if t else x for x, t in zip(leaves, traced)])

    return [x for x, t in zip(leaves, traced) if t], rebuild
