"""How a step calls the model on one device: the compute view of the parameters, and the context
that model code sees while it is traced (`shardlib.model.hooks.ComputeContext`).

Every call into the model (the loss, or a pipeline's three stage functions) goes through
`ModelCall`, and receives a `StepContext`: what the step hands the model besides parameters and
rows. Per-step inputs of the loss are new fields there, not new branches in the step.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from shardlib.model import Call, Model, Stages, hooks
from shardlib.model import blocks as blocks_lib
from shardlib.sharding import rules as rules_lib
from shardlib.sharding import staged
from shardlib.sharding.layout import Layout, known_names, restrict, spec_axes
from shardlib.sharding.mesh import EXPERT_AXIS
from shardlib.sharding.strategies import BATCH_RULES, Strategy
from shardlib.step import axis_names as axis_names_lib
from shardlib.step import batch as batch_lib
from shardlib.step import manual_axes as manual_axes_lib
from shardlib.step import hierarchical
from shardlib.step import precision as precision_lib
from shardlib.step.shape_errors import is_shape_mismatch
from shardlib.step import zeropp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepContext:
    """What one step gives the model besides parameters and rows; traced into the shard_map as a
    replicated argument.

    The seam for per-step inputs of the loss: each is a field here, read by `ModelCall`, so the
    gradient providers and the step's wiring pass it through unchanged.
    """

    scale: Any = None  # the loss scale the gradients are taken of (fp16's, else 1); None: unscaled
    key: Any = None  # this step's key (from the run's seed and the step); ModelCall folds in the device
    model_state: Any = None  # the mutable model state (BatchNorm statistics), replicated
    step: Any = None  # the train state's step (`Call.step`, for a loss on a schedule); None in evaluation
    train: bool = dataclasses.field(default=True, metadata=dict(static=True))  # False: evaluation
    # how many microbatches the step averages this call's loss over (grad_accum; `global_sum` undoes it)
    microbatches: int = dataclasses.field(default=1, metadata=dict(static=True))

    def for_microbatch(self, index: jax.Array) -> StepContext:
        """The context of one microbatch of an accumulated step: its own key."""
        return self if self.key is None else dataclasses.replace(self, key=jax.random.fold_in(self.key, index))


def active_axes(layout: Layout, exclude: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The batch axes that really split the batch (size > 1): collectives over size-1 axes move
    nothing, and XLA refuses a cross-partition all-reduce over a size-1 manual axis next to auto axes."""
    return tuple(a for a in layout.batch_axes if layout.mesh.shape[a] > 1 and a not in exclude)


def batch_axis_names(mesh: jax.sharding.Mesh) -> tuple[str, ...] | None:
    """The mesh axes that split the batch (every strategy's ``batch`` rule) with more than one
    device: the ``axis_name`` for synchronised BatchNorm (``nnx.BatchNorm(axis_name=...)``, linen
    ``nn.BatchNorm(axis_name=...)``), whose statistics then cover the global batch inside the step.
    None on one device. Size-1 axes are left out: XLA refuses collectives over them next to auto axes."""
    axes = tuple(a for _, named in BATCH_RULES for a in rules_lib.as_axes(named) if mesh.shape.get(a, 1) > 1)
    return axes or None


def average_state(model_state: Any, axes: tuple[str, ...]) -> Any:
    """Model state (BatchNorm running statistics) averaged over the data-parallel devices, so that
    every replica carries the same statistics. A leaf equal on every device by construction (a
    constant buffer, a step counter: not varying over ``axes`` in the shard_map's types) is kept
    as it is; an integer leaf that differs between devices is refused (no mean of it is exact)."""
    if not axes:
        return model_state

    def mean(path, x):
        if not set(axes) & jax.typeof(x).manual_axis_type.varying:
            return x
        if jnp.issubdtype(x.dtype, jnp.floating):
            return jax.lax.pmean(x, axes)
        raise ValueError(
            f"model state {jax.tree_util.keystr(path)} ({x.dtype}) depends on this device's rows, so it differs "
            f"between the devices of {axes}, and an average of it is not an integer: make it a float variable "
            "(then it is averaged over the batch axes), or update it from replicated values only (a step count)")

    return jax.tree_util.tree_map_with_path(mean, model_state)


