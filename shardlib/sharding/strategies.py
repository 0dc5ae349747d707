"""Parallelism strategies as data: rule tables plus the few knobs the train step needs.

``param_rules`` place the parameters (their storage layout), ``state_rules`` place the optimizer
state and the reduced gradients, ``activation_rules`` place activations inside the step (only
model-parallel axes: the batch axes are manual there). The compute layout of a weight is its
storage layout with the batch axes removed: where they differ (ZeRO-3 / FSDP) the step gathers
the weight before use and reduce-scatters its gradient, as the ZeRO paper prescribes.

  strategy  params             grads / optimizer state   collectives per step
  dp        replicated         replicated                all-reduce grads            2 Psi
  zero1     replicated         sharded                   reduce-scatter + all-gather 2 Psi
  zero2     replicated         sharded, and so is the    same as zero1               2 Psi
                               accumulation buffer       (per microbatch under accumulation)
  zero3     sharded            sharded                   gather fwd + bwd + r-s      3 Psi
  zero3_hpz zero3 stored over (fsdp, data); gathered over data once per step (a secondary
            partition per host, ZeRO++ hpZ), then per layer over fsdp only
  tp        split on heads/mlp/vocab (Megatron column/row parallel), batch over data
  fsdp_tp   zero3 over fsdp x tp over tensor (2-D)
  hsdp      zero3 within fsdp, replicated across data (all-reduce over data); with data=1
            it is zero3 over fsdp
  as_annotated  the model's own placement: parameters annotated with mesh axes (MaxText style,
            ``out_sharding=P("fsdp", "tensor")``, ``nn.with_partitioning``) are stored as annotated,
            optimizer state alike; batch axes among them are gathered and reduce-scattered like zero3

Every sharding strategy also shards what its rules leave unsharded: ``param_fallback`` /
``state_fallback`` name the axes of the ZeRO fallback (`rules.AutoShard`), so a model without
logical names still gets ZeRO's memory. ``requires`` names the mesh axes a strategy shards over;
a mesh where they have size 1 is refused, except a single-device mesh, where every strategy is
the same placement (nothing is split).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping

import warnings
from typing import Any

import jax

from shardlib.sharding.mesh import EXPERT_AXIS, MESH_AXES
from shardlib.sharding.rules import AUTO_SHARD_SKIP, Rules, as_axes, is_names, path_str
from shardlib.registry import lookup

# Megatron-style tensor parallelism: attention heads and the MLP hidden dimension are split, so
# the in-projections are column-parallel and the out-projections row-parallel; the vocabulary of
# the embedding and the output head is split too. Flax's own names (lm1b, t5x, MaxText) are known:
# 'joined_kv' (heads x head_dim fused) splits like heads; 'kv' (head_dim) and 'norm' stay whole, as
# does 'lora_rank' (a LoRA adapter's few columns, `models.lora`: its other dims follow the weight's).
TENSOR_RULES: Rules = (
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("joined_kv", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("norm", None),
    ("lora_rank", None),
)

# Pipeline parallelism: the stacked layers are split into contiguous stages over 'pipe'. Prepended
# to a strategy's tables when the mesh has pipe > 1, so every strategy composes with a pipeline.
PIPE_AXIS = "pipe"
PIPE_RULES: Rules = (("layers", PIPE_AXIS),)

# Batch dimension of inputs and activations: split over every data-parallel axis. The expert axis
# is one: its devices hold different experts but the same other weights, so for everything but an
# MoE layer's experts it is data parallelism, as in GShard and DeepSpeed-MoE.
BATCH_RULES: Rules = (("batch", ("data", "fsdp", EXPERT_AXIS)),)

# Expert parallelism: an MoE layer's stacked experts (logical name "experts") are split over the
# expert axis. Prepended to a strategy's tables when the mesh has expert > 1, so every strategy
# composes with it; the experts' other dims keep the strategy's rules (ZeRO-3 shards them too).
EXPERT_RULES: Rules = (("experts", EXPERT_AXIS),)

# ZeRO sharding of weights over all data-parallel devices: prefer the model dimension, fall back
# to another dimension when it does not divide (each fallback is reported by rules.report).
ZERO_RULES: Rules = (
    ("embed", ("data", "fsdp")),
    ("mlp", ("data", "fsdp")),
    ("heads", ("data", "fsdp")),
    ("kv_heads", ("data", "fsdp")),
    ("vocab", ("data", "fsdp")),
    ("joined_kv", ("data", "fsdp")),
    ("head_dim", ("data", "fsdp")),
    ("kv", ("data", "fsdp")),
)

# Hybrid sharding: shard within the fsdp axis only, replicate across data.
HSDP_RULES: Rules = tuple((name, "fsdp") for name, _ in ZERO_RULES)

# The model's own placement: an annotation that names mesh axes ("fsdp", or ("data", "fsdp") for
# one dim over two axes) maps to exactly those axes. Every ordered tuple of distinct axes is a name.
MESH_AXIS_RULES: Rules = tuple(
    (axes[0], axes[0]) if len(axes) == 1 else (axes, axes)
    for k in range(1, len(MESH_AXES) + 1) for axes in itertools.permutations(MESH_AXES, k)
)

ZERO_AXES = ("data", "fsdp")  # ZeRO over every data-parallel device

# hpZ (ZeRO++ hierarchical partitioning): ZeRO-3 with the intra-host axis major in every sharded
# dim, so that a gather over the inter-host axis ("data") alone gives a contiguous block of the
# intra-host split: the secondary partition (shardlib.step.hierarchical).
HPZ_AXES = ("fsdp", "data")
HPZ_RULES: Rules = tuple((name, HPZ_AXES) for name, _ in ZERO_RULES)


@dataclasses.dataclass(frozen=True)
class Strategy:
    """How parameters, optimizer state and batches are laid out over the mesh."""

    name: str
    param_rules: Rules
    state_rules: Rules
    activation_rules: Rules = TENSOR_RULES
    batch_rules: Rules = BATCH_RULES
    default_mesh: Mapping[str, int] = dataclasses.field(default_factory=lambda: {"data": -1})
    # Under gradient accumulation: reduce-scatter every microbatch into a sharded buffer (ZeRO-2)
    # instead of accumulating full local gradients and reducing once per step (dp, ZeRO-1).
    shard_grad_buffer: bool = False
    summary: str = ""
    # Mesh axes of the ZeRO fallback for parameters / optimizer state that no rule shards over them.
    param_fallback: tuple[str, ...] = ()
    state_fallback: tuple[str, ...] = ()
    # Groups of mesh axes this strategy shards over: each group's size must exceed 1 (or the mesh
    # is one device), else the strategy would silently replicate everything.
    requires: tuple[tuple[str, ...], ...] = ()
    # hpZ: the inter-host batch axis the step gathers the weights over once per step (a secondary
    # partition within each host), so that the per-layer gathers cross intra-host links only.
    secondary_axis: str | None = None
    # ZeRO-1/2: the optimizer state (and so the gradient's reduce-scatter) splits the last dim a rule
    # or the fallback can split: a Dense kernel's output dim, the major dim of its weight-gradient
    # matmul's result (`shardlib.step.reduce.reduced_transposed`, docs/design.md). Only where the
    # backend policy wants it too (`BackendPolicy.state_from_last`: XLA:CPU): `Layout.state_from_last`.
    state_from_last: bool = False
    # (axis, strategy): with that mesh axis of size 1 this strategy is that one (hsdp without data
    # replicas is zero3), which a run says rather than accept it without comment.
    collapses: tuple[str, str] | None = None

    @property
    def shards_params(self) -> bool:
        return bool(self.param_rules or self.param_fallback)

    @property
    def shards_state(self) -> bool:
        return bool(self.state_rules or self.state_fallback)

    @property
    def state_differs(self) -> bool:
        """The optimizer state is placed otherwise than the parameters (ZeRO-1/2)."""
        return (self.state_rules, self.state_fallback) != (self.param_rules, self.param_fallback)

    # The model's own rule table (`with_logical_rules`): every logical name the model uses must be in it.
    own_rules: Rules | None = None

    def with_rules(self, **changes) -> "Strategy":
        return dataclasses.replace(self, **changes)

    def with_logical_rules(self, rules: Rules) -> "Strategy":
        """This strategy with your own Flax rule table (what MaxText / t5x pass to
        ``nn.logical_axis_rules``) placing the parameters, their optimizer state and the
        activations, as it does there; the strategy keeps its batch split, ZeRO fallback (for
        tensors the table leaves off the batch axes) and gradient buffer. Rules over axes
        shardlib's meshes lack are refused here, and `make_layout` warns about a name the model
        uses that the table does not list (such a dim would otherwise stay whole silently)."""
        table = check_logical_rules(rules)
        return dataclasses.replace(self, param_rules=table, state_rules=table, activation_rules=table, own_rules=table,
                                   state_from_last=False)  # Flax resolves a table's dims in order


# Mesh axes of other codebases' rule tables and the shardlib axis that does their job.
FOREIGN_AXES = {"model": "tensor", "mdl": "tensor", "mp": "tensor", "tp": "tensor", "stage": "pipe", "batch": "data",
                 "replica": "data", "dp": "data"}


def _check_rule(entry: Any) -> tuple[str, Any]:
    """One ``(logical_name, mesh_axes)`` entry, its mesh axes shardlib's own."""
    if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[0], str)):
        raise ValueError(f"logical rule {entry!r}: each rule is (logical_name, mesh_axes), mesh_axes a mesh axis, "
                         "a tuple of them or None, as nn.logical_axis_rules takes them")
    name, axes = entry
    axes = tuple(axes) if isinstance(axes, list) else axes
    for axis in as_axes(axes):
        if axis not in MESH_AXES:
            use = FOREIGN_AXES.get(axis)
            hint = (f"write {use!r}, shardlib's axis for that job" if use else
                    "map the name to one of those axes, or to None to keep the dim whole")
            raise ValueError(f"logical rule ({name!r}, {axes!r}): {axis!r} is not a mesh axis of shardlib "
                             f"(its meshes have {', '.join(MESH_AXES)}); {hint}")
    return name, axes


