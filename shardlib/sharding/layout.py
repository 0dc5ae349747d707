"""The placement of one model under one strategy on one mesh: the input the step is built from.

Three layouts per parameter:
  storage  (``params``)  where the parameter lives between steps (strategy.param_rules)
  state    (``state``)   where its optimizer state and reduced gradient live (strategy.state_rules)
  compute                storage with the batch axes removed: what the forward pass needs
Batch axes (``data``, ``fsdp``) are manual inside the step, so every collective over them is
written explicitly and its volume is the ZeRO paper's; so is ``pipe`` when it has more than one
device (the layer stack is split over it and the pipeline schedule moves activations by hand);
``tensor`` is left to XLA's GSPMD partitioner.

Mismatches are loud: a strategy on a mesh where its axes have one device is an error naming a
mesh to use, and a tensor left on every device under a sharding strategy (above 1% of the
model's parameter bytes, and not an unnamed one under the fallback's 1024-element floor) is a
`ReplicationWarning` naming it and the reason.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from shardlib import backend as backend_lib
from shardlib.backend import BackendPolicy
from shardlib.sharding import rules as rules_lib
from shardlib.sharding.mesh import CONTEXT_AXIS, EXPERT_AXIS, MESH_AXES, MeshError, describe, resolve_axis_sizes
from shardlib.sharding.strategies import (EXPERT_RULES, FOREIGN_AXES, PIPE_AXIS, PIPE_RULES, STRATEGIES, Strategy, expert_split, get_strategy,
                                         pipelined, unmet_requirements, warn_uncovered_names)
from shardlib.text import nearest_multiples

# A tensor replicated under a sharding strategy is warned about above this share of the model's
# parameter bytes (smaller ones cost little; `max_replicated_bytes` makes any size an error).
WARN_REPLICATED_FRACTION = 0.01


class ReplicationWarning(UserWarning):
    """A tensor a sharding strategy leaves whole on every device."""


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
    # The backend policy of the mesh's devices (`shardlib.backend.policy_for`, or the one `forced`
    # when the layout was made): resolved once here, and again by `build` for the step it builds.
    backend: BackendPolicy = backend_lib.POLICIES["cpu"]
    # Context parallelism (`context` > 1): each device holds one early and one late chunk of every
    # sequence (causal load balance), and how attention reaches the other chunks ("auto", "ring",
    # "allgather"; `shardlib.model.attention`)
    context_balance: bool = True
    context_attention: str = "auto"

    @property
    def context_size(self) -> int:
        return self.mesh.shape.get(CONTEXT_AXIS, 1) if CONTEXT_AXIS in self.batch_axes else 1

    @property
    def row_axes(self) -> tuple[str, ...]:
        """The batch axes that split the rows; ``context`` splits the sequence (dim 1) instead."""
        return tuple(a for a in self.batch_axes if a != CONTEXT_AXIS)

    @property
    def sequence_multiple(self) -> int:
        """What the sequence length must divide by: C chunks, 2C when balanced (one early, one late each)."""
        c = self.context_size
        return 1 if c == 1 else c * (2 if self.context_balance else 1)

    @property
    def state_from_last(self) -> bool:
        """zero1/zero2's optimizer state splits a tensor's last dim a rule or the fallback can split
        (`Strategy.state_from_last`) where the backend wants it (XLA:CPU; elsewhere the largest)."""
        return self.strategy.state_from_last and self.backend.state_from_last

    @property
    def batch_size_multiple(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.row_axes)

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
        axes = tuple(a for a in self.row_axes if self.mesh.shape[a] > 1)
        lead = None if not axes else axes[0] if len(axes) == 1 else axes
        if self.context_size > 1 and ndim >= 2:  # the sequence dim over context
            return P(lead, CONTEXT_AXIS, *(None,) * (ndim - 2))
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
            self._check_sequence(name, x.shape)
            if size % n:
                axes = " x ".join(a for a in self.batch_axes if self.mesh.shape[a] > 1) or "none"
                what = f"the {self.batch_size_multiple} data-parallel devices (mesh axes {axes})"
                if microbatches > 1:
                    what += f" times {microbatches} microbatches"
                raise ValueError(f"batch {name!r} has {size} rows, which {what} cannot split evenly; "
                                 f"use a multiple of {n}: {nearest_multiples(size, n)} (a dataset's last, "
                                 "shorter batch: pad it with rows of loss weight 0, the mask of shardlib.global_mean)")

    def _check_sequence(self, name: str, shape: tuple[int, ...]) -> None:
        """Under context parallelism every leaf with a second dim is split on it, the sequence."""
        from shardlib.text import nearest_multiples

        m = self.sequence_multiple
        if m > 1 and len(shape) >= 2 and shape[1] % m:
            how = f"2 x context={self.context_size} chunks (one early, one late per device)" if self.context_balance \
                else f"context={self.context_size} chunks"
            raise ValueError(f"batch {name!r} has sequence length {shape[1]} (dim 1), which {how} cannot split "
                             f"evenly; use a multiple of {m}: {nearest_multiples(shape[1], m)}"
                             + ("" if not self.context_balance else " (or --no-cp-balance: a multiple of the context size)"))

    def replicated(self) -> list[rules_lib.LeafLayout]:
        """Tensors the strategy shards that stayed whole on every device (each with its notes)."""
        if self.strategy.shards_params:
            return rules_lib.replicated_leaves(self.params, self.mesh)
        if self.strategy.shards_state:
            return rules_lib.replicated_leaves(self.state, self.mesh)
        return []  # dp: replicated by design

    def replicated_bytes(self) -> int:
        """R: bytes of one copy of the replicated tensors (their optimizer moments add 2 R under Adam)."""
        return sum(leaf.bytes() for leaf in self.replicated())

    def param_bytes(self) -> int:
        return sum(leaf.bytes() for leaf in jax.tree.leaves(self.params, is_leaf=rules_lib.is_layout))

    def replication_summary(self) -> str:
        """One line for banners and reports: how much a sharding strategy leaves on every device."""
        from shardlib.text import format_bytes

        leaves = self.replicated()
        if not leaves:
            return "replicated against the strategy: none"
        share = self.replicated_bytes() / max(1, self.param_bytes())
        return (f"replicated against the strategy: {len(leaves)} tensor(s), {format_bytes(self.replicated_bytes())} "
                f"({share:.1%} of the parameter bytes) on every device")

    def report(self, abstract_opt_state: Any = None) -> str:
        """The storage table, the optimizer-state table where it differs, and the replicated total;
        given an optimizer's abstract state, also its leaves that could not follow a parameter."""
        parts = [rules_lib.report(self.params, self.mesh)]
        if self.strategy.state_differs:
            parts += ["optimizer state:", rules_lib.report(self.state, self.mesh)]
        if abstract_opt_state is not None:
            parts += _own_layout_report(self.opt_state_layouts(abstract_opt_state), self.mesh)
        return "\n".join(parts + [self.replication_summary()])

    def opt_state_layouts(self, abstract_opt_state: Any) -> Any:
        """A `LeafLayout` per leaf of an optax state (``jax.eval_shape(tx.init, params)``).

        A leaf shaped like the parameter its path ends in (Adam's moments, MultiSteps' accumulator,
        an EMA) takes that parameter's state layout; a leaf of another shape (Adafactor's row and
        column factors) or of no parameter is laid out on its own shape by the strategy's ZeRO
        fallback, with a note; scalars (counts, injected hyperparameters) are replicated.
        """
        by_path = {_components(l.path): l for l in jax.tree.leaves(self.state, is_leaf=rules_lib.is_layout)}
        strategy = self.strategy
        auto = rules_lib.AutoShard(strategy.state_fallback, from_last=self.state_from_last) \
            if strategy.state_fallback else None

        def place(path, leaf):
            name, shape = rules_lib.path_str(path), tuple(leaf.shape)
            param = _owner(_components(name), by_path)
            if param is not None and param.shape == shape:
                return dataclasses.replace(param, path=name, dtype=leaf.dtype)
            if math.prod(shape) <= 1:  # counters, hyperparameters, Adafactor's placeholders
                return rules_lib.LeafLayout(name, shape, leaf.dtype, None, P())
            spec, notes = rules_lib.spec_for(None, shape, (), self.mesh, path=name, auto=auto)
            owner = f"its parameter {param.path} is {param.shape}" if param else "it follows no parameter"
            return rules_lib.LeafLayout(name, shape, leaf.dtype, None, spec, (f"{OWN_LAYOUT}: {owner}",) + notes[1:])

        return jax.tree_util.tree_map_with_path(place, abstract_opt_state)


