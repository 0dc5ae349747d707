"""The sharded train step and eval step, built from a `Layout`.

One step is two halves:

1. *Gradients* (``jax.shard_map``, manual over the batch axes): each device computes the loss of
   its rows; parameters whose storage is sharded over a batch axis are all-gathered first (one
   layer at a time for scanned models, again in the backward pass), and every gradient is reduced
   explicitly into its optimizer-state layout: ``psum`` (dp), ``psum_scatter`` (ZeRO-1/2), or the
   reduce-scatter that autodiff derives from the gather (ZeRO-3). Writing these collectives by
   hand is what makes the communication volume the ZeRO paper's on every backend (XLA:CPU never
   turns a GSPMD gradient all-reduce into a reduce-scatter).
2. *Update* (GSPMD): the optax update runs on gradients and optimizer state in the state layout;
   the new parameters are resharded to their storage layout (the ZeRO-1/2 all-gather). A
   non-finite loss or gradient norm skips the update and is counted.
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

from shardlib.step import compression as compression_lib
from shardlib.model import hooks
from shardlib.step import pipeline as pipeline_lib
from shardlib.step import precision as precision_lib
from shardlib.sharding import rules as rules_lib
from shardlib.sharding.layout import Layout, restrict, spec_axes
from shardlib.model import Model

@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any
    loss_scale: Any = None  # {"scale", "good_steps"} under fp16 dynamic loss scaling, else None
    grad_residual: Any = None  # per-device error-feedback residuals under int8 gradient compression


def abstract_state(init: Callable[[jax.Array], Any], shardings: Any) -> Any:
    """Shapes and dtypes of ``init``'s output with ``shardings`` attached; nothing allocated."""
    shapes = jax.eval_shape(init, jax.random.key(0))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


@dataclasses.dataclass(frozen=True)
class TrainProgram:
    """A model, an optimizer and a layout, compiled into init / step / eval functions."""

    model: Model
    tx: optax.GradientTransformation
    layout: Layout
    init: Callable[[jax.Array], TrainState]
    step: Callable[[TrainState, Mapping[str, jax.Array]], tuple[TrainState, dict[str, jax.Array]]]
    evaluate: Callable[[Any, Mapping[str, jax.Array]], dict[str, jax.Array]]
    state_sharding: TrainState

    @property
    def mesh(self):
        return self.layout.mesh

    def abstract_state(self) -> TrainState:
        """ShapeDtypeStructs (with shardings) of the train state: for planning and restoring."""
        return abstract_state(self.init, self.state_sharding)

    def abstract_batch(self, batch_shapes: Mapping[str, tuple[tuple[int, ...], Any]]) -> dict[str, jax.ShapeDtypeStruct]:
        return self.layout.abstract_batch(batch_shapes)

    def compile_step(self, state: Any, batch: Any):
        """The compiled step for (abstract or concrete) arguments: memory_analysis, as_text, cost_analysis."""
        return self.step.lower(state, batch).compile()


def _sharded_paths(layout: Layout) -> list[str]:
    """Parameters whose storage is split over a batch axis: the ones ZeRO-3 must gather."""
    return [l.path for l in jax.tree.leaves(layout.params, is_leaf=rules_lib.is_layout)
            if spec_axes(restrict(l.spec, layout.batch_axes))]


def _reduce_grad(grad: jax.Array, param_spec: P, state_spec: P, batch_axes: tuple[str, ...],
                 method: compression_lib.Compression, residual: jax.Array | None):
    """Reduce one local gradient into its state layout over the batch axes -> (grad, residual).

    Dims gathered in the forward pass were already reduce-scattered by autodiff; dims the state
    shards but storage does not are reduce-scattered here; the remaining batch axes are summed.
    A tensor reduced twice carries its residual through the first reduction only.
    """
    for dim, (p_axes, s_axes) in enumerate(zip(param_spec, state_spec)):
        if s_axes and not p_axes:
            grad, residual = compression_lib.compressed_psum_scatter(
                grad, rules_lib.as_axes(s_axes), dim, method, residual)
            method, residual_out, residual = _second_pass(method), residual, None
            break
    else:
        residual_out = None
    rest = tuple(a for a in batch_axes if a not in spec_axes(param_spec) | spec_axes(state_spec))
    if rest:
        grad, new = compression_lib.compressed_psum(grad, rest, method, residual)
        residual_out = new if residual_out is None else residual_out
    return grad, residual_out if residual_out is not None else residual


