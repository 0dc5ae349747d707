"""Local SGD and DiLoCo: replicas that train alone for H steps, then average their parameters.

The mesh's ``data`` axis holds R independent replicas (R = ``mesh.shape["data"]``). Each replica
trains on its own rows of the global batch with its own optimizer state, reducing gradients only
within itself (over ``fsdp`` under ``hsdp``; nothing under ``dp``). Every ``sync_every`` = H
steps the parameters are averaged across ``data``: one all-reduce of Psi per H steps instead of
one per step, so the slow links that ``data`` usually crosses (between hosts) carry H times less.

With ``outer_tx`` (DiLoCo, Douillard et al. 2023) the average is not adopted directly:
``anchor - mean(replicas)`` is a pseudo-gradient for ``outer_tx`` (e.g. Nesterov SGD), applied to
the anchor (the parameters at the last sync), and every replica restarts from the new anchor.

With ``sync_warmup`` = W (post-local SGD, Lin et al. 2020, "Don't Use Large Mini-Batches, Use
Local SGD") the first W steps are synchronous data-parallel steps (gradients all-reduced over
``data``, so every replica applies the same update and the replicas stay identical), and local
steps start after them. The early steps, when the loss falls fastest, are where R small-batch
replica updates lose most against one large-batch update (measured in docs/local_sgd.md).
With ``average_opt_state`` the sync also averages the inner optimizer state (e.g. Adam's moments),
so that every replica restarts the period from one state, as it does from one set of parameters.

Three compiled programs, chosen in Python by the step counter, so that each has a fixed set of
collectives: ``local_step`` (no collective over ``data`` beyond the scalar metrics), ``sync``
(the parameter all-reduce over ``data``) and ``sync_step`` (the warm-up's data-parallel step:
the gradient all-reduce over ``data``). Replica state carries a leading replica axis sharded
over ``data`` (``P("data", ...)``), so what each device stores is explicit in the shardings.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from shardlib.model import hooks
from shardlib.sharding import rules as rules_lib
from shardlib.sharding.layout import Layout, restrict, spec_axes
from shardlib.model import Model
from shardlib.step.program import abstract_state, build

REPLICA_AXIS = "data"


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LocalSGDState:
    """Per-replica parameters and optimizer state (leading axis R), plus the outer loop's state."""

    step: jax.Array  # local steps taken (all replicas together); the sync schedule reads it
    params: Any  # [R, ...] per leaf, P("data", *storage spec)
    opt_state: Any  # inner optimizer state, one per replica, leading axis R
    anchor: Any = None  # parameters after the last sync (outer_tx only), storage layout
    outer_opt_state: Any = None  # outer_tx state over the anchor (outer_tx only)


def _reduce_within_replica(grad: jax.Array, param_spec: P, state_spec: P, axes: tuple[str, ...]) -> jax.Array:
    """Reduce one local gradient over a replica's own axes (never ``data``) into its state layout.

    Dims the storage shards were reduce-scattered by autodiff (the transpose of the gather);
    dims only the state shards are reduce-scattered here; the remaining axes are summed.
    """
    for dim, (p_axes, s_axes) in enumerate(zip(param_spec, state_spec)):
        if s_axes and not p_axes:
            grad = jax.lax.psum_scatter(grad, s_axes, scatter_dimension=dim, tiled=True)
    rest = tuple(a for a in axes if a not in spec_axes(param_spec) | spec_axes(state_spec))
    return jax.lax.psum(grad, rest) if rest else grad


def _activation_spec(layout: Layout) -> Callable[[Any, tuple[int, ...]], P]:
    """Activation constraints over the axes left to GSPMD (tensor, pipe), as the train step uses."""
    auto = tuple(a for a in layout.mesh.axis_names if a not in layout.batch_axes)

    @functools.lru_cache(maxsize=None)
    def resolve(logical: tuple, shape: tuple) -> P:
        return restrict(rules_lib.spec_for(logical, shape, layout.strategy.activation_rules, layout.mesh)[0], auto)

    return lambda logical, shape: resolve(tuple(logical), tuple(shape))


def _stacked(sharding: NamedSharding) -> NamedSharding:
    return NamedSharding(sharding.mesh, P(REPLICA_AXIS, *sharding.spec))