def check_axis_alias(alias: str | None, layout: Layout) -> str | None:
    """``build(axis_name=...)``: a name of the model's own, not one of the mesh's axes (those are
    bound in the step already; rebinding one would silently change what its collectives reduce)."""
    if alias is None:
        return None
    if not isinstance(alias, str):
        raise TypeError(f"build(axis_name=...) takes the one collective axis name your modules use, such as "
                        f"'batch', got {alias!r}")
    if alias in layout.mesh.axis_names:
        raise ValueError(f"build(axis_name={alias!r}): {alias!r} is a mesh axis, bound in the step already; "
                         "axis_name names the model's own pmap-era axis (nn.BatchNorm(axis_name='batch')), "
                         "so leave it out")
    return alias


def logical_rules(layout: Layout) -> tuple[tuple[str, Any], ...]:
    """The activation rules over the GSPMD axes with more than one device, as Flax logical-axis
    rules (linen's ``nn.with_logical_constraint``); empty where no such axis exists (no constraint)."""
    auto = {a for a in auto_axes(layout) if layout.mesh.shape[a] > 1}
    if not auto:
        return ()
    kept = ((name, tuple(a for a in rules_lib.as_axes(axes) if a in auto)) for name, axes in layout.strategy.activation_rules)
    return tuple((name, None if not axes else axes[0] if len(axes) == 1 else axes) for name, axes in kept)


def activation_spec(layout: Layout) -> Callable[[Any, tuple[int, ...]], P]:
    """Activation constraints over the axes left to GSPMD (the batch axes are manual in the step)."""
    rules = layout.strategy.activation_rules
    auto = tuple(a for a in layout.mesh.axis_names if a not in layout.batch_axes)

    @functools.lru_cache(maxsize=None)
    def resolve(logical: tuple, shape: tuple) -> P:
        spec, _ = rules_lib.spec_for(logical, shape, rules, layout.mesh)
        return restrict(spec, auto)

    return lambda logical, shape: resolve(tuple(logical), tuple(shape))


# Activation dims every strategy keeps whole: shardlib's models name the sequence "seq", t5x's "length".
WHOLE_ACTIVATION_NAMES = ("seq", "length")


class ActivationNames:
    """The names of the activation constraints a model makes in the step (`shardlib.constrain`,
    linen's ``nn.with_logical_constraint``) against the strategy's rules: a name they do not know
    gets no constraint, silently, as in Flax. Noted while the model is traced, warned about in one
    message after the trace, once per program (the step's trace and evaluate's add only new names)."""

    def __init__(self, strategy: Strategy):
        self.strategy, self.known = strategy, _activation_names(strategy)
        self.unknown: set[str] = set()
        self.warned: set[str] = set()

    def note(self, names: Sequence[Any]) -> None:
        self.unknown.update(n for n in names if isinstance(n, str) and n not in self.known)

    def warn(self) -> None:
        new = sorted(self.unknown - self.warned)
        if new:
            self.warned.update(new)
            warnings.warn(_unknown_activations(self.strategy, new), UserWarning, stacklevel=2)


def _activation_names(strategy: Strategy) -> set[str]:
    """Names an activation constraint may use under ``strategy``: its own table's (``with_logical_rules``)
    or any built-in table's, the batch, and the dims activations keep whole."""
    table = known_names(strategy) if strategy.own_rules is None else {name for name, _ in strategy.own_rules}
    batch = {name for name, _ in strategy.batch_rules}
    return {n for n in table if isinstance(n, str)} | batch | set(WHOLE_ACTIVATION_NAMES) | set(rules_lib.AUTO_SHARD_SKIP)


