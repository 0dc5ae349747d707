"""Which layers each pipeline stage runs: the even split, an explicit list, or ``"auto"``.

The first stage also runs the embedding and the last one the head (and the loss), so with a
large vocabulary an even split of the layers leaves the last stage the slowest, and every other
stage waits for it each tick. ``"auto"`` compiles the three pieces a stage is made of (the
embedding, one layer, the head with its loss, each forward and backward, on one microbatch) and
gives each stage the contiguous run of layers that makes the slowest stage as cheap as possible.

A piece's cost is read from its compiled program (``cost_analysis()``: FLOPs and bytes
accessed) and weighed as a roofline: ``max(flops, bytes * MACHINE_BALANCE)`` FLOP-equivalents,
so a piece bound by memory traffic (the softmax over a large vocabulary) counts as such.

Storage stays the even split over ``pipe`` (checkpoints keep the model's own shapes); a stage
whose compute layers are stored on a neighbour receives them at the start of the step and sends
their gradients back at the end (`layer_moves`, `shardlib.step.pipeline`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

# FLOPs per byte at which an accelerator turns from memory- to compute-bound: an H100 SXM does
# 989e12 dense bf16 FLOP/s over 3.35e12 B/s of HBM, about 300.
MACHINE_BALANCE = 300.0

StageLayers = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Cost:
    """One compiled program's ``flops`` and ``bytes`` accessed (XLA's cost analysis)."""

    flops: float = 0.0
    bytes: float = 0.0

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.flops + other.flops, self.bytes + other.bytes)

    def __mul__(self, n: int) -> Cost:
        return Cost(self.flops * n, self.bytes * n)

    @property
    def roofline(self) -> float:
        """FLOP-equivalents of the bound that limits it: compute, or memory traffic."""
        return max(self.flops, self.bytes * MACHINE_BALANCE)


def even_split(n_layers: int, stages: int) -> StageLayers:
    return (n_layers // stages,) * stages


def balance(costs: Sequence[float], stages: int, first: float = 0.0, last: float = 0.0) -> StageLayers:
    """Layers per stage (contiguous, at least one each) minimising the slowest stage's cost, where
    stage s costs the sum of its layers' ``costs`` plus ``first`` on stage 0 and ``last`` on the
    last stage. Pure; ties keep the even split when it is optimal, else the first optimum found."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot split {n} layers into {stages} stages of at least one layer each")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    extra = lambda s: (first if s == 0 else 0.0) + (last if s == stages - 1 else 0.0)
    segment = lambda s, i, j: prefix[j] - prefix[i] + extra(s)
    best = _min_max_splits(n, stages, segment)
    if n % stages == 0:
        even = even_split(n, stages)
        if _slowest(even, segment) <= _slowest(best, segment):
            return even
    return best


def _min_max_splits(n: int, stages: int, segment) -> StageLayers:
    """DP over (stages used, layers placed): the split whose costliest segment is cheapest."""
    inf = float("inf")
    value = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    value[0][0] = 0.0
    for s in range(1, stages + 1):
        for j in range(s, n - (stages - s) + 1):
            for i in range(s - 1, j):
                v = max(value[s - 1][i], segment(s - 1, i, j))
                if v < value[s][j]:
                    value[s][j], cut[s][j] = v, i
    sizes, j = [], n
    for s in range(stages, 0, -1):
        i = cut[s][j]
        sizes.append(j - i)
        j = i
    return tuple(reversed(sizes))


def _slowest(split: StageLayers, segment) -> float:
    starts = [sum(split[:s]) for s in range(len(split))]
    return max(segment(s, starts[s], starts[s] + n) for s, n in enumerate(split))