def _components(path: str) -> tuple[str, ...]:
    return tuple(part for part in path.split("/") if part)


def _owner(components: tuple[str, ...], by_path: Mapping[tuple[str, ...], rules_lib.LeafLayout]):
    """The parameter whose path is the longest tail of an optimizer-state path (None: no such)."""
    for start in range(len(components) + 1):
        if components[start:] in by_path:
            return by_path[components[start:]]
    return None


OWN_LAYOUT = "own layout"  # the note opening an optimizer-state leaf laid out on its own shape


def has_own_layout(leaf: rules_lib.LeafLayout) -> bool:
    """Whether `Layout.opt_state_layouts` laid this leaf out on its own shape (factored moments,
    flat buffers) rather than as its parameter's state."""
    return any(note.startswith(OWN_LAYOUT) for note in leaf.notes)


def _own_layout_report(layouts: Any, mesh: Mesh) -> list[str]:
    """The optimizer-state leaves that could not take their parameter's layout, as a table."""
    own = [l for l in jax.tree.leaves(layouts, is_leaf=rules_lib.is_layout) if has_own_layout(l)]
    return ["optimizer state not shaped like its parameter:", rules_lib.report(own, mesh)] if own else []


def sharding_report(layout: Layout | Any, mesh: Mesh | None = None, *, optimizer: Any = None) -> str:
    """Per-tensor table of a `Layout` (its mesh), or of a tree of `LeafLayout` on ``mesh``.
    ``optimizer`` (an optax transformation, with a Layout): add its state leaves that cannot
    follow their parameter's layout (factored moments), each with where it went and why."""
    if isinstance(layout, Layout):
        return layout.report(_abstract_opt_state(optimizer, layout))
    if mesh is None:
        raise TypeError("sharding_report(tree, mesh): a tree of LeafLayout needs its mesh; pass a Layout to omit it")
    return rules_lib.report(layout, mesh)