def _unknown_activations(strategy: Strategy, names: list[str]) -> str:
    listed = ", ".join(map(repr, names))
    if strategy.own_rules is not None:
        return (f"your logical-axis rules (Strategy.with_logical_rules) have no rule for the activation names {listed} "
                "(shardlib.constrain / nn.with_logical_constraint), so those dims get no sharding constraint: add a "
                "rule for each name (None keeps the dim whole)")
    split = ", ".join(name for name, axes in strategy.activation_rules if axes)
    return (f"the activation names {listed} (shardlib.constrain / nn.with_logical_constraint) are in none of strategy "
            f"{strategy.name!r}'s rules, so those dims get no sharding constraint at all: use shardlib's names "
            f"({split} split over 'tensor'; batch; {', '.join(WHOLE_ACTIVATION_NAMES)}, embed kept whole), or hand "
            f"your own rule table, with a rule for each of these names, to the strategy: "
            f"shardlib.get_strategy({strategy.name!r}).with_logical_rules(rules)")


def auto_axes(layout: Layout) -> tuple[str, ...]:
    """The mesh axes left to GSPMD inside the step (``tensor``)."""
    return tuple(a for a in layout.mesh.axis_names if a not in layout.manual_axes)


def gathered_axes(layout: Layout) -> tuple[str, ...]:
    """The batch axes a parameter's shards are gathered over before use: all but ``expert``, whose
    split of an MoE layer's experts stays (each device computes its own experts on the tokens the
    layer sends it, `shardlib.model.experts`)."""
    return tuple(a for a in layout.batch_axes if a != EXPERT_AXIS)


def expert_split_paths(layout: Layout) -> tuple[str, ...]:
    """Parameters split over ``expert`` with more than one device: an MoE layer's experts."""
    if layout.mesh.shape.get(EXPERT_AXIS, 1) == 1:
        return ()
    return tuple(l.path for l in jax.tree.leaves(layout.params, is_leaf=rules_lib.is_layout)
                 if EXPERT_AXIS in spec_axes(l.spec))


def sharded_paths(layout: Layout) -> tuple[str, ...]:
    """Parameters whose storage is split over a gathered batch axis: the ones ZeRO-3 must gather."""
    return tuple(l.path for l in jax.tree.leaves(layout.params, is_leaf=rules_lib.is_layout)
                 if spec_axes(restrict(l.spec, gathered_axes(layout))))


class WholeGatherWarning(UserWarning):
    """ZeRO-3 of a model that does not gather its own layers: the step's peak can hold all its weights."""


def warn_whole_gather(layout: Layout, specs: Any, reads_gather: bool) -> None:
    """Warn (once per model and mesh) when ZeRO-3 stores the parameters sharded but the step's peak
    will hold most of them at once: a model without ``gather_layer`` whose blocks are not gathered
    per call (``blocks=()``) while an unrolled stack of identical blocks holds most of them, or
    whose scanned stack (parameters carrying the 'layers' axis) the step gathers whole. Autodiff
    keeps every gathered weight for the backward pass unless the gather sits inside a remat of its
    block (`shardlib.model.blocks`). A model without a stack (an MLP) is not warned about."""
    leaves = jax.tree.leaves(layout.params, is_leaf=rules_lib.is_layout)
    if not any(spec_axes(spec) for spec in jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))):
        return
    from shardlib.text import format_bytes

    total = sum(l.bytes() for l in leaves)
    stacked = [l for l in leaves if l.logical and "layers" in l.logical]
    if stacked:
        if reads_gather:  # linen reads a scanned stack one layer at a time
            return
        parent = os.path.commonpath([l.path for l in stacked]) or stacked[0].path
        held = sum(l.bytes() for l in stacked)
        warnings.warn(
            f"{layout.strategy.name} stores {format_bytes(total)} of parameters sharded, but this model does not gather "
            f"them itself (gathers_params=False), so the step gathers its scanned stack {parent!r} ({format_bytes(held)}) "
            "whole before the scan and its peak holds all of it. To hold one layer at a time, call "
            "shardlib.gather_layer(layer) at the top of the scan body and build with gathers_params=True (docs/nnx.md, "
            "'Scanned layers under ZeRO-3')", WholeGatherWarning, stacklevel=4)
        return
    name, blocks = blocks_lib.largest_stack([(tuple(l.path.split("/")), l.shape, l.bytes()) for l in leaves])
    if len(blocks) < 2 or 2 * sum(blocks) < total:
        return
    why = ("from_linen gathers each weight where it is read" if reads_gather else
           "this model does not gather them itself (gathers_params=False)")
    warnings.warn(
        f"{layout.strategy.name} stores {format_bytes(total)} of parameters sharded, but {why} and its blocks are not "
        f"gathered one at a time (blocks=()), so autodiff keeps every gathered weight for the backward pass and the "
        f"step's peak can hold all of them, not one block's; most of them are {name} ({len(blocks)} identical blocks "
        f"of {format_bytes(blocks[0])}). To hold one block at a time, build the model with blocks='auto' (the default) "
        "or name its blocks (docs/your-model.md, 'ZeRO-3 one block at a time')", WholeGatherWarning, stacklevel=4)


