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

With ``outer_delay`` = D (streaming DiLoCo, Douillard et al. 2025, "Streaming DiLoCo with
overlapping communication") the outer synchronisation overlaps the next D inner steps: at the
sync point the replicas' parameters are kept (a local copy, no communication) and training goes
on; the D-th step after it all-reduces that copy alongside its own forward and backward pass,
applies the outer optimizer to the anchor, and mixes every replica with the new anchor,
``outer_mix * replica + (1 - outer_mix) * anchor`` (the paper's alpha; 0.5 there), so the D
overlapped steps' local progress is kept in part. D = 0 is DiLoCo as above.

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

from shardlib.model import Model
from shardlib.sharding import rules as rules_lib
from shardlib.sharding.layout import Layout, restrict, spec_axes
from shardlib.sharding.mesh import describe
from shardlib.step import batch as batch_lib
from shardlib.step import grads as grads_lib
from shardlib.step import precision as precision_lib
from shardlib.step import reduce as reduce_lib
from shardlib.step.compute import ModelCall, StepContext
from shardlib.step.compression import get_compression
from shardlib.step.program import build
from shardlib.step.state import abstract_state

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
    snapshot: Any = None  # outer_delay > 0: the replicas' parameters at the last sync point, stacked like params


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


def _check_outer_delay(outer_delay: int, outer_mix: float, sync_every: int, outer_tx: Any) -> None:
    """Refuse a delay that cannot be streamed, naming the flag and the fix."""
    if isinstance(outer_delay, bool) or not isinstance(outer_delay, int) or outer_delay < 0:
        raise ValueError(f"outer_delay must be a non-negative integer (inner steps the outer sync overlaps; "
                         f"0: DiLoCo's blocking sync), got {outer_delay!r}")
    if outer_delay == 0:
        return
    if outer_tx is None:
        raise ValueError(f"outer_delay={outer_delay} delays DiLoCo's outer update, but outer_tx is None; pass "
                         "outer_tx (optax.sgd(1.0) is plain averaging, optax.sgd(0.7, momentum=0.9, nesterov=True) "
                         "the paper's)")
    if outer_delay >= sync_every:
        raise ValueError(f"outer_delay={outer_delay} must be smaller than sync_every={sync_every}: the delayed outer "
                         "update has to land before the next sync point starts another")
    if not 0.0 <= outer_mix <= 1.0:
        raise ValueError(f"outer_mix must be in [0, 1] (a replica's own weight when the delayed update lands), "
                         f"got {outer_mix!r}")


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
    if layout.context_size > 1:
        raise ValueError(f"local SGD does not split sequences: the mesh {describe(layout.mesh)} has a context axis; "
                         "use a mesh without context (or build() for context parallelism)")
    if layout.mesh.shape[REPLICA_AXIS] < 2:
        raise ValueError(
            f"local SGD averages the replicas on mesh axis {REPLICA_AXIS!r}, which has one device on the mesh "
            f"{describe(layout.mesh)}: there is one replica and nothing to average; give {REPLICA_AXIS!r} two or "
            f"more devices (e.g. make_mesh({{{REPLICA_AXIS!r}: 2, 'fsdp': 4}}) with 'hsdp'), or train with build()"
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
    outer_delay: int = 0  # streaming DiLoCo: the outer update lands this many steps after its sync point
    mark: Any = None  # jitted state -> state: snapshot := params, at a sync point (outer_delay > 0)
    merge_step: Any = None  # jitted (state, batch) -> (state, metrics): a local step + the delayed outer update

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
        batch_lib.check(self.layout, batch)
        done = int(state.step) + 1
        if done <= self.sync_warmup:
            state, metrics = self.sync_step(state, batch)
            if done == self.sync_warmup and self.rebase is not None:
                state = self.rebase(state)  # the outer optimizer starts from the warmed-up model
            return state, {**metrics, "synced": jnp.asarray(1, jnp.int32)}
        merged = self.lands_outer_update(done)
        state, metrics = (self.merge_step if merged else self.local_step)(state, batch)
        synced = is_sync_step(done, self.sync_every, self.sync_warmup)
        if synced:
            state = self.mark(state) if self.outer_delay else self.sync(state)
        metrics = {**metrics, "synced": jnp.asarray(int(synced), jnp.int32)}
        return state, ({**metrics, "merged": jnp.asarray(int(merged), jnp.int32)} if self.outer_delay else metrics)

    def lands_outer_update(self, step: int) -> bool:
        """Whether step ``step`` (1-based) is the one the delayed outer update of a sync point lands in."""
        start = step - self.outer_delay
        return self.outer_delay > 0 and start > self.sync_warmup and is_sync_step(start, self.sync_every,
                                                                                  self.sync_warmup)

    def abstract_state(self) -> LocalSGDState:
        """ShapeDtypeStructs (with shardings) of the state: for planning and restoring."""
        return abstract_state(self.init, self.state_sharding)

    def abstract_batch(self, batch_shapes: Mapping[str, tuple[tuple[int, ...], Any]]) -> dict[str, jax.ShapeDtypeStruct]:
        return self.layout.abstract_batch(batch_shapes)

    def compile_local_step(self, state: Any, batch: Any):
        batch_lib.check(self.layout, batch)
        return self.local_step.lower(state, batch).compile()

    def compile_sync(self, state: Any):
        return self.sync.lower(state).compile()

    def compile_sync_step(self, state: Any, batch: Any):
        batch_lib.check(self.layout, batch)
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
    outer_delay: int = 0,
    outer_mix: float = 0.5,
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
    ``outer_delay`` = D > 0 (with ``outer_tx``, D < ``sync_every``) streams the outer sync: its
    all-reduce runs in the D-th step after the sync point, alongside that step's compute, and the
    replicas then mix with the new anchor by ``outer_mix``; metric ``merged`` marks that step.
    Not supported here: mixed precision, gradient accumulation, gradient compression, models that
    draw random numbers or carry BatchNorm statistics.
    """
    _check_layout(layout, sync_every, sync_warmup)
    _check_outer_delay(outer_delay, outer_mix, sync_every, outer_tx)
    grads_lib.refuse_key_and_state(model, "build_local_sgd", "use shardlib.build")
    replicas = _Replicas.for_layout(layout)
    state_sharding = _state_sharding(model, tx, outer_tx, replicas, layout, streamed=outer_delay > 0)
    init = jax.jit(_init_fn(model, tx, outer_tx, replicas, streamed=outer_delay > 0), out_shardings=state_sharding)
    grads_fn = _replica_grads(model, layout, replicas)
    replicated = NamedSharding(layout.mesh, P())
    step_jit = functools.partial(jax.jit, in_shardings=(state_sharding, None), out_shardings=(state_sharding, replicated),
                                 donate_argnums=(0,) if donate else ())
    step_fn = functools.partial(_step, grads_fn, tx, replicas, lr_schedule)
    # Identical gradients, optimizer states and parameters on every replica give identical updates,
    # so the replicas stay equal through the warm-up without a parameter all-reduce.
    local_step = step_jit(functools.partial(step_fn, synchronous=False))
    sync_step = step_jit(functools.partial(step_fn, synchronous=True))

    averages = _Averages(replicas, state_sharding.opt_state, outer_tx)
    state_jit = functools.partial(jax.jit, in_shardings=(state_sharding,), out_shardings=state_sharding,
                                  donate_argnums=(0,) if donate else ())
    sync = state_jit(functools.partial(averages.sync, average_opt_state=average_opt_state))
    rebase = state_jit(averages.rebase) if outer_tx is not None and sync_warmup > 0 else None
    consensus = jax.jit(lambda state: averages.replica_mean(state.params), in_shardings=(state_sharding,),
                        out_shardings=replicas.param_shardings)
    # Evaluation of one set of parameters is ordinary data-parallel evaluation under this layout.
    evaluate = build(model, tx, layout, donate=False).evaluate
    streamed = {}
    if outer_delay:
        streamed = dict(outer_delay=outer_delay, mark=state_jit(averages.mark),
                        merge_step=step_jit(functools.partial(averages.merge_step, step_fn, outer_mix)))
    return LocalSGDProgram(model, tx, outer_tx, layout, sync_every, init, local_step, sync, evaluate, consensus,
                           state_sharding, sync_step=sync_step, sync_warmup=sync_warmup, rebase=rebase, **streamed)


@dataclasses.dataclass(frozen=True)
class _Replicas:
    """The layout as R replicas stacked along a leading axis split over ``data``."""

    mesh: jax.sharding.Mesh
    batch_axes: tuple[str, ...]
    n: int
    param_shardings: Any  # one replica's storage layout
    stacked_params: Any  # NamedShardings of the stacked parameters, P("data", *storage spec)
    stacked_state: Any  # the same in the optimizer-state layout
    manual_params: Any  # one replica's storage specs over the batch axes; never names data (checked)
    stacked_manual: Any  # the stacked parameters' shard_map specs
    stacked_manual_state: Any

    @classmethod
    def for_layout(cls, layout: Layout) -> _Replicas:
        param_shardings = layout.param_shardings()
        manual_params = layout.manual(layout.params)
        lead = lambda spec: P(REPLICA_AXIS, *spec)
        return cls(layout.mesh, layout.batch_axes, layout.mesh.shape[REPLICA_AXIS], param_shardings,
                   jax.tree.map(_stacked, param_shardings), jax.tree.map(_stacked, layout.state_shardings()),
                   manual_params, jax.tree.map(lead, manual_params), jax.tree.map(lead, layout.manual(layout.state)))

    def broadcast(self, params: Any) -> Any:
        """Every replica gets the same parameters: a local copy on each device, no communication."""
        stacked = jax.tree.map(lambda p: jnp.broadcast_to(p[None], (self.n, *p.shape)), params)
        return jax.lax.with_sharding_constraint(stacked, self.stacked_params)

    def per_replica(self, flags: jax.Array, x: jax.Array) -> jax.Array:
        return flags.reshape((self.n,) + (1,) * (x.ndim - 1))


def _state_sharding(model: Model, tx: optax.GradientTransformation, outer_tx: optax.GradientTransformation | None,
                    replicas: _Replicas, layout: Layout, streamed: bool = False) -> LocalSGDState:
    """Inner optimizer state stacked like the parameters, the outer one laid out like the anchor."""
    mesh, replicated = replicas.mesh, NamedSharding(replicas.mesh, P())
    abstract = model.abstract()
    # Each leaf as `Layout.opt_state_layouts` places one replica's (never over the replica axis),
    # stacked over the replicas: by path and shape, so callable masks and labels, masked states and
    # factored moments place as they do in `build`.
    one_replica = tuple(a for a in mesh.axis_names if a != REPLICA_AXIS)
    opt_shardings = jax.tree.map(lambda leaf: NamedSharding(mesh, P(REPLICA_AXIS, *restrict(leaf.spec, one_replica))),
                                 layout.opt_state_layouts(jax.eval_shape(tx.init, abstract)), is_leaf=rules_lib.is_layout)
    outer_shardings = None
    if outer_tx is not None:
        abstract_outer = jax.eval_shape(outer_tx.init, abstract)
        outer_shardings = optax.tree_utils.tree_map_params(
            outer_tx, lambda _, sharding: sharding, abstract_outer, replicas.param_shardings,
            transform_non_params=lambda _: replicated,
        )
    return LocalSGDState(
        step=replicated, params=replicas.stacked_params, opt_state=opt_shardings,
        anchor=replicas.param_shardings if outer_tx is not None else None, outer_opt_state=outer_shardings,
        snapshot=replicas.stacked_params if streamed else None,
    )


def _init_fn(model: Model, tx: optax.GradientTransformation, outer_tx: optax.GradientTransformation | None,
             replicas: _Replicas, streamed: bool = False) -> Callable[[jax.Array], LocalSGDState]:
    def init_fn(key):
        params = model.init(key)  # replicas start from one initialisation, as in DiLoCo
        stacked = jax.lax.with_sharding_constraint(replicas.broadcast(params), replicas.stacked_state)
        return LocalSGDState(
            step=jnp.zeros((), jnp.int32), params=replicas.broadcast(params), opt_state=jax.vmap(tx.init)(stacked),
            anchor=params if outer_tx is not None else None,
            outer_opt_state=outer_tx.init(params) if outer_tx is not None else None,
            snapshot=replicas.broadcast(params) if streamed else None,
        )

    return init_fn


def _replica_grads(model: Model, layout: Layout, replicas: _Replicas) -> Callable:
    """``(stacked params, batch, synchronous) -> (losses, aux, grads)``, each with a leading replica
    axis: one replica's gradients (manual over data and fsdp), reduced over fsdp only, never data
    unless ``synchronous`` (the warm-up: data parallelism's gradient all-reduce)."""
    reducer = reduce_lib.Reducer.for_layout(layout, get_compression("none"), exclude=(REPLICA_AXIS,))
    rows_split = math.prod(layout.mesh.shape[a] for a in layout.batch_axes if a != REPLICA_AXIS)
    provider = grads_lib.Plain(ModelCall.for_layout(model, layout, precision_lib.get_precision("f32"), rows_split,
                                                    mean_exclude=(REPLICA_AXIS,)),
                               reducer)

    def body(stacked, batch, synchronous: bool):
        params = reduce_lib.vary(jax.tree.map(lambda p: p[0], stacked), replicas.manual_params, reducer.axes)
        (loss, aux), grads, _, _ = provider.value_and_grad(params, batch, StepContext(), None)
        if synchronous and replicas.n > 1:
            grads = jax.tree.map(lambda g: jax.lax.psum(g, REPLICA_AXIS) / replicas.n, grads)
        if reducer.axes:
            loss, aux = jax.lax.psum((loss, aux), reducer.axes)
        lead = lambda x: x[None]
        return lead(loss), jax.tree.map(lead, aux), jax.tree.map(lead, grads)

    def grads_fn(stacked, batch, synchronous: bool):
        return jax.shard_map(
            functools.partial(body, synchronous=synchronous), mesh=layout.mesh,
            in_specs=(replicas.stacked_manual, batch_lib.specs(layout, batch)),
            out_specs=(P(REPLICA_AXIS), P(REPLICA_AXIS), replicas.stacked_manual_state),
            axis_names=set(layout.batch_axes),
        )(stacked, batch)

    return grads_fn


def _step(grads_fn: Callable, tx: optax.GradientTransformation, replicas: _Replicas, lr_schedule: Callable | None,
          state: LocalSGDState, batch: Any, *, synchronous: bool) -> tuple[LocalSGDState, dict[str, jax.Array]]:
    """Every replica's optimizer step on its own gradients; a replica with NaNs skips its update."""
    losses, aux, grads = grads_fn(state.params, batch, synchronous)
    grads = jax.lax.with_sharding_constraint(grads, replicas.stacked_state)
    params_s = jax.lax.with_sharding_constraint(state.params, replicas.stacked_state)
    updates, opt_state = jax.vmap(tx.update)(grads, state.opt_state, params_s)
    new_params = jax.lax.with_sharding_constraint(optax.apply_updates(params_s, updates), replicas.stacked_params)
    grad_norms = jax.vmap(optax.tree.norm)(grads)
    finite = jnp.isfinite(losses) & jnp.isfinite(grad_norms)
    keep = lambda new, old: jnp.where(replicas.per_replica(finite, new), new, old)
    new_state = dataclasses.replace(
        state, step=state.step + 1,
        params=jax.tree.map(keep, new_params, state.params),
        opt_state=jax.tree.map(keep, opt_state, state.opt_state),
    )
    # Gathered, then averaged locally: a psum of these scalars would be merged by XLA's all-reduce
    # combiner with streaming DiLoCo's delayed parameter all-reduce, making it wait for this step.
    losses, grad_norms, finite, aux = jax.lax.with_sharding_constraint(
        (losses, grad_norms, finite, aux), NamedSharding(replicas.mesh, P()))
    metrics = {"loss": jnp.mean(losses), "grad_norm": jnp.mean(grad_norms),
               "skipped": jnp.sum(~finite).astype(jnp.int32), **jax.tree.map(jnp.mean, aux)}
    if lr_schedule is not None:
        metrics["lr"] = jnp.asarray(lr_schedule(state.step), jnp.float32)
    return new_state, metrics


@dataclasses.dataclass(frozen=True)
class _Averages:
    """The sync: one all-reduce of the parameters over data (``shard_map``, so it is exactly that),
    adopted directly or through DiLoCo's outer optimizer."""

    replicas: _Replicas
    opt_shardings: Any  # the inner optimizer state's shardings (stacked)
    outer_tx: optax.GradientTransformation | None

    def _mean_body(self, stacked: Any) -> Any:
        n = self.replicas.n
        if n == 1:  # XLA refuses an all-reduce over a size-1 manual axis next to auto axes
            return jax.tree.map(lambda p: p[0], stacked)
        return jax.tree.map(lambda p: jax.lax.psum(p[0], REPLICA_AXIS) / n, stacked)

    def replica_mean(self, stacked: Any) -> Any:
        """The replicas' mean parameters, in the storage specs over the batch axes."""
        r = self.replicas
        return jax.shard_map(self._mean_body, mesh=r.mesh, in_specs=(r.stacked_manual,), out_specs=r.manual_params,
                             axis_names=set(r.batch_axes))(stacked)

    def opt_mean(self, opt_state: Any) -> Any:
        r = self.replicas
        manual_opt = jax.tree.map(lambda sharding: restrict(sharding.spec, r.batch_axes), self.opt_shardings)
        return jax.shard_map(functools.partial(_average_leaves, n_replicas=r.n), mesh=r.mesh, in_specs=(manual_opt,),
                             out_specs=manual_opt, axis_names=set(r.batch_axes))(opt_state)

    def average(self, stacked_params: Any) -> Any:
        """The replicas' mean parameters, in the storage layout."""
        return jax.lax.with_sharding_constraint(self.replica_mean(stacked_params), self.replicas.param_shardings)

    def sync(self, state: LocalSGDState, average_opt_state: bool = False) -> LocalSGDState:
        mean = self.average(state.params)
        if average_opt_state:
            state = dataclasses.replace(state, opt_state=self.opt_mean(state.opt_state))
        if self.outer_tx is None:
            return dataclasses.replace(state, params=self.replicas.broadcast(mean))
        state = self._outer_update(state, mean)
        return dataclasses.replace(state, params=self.replicas.broadcast(state.anchor))

    def _outer_update(self, state: LocalSGDState, mean: Any) -> LocalSGDState:
        """DiLoCo's outer step on the anchor, from the replicas' mean."""
        pseudo_grad = jax.tree.map(jnp.subtract, state.anchor, mean)  # anchor - average: a descent direction
        updates, outer_opt_state = self.outer_tx.update(pseudo_grad, state.outer_opt_state, state.anchor)
        anchor = jax.lax.with_sharding_constraint(optax.apply_updates(state.anchor, updates),
                                                  self.replicas.param_shardings)
        return dataclasses.replace(state, anchor=anchor, outer_opt_state=outer_opt_state)

    def mark(self, state: LocalSGDState) -> LocalSGDState:
        """A streamed sync point: keep the replicas' parameters for the delayed all-reduce (no communication)."""
        return dataclasses.replace(state, snapshot=jax.tree.map(jnp.copy, state.params))

    def merge_step(self, step_fn: Callable, outer_mix: float, state: LocalSGDState,
                   batch: Any) -> tuple[LocalSGDState, dict[str, jax.Array]]:
        """A local step and, beside it, the all-reduce of the snapshot; then the outer update and the mix.

        The mean reads only the snapshot, not this step's parameters, so the all-reduce need not
        wait for the step's compute (it overlaps it where the backend runs both at once)."""
        mean = self.average(state.snapshot)
        state, metrics = step_fn(state, batch, synchronous=False)
        state = self._outer_update(state, mean)
        anchor = self.replicas.broadcast(state.anchor)
        params = jax.tree.map(lambda p, a: outer_mix * p + (1.0 - outer_mix) * a, state.params, anchor)
        return dataclasses.replace(state, params=params), metrics

    def rebase(self, state: LocalSGDState) -> LocalSGDState:
        """The anchor becomes the (warmed-up) replicas' mean; the outer optimizer state is untouched."""
        anchor = self.average(state.params)
        return dataclasses.replace(state, params=self.replicas.broadcast(anchor), anchor=anchor)