def _abstract_opt_state(optimizer: Any, layout: Layout) -> Any:
    if optimizer is None:
        return None
    params = jax.tree.map(lambda l: jax.ShapeDtypeStruct(l.shape, l.dtype), layout.params, is_leaf=rules_lib.is_layout)
    return jax.eval_shape(optimizer.init, params)


@runtime_checkable
class ParamSource(Protocol):
    """What a layout reads from a model: its parameters' shapes and their logical axis names.

    `shardlib.Model` is one. The sharding layer sits below the model layer (docs/design.md,
    "Layers"), so it names only these two members instead of importing the model package.
    """

    logical_axes: Any

    def abstract(self) -> Any: ...


def make_layout(
    model: ParamSource,
    strategy: str | Strategy,
    mesh: Mesh,
    *,
    max_replicated_bytes: int | None = None,
    auto_shard: bool = True,
) -> Layout:
    """Resolve the strategy's rule tables against the model's logical axes on this mesh.

    ``auto_shard`` (default on) applies the strategy's ZeRO fallback to every tensor its rules
    leave off the ZeRO axes (`rules.AutoShard`); off, only the rules place tensors.
    """
    check_model_argument(model, "make_layout")
    strategy = get_strategy(strategy)
    _check_axis_names(strategy, mesh)
    _check_requirements(strategy, mesh)
    abstract = model.abstract()
    stages = mesh.shape.get(PIPE_AXIS, 1)
    if stages > 1:
        strategy = pipelined(strategy)
    if mesh.shape.get(EXPERT_AXIS, 1) > 1:
        strategy = expert_split(strategy)
    names_warned = _warn_names(abstract, model.logical_axes, strategy, mesh)
    backend = backend_lib.policy_for(mesh)
    from_last = strategy.state_from_last and backend.state_from_last
    fallback = lambda axes, last=False: rules_lib.AutoShard(axes, from_last=last) if auto_shard and axes else None
    params = rules_lib.layout_tree(abstract, model.logical_axes, strategy.param_rules, mesh,
                                   table=f"{strategy.name}.param_rules", auto=fallback(strategy.param_fallback))
    state = rules_lib.layout_tree(abstract, model.logical_axes, strategy.state_rules, mesh,
                                  table=f"{strategy.name}.state_rules", from_last=from_last,
                                  auto=fallback(strategy.state_fallback, from_last))
    if stages > 1:
        _check_stages(params, stages)
    rules_lib.validate_rules(strategy.batch_rules, mesh, table=f"{strategy.name}.batch_rules")
    rules_lib.validate_rules(strategy.activation_rules, mesh, table=f"{strategy.name}.activation_rules")
    batch_axes = tuple(a for name, axes in strategy.batch_rules if name == "batch" for a in rules_lib.as_axes(axes))
    if mesh.shape.get(CONTEXT_AXIS, 1) > 1 and CONTEXT_AXIS not in batch_axes:
        _check_context(mesh)
        batch_axes += (CONTEXT_AXIS,)  # manual in the step, gradients averaged over it like a batch axis
    if max_replicated_bytes is not None:
        rules_lib.check_replication(params if strategy.shards_params else state, mesh, max_replicated_bytes)
    layout = Layout(mesh, strategy, params, state, batch_axes, backend)
    _check_reducible(layout)
    _warn_replicated(layout)
    if not names_warned:  # an idle model axis then follows from the names already warned about
        _warn_idle_model_axes(layout)
    return layout