def check_stage_layers(stage_layers: Any, n_layers: int, stages: int) -> StageLayers | str | None:
    """``None``, ``"auto"`` or a list of positive layer counts summing to ``n_layers``, one per
    stage; anything else is refused with the expected length and sum."""
    if stage_layers is None or stage_layers == "auto":
        return stage_layers
    if isinstance(stage_layers, str):
        raise ValueError(f"stage_layers={stage_layers!r}: pass 'auto' or a list of layer counts such as "
                         f"{','.join(map(str, even_split(n_layers, stages)))}")
    split = tuple(int(n) for n in stage_layers)
    if len(split) != stages or sum(split) != n_layers or min(split) < 1:
        raise ValueError(
            f"stage_layers={','.join(map(str, split))} must give each of the {stages} pipeline stages at least one "
            f"layer and sum to the model's {n_layers} layers (length {stages}, sum {n_layers}), "
            f"e.g. {','.join(map(str, even_split(n_layers, stages)))} or 'auto'")
    return split


def parse_stage_layers(text: str | None) -> StageLayers | str | None:
    """The CLI's ``--stage-layers``: ``auto``, ``3,5``, or nothing (the even split)."""
    if text is None or text in ("", "even"):
        return None
    if text == "auto":
        return "auto"
    try:
        return tuple(int(n) for n in text.split(","))
    except ValueError:
        raise ValueError(f"--stage-layers {text!r}: use 'auto' or layer counts per stage such as 3,5") from None


def layer_moves(split: StageLayers, stored_per_stage: int) -> list[tuple[int, int, int, int]]:
    """(slot, layer, stored on, computed on) for every layer whose compute stage is not the one
    that stores it (storage: ``stored_per_stage`` contiguous layers per stage)."""
    moves, start = [], 0
    for stage, n in enumerate(split):
        for slot in range(n):
            layer = start + slot
            if layer // stored_per_stage != stage:
                moves.append((slot, layer, layer // stored_per_stage, stage))
        start += n
    return moves


@dataclasses.dataclass(frozen=True)
class Pieces:
    """Compiled cost of one microbatch's forward + backward through each piece of a stage."""

    embed: Cost
    layer: Cost
    head: Cost

    def stage_costs(self, split: StageLayers, embed_everywhere: bool = False) -> list[Cost]:
        """Each stage's cost under ``split``; ``embed_everywhere``: every stage computes the
        embedding and the head (the step's choice when they hold collectives)."""
        S = len(split)
        ends = lambda s: (self.embed if s == 0 or embed_everywhere else Cost()) + \
            (self.head if s == S - 1 or embed_everywhere else Cost())
        return [self.layer * n + ends(s) for s, n in enumerate(split)]

    def auto(self, n_layers: int, stages: int, embed_everywhere: bool = False) -> StageLayers:
        if embed_everywhere:  # the ends cost the same on every stage: only the layers differ
            return balance([self.layer.roofline] * n_layers, stages)
        return balance([self.layer.roofline] * n_layers, stages, self.embed.roofline, self.head.roofline)


def compiled_cost(fn, *args) -> Cost:
    """FLOPs and bytes accessed of ``fn`` compiled for abstract ``args`` on one device."""
    analysis = jax.jit(fn).lower(*args).compile().cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
    return Cost(float(analysis.get("flops", 0.0)), float(analysis.get("bytes accessed", 0.0)))


def _grad_of(fn):
    """fn(params, x, rows) -> y, made into its forward + backward (a cotangent of ones)."""
    def both(p, x, rows):
        y, vjp = jax.vjp(lambda p, x: fn(p, x, rows), p, x)
        return vjp(jax.tree.map(jnp.ones_like, y))
    return both


def _one_layer(stacked: str, params: Any, index: int) -> Any:
    return {**params, stacked: jax.tree.map(lambda a: a[index:index + 1], params[stacked])}


def stage_program(pipeline: Any, layers: range, first: bool, last: bool):
    """The work of one stage as one function of (params, x, rows): embed (first), the given layers one
    at a time (XLA counts a scan body once, so they are not scanned), head and loss (last)."""
    def run(p, x, rows):
        if first:
            x = pipeline.embed(p, rows, None)
        for i in layers:
            x = pipeline.stage(_one_layer(pipeline.stacked, p, i), x, None)
        if last:
            return pipeline.head_loss(p, x, rows, None)[0]
        return x
    return _grad_of(run)


@functools.lru_cache(maxsize=16)
def _cached_pieces(pipeline: Any, params_key: Any, rows_key: Any, x_key: Any) -> Pieces:
    params, rows, x = (jax.tree.unflatten(t, [jax.ShapeDtypeStruct(s, d) for s, d in leaves])
                       for t, leaves in (params_key, rows_key, x_key))
    cost = lambda first, last, layers: compiled_cost(stage_program(pipeline, layers, first, last), params, x, rows)
    return Pieces(embed=cost(True, False, range(0)), layer=cost(False, False, range(1)), head=cost(False, True, range(0)))


def _key(tree: Any) -> Any:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(l.shape), jnp.dtype(l.dtype)) for l in leaves)