def _second_pass(method: compression_lib.Compression) -> compression_lib.Compression:
    """A residual belongs to one reduction: a stateful method's second reduction falls back to bf16."""
    return compression_lib.get_compression("bf16") if method.needs_residual else method


def _activation_spec(layout: Layout) -> Callable:
    rules = layout.strategy.activation_rules
    auto = tuple(a for a in layout.mesh.axis_names if a not in layout.batch_axes)

    @functools.lru_cache(maxsize=None)
    def resolve(logical: tuple, shape: tuple) -> P:
        spec, _ = rules_lib.spec_for(logical, shape, rules, layout.mesh)
        return restrict(spec, auto)

    return lambda logical, shape: resolve(tuple(logical), tuple(shape))


def _learning_rate(opt_state: Any, step: jax.Array, schedule: Callable | None) -> jax.Array | None:
    if schedule is not None:
        return jnp.asarray(schedule(step), jnp.float32)
    found = optax.tree_utils.tree_get(opt_state, "learning_rate")
    return None if found is None else jnp.asarray(found, jnp.float32)


def build(
    model: Model,
    tx: optax.GradientTransformation,
    layout: Layout,
    *,
    lr_schedule: Callable | None = None,
    precision: str | precision_lib.Precision = "f32",
    grad_accum: int = 1,
    grad_compression: str | compression_lib.Compression = "none",
    microbatches: int | None = None,
    schedule: str = "1f1b",
    donate: bool = True,
) -> TrainProgram:
    """Compile-ready init, train step and eval step for ``model`` under ``layout``.

    ``grad_accum=K`` splits each device's rows into K microbatches inside one compiled step.
    dp / zero1 accumulate full local gradients and reduce once per step; strategies with
    ``shard_grad_buffer`` (zero2, zero3 and its variants) reduce-scatter every microbatch into a
    buffer that is 1/N of the gradients, trading K reductions for memory, as ZeRO-2 does.

    ``grad_compression`` ("none", "bf16", "int8") compresses the gradient reductions the step
    writes (dp, zero1, zero2, tp, and the data-axis all-reduce of hsdp); int8 keeps per-device
    error-feedback residuals in the train state.

    When the mesh's ``pipe`` axis has S > 1 devices the layer stack is split into S stages
    (`shardlib.step.pipeline`): each device's rows run as ``microbatches`` (default 2S) microbatches
    through the ``schedule`` ("1f1b" or "gpipe"), which replaces ``grad_accum``.
    """
    policy = precision_lib.get_precision(precision)
    method = compression_lib.get_compression(grad_compression)
    if grad_accum < 1:
        raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
    mesh, batch_axes = layout.mesh, layout.batch_axes
    n_batch = math.prod(mesh.shape[a] for a in batch_axes)
    n_stages = layout.pipeline_stages
    if n_stages > 1:
        microbatches = _check_pipeline(model, layout, grad_accum, method, microbatches)
        schedule = pipeline_lib.get_schedule(schedule)
    elif microbatches not in (None, grad_accum):
        raise ValueError(f"microbatches={microbatches} applies to a pipelined mesh (pipe > 1); without one, "
                         f"pass grad_accum={microbatches}")
    else:
        microbatches = grad_accum
    manual_axes = layout.manual_axes  # batch axes, and 'pipe' when pipelined
    param_shardings = layout.param_shardings()
    state_shardings = layout.state_shardings()
    manual_params = layout.manual(layout.params)  # what the model and the reductions see
    manual_state = layout.manual(layout.state)
    mapped_params = layout.manual(layout.params, manual_axes)  # shard_map specs (with 'pipe')
    mapped_state = layout.manual(layout.state, manual_axes)
    must_gather = _sharded_paths(layout)
    if method.name != "none" and must_gather:
        raise ValueError(
            f"grad_compression={method.name!r} cannot compress {layout.strategy.name}'s gradient reduce-scatter: "
            "it is the transpose of the weight all-gather, derived by autodiff; use precision='bf16', which "
            "gathers and reduce-scatters in bfloat16, or a strategy that keeps parameters unsharded (dp, zero1, zero2)"
        )
    # Collectives over size-1 axes move nothing, and XLA refuses a cross-partition all-reduce over
    # a size-1 manual axis next to auto axes: only reduce over axes that really split the batch.
    active_axes = tuple(a for a in batch_axes if mesh.shape[a] > 1)
    replicated = NamedSharding(mesh, P())
    ctx_args = dict(activation_spec=_activation_spec(layout))

    # ---- init: parameters and optimizer state are created directly in their shards.
    abstract_params = model.abstract()
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    opt_shardings = optax.tree_utils.tree_map_params(
        tx, lambda _, sharding: sharding, abstract_opt, state_shardings, transform_non_params=lambda _: replicated
    )
    loss_scale = precision_lib.init_loss_scale(policy)
    n_active = math.prod(mesh.shape[a] for a in active_axes)
    per_device = P(active_axes or None)  # leading axis: one residual per data-parallel device

    def zero_residuals(params):
        if not method.needs_residual:
            return None
        return jax.tree.map(lambda p: jnp.zeros((n_active, *p.shape), jnp.float32), params)

    residual_sharding = (jax.tree.map(lambda _: NamedSharding(mesh, per_device), abstract_params)
                         if method.needs_residual else None)
    state_sharding = TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings,
                                loss_scale=jax.tree.map(lambda _: replicated, loss_scale),
                                grad_residual=residual_sharding)

    def init_fn(key):
        params = precision_lib.cast_floating(model.init(key), policy.param_dtype)
        in_state_layout = jax.lax.with_sharding_constraint(params, state_shardings)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(in_state_layout),
                          loss_scale=precision_lib.init_loss_scale(policy), grad_residual=zero_residuals(params))

    init = jax.jit(init_fn, out_shardings=state_sharding)

    # ---- per-device loss: gather what storage shards, run the model, average over the batch axes.
    cast_first = policy.casts_before_gather(mesh.devices.flat[0].platform)
    compute = lambda tree: precision_lib.cast_floating(tree, policy.compute_dtype)
    unsharded = lambda p, spec: p if spec_axes(spec) else compute(p)

    def compute_view(params):
        """Parameters as the model computes with them: in the compute dtype, and fully gathered
        up front for a model that does not gather its own (sharded weights of one that does are
        cast by gather_layer, after their gather, unless the cast comes first)."""
        if cast_first:
            params = compute(params)
        if not model.gathers_params:
            params = jax.tree.map(hooks.all_gather_spec, params, manual_params)
            return params if cast_first else compute(params)
        return params if cast_first else jax.tree.map(unsharded, params, manual_params)

    model_specs = manual_params if model.gathers_params else None

    def traced_by_model(fn):
        """Run ``fn(ctx)`` in a compute context; name any sharded parameter the model never gathered."""
        ctx = hooks.ComputeContext(**ctx_args, cast_to=None if cast_first else policy.compute_dtype)

        def check_gathered(err=None):
            missed = [p for p in must_gather if p not in ctx.gathered] if model.gathers_params else []
            if missed:
                raise ValueError(
                    f"the model declares gathers_params=True but never passed {', '.join(missed)} through "
                    "shardlib.model.hooks.gather_layer, so it computed with parameter shards; gather them, "
                    "or build the model with gathers_params=False"
                ) from err

        with hooks.compute_context(ctx):
            try:
                out = fn()
            except Exception as err:  # a shape error from an ungathered shard: say which parameter
                check_gathered(err)
                raise
        check_gathered()
        return out

    def local_loss(params, batch):
        loss, aux = traced_by_model(lambda: model.loss(compute_view(params), batch, model_specs))
        return loss / n_batch, jax.tree.map(lambda a: a / n_batch, aux)

    if n_stages > 1:  # the model's stages, over the parameters as they are stored
        stages = pipeline_lib.Stages(
            stacked=model.pipeline.stacked,
            embed=lambda p, b: model.pipeline.embed(compute_view(p), b, model_specs),
            stage=lambda p, x: model.pipeline.stage(compute_view(p), x, model_specs),
            head_loss=lambda p, x, b: model.pipeline.head_loss(compute_view(p), x, b, model_specs),
        )
        # The first / last stage alone may run the embedding / head (a branch) only when they hold
        # no collective: no parameter gathered over the batch axes, no tensor parallelism.
        branch = not must_gather and mesh.shape.get("tensor", 1) == 1
        pipeline_args = dict(n_stages=n_stages, microbatches=microbatches, loss_weight=1.0 / (n_batch * microbatches),
                             branch=branch)

    def reduce(grads, residuals):
        flat, treedef = jax.tree.flatten(grads)
        rows = zip(flat, treedef.flatten_up_to(manual_params), treedef.flatten_up_to(manual_state),
                   treedef.flatten_up_to(residuals) if residuals is not None else [None] * len(flat))
        out = [_reduce_grad(g, ps, ss, active_axes, method, r) for g, ps, ss, r in rows]
        residuals = treedef.unflatten([r for _, r in out]) if method.needs_residual else None
        return treedef.unflatten([g for g, _ in out]), residuals

    reduce_each_microbatch = layout.strategy.shard_grad_buffer

    # Every local gradient must vary over the mapped axes, so that autodiff never inserts a psum of
    # its own: the reductions are the explicit ones below (and the pipeline's over 'pipe').
    vary_axes = active_axes + tuple(a for a in manual_axes if a not in batch_axes)

    def grads_body(params, batch, scale, residuals):
        def make_varying(p, spec):
            missing = tuple(a for a in vary_axes if a not in spec_axes(spec))
            return jax.lax.pcast(p, missing, to="varying") if missing else p

        params = jax.tree.map(make_varying, params, mapped_params)
        if residuals is not None:
            residuals = jax.tree.map(lambda r: r[0], residuals)

        def microbatch(rows, residuals):
            scaled = lambda p, b: (lambda out: (out[0] * scale, out))(local_loss(p, b))
            (_, (loss, aux)), grads = jax.value_and_grad(scaled, has_aux=True)(params, rows)
            if reduce_each_microbatch:
                grads, residuals = reduce(grads, residuals)
            return (loss, aux, grads), residuals

        if n_stages > 1:
            (loss, aux), grads = traced_by_model(lambda: pipeline_lib.value_and_grad(
                stages, params, batch, schedule=schedule, seed=scale, **pipeline_args))
        elif grad_accum == 1:
            (loss, aux, grads), residuals = microbatch(batch, residuals)
        else:
            micro = jax.tree.map(lambda x: x.reshape(grad_accum, x.shape[0] // grad_accum, *x.shape[1:]), batch)
            first = microbatch(jax.tree.map(lambda x: x[0], micro), residuals)

            def add(carry, rows):
                total, residuals = carry
                out, residuals = microbatch(rows, residuals)
                return (jax.tree.map(jnp.add, total, out), residuals), None

            (total, residuals), _ = jax.lax.scan(add, first, jax.tree.map(lambda x: x[1:], micro))
            loss, aux, grads = jax.tree.map(lambda x: x / grad_accum, total)
        if not reduce_each_microbatch:
            grads, residuals = reduce(grads, residuals)
        if residuals is not None:
            residuals = jax.tree.map(lambda r: r[None], residuals)
        return jax.lax.psum(loss, active_axes), jax.lax.psum(aux, active_axes), grads, residuals

    def batch_specs(batch):
        return jax.tree.map(lambda x: restrict(layout.batch_spec(x.ndim), batch_axes), batch)

    residual_specs = jax.tree.map(lambda _: per_device, abstract_params) if method.needs_residual else None

    def step_fn(state: TrainState, batch):
        grads_fn = jax.shard_map(
            grads_body,
            mesh=mesh,
            in_specs=(mapped_params, batch_specs(batch), P(), residual_specs),
            out_specs=(P(), P(), mapped_state, residual_specs),
            axis_names=set(manual_axes),
        )
        scale = jnp.ones((), jnp.float32) if state.loss_scale is None else state.loss_scale["scale"]
        loss, aux, grads, residuals = grads_fn(state.params, batch, scale, state.grad_residual)
        grads = jax.lax.with_sharding_constraint(jax.tree.map(lambda g: g / scale, grads), state_shardings)
        params_s = jax.lax.with_sharding_constraint(state.params, state_shardings)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

        def apply_update(_):
            updates, opt_state = tx.update(grads, state.opt_state, params_s)
            new_params = jax.lax.with_sharding_constraint(optax.apply_updates(params_s, updates), param_shardings)
            return new_params, opt_state, residuals

        def skip_update(_):
            return state.params, state.opt_state, state.grad_residual

        # A branch, not a select over the whole state: only one side runs, and no second copy
        # of the parameters and optimizer state stays alive for the select.
        params, opt_state, residuals = jax.lax.cond(finite, apply_update, skip_update, None)
        new_state = TrainState(
            step=state.step + finite.astype(jnp.int32),
            params=params,
            opt_state=opt_state,
            loss_scale=precision_lib.update_loss_scale(state.loss_scale, finite, policy),
            grad_residual=residuals,
        )
        metrics = {"loss": loss, "grad_norm": grad_norm, "skipped": (~finite).astype(jnp.int32), **aux}
        if state.loss_scale is not None:
            metrics["loss_scale"] = state.loss_scale["scale"]
        lr = _learning_rate(state.opt_state, state.step, lr_schedule)
        if lr is not None:
            metrics["lr"] = lr
        return new_state, metrics

    step = jax.jit(
        step_fn,
        in_shardings=(state_sharding, None),
        out_shardings=(state_sharding, replicated),
        donate_argnums=(0,) if donate else (),
    )

    def eval_fn(params, batch):
        def body(p, b):
            if n_stages > 1:
                loss, aux = traced_by_model(lambda: pipeline_lib.loss(stages, p, b, **pipeline_args))
            else:
                loss, aux = local_loss(p, b)
            return {"loss": jax.lax.psum(loss, active_axes), **jax.lax.psum(aux, active_axes)}

        return jax.shard_map(
            body, mesh=mesh, in_specs=(mapped_params, batch_specs(batch)), out_specs=P(), axis_names=set(manual_axes)
        )(params, batch)

    evaluate = jax.jit(eval_fn, in_shardings=(param_shardings, None), out_shardings=replicated)
    return TrainProgram(model, tx, layout, init, _CheckedStep(step, layout, microbatches), evaluate, state_sharding)


def _check_pipeline(model: Model, layout: Layout, grad_accum: int, method: compression_lib.Compression,
                    microbatches: int | None) -> int:
    """Refuse what a pipelined step cannot do, with the fix; return the microbatch count."""
    n_stages = layout.pipeline_stages
    if model.pipeline is None:
        raise ValueError(
            f"the mesh has pipe={n_stages} but the model does not say how to cut it into stages: "
            "build it with pipeline=shardlib.Stages(...) (models.trainable does), or use pipe=1"
        )
    if grad_accum != 1:
        raise ValueError("a pipelined step accumulates over its microbatches: pass microbatches=K, not grad_accum=K")
    if method.needs_residual:
        raise ValueError(f"grad_compression={method.name!r} keeps per-device residuals, which pipelining does "
                         "not support yet; use 'bf16' or 'none'")
    microbatches = 2 * n_stages if microbatches is None else microbatches
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    return microbatches


class _CheckedStep:
    """The jitted step, with a readable error for a batch the data axes (and microbatches) cannot
    split, and at most one step in flight.

    Queuing many steps without waiting deadlocks XLA:CPU's collectives on simulated devices (seen
    after ~50 queued dp steps on jaxlib 0.10.2: every device thread waits in a rendezvous).
    Waiting for the previous step before dispatching the next keeps the device busy (the next
    step is queued while the current one runs) and bounds the queue.
    """

    def __init__(self, jitted, layout: Layout, microbatches: int):
        self._jitted, self._layout, self.microbatches = jitted, layout, microbatches
        self._in_flight = None

    def _check(self, batch):
        self._layout.check_batch(batch, microbatches=self.microbatches)

    def __call__(self, state, batch):
        self._check(batch)
        if self._in_flight is not None:
            jax.block_until_ready(self._in_flight)
        state, metrics = self._jitted(state, batch)
        self._in_flight = metrics["loss"]
        return state, metrics

    def lower(self, state, batch):
        self._check(batch)
        return self._jitted.lower(state, batch)
