"""The calls model code makes so that one model definition serves every strategy.

* ``constrain(x, ("batch", "seq", "embed"))`` pins an activation to the strategy's compute
  layout (tensor-parallel axes only: batch axes are manual inside the train step).
* ``gather_layer(state)`` is called by a model that gathers its own parameters (``Model.
  gathers_params``): at the top of a scanned layer body, and inside rematerialised functions
  for the parameters outside the scan. Under ZeRO-3 / FSDP it all-gathers those shards, so full
  weights exist only while that layer runs and are gathered again in the backward pass; its
  transpose is the reduce-scatter of the gradients. Everywhere else it returns its input.

Losses call two more: ``global_mean(values, weights)`` (a masked mean over the global batch) and
``gather_batch(x)`` (every device's rows, for a loss over the whole batch such as CLIP's).

All are no-ops outside a shardlib step, so the same model runs eagerly on one device.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from shardlib import compat
from shardlib.sharding import staged
from shardlib.sharding.rules import as_axes

SPEC_METADATA = "shardlib_spec"  # Variable metadata: (path, storage spec over the manual axes)


@dataclasses.dataclass
class ComputeContext:
    """What the step engine tells model code while it traces the per-device body."""

    activation_spec: Callable[[Sequence[str | None], tuple[int, ...]], P]
    gathered: set[str] = dataclasses.field(default_factory=set)  # paths gather_layer saw (checked by the step)
    cast_to: Any = None  # compute dtype to cast gathered weights to (when the cast follows the gather)
    # path -> storage spec over the axes left to GSPMD (``tensor``): the split a gather must keep
    auto_specs: Mapping[str, P] = dataclasses.field(default_factory=dict)
    # (shard, spec) -> gathered: the gather itself (ZeRO++'s int8 one, `shardlib.step.zeropp`)
    gather: Callable[[Any, Sequence[Any]], jax.Array] | None = None
    sliced: set[str] = dataclasses.field(default_factory=set)  # paths gathered one slice of a stack at a time
    # state -> state, first, on all of one gather_layer call's state (`shardlib.step.layerwise`'s twins)
    gather_tree: Callable[[Any], Any] | None = None
    # (logical name, mesh axes) over the GSPMD axes: what Flax linen's nn.with_logical_constraint reads
    # (None: the caller's own rules, as outside a step)
    logical_rules: tuple[tuple[str, Any], ...] | None = ()
    # The batch axes the step averages the per-device losses over, and how many devices that is
    # (`global_mean`); empty outside a traced step body
    mean_axes: tuple[str, ...] = ()
    rows_split: int = 1
    # The microbatches the step averages over (grad_accum): with ``rows_split``, what `global_sum` undoes
    microbatches: int = 1
    # The batch axes this device's rows vary over inside the step (`batch_varying`)
    row_axes: tuple[str, ...] = ()
    # Told the logical names of every activation constraint (`constrain`, linen's
    # nn.with_logical_constraint): the step warns about names its activation rules do not know
    note_names: Callable[[Sequence[Any]], None] | None = None
    # The backend policy the step was built with (`shardlib.backend.policy_for` its mesh, resolved
    # once by build): what `all_gather_spec` and `backend_policy` read while the model is traced.
    # None outside a step: plain JAX (no barrier, no custom gather).
    backend: Any = None
    # The ZeRO-3 gathers' dtypes: a shard is cast to ``gather_dtype`` before its all-gather (None:
    # sent as it is, cast afterwards to ``cast_to``), and the gather's backward reduce-scatters the
    # cotangent in ``reduce_dtype`` (`shardlib.step.precision.Precision.reduce_dtype`; None: in its own)
    gather_dtype: Any = None
    reduce_dtype: Any = None
    # Set by `shardlib.model.experts.dispatch`: the model sent its tokens to the experts split over
    # ``expert`` (the step refuses a model that computes with those shards without doing so)
    experts_dispatched: bool = False
    # Context parallelism: the sequence is split over ``context_size`` devices of the `context`
    # axis (1: not split), balanced (one early and one late chunk each) or contiguous, and how
    # `shardlib.model.attention.attention` reaches the other chunks; each call of it is noted in
    # ``attention_calls``, so the step can refuse a model whose own attention would see its chunk only.
    context_size: int = 1
    context_balance: bool = True
    context_attention: str = "auto"
    attention_calls: list = dataclasses.field(default_factory=list)
    # What the backward pass of a block gathered per call recomputes (`shardlib.model.blocks`):
    # "weights" re-gathers its weights and keeps its matmuls' outputs, "block" reruns the whole block
    block_recompute: str = "weights"
    # Gather axes whose backward reduce-scatter spans the whole mesh and goes in two stages: the
    # axes -> the inner group size (`shardlib.sharding.staged.stages_for`; empty: one stage)
    scatter_stages: Mapping[tuple[str, ...], int] = dataclasses.field(default_factory=dict)


_CONTEXT: contextvars.ContextVar[ComputeContext | None] = contextvars.ContextVar(
    "shardlib_compute_context", default=None
)


@contextlib.contextmanager
def compute_context(ctx: ComputeContext) -> Iterator[ComputeContext]:
    token = _CONTEXT.set(ctx)
    try:
        yield ctx
    finally:
        _CONTEXT.reset(token)


# (alias, batch axes) while a step binds a pmap-era axis name (`build(axis_name=)`), for NNX modules.
_AXIS_BINDING: contextvars.ContextVar[tuple[str, tuple[str, ...]] | None] = contextvars.ContextVar(
    "shardlib_axis_binding", default=None
)


@contextlib.contextmanager
def axis_binding(alias: str, axes: tuple[str, ...]) -> Iterator[None]:
    token = _AXIS_BINDING.set((alias, axes))
    try:
        yield
    finally:
        _AXIS_BINDING.reset(token)


def rebind_axis_name(module: Any) -> None:
    """Under `axis_binding`: point every NNX submodule whose ``axis_name`` is the alias (a
    ``nnx.BatchNorm(axis_name="batch")``) at the step's batch axes (None on one device). The
    module is the step's own binding of the parameters, so the user's instance is untouched."""
    binding = _AXIS_BINDING.get()
    if binding is None:
        return
    from flax import nnx

    alias, axes = binding
    for _, sub in nnx.iter_modules(module):
        if getattr(sub, "axis_name", None) == alias:
            sub.axis_name = axes or None


def pmap_context(axis_name: str) -> ComputeContext:
    """The context of ``jax.pmap``'s step (`shardlib.step.pmap`), which averages the devices' losses
    over ``axis_name`` as the mesh step does: `global_mean` and `gather_batch` reach across it there
    too, rather than computing each device's own objective. Nothing else changes: no activation
    constraint, the user's own linen rules."""
    return ComputeContext(lambda logical_axes, shape: P(), logical_rules=None, mean_axes=(axis_name,),
                          rows_split=jax.lax.axis_size(axis_name))