def check_logical_rules(rules: Rules) -> Rules:
    """A user's rule table as a tuple of checked ``(name, mesh_axes)`` rules (order kept: first
    applicable rule wins, as in Flax)."""
    if isinstance(rules, (str, bytes)) or not hasattr(rules, "__iter__"):
        raise ValueError(f"with_logical_rules takes a sequence of (logical_name, mesh_axes) rules, got {rules!r}")
    return tuple(_check_rule(entry) for entry in rules)


def warn_uncovered_names(strategy: Strategy, logical: Any) -> bool:
    """Under the model's own rule table: warn about each tensor dim whose logical name the table
    does not list, which every strategy would otherwise keep whole without a word. Returns whether
    it warned (`make_layout` then says nothing more about names)."""
    if strategy.own_rules is None:
        return False
    listed = {name for name, _ in strategy.own_rules} | set(AUTO_SHARD_SKIP)
    missing = [f"{path_str(path)} dim {dim} {name!r}"
               for path, names in jax.tree_util.tree_leaves_with_path(logical, is_leaf=is_names)
               for dim, name in enumerate(names or ()) if name is not None and name not in listed]
    if missing:
        warnings.warn(f"your logical-axis rules (Strategy.with_logical_rules) have no rule for: {'; '.join(missing)}; "
                      "those dims are placed as if unnamed: add a rule for each name (None keeps the dim whole)",
                      UserWarning, stacklevel=4)
    return bool(missing)


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("dp", param_rules=(), state_rules=(), default_mesh={"data": -1},
                 summary="replicate everything, all-reduce gradients"),
        Strategy("zero1", param_rules=(), state_rules=ZERO_RULES, default_mesh={"data": -1},
                 state_fallback=ZERO_AXES, state_from_last=True, requires=(ZERO_AXES,), summary="shard optimizer state"),
        Strategy("zero2", param_rules=(), state_rules=ZERO_RULES, default_mesh={"data": -1},
                 state_fallback=ZERO_AXES, state_from_last=True, requires=(ZERO_AXES,), shard_grad_buffer=True,
                 summary="shard optimizer state and gradients"),
        Strategy("zero3", param_rules=ZERO_RULES, state_rules=ZERO_RULES, default_mesh={"fsdp": -1},
                 param_fallback=ZERO_AXES, state_fallback=ZERO_AXES, requires=(ZERO_AXES,), shard_grad_buffer=True,
                 summary="shard parameters, gradients and optimizer state (FSDP)"),
        Strategy("zero3_hpz", param_rules=HPZ_RULES, state_rules=HPZ_RULES, default_mesh={"data": 2, "fsdp": -1},
                 param_fallback=HPZ_AXES, state_fallback=HPZ_AXES, requires=(("data",), ("fsdp",)),
                 shard_grad_buffer=True, secondary_axis="data",
                 summary="zero3 + a secondary weight shard within each host (ZeRO++ hpZ): layer gathers stay on fsdp"),
        Strategy("tp", param_rules=TENSOR_RULES, state_rules=TENSOR_RULES, default_mesh={"tensor": -1},
                 requires=(("tensor",),), summary="Megatron tensor parallelism"),
        Strategy("fsdp_tp", param_rules=TENSOR_RULES + HSDP_RULES, state_rules=TENSOR_RULES + HSDP_RULES,
                 default_mesh={"fsdp": -1, "tensor": 2}, shard_grad_buffer=True,
                 param_fallback=("fsdp",), state_fallback=("fsdp",), requires=(("fsdp",), ("tensor",)),
                 summary="FSDP over fsdp x tensor parallelism over tensor"),
        Strategy("hsdp", param_rules=HSDP_RULES, state_rules=HSDP_RULES, default_mesh={"data": 2, "fsdp": -1},
                 shard_grad_buffer=True, param_fallback=("fsdp",), state_fallback=("fsdp",), requires=(("fsdp",),),
                 collapses=("data", "zero3"), summary="FSDP within fsdp, replicated across data"),
        Strategy("as_annotated", param_rules=MESH_AXIS_RULES, state_rules=MESH_AXIS_RULES,
                 default_mesh={"fsdp": -1}, shard_grad_buffer=True,
                 summary="the model's own mesh-axis annotations (MaxText / Flax NNX style)"),
    )
}