def _check_context(mesh: Mesh) -> None:
    """Context parallelism splits the sequence inside the step's shard_map; the pipeline's
    microbatch schedule does not carry it."""
    if mesh.shape.get(PIPE_AXIS, 1) > 1:
        raise MeshError(f"mesh context={mesh.shape[CONTEXT_AXIS]} with pipe={mesh.shape[PIPE_AXIS]}: context "
                        "parallelism does not compose with the pipeline; use pipe=1 (data / fsdp / tensor compose)")


def check_model_argument(model: Any, caller: str) -> None:
    """Refuse what users hand over before wrapping it (an NNX or linen module, a params dict),
    naming the adapter that makes a `shardlib.Model` of it."""
    if isinstance(model, ParamSource):
        return
    from flax import linen as nn
    from flax import nnx

    adapter = ("shardlib.from_nnx(module, loss_fn)" if isinstance(model, nnx.Module) else
               "shardlib.from_linen(module, loss_fn, example_batch)" if isinstance(model, nn.Module) else
               "shardlib.from_functions(init_fn, loss_fn)")
    kind = type(model)
    raise TypeError(f"{caller} takes a shardlib.Model, got {kind.__module__}.{kind.__qualname__}: "
                    f"wrap it with {adapter}")


def _check_axis_names(strategy: Strategy, mesh: Mesh) -> None:
    """A mesh of the user's own (jax.make_mesh) with an axis no rule names, without one a rule names,
    or with Explicit axes: the first would split nothing, the others fail later with JAX's words
    about specs. Say which mesh to build."""
    named = {a for rules in (strategy.param_rules, strategy.state_rules, strategy.activation_rules,
                             strategy.batch_rules) for _, axes in rules for a in rules_lib.as_axes(axes)}
    foreign = [a for a in mesh.axis_names if a not in MESH_AXES and a not in named and mesh.shape[a] > 1]
    missing = [a for a in MESH_AXES if a in named and a not in mesh.axis_names]
    typed = [a for a, kind in zip(mesh.axis_names, mesh.axis_types) if kind != jax.sharding.AxisType.Auto]
    if not foreign and not missing and not typed:
        return
    problem = (f"mesh axis {foreign[0]!r} is not one of shardlib's, so strategy {strategy.name!r} would split "
               f"nothing over it" if foreign else f"the mesh has no axis {missing[0]!r}, which strategy "
               f"{strategy.name!r}'s rules name" if missing else
               f"mesh axis {typed[0]!r} is {mesh.axis_types[mesh.axis_names.index(typed[0])]} (jax.make_mesh's "
               "default), and the step leaves the model-parallel axes to the compiler, which needs Auto axes")
    sizes = {FOREIGN_AXES.get(a, a): n for a, n in mesh.shape.items() if n > 1}
    raise MeshError(f"{problem} (mesh {describe(mesh)}); shardlib meshes have the axes {', '.join(MESH_AXES)} "
                    f"(unused ones of size 1): build it with shardlib.make_mesh({sizes})")