def measure_pieces(pipeline: Any, params: Any, rows: Any) -> Pieces:
    """Compile the embedding, one layer and the head (each forward + backward) for one
    microbatch ``rows`` (abstract) with the full ``params`` (abstract), and read their costs."""
    x = jax.eval_shape(lambda p, r: pipeline.embed(p, r, None), params, rows)
    return _cached_pieces(pipeline, _key(params), _key(rows), _key(x))


def compiled_stage_costs(pipeline: Any, params: Any, rows: Any, split: StageLayers) -> list[Cost]:
    """Each stage's cost under ``split``, compiled as one program per stage (not summed from
    pieces): what `Pieces.stage_costs` estimates."""
    x = jax.eval_shape(lambda p, r: pipeline.embed(p, r, None), params, rows)
    costs, start = [], 0
    for s, n in enumerate(split):
        fn = stage_program(pipeline, range(start, start + n), s == 0, s == len(split) - 1)
        costs.append(compiled_cost(fn, params, x, rows))
        start += n
    return costs


def stage_table(pipeline: Any, params: Any, rows: Any, stages: int, chosen: Any = "auto",
                embed_everywhere: bool = False) -> dict[str, Any]:
    """Each stage's FLOPs and bytes (one microbatch, forward + backward) under the even split and
    under ``chosen`` (``"auto"`` or layers per stage): what ``shardlib plan`` shows and writes."""
    pieces = measure_pieces(pipeline, params, rows)
    n_layers = jax.tree.leaves(params[pipeline.stacked])[0].shape[0]
    split = pieces.auto(n_layers, stages, embed_everywhere) if chosen in (None, "auto") else tuple(chosen)
    rows_of = lambda s: [dataclasses.asdict(c) for c in pieces.stage_costs(s, embed_everywhere)]
    return {"even": {"layers": list(even_split(n_layers, stages)), "stages": rows_of(even_split(n_layers, stages))},
            "chosen": {"layers": list(split), "how": "auto" if chosen in (None, "auto") else "given",
                       "stages": rows_of(split)},
            "layer_moves": len(layer_moves(split, n_layers // stages)),
            # each moved layer's parameters arrive once per step and its gradient goes back once
            "layer_move_bytes": 2 * len(layer_moves(split, n_layers // stages)) * _layer_bytes(params[pipeline.stacked])}


def _layer_bytes(stack: Any) -> int:
    return sum(l.size // l.shape[0] * jnp.dtype(l.dtype).itemsize for l in jax.tree.leaves(stack))


def format_stage_table(table: dict[str, Any]) -> list[str]:
    """Text lines of `stage_table`: GFLOP / MB per stage, the slowest stage marked."""
    lines = []
    for name in ("even", "chosen"):
        entry = table[name]
        slowest = max(range(len(entry["stages"])), key=lambda s: Cost(**entry["stages"][s]).roofline)
        cells = [f"{c['flops'] / 1e9:,.2f} GFLOP {c['bytes'] / 1e6:,.1f} MB" + (" (slowest)" if s == slowest else "")
                 for s, c in enumerate(entry["stages"])]
        label = f"{name} ({entry.get('how', 'even')}) {','.join(map(str, entry['layers']))}"
        lines.append(f"    {label}: " + " | ".join(cells))
    lines.append(f"    layers computed off their storage stage: {table['layer_moves']} "
                 f"({table['layer_move_bytes']:,} B/step sent: parameters there, gradients back)")
    return lines