def unmet_requirements(strategy: Strategy, mesh_shape: Mapping[str, int]) -> list[tuple[str, ...]]:
    """The axis groups ``strategy`` shards over that have one device on this mesh (none on one device)."""
    if all(size == 1 for size in mesh_shape.values()):
        return []
    return [axes for axes in strategy.requires if math.prod(mesh_shape.get(a, 1) for a in axes) == 1]


def pipelined(strategy: Strategy) -> Strategy:
    """``strategy`` with each stage's layers (and their optimizer state) stored on its stage only."""
    if strategy.param_rules[:1] == PIPE_RULES:
        return strategy
    return strategy.with_rules(param_rules=PIPE_RULES + strategy.param_rules,
                               state_rules=PIPE_RULES + strategy.state_rules)


def expert_split(strategy: Strategy) -> Strategy:
    """``strategy`` with every MoE layer's experts (and their optimizer state) split over ``expert``."""
    if strategy.param_rules[:1] == EXPERT_RULES:
        return strategy
    return strategy.with_rules(param_rules=EXPERT_RULES + strategy.param_rules,
                               state_rules=EXPERT_RULES + strategy.state_rules)


# Names other libraries use for a preset of this table: FSDP shards what ZeRO-3 shards.
ALIASES: dict[str, str] = {"fsdp": "zero3"}


def get_strategy(name: str | Strategy) -> Strategy:
    """The named preset (or an `ALIASES` name), or the object itself; an unknown name lists the known ones."""
    return lookup(STRATEGIES, ALIASES.get(name, name) if isinstance(name, str) else name, Strategy, "strategy")