def _check_requirements(strategy: Strategy, mesh: Mesh) -> None:
    """Refuse a strategy whose axes have one device here: it would train replicated under its name.

    One device is the exception (a notebook on one accelerator runs the same code it will run on
    many): allowed, with a warning that the strategy splits nothing here.
    """
    if mesh.size == 1 and strategy.requires:
        warnings.warn(f"strategy {strategy.name!r} on a one-device mesh splits nothing: every tensor is whole "
                      f"on the one device, as under 'dp'; the layout takes effect on a mesh with more devices",
                      ReplicationWarning, stacklevel=3)
        return
    unmet = unmet_requirements(strategy, mesh.shape)
    if not unmet:
        return
    several = len(unmet) > 1 or len(unmet[0]) > 1
    axes = " and ".join(" x ".join(group) for group in unmet)
    suits = [name for name, s in STRATEGIES.items() if s.requires and not unmet_requirements(s, mesh.shape)]
    raise rules_lib.RuleError(
        f"strategy {strategy.name!r} shards over mesh {'axes' if several else 'axis'} {axes}, which "
        f"{'have one device in all' if several else 'has one device'} on the mesh "
        f"{describe(mesh)}: nothing would be split; use a mesh such as {_suggested_mesh(strategy, mesh)}"
        + (f", or a strategy for this mesh: {', '.join(suits)}" if suits else ", or strategy 'dp'")
    )


