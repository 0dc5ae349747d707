"""The placement of one model under one strategy on one mesh: the input the step is built from.

Three layouts per parameter:
  storage  (``params``)  where the parameter lives between steps (strategy.param_rules)
  state    (``state``)   where its optimizer state and reduced gradient live (strategy.state_rules)
  compute                storage with the batch axes removed: what the forward pass needs
Batch axes (``data``, ``fsdp``) are manual inside the step, so every collective over them is
written explicitly and its volume is the ZeRO paper's; so is ``pipe`` when it has more than one
device (the layer stack is split over it and the pipeline schedule moves activations by hand);
``tensor`` is left to XLA's GSPMD partitioner.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from shardlib.sharding import rules as rules_lib
from shardlib.model import Model
from shardlib.sharding.strategies import PIPE_AXIS, Strategy, get_strategy, pipelined


def restrict(spec: P, axes: Sequence[str]) -> P:
    """Keep only ``axes`` in a spec (the manual part, or the auto part)."""
    keep = set(axes)
    out = []
    for entry in spec:
        kept = tuple(a for a in rules_lib.as_axes(entry) if a in keep)
        out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return P(*out)


def spec_axes(spec: P) -> set[str]:
    return {a for entry in spec for a in rules_lib.as_axes(entry)}


@dataclasses.dataclass(frozen=True)
class Layout:
    """Everything derived from (model, strategy, mesh) before any step is traced."""

    mesh: Mesh
    strategy: Strategy
    params: Any  # tree of LeafLayout: storage layout
    state: Any  # tree of LeafLayout: optimizer-state / reduced-gradient layout
    batch_axes: tuple[str, ...]  # mesh axes the batch is split over (manual in the step)

    @property
    def batch_size_multiple(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.batch_axes)

    def param_shardings(self) -> Any:
        return rules_lib.shardings(self.params, self.mesh)

    def state_shardings(self) -> Any:
        return rules_lib.shardings(self.state, self.mesh)

    @property
    def pipeline_stages(self) -> int:
        return self.mesh.shape.get(PIPE_AXIS, 1)

    @property
    def manual_axes(self) -> tuple[str, ...]:
        """Mesh axes the step maps by hand: the batch axes, and ``pipe`` under a pipeline."""
        return self.batch_axes + ((PIPE_AXIS,) if self.pipeline_stages > 1 else ())

    def manual(self, layouts: Any, axes: Sequence[str] | None = None) -> Any:
        """Specs restricted to ``axes`` (default: the batch axes, what the model and the reductions see)."""
        axes = self.batch_axes if axes is None else tuple(axes)
        return jax.tree.map(lambda l: restrict(l.spec, axes), layouts, is_leaf=rules_lib.is_layout)

    def batch_spec(self, ndim: int) -> P:
        axes = tuple(a for a in self.batch_axes if self.mesh.shape[a] > 1)
        lead = None if not axes else axes[0] if len(axes) == 1 else axes
        return P(lead, *(None,) * (ndim - 1))

    def abstract_batch(self, batch_shapes: Mapping[str, tuple[tuple[int, ...], Any]]) -> dict[str, jax.ShapeDtypeStruct]:
        """``{"inputs": ((B, T), jnp.int32), ...}`` -> ShapeDtypeStructs with the batch sharding."""
        return {
            k: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(self.mesh, self.batch_spec(len(shape))))
            for k, (shape, dtype) in batch_shapes.items()
        }

    def batch_sharding(self, batch: Mapping[str, Any]) -> Any:
        return jax.tree.map(lambda x: NamedSharding(self.mesh, self.batch_spec(len(x.shape))), batch)

    def check_batch(self, batch: Mapping[str, Any], microbatches: int = 1) -> None:
        """Clear error for a global batch the data-parallel devices (x microbatches) cannot split evenly."""
        n = self.batch_size_multiple * microbatches
        for name, x in batch.items():
            size = x.shape[0]
            if size % n:
                axes = "x".join(a for a in self.batch_axes if self.mesh.shape[a] > 1) or "none"
                what = f"the {self.batch_size_multiple} data-parallel devices (mesh axes {axes})"
                if microbatches > 1:
                    what += f" times {microbatches} microbatches"
                raise ValueError(
                    f"batch {name!r} has {size} rows, which {what} cannot split evenly; "
                    f"use a multiple of {n} such as {max(n, size // n * n)}"
                )

    def report(self) -> str:
        return rules_lib.report(self.params, self.mesh)


def make_layout(
    model: Model,
    strategy: str | Strategy,
    mesh: Mesh,
    *,
    max_replicated_bytes: int | None = None,
) -> Layout:
    """Resolve the strategy's rule tables against the model's logical axes on this mesh."""
    strategy = get_strategy(strategy)
    abstract = model.abstract()
    stages = mesh.shape.get(PIPE_AXIS, 1)
    if stages > 1:
        strategy = pipelined(strategy)
    params = rules_lib.layout_tree(abstract, model.logical_axes, strategy.param_rules, mesh, table=f"{strategy.name}.param_rules")
    state = rules_lib.layout_tree(abstract, model.logical_axes, strategy.state_rules, mesh, table=f"{strategy.name}.state_rules")
    if stages > 1:
        _check_stages(params, stages)
    rules_lib.validate_rules(strategy.batch_rules, mesh, table=f"{strategy.name}.batch_rules")
    rules_lib.validate_rules(strategy.activation_rules, mesh, table=f"{strategy.name}.activation_rules")
    batch_axes = tuple(a for name, axes in strategy.batch_rules if name == "batch" for a in rules_lib.as_axes(axes))
    if max_replicated_bytes is not None:
        rules_lib.check_replication(params if strategy.param_rules else state, mesh, max_replicated_bytes)
    layout = Layout(mesh, strategy, params, state, batch_axes)
    _check_reducible(layout)
    return layout


def _check_reducible(layout: Layout) -> None:
    """Each state dim must either equal its storage dim (ZeRO-3) or shard a replicated dim (ZeRO-1/2)."""
    manual_params = jax.tree.leaves(layout.manual(layout.params))
    manual_state = jax.tree.leaves(layout.manual(layout.state))
    for leaf, p_spec, s_spec in zip(jax.tree.leaves(layout.params, is_leaf=rules_lib.is_layout), manual_params, manual_state):
        for dim, (p_axes, s_axes) in enumerate(zip(p_spec, s_spec)):
            if p_axes and p_axes != s_axes:
                raise rules_lib.RuleError(
                    f"{leaf.path}: dim {dim} is stored over {p_axes} but its optimizer state over {s_axes}; "
                    "state rules must keep the storage sharding of each dim"
                )


def _check_stages(params: Any, stages: int) -> None:
    """Every stacked ("layers") parameter must split evenly into the pipeline's stages."""
    stacked = [l for l in jax.tree.leaves(params, is_leaf=rules_lib.is_layout) if l.logical and l.logical[0] == "layers"]
    if not stacked:
        raise rules_lib.RuleError(
            f"the mesh has pipe={stages} but no parameter has a leading 'layers' axis to split into stages; "
            "stack the layers (as models.gpt does) or use pipe=1"
        )
    for leaf in stacked:
        n_layers = leaf.shape[0]
        if n_layers % stages:
            divisors = [d for d in range(1, n_layers + 1) if n_layers % d == 0]
            raise rules_lib.RuleError(
                f"{leaf.path} stacks {n_layers} layers, which pipe={stages} stages cannot split evenly; "
                f"use a stage count among {divisors} (mesh axis 'pipe', --pipeline-stages)"
            )