def _gather_groups(specs: Any) -> set[tuple[str, ...]]:
    """The mesh-axes groups the gathers of ``specs`` run over (one per sharded dim entry)."""
    leaves = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
    return {rules_lib.as_axes(entry) for spec in leaves if isinstance(spec, P) for entry in spec if entry}


@dataclasses.dataclass(frozen=True)
class ModelCall:
    """The model as one device computes it: parameters cast to the compute dtype and gathered
    (up front, or by the model's own ``gather_layer`` calls), traced in a compute context."""

    model: Model
    specs: Any  # storage specs over the manual batch axes: what the gathers read
    auto_specs: Any  # storage specs over the GSPMD axes (a tree like specs): the split the gathers keep
    auto_by_path: Mapping[str, P]  # the same by parameter path, for the model's own gather_layer calls
    must_gather: tuple[str, ...]
    activation_spec: Callable[[Any, tuple[int, ...]], P]
    compute_dtype: Any
    cast_first: bool  # cast the shards to compute_dtype in their gather, before it (half the bytes on GPU / TPU)
    rows_split: int  # devices the rows are split over: the loss is a mean over all of them
    key_axes: tuple[str, ...] = ()  # the batch axes whose device index is folded into the key
    # hpZ: gathered over the inter-host axis once per call, before the layers (then specs are intra-host)
    secondary: hierarchical.SecondaryPartition | None = None
    gather: Callable[[Any, Any], jax.Array] | None = None  # ZeRO++'s quantised gather (`zeropp`); None: all_gather
    gather_tree: Callable[[Any], Any] | None = None  # per gather_layer call, first (`layerwise`'s twins)
    logical_rules: tuple = ()  # the activation rules for Flax's nn.with_logical_constraint (`logical_rules`)
    mean_axes: tuple[str, ...] = ()  # the batch axes the loss is a mean over (`hooks.global_mean`)
    axis_alias: str | None = None  # a linen module's own collective axis_name, bound to key_axes (`axis_names`)
    activation_names: ActivationNames | None = None  # the names of the model's activation constraints
    backend: Any = None  # the `shardlib.backend.BackendPolicy` build resolved from the mesh (None: plain JAX)
    reduce_dtype: Any = None  # the dtype the ZeRO-3 gathers' backward reduce-scatters in (`Precision.reduce_dtype`)
    stored: Any = None  # per parameter: stored over a batch axis (a gather casts it when cast_first); None: specs'
    expert_split: tuple[str, ...] = ()  # parameters split over ``expert`` (`expert_split_paths`)
    # context parallelism: (devices the sequence is split over, balanced, attention mode) (`hooks.ComputeContext`)
    context: tuple[int, bool, str] = (1, True, "auto")
    block_recompute: str = "weights"  # what a per-call block's backward recomputes (`hooks.ComputeContext`)
    # gather axes whose backward reduce-scatter goes in two stages -> inner group (`hooks.ComputeContext`)
    scatter_stages: Mapping[tuple[str, ...], int] = dataclasses.field(default_factory=dict)

    @classmethod
    def for_layout(cls, model: Model, layout: Layout, policy: precision_lib.Precision,
                   rows_split: int, exclude: tuple[str, ...] = (), mean_exclude: tuple[str, ...] = (),
                   axis_alias: str | None = None) -> ModelCall:
        backend = layout.backend
        cast_first = policy.casts_before_gather(backend)
        auto = layout.manual(layout.params, auto_axes(layout))
        by_path = {l.path: spec for l, spec in zip(jax.tree.leaves(layout.params, is_leaf=rules_lib.is_layout),
                                                   jax.tree.leaves(auto))}
        secondary = hierarchical.for_layout(layout, model.gathers_params)
        specs = secondary.intra_specs if secondary else layout.manual(layout.params, gathered_axes(layout))
        if not model.gathered_blocks and (not model.gathers_params or model.gathers_on_read):
            warn_whole_gather(layout, specs, model.gathers_on_read)
        return cls(model, specs, auto, by_path, sharded_paths(layout), activation_spec(layout),
                   policy.compute_dtype, cast_first, rows_split, active_axes(layout, exclude), secondary,
                   logical_rules=logical_rules(layout), mean_axes=active_axes(layout, exclude + mean_exclude),
                   axis_alias=check_axis_alias(axis_alias, layout), activation_names=ActivationNames(layout.strategy),
                   backend=backend, reduce_dtype=policy.reduce_dtype,
                   stored=jax.tree.map(lambda spec: bool(spec_axes(spec)), layout.manual(layout.params, gathered_axes(layout))),
                   expert_split=expert_split_paths(layout),
                   context=(layout.context_size, layout.context_balance, layout.context_attention),
                   scatter_stages=staged.stages_for(layout.mesh, _gather_groups(specs), backend))

    def _compute(self, tree: Any) -> Any:
        """``tree`` in the compute dtype; a layerwise state shard keeps the master dtype, so its
        cotangent (the reduced gradient) is reduced in it (`shardlib.step.layerwise`)."""
        def cast(x):
            if zeropp.is_carried(x) and x.role == "shard":
                return dataclasses.replace(x, value=precision_lib.cast_floating(x.value, self.compute_dtype))
            return precision_lib.cast_floating(x, self.compute_dtype)

        return jax.tree.map(cast, tree, is_leaf=zeropp.is_carried)

    def _model_specs(self) -> Any:
        return self.specs if self.model.gathers_params else None

    def view(self, params: Any) -> Any:
        """Parameters as the model computes with them: in the compute dtype, and fully gathered
        up front for a model that does not gather its own (sharded weights of one that does are
        cast by gather_layer, after their gather, or by the gather itself when the cast comes first:
        its backward then reduces the gradient in ``reduce_dtype``, `hooks.gather_dim`)."""
        if self.cast_first:  # the weights no gather casts
            stored = self.stored if self.stored is not None else jax.tree.map(lambda s: bool(spec_axes(s)), self.specs)
            params = jax.tree.map(lambda p, s: p if s else self._compute(p), params, stored, is_leaf=zeropp.is_carried)
        if self.secondary is not None:
            params = self.secondary.gather(params, self.auto_specs)
        if not self.model.gathers_params:
            gather = functools.partial(hooks.gather_shards, gather=self.gather)
            params = jax.tree.map(gather, params, self.specs, self.auto_specs, is_leaf=zeropp.is_carried)
            return params if self.cast_first else self._compute(params)
        unsharded = lambda p, spec: p if spec_axes(spec) else self._compute(p)
        return params if self.cast_first else jax.tree.map(unsharded, params, self.specs, is_leaf=zeropp.is_carried)

    def _context(self, in_step: bool = True, microbatches: int = 1) -> hooks.ComputeContext:
        """``in_step`` False: for an abstract trace (`probe`, inside the shard_map) that must not sum
        over the batch axes; the rows still vary over them (``row_axes``)."""
        return hooks.ComputeContext(self.activation_spec, cast_to=None if self.cast_first else self.compute_dtype,
                                    backend=self.backend, gather_dtype=self.compute_dtype if self.cast_first else None,
                                    reduce_dtype=self.reduce_dtype,
                                    auto_specs=self.auto_by_path, gather=self.gather, gather_tree=self.gather_tree,
                                    logical_rules=self.logical_rules, mean_axes=self.mean_axes if in_step else (),
                                    rows_split=self.rows_split, row_axes=self.key_axes, microbatches=microbatches,
                                    note_names=None if self.activation_names is None else self.activation_names.note,
                                    context_size=self.context[0], context_balance=self.context[1],
                                    context_attention=self.context[2], block_recompute=self.block_recompute,
                                    scatter_stages=self.scatter_stages)

    def probe(self, params: Any, rows: Any, ctx: StepContext) -> hooks.ComputeContext:
        """The compute context an abstract trace of the loss leaves: which parameters the model
        passes through ``gather_layer`` (``gathered``), and which one stacked slice at a time (``sliced``)."""
        seen = self._context(in_step=False)

        def run(p, b):
            with hooks.compute_context(seen):
                call = Call(key=self.device_key(ctx), state=ctx.model_state, train=ctx.train, step=ctx.step)
                return self.model.run(self.view(p), batch_lib.local(b), self._model_specs(), call)

        with axis_names_lib.bound_axis_name(self.axis_alias, self.key_axes):
            try:
                jax.eval_shape(run, params, rows)
            except Exception as err:
                self._explain(err)
                raise
        self._warn_unknown_activations()
        return seen

    def traced(self, fn: Callable[[], Any], microbatches: int = 1) -> Any:
        """Run ``fn()`` in a compute context; name any sharded parameter the model never gathered."""
        ctx = self._context(microbatches=microbatches)
        with hooks.compute_context(ctx), axis_names_lib.bound_axis_name(self.axis_alias, self.key_axes):
            try:
                out = fn()
            except Exception as err:  # a shape error from an ungathered shard: say which parameter
                self._explain(err)
                self._check_gathered(ctx, err)
                raise
        self._check_gathered(ctx)
        self._check_attention(ctx)
        self._check_dispatched(ctx)
        self._warn_unknown_activations()
        return out

    def _check_dispatched(self, ctx: hooks.ComputeContext) -> None:
        """Refuse a model whose experts are split over ``expert`` but that never sent its tokens to
        them: each device would compute with its own E/P experts as if they were all of them."""
        if self.expert_split and not ctx.experts_dispatched:
            raise ValueError(
                f"the parameters {', '.join(self.expert_split[:4])} are split over the 'expert' mesh axis (logical name "
                "'experts'), but the model never called shardlib.model.experts.dispatch, so each device computed with "
                "its own experts only; route the tokens through experts.dispatch / experts.combine (models/moe.py), "
                "or drop 'expert' from --mesh (give those devices to data)")

    def _check_attention(self, ctx: hooks.ComputeContext) -> None:
        """Under context parallelism each device holds a part of every sequence: attention that
        is not shardlib's would attend within that part only, silently wrong."""
        if ctx.context_size > 1 and not ctx.attention_calls:
            raise ValueError(
                f"the mesh splits every sequence over context={ctx.context_size} devices, but the model never called "
                "shardlib.model.attention.attention(q, k, v, causal=True), so its own attention would see only this "
                "device's part of the sequence: call that helper in place of your attention (it is plain attention "
                "without a context axis), and take positions from shardlib.model.attention.positions(seq_len); or "
                "use a mesh without context")

    def _warn_unknown_activations(self) -> None:
        if self.activation_names is not None:
            self.activation_names.warn()

    def _explain(self, err: Exception) -> None:
        """JAX's errors about the step's manual batch axes, or a pmap-era axis name, with what to write."""
        manual_axes_lib.note(err, self.key_axes)
        axis_names_lib.raise_unbound_axis(err, self.key_axes, self.axis_alias)

    def _check_gathered(self, ctx: hooks.ComputeContext, err: Exception | None = None) -> None:
        """After a trace: refuse a model that computed with shards it never gathered. After an
        error: only a shape mismatch (`shape_errors.SHAPE_MISMATCHES`) can come from a shard; any other (a missing batch key, the
        user's own check) is the model's and propagates as it is, with a note. A model that gathers
        on read (linen) is never refused: a parameter it did not read, it did not compute with."""
        missed = [p for p in self.must_gather if p not in ctx.gathered] if self.model.gathers_params else []
        if err is not None and self.model.gathered_blocks and is_shape_mismatch(err):
            err.add_note(
                f"shardlib: the blocks of this model ({self.model.gathered_blocks[0]!r}, ...) are gathered when their "
                "__call__ runs; their weights used outside it (another method of the block, or a sublayer called from "
                "the parent) are this device's shards. Name the submodules that are called as a whole "
                "(blocks=(...)), or gather the whole model once per step (blocks=())")
            return
        if not missed or (err is None and self.model.gathers_on_read):
            return
        if err is not None and (self.model.gathers_on_read or not is_shape_mismatch(err)):
            err.add_note(f"shardlib: raised before the model (gathers_params=True) passed {', '.join(missed)} "
                         "through shardlib.model.hooks.gather_layer")
            return
        raise ValueError(
            f"the model declares gathers_params=True but never passed {', '.join(missed)} through "
            "shardlib.model.hooks.gather_layer, so it computed with parameter shards; gather them, "
            "or build the model with gathers_params=False"
        ) from err

    def device_key(self, ctx: StepContext) -> jax.Array | None:
        """The step's key with this device's index over the batch axes folded in: data-parallel
        devices draw different masks, the devices of one model replica (tensor) the same."""
        if ctx.key is None or not self.model.uses_key:
            return None
        return jax.random.fold_in(ctx.key, jax.lax.axis_index(self.key_axes) if self.key_axes else 0)

    def loss(self, params: Any, rows: Any, ctx: StepContext) -> tuple[jax.Array, dict[str, jax.Array], Any]:
        """This device's share of the mean loss over all rows (and of the aux metrics), and the
        model state after this call (in the dtypes it came in, so a skipped step can keep either)."""
        call = Call(key=self.device_key(ctx), state=ctx.model_state, train=ctx.train, step=ctx.step)
        rows = batch_lib.local(rows)  # a per_device batch: this device's own
        loss, aux, state = self.traced(lambda: self.model.run(self.view(params), rows, self._model_specs(), call),
                                       ctx.microbatches)
        if ctx.model_state is not None:
            state = jax.tree.map(lambda new, old: new.astype(old.dtype), state, ctx.model_state)
        # Summed over the devices in float32: a bf16 metric's psum aborts XLA:CPU (AllReducePromotion,
        # docs/design.md) and a bf16 sum over devices loses digits on every backend.
        share = lambda x: x.astype(jnp.float32) / self.rows_split
        return share(loss), jax.tree.map(share, aux), state

    def stages(self, ctx: StepContext) -> Stages:
        """The model's pipeline stages over the parameters as stored (call them inside `traced`);
        `check_options` refuses models that need a key or state here."""
        del ctx
        pipe, specs = self.model.pipeline, self._model_specs()
        return Stages(
            stacked=pipe.stacked,
            embed=lambda p, b: pipe.embed(self.view(p), b, specs),
            stage=lambda p, x: pipe.stage(self.view(p), x, specs),
            head_loss=lambda p, x, b: pipe.head_loss(self.view(p), x, b, specs),
        )