def _suggested_mesh(strategy: Strategy, mesh: Mesh) -> str:
    """The strategy's default mesh on this many devices (keeping the pipeline), as --mesh text."""
    stages = mesh.shape.get(PIPE_AXIS, 1)
    try:
        sizes = resolve_axis_sizes(strategy.default_mesh, mesh.size // stages)
    except MeshError:
        sizes = {}
    sizes[PIPE_AXIS] = stages
    if unmet_requirements(strategy, sizes):
        return f"one with {' and '.join('x'.join(g) + ' > 1' for g in strategy.requires)}"
    return "--mesh " + ",".join(f"{k}={v}" for k, v in sizes.items() if v > 1)


def _warn_names(abstract: Any, logical: Any, strategy: Strategy, mesh: Mesh) -> bool:
    """One warning about the model's logical names against the rules that place them, given here
    rather than by the adapters: only now is the user's own table (``with_logical_rules``,
    ``with_rules``) known, so a name it maps is silent and one nothing maps is named with its
    tensor and dim. Returns whether it warned."""
    if strategy.own_rules is not None:
        return warn_uncovered_names(strategy, logical)
    unknown = _unknown_names(abstract, logical, strategy)
    unmatched = _unmatched_names(logical, strategy, mesh)
    listing = f"no strategy has a rule for these logical names, so every strategy places those dims as if they " \
              f"were unnamed: {'; '.join(unknown)}"
    if unmatched:
        warnings.warn(unmatched + (f"; {listing}" if unknown else ""), ReplicationWarning, stacklevel=3)
    elif unknown:
        known = sorted(n for n in known_names(strategy) if isinstance(n, str))
        warnings.warn(f"{listing}; use names among {', '.join(known)} (or, for names of your own codebase's rule "
                      "table, build with shardlib.get_strategy(name).with_logical_rules(your_rules))",
                      UserWarning, stacklevel=3)
    return bool(unmatched or unknown)


def known_names(strategy: Strategy) -> set:
    """Logical names some table maps: the built-in strategies', this strategy's (``with_rules``
    may add names) and the stack axis ("layers", which the adapters name and nothing splits)."""
    tables = [s.param_rules + s.state_rules + s.activation_rules + s.batch_rules
              for s in (*STRATEGIES.values(), strategy)]
    return {name for rules in tables + [PIPE_RULES, EXPERT_RULES] for name, _ in rules} | set(rules_lib.AUTO_SHARD_SKIP)


def _unknown_names(abstract: Any, logical: Any, strategy: Strategy) -> list[str]:
    """``path shape dim i 'name'`` for each tensor dim whose name no table knows (a typo, a name
    from another codebase's rules such as the Flax guide's "model")."""
    known = known_names(strategy)
    return [f"{rules_lib.path_str(path)} {tuple(leaf.shape)} dim {dim} {name!r}"
            for (path, leaf), names in zip(jax.tree_util.tree_leaves_with_path(abstract),
                                           rules_lib.logical_leaves(abstract, logical))
            for dim, name in enumerate(names or ()) if name is not None and name not in known]


def _unmatched_names(logical: Any, strategy: Strategy, mesh: Mesh) -> str | None:
    """A model whose axis names no rule of the strategy knows is laid out by the fallback alone:
    the sentence that says so and what to write, or None. The pipeline's and experts' rules, which a
    mesh with those axes adds to any strategy, are not the strategy's own: dp over pipe x data has none."""
    added = {name for name, _ in PIPE_RULES + EXPERT_RULES}
    known = lambda s: {name for name, _ in s.param_rules + s.state_rules} - added
    leaves = jax.tree.leaves(logical, is_leaf=rules_lib.is_names)
    # A stack's "layers" axis (named by the adapters for nn.scan stacks) is never split: not the user's name
    names = {n for leaf in leaves if leaf is not None for n in leaf if n is not None} - set(rules_lib.AUTO_SHARD_SKIP)
    if not known(strategy) or not names or names & known(strategy):
        return None
    others = [s.name for s in STRATEGIES.values() if s.name != strategy.name and names & known(s)]
    if all(a in MESH_AXES for n in names for a in rules_lib.as_axes(n)):
        hint = "these look like mesh axes: strategy 'as_annotated' keeps the model's own placement"
    else:  # an example rule onto an axis this mesh splits, for names that are not mesh axes already
        target = next((a for a in ("tensor", "fsdp", "data") if mesh.shape.get(a, 1) > 1), None)
        own = sorted(str(n) for n in names if not set(rules_lib.as_axes(n)) <= set(MESH_AXES))[:2]
        rule = ", ".join(f"({n!r}, {target!r})" for n in own)
        hint = ("map them onto mesh axes with Strategy.with_rules" if target is None else
                f"map them onto mesh axes, e.g. get_strategy({strategy.name!r}).with_rules(param_rules=({rule},) + "
                f"get_strategy({strategy.name!r}).param_rules)")
        hint += f", or use a strategy whose rules name them ({', '.join(others)})" if others else ""
    return (f"strategy {strategy.name!r} has no rule for any of the model's axis names "
            f"({', '.join(sorted(map(str, names)))}); {hint}")


def _warn_idle_model_axes(layout: Layout) -> None:
    """A model axis the strategy requires (``tensor``) that splits no parameter: an unannotated model
    under fsdp_tp, whose fsdp fallback splits every tensor, so no replication warning shows that
    the tensor devices hold and compute the same thing."""
    required = {a for group in layout.strategy.requires for a in group if a not in layout.batch_axes}
    used = {a for leaf in jax.tree.leaves(layout.params, is_leaf=rules_lib.is_layout) for a in spec_axes(leaf.spec)}
    for axis in sorted(a for a in required - used if layout.mesh.shape.get(a, 1) > 1):
        names = sorted({n for n, axes in layout.strategy.param_rules if axis in rules_lib.as_axes(axes)}, key=str)
        warnings.warn(
            f"{layout.strategy.name} on {describe(layout.mesh)} splits no parameter over {axis!r}: none has a logical "
            f"name its rules map there ({', '.join(map(str, names))}), so the {axis} devices hold and compute the same; "
            "name them (nn.with_logical_partitioning, or path_rules= of from_linen / from_nnx / from_functions), "
            "or give those devices to a batch axis", ReplicationWarning, stacklevel=3)


def _warn_replicated(layout: Layout) -> None:
    """One warning listing every tensor a sharding strategy leaves whole above 1% of the parameter
    bytes, except small unnamed ones (biases, a toy head): keeping those whole is the documented
    fallback, not something to fix, and warning about them on a small model teaches users to
    ignore this warning. `sharding_report` still lists them."""
    limit = WARN_REPLICATED_FRACTION * layout.param_bytes()
    big = [leaf for leaf in layout.replicated() if leaf.bytes() > limit and not _small_and_unnamed(leaf)]
    if not big:
        return
    from shardlib.text import format_bytes

    lines = "\n".join(f"  {l.path} {l.shape} ({format_bytes(l.bytes())}): {'; '.join(l.notes)}" for l in big)
    warnings.warn(
        f"{layout.strategy.name} on {describe(layout.mesh)} keeps {len(big)} tensor(s) whole on every device:\n"
        f"{lines}\nsee shardlib.sharding_report(layout); make_layout(..., max_replicated_bytes=N) makes this an error",
        ReplicationWarning, stacklevel=3)


def _small_and_unnamed(leaf: rules_lib.LeafLayout) -> bool:
    """Under the fallback's size floor and named nowhere (a scanned stack's "layers" axis is the
    adapters' name, not the user's): whole by design, whatever the strategy."""
    names = [n for n in leaf.logical or () if n is not None and n not in rules_lib.AUTO_SHARD_SKIP]
    return math.prod(leaf.shape) < rules_lib.AUTO_SHARD_MIN_SIZE and not names


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