def is_sync_step(step: int, sync_every: int, sync_warmup: int = 0) -> bool:
    """Whether step number ``step`` (1-based) ends synchronised: in the warm-up, or every H after it.

    The local periods are counted from the end of the warm-up, so the first local period is a
    full H steps long whatever W is (with W a multiple of H this is simply ``step % H == 0``).
    """
    return step <= sync_warmup or (step - sync_warmup) % sync_every == 0


def _average_leaves(stacked: Any, n_replicas: int) -> Any:
    """Mean over ``data`` of every floating leaf of a stacked tree, inside ``shard_map``.

    Each device holds its replica's block ``[1, ...]``; the ``psum`` over ``data`` is the one
    all-reduce. Integer leaves (Adam's step count) are equal on every replica and kept as they are.
    """
    def mean(x):
        if n_replicas == 1 or not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        return jax.lax.psum(x, REPLICA_AXIS) / n_replicas

    return jax.tree.map(mean, stacked)


def _check_layout(layout: Layout, sync_every: int, sync_warmup: int = 0) -> None:
    """Refuse a layout that splits one replica's tensors over ``data``, with the fix."""
    if not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"sync_every must be a positive integer (local steps between averages), got {sync_every!r}")
    if not isinstance(sync_warmup, int) or sync_warmup < 0:
        raise ValueError(f"sync_warmup must be a non-negative integer (synchronous steps first), got {sync_warmup!r}")
    if REPLICA_AXIS not in layout.batch_axes:
        raise ValueError(
            f"local SGD runs one replica per slice of mesh axis {REPLICA_AXIS!r}, but strategy "
            f"{layout.strategy.name!r} splits the batch over {layout.batch_axes} only"
        )
    for tree, what in ((layout.params, "stores"), (layout.state, "keeps the optimizer state of")):
        for leaf in jax.tree.leaves(tree, is_leaf=rules_lib.is_layout):
            if REPLICA_AXIS in spec_axes(leaf.spec):
                raise ValueError(
                    f"local SGD keeps a whole replica on every {REPLICA_AXIS!r} slice, but strategy "
                    f"{layout.strategy.name!r} {what} {leaf.path} {leaf.shape} sharded over {REPLICA_AXIS!r} "
                    f"(spec {tuple(leaf.spec)}); use 'dp' (each replica replicated over its devices), "
                    "'hsdp' (each replica sharded over 'fsdp') or 'tp' (each replica split over 'tensor')"
                )


@dataclasses.dataclass(frozen=True)
class LocalSGDProgram:
    """Init, local step, sync and eval for R replicas averaged every ``sync_every`` steps."""

    model: Model
    tx: optax.GradientTransformation
    outer_tx: optax.GradientTransformation | None
    layout: Layout
    sync_every: int
    init: Callable[[jax.Array], LocalSGDState]
    local_step: Any  # jitted (state, batch) -> (state, metrics): no parameter traffic over data
    sync: Any  # jitted state -> state: the all-reduce of the parameters over data
    evaluate: Callable[[Any, Mapping[str, jax.Array]], dict[str, jax.Array]]  # (storage-layout params, batch)
    consensus: Any  # jitted state -> replica-averaged params in the storage layout (for evaluate / export)
    state_sharding: LocalSGDState
    sync_step: Any = None  # jitted (state, batch) -> (state, metrics): a data-parallel step (warm-up)
    sync_warmup: int = 0  # the first sync_warmup steps are sync_step; local steps after them
    rebase: Any = None  # jitted state -> state: anchor := replica mean (outer_tx, end of the warm-up)

    @property
    def mesh(self):
        return self.layout.mesh

    @property
    def replicas(self) -> int:
        return self.mesh.shape[REPLICA_AXIS]

    def step(self, state: LocalSGDState, batch: Mapping[str, Any]) -> tuple[LocalSGDState, dict[str, jax.Array]]:
        """One step: a synchronous step in the warm-up; after it a local step, and the sync when
        it completes H local steps since the last one.

        Reads the step counter on the host (one scalar), which waits for the previous step.
        """
        self.layout.check_batch(batch)
        done = int(state.step) + 1
        if done <= self.sync_warmup:
            state, metrics = self.sync_step(state, batch)
            if done == self.sync_warmup and self.rebase is not None:
                state = self.rebase(state)  # the outer optimizer starts from the warmed-up model
            return state, {**metrics, "synced": jnp.asarray(1, jnp.int32)}
        state, metrics = self.local_step(state, batch)
        synced = is_sync_step(done, self.sync_every, self.sync_warmup)
        if synced:
            state = self.sync(state)
        return state, {**metrics, "synced": jnp.asarray(int(synced), jnp.int32)}

    def abstract_state(self) -> LocalSGDState:
        """ShapeDtypeStructs (with shardings) of the state: for planning and restoring."""
        return abstract_state(self.init, self.state_sharding)

    def abstract_batch(self, batch_shapes: Mapping[str, tuple[tuple[int, ...], Any]]) -> dict[str, jax.ShapeDtypeStruct]:
        return self.layout.abstract_batch(batch_shapes)

    def compile_local_step(self, state: Any, batch: Any):
        self.layout.check_batch(batch)
        return self.local_step.lower(state, batch).compile()

    def compile_sync(self, state: Any):
        return self.sync.lower(state).compile()

    def compile_sync_step(self, state: Any, batch: Any):
        self.layout.check_batch(batch)
        return self.sync_step.lower(state, batch).compile()