def current() -> ComputeContext | None:
    """The context of the step being traced (None outside one): for model-level helpers
    (`shardlib.model.attention`)."""
    return _CONTEXT.get()


def logical_rules() -> tuple[tuple[str, Any], ...] | None:
    """The step's activation rules as Flax logical-axis rules (batch axes dropped: they are manual
    in the step); None outside a shardlib step, where the caller's own rules apply."""
    ctx = _CONTEXT.get()
    return None if ctx is None else ctx.logical_rules


def global_mean(values: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """The mean of ``values`` over the whole batch, weighted by ``weights`` (a token mask), for a loss.

    A step averages the devices' losses, so a loss that divides by its own rows' weight (the
    masked tokens on this device) differs from one device's over the same batch. This one
    divides by the weight summed over every device of the step, and scales by the device
    count that the step's average divides by again: the step's loss and gradients are then
    those of one device. Outside a shardlib step it is the plain weighted mean. ``weights`` may
    have fewer dims than ``values`` (one weight per row): it then weighs each row's elements; its
    shape must lead ``values``' (a (seq,) vector against (rows, seq) values is refused). Under
    ``grad_accum=K`` it is each microbatch's global mean, and the step averages the K of them; a
    microbatch with no weight anywhere contributes 0. Computed in float32, whatever ``values`` is.
    Each device's value is its share, not the batch's mean: a statistic used inside the loss (PPO's
    advantage mean and std) comes from ``gather_batch(x)`` instead.
    """
    values, weights = _weighed(values, weights)
    total = jax.lax.stop_gradient(weights.sum())
    ctx = _CONTEXT.get()
    if ctx is not None and ctx.mean_axes:
        total = jax.lax.psum(total, ctx.mean_axes) / ctx.rows_split
    # No weight at all (a microbatch of padding only): the sum is 0 too, so it adds 0 rather than 0/0 = NaN.
    return (values * weights).sum() / jnp.where(total > 0, total, 1.0)


def global_sum(values: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """The sum of ``values`` (times ``weights``) over the whole batch: a count (correct predictions,
    real tokens) or a summed loss, returned from the loss as the step and ``program.evaluate``
    report it.

    Both average what the loss returns over the data-parallel devices and the ``grad_accum``
    microbatches, which makes a mean the batch's mean but a plain ``jnp.sum`` a device's share
    (45 rows on 8 devices reported as 5.625). This one scales this device's sum by what that
    average divides by, so the reported value is the sum over every row of the step (and, as a
    loss, its gradients are the sum's). Outside a shardlib step it is the plain sum. Computed in
    float32; ``weights`` as in `global_mean`.
    """
    values, weights = _weighed(values, weights)
    total = (values * weights).sum()
    ctx = _CONTEXT.get()
    return total if ctx is None else total * (ctx.rows_split * ctx.microbatches)


def batch_sum(x: Any) -> Any:
    """``x`` (an array or pytree) summed over every device of the step's batch (a ``psum`` over its
    batch axes; the identity outside a step): a count over the whole batch that a statistic is then
    computed from inside the loss (an MoE layer's tokens per expert, whose max over mean is not a
    mean of the devices' own). Each device then holds the same value, which the step's average of
    the metrics keeps. Under ``grad_accum`` it is the microbatch's sum."""
    ctx = _CONTEXT.get()
    axes = ctx.mean_axes if ctx is not None else ()
    return jax.tree.map(lambda leaf: jax.lax.psum(leaf, axes), x) if axes else x


def row_index() -> Any:
    """This device's index over the batch axes that split the rows inside a step (0 outside one):
    what the step folds into its key, for an adapter that draws where the step passes no key."""
    ctx = _CONTEXT.get()
    axes = ctx.row_axes if ctx is not None else ()
    return jax.lax.axis_index(axes) if axes else 0


# Evaluation's fixed seed (`eval_key`): the same draws on every call, as the Flax VAE example's eval_rng.
EVAL_SEED = 0


def eval_key() -> jax.Array:
    """The key a model that is random in evaluation too (a VAE's reparameterisation, a diffusion
    loss's noise) draws from where ``program.evaluate`` passes none: fixed, so evaluation repeats,
    with this device's index folded in as the step folds it into its key, so the devices' rows draw
    independent numbers. The adapters' ``eval_rng_streams`` / ``eval_key`` options read it."""
    return jax.random.fold_in(jax.random.key(EVAL_SEED), row_index())


def batch_varying(x: Any) -> Any:
    """``x`` (an array or pytree built from constants, such as an RNN's zero initial carry) typed as
    varying with this device's rows. Inside the step the rows vary over the batch axes, so a
    ``lax.scan`` / ``while_loop`` whose carry starts constant and takes the rows up in its body fails
    JAX's check that the carry keeps its type; this is the cast JAX asks for (``lax.pcast(...,
    to="varying")``) over the step's batch axes. Flax's RNN cells get it from the adapters; call it
    on the initial carry of a scan of your own. The identity outside a shardlib step."""
    ctx = _CONTEXT.get()
    axes = ctx.row_axes if ctx is not None else ()
    return jax.tree.map(lambda leaf: _vary(leaf, axes), x) if axes else x


def vary_initial_carry(cell: Any) -> None:
    """Make this RNN cell instance's ``initialize_carry`` return `batch_varying` carries (an
    instance attribute over the class's method; the linen adapter removes it after the call)."""
    method = type(cell).initialize_carry
    object.__setattr__(cell, "initialize_carry", lambda *args, **kwargs: batch_varying(method(cell, *args, **kwargs)))


def vary_nnx_carries(module: Any) -> None:
    """`vary_initial_carry` on every NNX RNN cell of ``module`` (the step's own binding of the
    parameters, so the user's instance keeps its method), for ``nnx.RNN``'s scan in the step."""
    from flax import nnx

    for _, sub in nnx.iter_modules(module):
        if isinstance(sub, nnx.RNNCellBase):
            vary_initial_carry(sub)


def _vary(leaf: Any, axes: tuple[str, ...]) -> jax.Array:
    missing = tuple(a for a in axes if a not in compat.varying_axes(leaf))
    return jax.lax.pcast(leaf, missing, to="varying") if missing else leaf


def _weighed(values: jax.Array, weights: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """``values`` and ``weights`` in float32 (a bf16 psum also aborts XLA:CPU), the weights checked and
    broadcast to the values (one weight per row weighs each of its elements)."""
    values = jnp.asarray(values).astype(jnp.float32)
    weights = jnp.ones((), jnp.float32) if weights is None else jnp.asarray(weights).astype(jnp.float32)
    _check_weights(values.shape, weights.shape)
    weights = weights.reshape(weights.shape + (1,) * (values.ndim - weights.ndim))
    return values, jnp.broadcast_to(weights, values.shape)


def _check_weights(values: tuple[int, ...], weights: tuple[int, ...]) -> None:
    """Weights lead like the values (one per value, or per row of them); numpy's trailing alignment
    would weigh a (rows, seq) loss by a (seq,) vector, which is rarely what a mask means: refuse it."""
    if weights and weights != values[:len(weights)]:
        raise ValueError(f"global_mean: weights of shape {weights} do not fit values of shape {values}: give one "
                         f"weight per value (shape {values}) or per row (a leading part of it, such as {values[:1]}), "
                         "e.g. the padding mask of the tokens the loss was computed on")


def gather_batch(x: Any, *, return_offset: bool = False) -> Any:
    """Every device's rows of ``x`` (an array or a pytree of arrays, rows leading), in the global
    batch's row order: for a loss that couples the examples of the batch (CLIP / SigLIP logits over
    all image-text pairs, in-batch negatives), which each device would otherwise compute over its
    own rows only, a different objective.

    The step's loss is the mean of the devices' losses (its gradient that mean's), and the gather's
    transpose sums every device's cotangent for these rows back onto the device that computed them; so a loss whose
    average over the devices is the global one trains like one device over the global batch: the
    same formula on the gathered rows (each device computes the whole B x B loss, as big_vision
    does), or the mean over this device's rows against all gathered ones. ``return_offset=True``
    returns ``(gathered, offset)``, ``offset`` the index of this device's first row in ``gathered``
    (the CLIP labels of its rows are ``arange(rows) + offset``). Under ``grad_accum=K`` or a
    pipeline's microbatches it gathers the microbatch's rows of every device (B/K rows); rows split
    over no axis (``tensor``) are whole already. Outside a shardlib step it returns ``x`` (offset 0).
    """
    rows = _leading_rows(x)
    ctx = _CONTEXT.get()
    axes = ctx.mean_axes if ctx is not None else ()
    gathered = jax.tree.map(lambda leaf: _gather_rows(leaf, axes), x) if axes else x
    if not return_offset:
        return gathered
    if len(rows) != 1:
        raise ValueError(f"gather_batch(return_offset=True): the leaves of x have {sorted(rows)} rows; the offset "
                         "counts rows, so every leaf needs the same leading (batch) dimension: gather them in "
                         "separate calls")
    return gathered, (jax.lax.axis_index(axes) * rows.pop() if axes else 0)


def _gather_rows(leaf: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """All-gather along the rows in at least float32: the transpose sums the devices' cotangents (a
    reduce-scatter), which in bf16 loses digits and aborts XLA:CPU (as a bf16 psum does)."""
    leaf = jnp.asarray(leaf)
    if not jnp.issubdtype(leaf.dtype, jnp.floating):
        return jax.lax.all_gather(leaf, axes, axis=0, tiled=True)
    wide = leaf.astype(jnp.promote_types(leaf.dtype, jnp.float32))
    return jax.lax.all_gather(wide, axes, axis=0, tiled=True).astype(leaf.dtype)


def _leading_rows(x: Any) -> set[int]:
    """The row counts of ``x``'s leaves. A leaf without rows (a scalar such as the temperature) is
    refused here, on one device too, rather than by the all-gather inside a step."""
    shapes = [jnp.shape(leaf) for leaf in jax.tree.leaves(x)]
    if not shapes or any(not shape for shape in shapes):
        raise ValueError(f"gather_batch: x has leaves of shapes {shapes}; it gathers the rows (leading dimension) "
                         "of per-example arrays such as embeddings, so pass only those (a scalar such as a "
                         "temperature is the same on every device: use it as it is)")
    return {shape[0] for shape in shapes}


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """Sharding constraint from logical axis names; identity outside a shardlib step."""
    ctx = _CONTEXT.get()
    if ctx is None:
        return x
    if len(logical_axes) != x.ndim:
        raise ValueError(f"constrain: {len(logical_axes)} logical axes {tuple(logical_axes)} for an array of shape {x.shape}")
    if ctx.note_names is not None:
        ctx.note_names(logical_axes)
    spec = ctx.activation_spec(logical_axes, x.shape)
    if all(entry is None for entry in spec):
        return x
    return jax.lax.with_sharding_constraint(x, spec)


def backend_policy() -> Any:
    """The `shardlib.backend.BackendPolicy` of the step being traced (None outside a shardlib
    step): what a model reads for a backend-dependent choice of its own (`models.gpt`'s
    ``attention="auto"``), decided by the step's devices rather than JAX's default backend."""
    ctx = _CONTEXT.get()
    return None if ctx is None else ctx.backend


def block_recompute() -> str:
    """What the backward pass of a block gathered per call recomputes: `ComputeContext.block_recompute`."""
    ctx = _CONTEXT.get()
    return "weights" if ctx is None else ctx.block_recompute


def matmul_ordered(cotangent: jax.Array, dim: int, backend: Any) -> jax.Array:
    """A weight's cotangent about to be reduce-scattered over ``dim``, where ``backend`` (a
    `shardlib.backend.BackendPolicy`; None: plain JAX) has ``matmul_order`` (XLA:CPU): a matrix
    split on its first dim first materialises the matmul result it is JAX's transpose of (``[out,
    in]``, see `shardlib.step.reduce.reduced_transposed`) behind a barrier, then transposes it (a
    copy): without the barrier XLA:CPU folds the transpose into the matmul, which then runs unfused
    and costs more than the copy. Other backends take transposed operands as they are."""
    if cotangent.ndim != 2 or dim != 0 or backend is None or not backend.matmul_order:
        return cotangent
    return jax.lax.optimization_barrier(cotangent.T).T


def _floating(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


@functools.lru_cache(maxsize=None)
def _gather_dim(axes: Any, dim: int, in_dtype: Any, wire_dtype: Any, reduce_dtype: Any, backend: Any,
                stages: int | None = None):
    """``all_gather(x.astype(wire_dtype), axes, axis=dim, tiled=True)`` whose backward casts the
    cotangent to ``reduce_dtype``, reduce-scatters it (`matmul_ordered` first; in two stages with
    ``stages`` as the inner group) and returns it in the shard's ``in_dtype``: the gradient is
    reduced in ``reduce_dtype`` whatever dtype the weight was gathered in."""

    @jax.custom_vjp
    def gather(x):
        return jax.lax.all_gather(_cast(x, wire_dtype), axes, axis=dim, tiled=True)

    def bwd(_, cotangent):
        cotangent = matmul_ordered(_cast(cotangent, reduce_dtype), dim, backend)
        if stages is None:
            reduced = jax.lax.psum_scatter(cotangent, axes, scatter_dimension=dim, tiled=True)
        else:
            reduced = staged.psum_scatter(cotangent, as_axes(axes), dim, stages)
        return (_cast(reduced, in_dtype),)

    gather.defvjp(lambda x: (gather(x), None), bwd)
    return gather


def _cast(x: jax.Array, dtype: Any) -> jax.Array:
    return x if x.dtype == dtype else x.astype(dtype)


def gather_dim(x: jax.Array, axes: Any, dim: int, *, backend: Any = None, wire_dtype: Any = None,
               reduce_dtype: Any = None, stages: int | None = None) -> jax.Array:
    """All-gather ``x`` along ``dim`` over ``axes``, cast to ``wire_dtype`` first (None: as it is),
    its backward reduce-scattering in ``reduce_dtype`` (None: the gathered dtype). Where nothing
    asks otherwise it is autodiff's own all_gather / reduce-scatter pair (forward-mode included);
    else `_gather_dim`: a dtype change between the wire and the reduction, ``backend``'s
    ``custom_vjp_gather`` for a matrix's first dim (XLA:CPU's matmul-ordered reduce-scatter), or a
    reduce-scatter over the whole mesh in two stages (``stages``: the inner group,
    `shardlib.sharding.staged`)."""
    if not _floating(x.dtype):
        return jax.lax.all_gather(x, axes, axis=dim, tiled=True)
    wire = jnp.dtype(x.dtype if wire_dtype is None else wire_dtype)
    reduce = wire if reduce_dtype is None else jnp.dtype(reduce_dtype)
    custom = backend is not None and backend.custom_vjp_gather and x.ndim == 2 and dim == 0
    if not custom and reduce == wire and stages is None:
        return jax.lax.all_gather(_cast(x, wire), axes, axis=dim, tiled=True)
    return _gather_dim(axes, dim, jnp.dtype(x.dtype), wire, reduce, backend, stages)(x)


def all_gather_spec(x: jax.Array, spec: Sequence[Any]) -> jax.Array:
    """All-gather ``x`` along every dimension whose spec entry names mesh axes (`gather_dim`), with
    the step's backend policy and gather dtypes (`ComputeContext`; outside a step: plain). The cast
    to the wire dtype rides the first gather."""
    ctx = _CONTEXT.get()
    backend, wire, reduce = (None, None, None) if ctx is None else (ctx.backend, ctx.gather_dtype, ctx.reduce_dtype)
    stages = {} if ctx is None else ctx.scatter_stages
    for dim, axes in enumerate(spec):
        if axes:
            x = gather_dim(x, axes, dim, backend=backend, wire_dtype=wire, reduce_dtype=reduce,
                           stages=stages.get(as_axes(axes)))
    return x


def gather_shards(x: Any, spec: Sequence[Any], auto_spec: Sequence[Any] = (),
                  gather: Callable[[Any, Sequence[Any]], jax.Array] | None = None) -> jax.Array:
    """All-gather ``x`` over the manual axes of ``spec`` while it stays split over the GSPMD axes
    of ``auto_spec`` (``tensor``). ``gather(shard, spec)`` replaces `all_gather_spec` (ZeRO++'s
    quantised gather, whose ``x`` may carry its error-feedback residual along).

    GSPMD cannot partition a manual all-gather over an operand it has split on another axis: it
    all-gathers the operand over ``tensor`` first, so fsdp_tp's layers would compute with whole
    weights and reduce-scatter whole gradients (docs/design.md, "fsdp_tp's gathers keep the
    tensor split"). Mapping the auto axes by hand around the gather gathers each tensor shard
    on its own; the transpose reduce-scatters gradients of 1/T the size.
    """
    # A dim split over both kinds (an annotation such as ("fsdp", "tensor") on one dim) is left to
    # GSPMD as before: mapped by hand, its blocks would come back in the wrong order.
    gather = gather or all_gather_spec
    kept = P(*(None if manual else auto for manual, auto in zip(spec, auto_spec)))
    auto = {a for entry in kept for a in as_axes(entry)}
    if not auto or not any(spec):
        return gather(x, spec)
    return jax.shard_map(lambda shard: gather(shard, spec), in_specs=kept, out_specs=kept, axis_names=auto)(x)


def _gather_variable(variable: Any, ctx: ComputeContext) -> Any:
    stamp = variable.get_metadata().get(SPEC_METADATA) if hasattr(variable, "get_metadata") else None
    if not stamp:
        return variable
    path, spec = stamp
    ctx.gathered.add(path)
    value = variable.get_value()
    fitted = _fit(path, spec, value)
    if len(fitted) < len(spec):
        ctx.sliced.add(path)
    spec = fitted
    value = gather_shards(value, spec, _fit(path, ctx.auto_specs.get(path, (None,) * len(spec)), value), ctx.gather)
    if ctx.cast_to is not None and jax.numpy.issubdtype(value.dtype, jax.numpy.floating):
        value = value.astype(ctx.cast_to)
    return variable.replace(value)


def _fit(path: str, spec: Sequence[Any], value: jax.Array) -> tuple:
    """``spec`` for ``value``: a slice of a scanned stack drops the leading 'layers' entry."""
    spec, value = tuple(spec), (value.value if hasattr(value, "residual") else value)  # carried: the shard
    if len(spec) == value.ndim + 1:
        if spec[0] is not None:  # each device would scan only the layers of its own shard
            raise ValueError(
                f"gather_layer: {path} is one layer of a stack whose layer axis (dim 0) is split over {spec[0]!r}; "
                "name that axis 'layers', which no strategy splits: nnx.vmap(..., transform_metadata="
                "{nnx.PARTITION_NAME: 'layers'}) for annotated layers, else from_nnx(..., path_rules=[(r'^layers/', "
                "('layers',))]) with your stack's path")
        spec = spec[1:]
    if len(spec) != value.ndim:
        raise ValueError(f"gather_layer: {path} has spec {spec}, which does not fit a value of shape {value.shape}")
    return spec


def reduces_per_layer() -> bool:
    """Whether the step twins the parameters `gather_layer` sees, to reduce their gradients layer
    by layer inside the backward loop (`shardlib.step.layerwise`): then a model that gathers on
    read must route its whole parameters through `gather_layer` too, not only its shards."""
    ctx = _CONTEXT.get()
    return ctx is not None and ctx.gather_tree is not None


def gather_layer(state: Any) -> Any:
    """Gather the parameter shards in ``state`` (a Variable, a State, a module's state, or an NNX
    module such as the layer ``nnx.scan`` hands its body: a gathered copy) under ZeRO-3."""
    ctx = _CONTEXT.get()
    if ctx is None:
        return state
    from flax import nnx  # local: keep `import shardlib.model.hooks` light

    if ctx.gather_tree is not None:
        state = ctx.gather_tree(state)
    return jax.tree.map(lambda v: _gather_variable(v, ctx), state, is_leaf=lambda v: isinstance(v, nnx.Variable))


def gather_into(variables: Sequence[Any]) -> list[tuple[Any, Any]]:
    """Each parameter shard among ``variables`` (NNX Variables) replaced in place by its gather
    (`gather_layer`'s, cast included); returns ``(variable, shard)`` pairs for `restore`. For a
    block gathered when its call runs (`shardlib.model.nnx_blocks`), which must hand the shards
    back to its remat, not the gathered weights."""
    replaced = []
    for variable, new in zip(variables, gather_layer(list(variables))):
        if new is not variable:
            replaced.append((variable, variable.get_value()))
            variable.set_value(new.get_value())
    return replaced


def restore(replaced: Sequence[tuple[Any, Any]]) -> None:
    """Put back the shards `gather_into` replaced."""
    for variable, shard in replaced:
        variable.set_value(shard)


# Where Flax exposes its logical constraint: `noting_flax_constraints` wraps each for a linen call.
_FLAX_CONSTRAINTS = (("flax.linen", "with_logical_constraint"), ("flax.linen.spmd", "with_logical_constraint"),
                     ("flax.linen.partitioning", "with_sharding_constraint"))
_flax_lock = threading.Lock()
_flax_users = 0  # calls inside `noting_flax_constraints`: the wrapper stays while any is running


@contextlib.contextmanager
def noting_flax_constraints() -> Iterator[None]:
    """While a linen module runs: ``nn.with_logical_constraint`` tells the step its names
    (``ComputeContext.note_names``). Flax resolves them out of sight, and returns before reading
    them when no rule applies (a mesh without a model axis), so its function is wrapped for the
    call; the wrapper passes everything through unchanged, and outside a step notes nothing."""
    import importlib

    global _flax_users
    targets = [(importlib.import_module(module), name) for module, name in _FLAX_CONSTRAINTS]
    with _flax_lock:
        if _flax_users == 0:
            for module, name in targets:  # each its own function, restored as it was
                setattr(module, name, _noting(getattr(module, name)))
        _flax_users += 1
    try:
        yield
    finally:
        with _flax_lock:
            _flax_users -= 1
            if _flax_users == 0:
                for module, name in targets:
                    setattr(module, name, getattr(module, name).__wrapped__)


def _noting(constraint: Callable[..., Any]) -> Callable[..., Any]:
    """``constraint`` (Flax's), reporting the names it is given to the step's ``note_names``."""
    @functools.wraps(constraint)
    def with_logical_constraint(x, logical_axis_resources, *args, **kwargs):
        ctx = _CONTEXT.get()
        if ctx is not None and ctx.note_names is not None:
            ctx.note_names([n for n in jax.tree.leaves(logical_axis_resources) if isinstance(n, str)])
        return constraint(x, logical_axis_resources, *args, **kwargs)

    return with_logical_constraint