def build_local_sgd(
    model: Model,
    tx: optax.GradientTransformation,
    layout: Layout,
    *,
    sync_every: int,
    outer_tx: optax.GradientTransformation | None = None,
    sync_warmup: int = 0,
    average_opt_state: bool = False,
    lr_schedule: Callable | None = None,
    donate: bool = True,
) -> LocalSGDProgram:
    """Local SGD over the ``data`` axis of ``layout`` ('dp', 'hsdp' or 'tp'), in float32.

    ``tx`` is each replica's (inner) optimizer; ``outer_tx`` None averages the replicas every
    ``sync_every`` steps, otherwise it is DiLoCo's outer optimizer on the pseudo-gradient
    ``anchor - mean(replicas)``: ``optax.sgd(0.7, momentum=0.9, nesterov=True)`` as in the paper;
    ``optax.sgd(1.0)`` is plain averaging again. ``sync_warmup`` = W makes the first W steps
    synchronous data-parallel steps (post-local SGD): with any ``tx`` they train exactly like
    ``build(model, tx, layout)``, at the data-parallel cost of one gradient all-reduce per step.
    ``average_opt_state`` also averages the inner optimizer state at each sync (Adam: two more
    parameter-sized all-reduces per sync, so the sync sends 3x the bytes). Metrics: ``loss``,
    ``accuracy`` and ``grad_norm`` averaged over replicas, ``skipped`` (replicas whose non-finite update was
    dropped), ``synced`` (1 on a step that ended with the sync), ``lr`` with ``lr_schedule``.
    Not supported here: mixed precision, gradient accumulation, gradient compression.
    """
    _check_layout(layout, sync_every, sync_warmup)
    mesh, batch_axes = layout.mesh, layout.batch_axes
    n_replicas = mesh.shape[REPLICA_AXIS]
    inner_axes = tuple(a for a in batch_axes if a != REPLICA_AXIS and mesh.shape[a] > 1)  # within a replica
    rows_split = math.prod(mesh.shape[a] for a in batch_axes if a != REPLICA_AXIS)
    replicated = NamedSharding(mesh, P())

    param_shardings = layout.param_shardings()
    state_shardings = layout.state_shardings()
    stacked_params = jax.tree.map(_stacked, param_shardings)
    stacked_state = jax.tree.map(_stacked, state_shardings)
    manual_params = layout.manual(layout.params)  # over the batch axes; never names data (checked)
    manual_state = layout.manual(layout.state)
    stacked_manual = jax.tree.map(lambda spec: P(REPLICA_AXIS, *spec), manual_params)
    stacked_manual_state = jax.tree.map(lambda spec: P(REPLICA_AXIS, *spec), manual_state)

    # ---- shardings of the state: inner optimizer state stacked like the params, outer like the anchor.
    abstract = model.abstract()
    abstract_stacked = jax.tree.map(lambda x: jax.ShapeDtypeStruct((n_replicas, *x.shape), x.dtype), abstract)
    abstract_opt = jax.eval_shape(jax.vmap(tx.init), abstract_stacked)
    opt_shardings = optax.tree_utils.tree_map_params(
        tx, lambda _, sharding: sharding, abstract_opt, stacked_state,
        transform_non_params=lambda _: NamedSharding(mesh, P(REPLICA_AXIS)),
    )
    outer_shardings = None
    if outer_tx is not None:
        abstract_outer = jax.eval_shape(outer_tx.init, abstract)
        outer_shardings = optax.tree_utils.tree_map_params(
            outer_tx, lambda _, sharding: sharding, abstract_outer, param_shardings,
            transform_non_params=lambda _: replicated,
        )
    state_sharding = LocalSGDState(
        step=replicated, params=stacked_params, opt_state=opt_shardings,
        anchor=param_shardings if outer_tx is not None else None, outer_opt_state=outer_shardings,
    )

    def broadcast(params):
        """Every replica gets the same parameters: a local copy on each device, no communication."""
        stacked = jax.tree.map(lambda p: jnp.broadcast_to(p[None], (n_replicas, *p.shape)), params)
        return jax.lax.with_sharding_constraint(stacked, stacked_params)

    def init_fn(key):
        params = model.init(key)  # replicas start from one initialisation, as in DiLoCo
        replicas = jax.lax.with_sharding_constraint(broadcast(params), stacked_state)
        return LocalSGDState(
            step=jnp.zeros((), jnp.int32), params=broadcast(params), opt_state=jax.vmap(tx.init)(replicas),
            anchor=params if outer_tx is not None else None,
            outer_opt_state=outer_tx.init(params) if outer_tx is not None else None,
        )

    init = jax.jit(init_fn, out_shardings=state_sharding)

    # ---- one replica's gradients (manual over data and fsdp): reduced over fsdp only, never data.
    activation_spec = _activation_spec(layout)

    def replica_loss(params, batch):
        ctx = hooks.ComputeContext(activation_spec=activation_spec)
        if not model.gathers_params:
            params = jax.tree.map(hooks.all_gather_spec, params, manual_params)
        with hooks.compute_context(ctx):
            loss, aux = model.loss(params, batch, manual_params if model.gathers_params else None)
        missed = [l.path for l in jax.tree.leaves(layout.params, is_leaf=rules_lib.is_layout)
                  if model.gathers_params and spec_axes(l.spec) & set(inner_axes) and l.path not in ctx.gathered]
        if missed:
            raise ValueError(f"the model declares gathers_params=True but never gathered {', '.join(missed)} "
                             "through shardlib.model.hooks.gather_layer")
        return loss / rows_split, jax.tree.map(lambda a: a / rows_split, aux)

    def grads_body(stacked, batch, synchronous: bool):
        def own(p, spec):  # this device's block of its replica's parameters, marked per-device over fsdp
            missing = tuple(a for a in inner_axes if a not in spec_axes(spec))
            return jax.lax.pcast(p[0], missing, to="varying") if missing else p[0]

        params = jax.tree.map(own, stacked, manual_params)
        (loss, aux), grads = jax.value_and_grad(replica_loss, has_aux=True)(params, batch)
        reduce = lambda g, p_spec, s_spec: _reduce_within_replica(g, p_spec, s_spec, inner_axes)
        grads = jax.tree.map(reduce, grads, manual_params, manual_state)
        if synchronous and n_replicas > 1:  # the warm-up: data parallelism's gradient all-reduce
            grads = jax.tree.map(lambda g: jax.lax.psum(g, REPLICA_AXIS) / n_replicas, grads)
        if inner_axes:
            loss, aux = jax.lax.psum((loss, aux), inner_axes)
        lead = lambda x: x[None]
        return lead(loss), jax.tree.map(lead, aux), jax.tree.map(lead, grads)

    def batch_specs(batch):
        return jax.tree.map(lambda x: restrict(layout.batch_spec(x.ndim), batch_axes), batch)

    def per_replica(flags: jax.Array, x: jax.Array) -> jax.Array:
        return flags.reshape((n_replicas,) + (1,) * (x.ndim - 1))

    def step_fn(state: LocalSGDState, batch, synchronous: bool):
        grads_fn = jax.shard_map(
            functools.partial(grads_body, synchronous=synchronous), mesh=mesh,
            in_specs=(stacked_manual, batch_specs(batch)),
            out_specs=(P(REPLICA_AXIS), P(REPLICA_AXIS), stacked_manual_state),
            axis_names=set(batch_axes),
        )
        losses, aux, grads = grads_fn(state.params, batch)
        grads = jax.lax.with_sharding_constraint(grads, stacked_state)
        params_s = jax.lax.with_sharding_constraint(state.params, stacked_state)
        updates, opt_state = jax.vmap(tx.update)(grads, state.opt_state, params_s)
        new_params = jax.lax.with_sharding_constraint(optax.apply_updates(params_s, updates), stacked_params)
        grad_norms = jax.vmap(optax.tree.norm)(grads)
        finite = jnp.isfinite(losses) & jnp.isfinite(grad_norms)  # a replica with NaNs skips its update
        keep = lambda new, old: jnp.where(per_replica(finite, new), new, old)
        new_state = dataclasses.replace(
            state, step=state.step + 1,
            params=jax.tree.map(keep, new_params, state.params),
            opt_state=jax.tree.map(keep, opt_state, state.opt_state),
        )
        metrics = {"loss": jnp.mean(losses), "grad_norm": jnp.mean(grad_norms),
                   "skipped": jnp.sum(~finite).astype(jnp.int32), **jax.tree.map(jnp.mean, aux)}
        if lr_schedule is not None:
            metrics["lr"] = jnp.asarray(lr_schedule(state.step), jnp.float32)
        return new_state, metrics

    step_jit = functools.partial(jax.jit, in_shardings=(state_sharding, None), out_shardings=(state_sharding, replicated),
                                 donate_argnums=(0,) if donate else ())
    local_step = step_jit(functools.partial(step_fn, synchronous=False))
    # Identical gradients, optimizer states and parameters on every replica give identical updates,
    # so the replicas stay equal through the warm-up without a parameter all-reduce.
    sync_step = step_jit(functools.partial(step_fn, synchronous=True))

    # ---- the sync: one all-reduce of the parameters over data (shard_map, so it is exactly that).
    def mean_body(stacked):
        if n_replicas == 1:  # XLA refuses an all-reduce over a size-1 manual axis next to auto axes
            return jax.tree.map(lambda p: p[0], stacked)
        return jax.tree.map(lambda p: jax.lax.psum(p[0], REPLICA_AXIS) / n_replicas, stacked)

    replica_mean = jax.shard_map(mean_body, mesh=mesh, in_specs=(stacked_manual,), out_specs=manual_params,
                                 axis_names=set(batch_axes))

    manual_opt = jax.tree.map(lambda sharding: restrict(sharding.spec, batch_axes), opt_shardings)
    opt_mean = jax.shard_map(functools.partial(_average_leaves, n_replicas=n_replicas), mesh=mesh,
                             in_specs=(manual_opt,), out_specs=manual_opt, axis_names=set(batch_axes))

    def average(stacked_params):
        """The replicas' mean parameters, in the storage layout."""
        return jax.lax.with_sharding_constraint(replica_mean(stacked_params), param_shardings)

    def sync_fn(state: LocalSGDState) -> LocalSGDState:
        mean = average(state.params)
        if average_opt_state:
            state = dataclasses.replace(state, opt_state=opt_mean(state.opt_state))
        if outer_tx is None:
            return dataclasses.replace(state, params=broadcast(mean))
        pseudo_grad = jax.tree.map(jnp.subtract, state.anchor, mean)  # anchor - average: a descent direction
        updates, outer_opt_state = outer_tx.update(pseudo_grad, state.outer_opt_state, state.anchor)
        anchor = jax.lax.with_sharding_constraint(optax.apply_updates(state.anchor, updates), param_shardings)
        return dataclasses.replace(state, params=broadcast(anchor), anchor=anchor, outer_opt_state=outer_opt_state)

    def rebase_fn(state: LocalSGDState) -> LocalSGDState:
        """The anchor becomes the (warmed-up) replicas' mean; the outer optimizer state is untouched."""
        anchor = average(state.params)
        return dataclasses.replace(state, params=broadcast(anchor), anchor=anchor)

    state_jit = functools.partial(jax.jit, in_shardings=(state_sharding,), out_shardings=state_sharding,
                                  donate_argnums=(0,) if donate else ())
    sync = state_jit(sync_fn)
    rebase = state_jit(rebase_fn) if outer_tx is not None and sync_warmup > 0 else None
    consensus = jax.jit(lambda state: replica_mean(state.params), in_shardings=(state_sharding,),
                        out_shardings=param_shardings)
    # Evaluation of one set of parameters is ordinary data-parallel evaluation under this layout.
    evaluate = build(model, tx, layout, donate=False).evaluate
    return LocalSGDProgram(model, tx, outer_tx, layout, sync_every, init, local_step, sync, evaluate, consensus,
                           state_sharding, sync_step=sync_step, sync_warmup=sync_warmup, rebase=rebase)
