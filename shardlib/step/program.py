"""The sharded train step and eval step, built from a `Layout` by wiring small parts.

One step is two halves:

1. *Gradients* (``jax.shard_map``, manual over the batch axes, and ``pipe`` when pipelined):
   a gradient provider (`shardlib.step.grads`: plain, accumulated, pipelined) calls the model
   through `shardlib.step.compute.ModelCall` and reduces every local gradient into its
   optimizer-state layout with `shardlib.step.reduce.Reducer` (``psum``, ``psum_scatter``, or
   the reduce-scatter autodiff derives from a ZeRO-3 gather; compressed or not).
2. *Update* (GSPMD, `shardlib.step.update`): the optax update in the state layout, the new
   parameters resharded to storage; a non-finite loss or gradient norm skips it, counted.

Precision (`shardlib.step.precision`) and compression (`shardlib.step.compression`) are policies
the parts receive; the train state and its shardings are `shardlib.step.state`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from shardlib import backend as backend_lib
from shardlib.model import Model
from shardlib.model import blocks as blocks_lib
from shardlib.sharding import rules as rules_lib
from shardlib.sharding.layout import Layout, check_model_argument
from shardlib.step import batch as batch_lib
from shardlib.step import buckets as buckets_lib
from shardlib.step import compression as compression_lib
from shardlib.step import given
from shardlib.step import grads as grads_lib
from shardlib.step import layerwise as layerwise_lib
from shardlib.step import offload as offload_lib
from shardlib.step import options as options_lib
from shardlib.step import precision as precision_lib
from shardlib.step import reduce as reduce_lib
from shardlib.step import staleness as staleness_lib
from shardlib.step import update as update_lib
from shardlib.step import zeropp
from shardlib.step.compute import ModelCall, StepContext, average_state
from shardlib.step.state import (TrainState, abstract_model_state, abstract_state, initializer, like_model,
                                 opt_state_sharding, state_sharding, step_key, transient_initializer)

__all__ = ["TrainProgram", "TrainState", "abstract_state", "build"]


@dataclasses.dataclass(frozen=True)
class TrainProgram:
    """A model, an optimizer and a layout, compiled into init / step / eval functions."""

    model: Model
    tx: optax.GradientTransformation
    layout: Layout
    init: Callable[[jax.Array], TrainState]
    step: Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]  # batch: any pytree of arrays (`batch`)
    evaluate: Callable[..., dict[str, jax.Array]]  # (params, batch, model_state=None): the model in eval mode
    state_sharding: TrainState
    # () -> fresh loss scale and residuals: the restore of a checkpoint saved under another
    # precision, compression or device count takes them (Checkpointer.restore(..., fresh=...))
    fresh_transient: Callable[[], dict[str, Any]] | None = None

    @property
    def mesh(self):
        return self.layout.mesh

    def init_from(self, params: Any, key: jax.Array | None = None, model_state: Any = None, opt_state: Any = None,
                  step: Any = None) -> TrainState:
        """A train state that starts from weights you already have (pretrained, `load_exported`, a
        ``TrainState.create``'s params, ``nnx.state(model, nnx.Param)``) instead of the model's init:
        each placed straight into its shards and cast to the master dtype, with a fresh optimizer
        state built from them, as ``init`` builds it. ``model_state`` (BatchNorm statistics) is kept
        when given (a Flax ``TrainState``'s ``batch_stats`` as it is: a tree that fits the model's
        one state collection is that collection), else the model's own init of it, with a warning.
        ``opt_state`` and ``step`` (a one-device run's ``state.opt_state`` and ``state.step``, of
        the same optimizer) continue that run instead: moments, schedule counts and step number.
        ``key`` (default ``jax.random.key(0)``) seeds the dropout stream."""
        key = jax.random.key(0) if key is None else key
        given.refuse_init_mistakes(params, self.model)
        given.refuse_replicated(given.pure(params), self.model.abstract(), "params")
        params = like_model(given.pure(params), self.model.abstract(), "parameters")
        if model_state is not None:
            expected = abstract_model_state(self.model)
            model_state = given.one_entry(given.pure(model_state), expected)
            given.refuse_replicated(model_state, expected, "batch_stats")
            model_state = like_model(model_state, expected, "model_state")
            model_state = jax.device_put(model_state, self.state_sharding.model_state)
        elif self.model.init_state is not None:
            warnings.warn("init_from without model_state=: the model's state (BatchNorm statistics, counters) starts "
                          "from its own init, not from the weights' run; pass model_state= to keep it", UserWarning,
                          stacklevel=2)
        state = self.init(key, jax.device_put(params, self.layout.param_shardings()), model_state)
        return given.continued(state, opt_state, step, self.state_sharding)

    def abstract_state(self) -> TrainState:
        """ShapeDtypeStructs (with shardings) of the train state: for planning and restoring."""
        return abstract_state(self.init, self.state_sharding)

    def abstract_batch(self, batch_shapes: Mapping[str, tuple[tuple[int, ...], Any]]) -> dict[str, jax.ShapeDtypeStruct]:
        return self.layout.abstract_batch(batch_shapes)

    def compile_step(self, state: Any, batch: Any):
        """The compiled step for (abstract or concrete) arguments: memory_analysis, as_text, cost_analysis."""
        return self.step.lower(state, batch).compile()


def _check_arguments(model: Any, tx: Any, layout: Any) -> None:
    """build's three positional arguments, each refused with what to pass instead."""
    check_model_argument(model, "build")
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        kind = type(tx)
        instead = ("pass its optax transformation (optimizer.tx), or the optax chain you built it from"
                   if kind.__name__ == "Optimizer" else "pass an optax.GradientTransformation, e.g. optax.adamw(1e-3)")
        raise TypeError(f"build takes an optax optimizer, got {kind.__module__}.{kind.__qualname__}: {instead}")
    if not isinstance(layout, Layout):
        raise TypeError(f"build takes a Layout as its third argument, got {type(layout).__name__}: "
                        "make one with shardlib.make_layout(model, strategy, mesh)")


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
    bucket_bytes: int | None = reduce_lib.DEFAULT_BUCKET_BYTES,
    gather_bucket_bytes: int | None = 0,
    offload: str | offload_lib.Offload = "none",
    staleness: int = 0,
    weight_gather: str = "none",
    stage_layers: str | tuple[int, ...] | None = None,
    layerwise: bool | None = None,
    block_recompute: str = "weights",
    axis_name: str | None = None,
    communication: options_lib.Communication | None = None,
    compiler_options: Mapping[str, Any] | None = None,
) -> TrainProgram:
    """Compile-ready init, train step and eval step for ``model`` under ``layout``.

    ``grad_accum=K`` splits each device's rows into K microbatches inside one compiled step.
    dp / zero1 accumulate full local gradients and reduce once per step; strategies with
    ``shard_grad_buffer`` (zero2, zero3 and its variants) reduce-scatter every microbatch into a
    buffer that is 1/N of the gradients, trading K reductions for memory, as ZeRO-2 does.

    ``grad_compression`` ("none", "bf16", "int8") compresses the gradient reductions the step
    writes: dp, zero1, zero2, tp, and the data-axis all-reduce of hsdp and fsdp_tp (data > 1; their
    fsdp reduce-scatter is autodiff's transpose of the weight gather and stays uncompressed), and
    under zero3 (and hsdp on data=1) the reduce-scatter in the weight gather's own backward (ZeRO++'s
    qgZ, `shardlib.step.zeropp`; its int8 residual is the whole local gradient). int8 keeps
    error-feedback residuals in the train state, sharded like the local gradients they correct.
    Under ``grad_accum`` with ``shard_grad_buffer`` the sum over the axes the buffer is not sharded
    over (hsdp's ``data``) runs once per step, after the microbatches.

    ``bucket_bytes`` packs the uncompressed gradient reductions the step writes (dp, zero1, zero2,
    hsdp's data axis) into buckets of at most that many bytes, one collective each, as PyTorch
    DDP does (`shardlib.step.buckets`); 0 or None: one collective per tensor. Compressed
    reductions stay per tensor. ``gather_bucket_bytes`` does the same for zero1/zero2's all-gather
    of the updated parameters (`buckets.gather`, as DeepSpeed's ZeRO-1/2 gather). It is off (0) by
    default: XLA writes a per-tensor all-gather straight into the parameter, where a bucket is split
    into the parameters by a copy of all of them (+8% bytes accessed by the small GPT's zero2 step),
    and on GPU XLA's own all-gather combiner merges them (`shardlib.runtime.xla_flags`).

    When the mesh's ``pipe`` axis has S > 1 devices the layer stack is split into S stages
    (`shardlib.step.pipeline`): each device's rows run as ``microbatches`` (default 2S) microbatches
    through the ``schedule`` ("1f1b" or "gpipe"), which replaces ``grad_accum``. ``stage_layers``
    gives the layers each stage computes: None (even), a tuple such as (3, 1), or "auto" (balance
    the stages' compiled costs, embedding and head included: `shardlib.step.stage_balance`).

    ``weight_gather="int8"`` (qwZ) sends ZeRO-3's per-layer weight all-gathers, forward and the
    backward's recompute, as int8 blocks with float32 scales (`shardlib.step.zeropp`); under zero3
    ``grad_compression`` compresses the gradient reduce-scatter in the gather's own backward (qgZ).

    ``layerwise`` (dp, zero1, zero2): reduce each layer's gradients inside the backward pass's
    loop (dp all-reduces, zero1/zero2 reduce-scatter: their loop carries state-shard-sized
    gradients), as plain ``jax.jit`` does, instead of all of them after it
    (`shardlib.step.layerwise`); None: where it applies (an uncompressed, unpipelined, synchronous
    step of a model that calls ``gather_layer``), True: required (a clear error where it cannot),
    False: reduce after the backward pass.

    ``block_recompute``: what the backward pass of a block gathered per call (ZeRO-3 of a model
    that does not gather its own parameters, `shardlib.model.blocks`) recomputes: "weights" (the
    default) gathers its weights again from their shards and keeps its matmuls' outputs, so the
    step's FLOPs stay those of dp; "block" keeps only the block's input and reruns it, about one
    more forward pass for the least memory. `shardlib train` falls back to "block" when "weights"
    does not fit a device.

    ``offload="opt_state"`` keeps the optimizer state in pinned host memory between steps
    (ZeRO-Offload, `shardlib.step.offload`): the step moves it to the device for the update only.

    ``staleness=tau`` reduces and applies the gradient computed at step t at step t + tau, so the
    reduction runs beside that step's compute (`shardlib.step.staleness`); 0: synchronous.

    ``axis_name``: the collective axis name the model's linen or NNX modules were written with for
    ``jax.pmap`` (``nn.BatchNorm(axis_name="batch")``); their collectives run over the step's
    batch axes, so BatchNorm statistics cover the global batch (`shardlib.step.axis_names`).

    ``compiler_options``: XLA options for the train and eval steps' compiles, over the backend
    policy's own (`shardlib.backend.step_compiler_options`: on TPU, the collective options of
    docs/tpu.md) and over ``LIBTPU_INIT_ARGS``.

    ``communication``: ``grad_compression``, ``weight_gather``, ``bucket_bytes``,
    ``gather_bucket_bytes`` and a ``reduce_dtype`` as one `shardlib.step.options.Communication`,
    in place of those keywords (given both, build refuses).

    Which options combine is one table, `shardlib.step.options.REFUSALS`: build checks it before
    anything is traced and raises an `OptionError` naming the option and the fix.
    """
    _check_arguments(model, tx, layout)
    if model.frozen is not None:  # from_nnx(wrt=...): the optimizer sees the trained parameters only,
        trained = jax.tree.map(lambda frozen: not frozen, model.frozen)  # and the frozen ones get no update
        tx = optax.chain(optax.masked(tx, trained), optax.masked(optax.set_to_zero(), model.frozen))
    layout = _with_backend(layout)
    comm, loose = options_lib.merged(communication, grad_compression=grad_compression, weight_gather=weight_gather,
                                     bucket_bytes=bucket_bytes, gather_bucket_bytes=gather_bucket_bytes)
    given_policy = precision_lib.get_precision(precision)
    policy = (given_policy if comm.reduce_dtype is None else
              dataclasses.replace(given_policy, reduce_dtype=comm.reduce_dtype))  # Communication's reduce_dtype
    method = compression_lib.get_compression(comm.grad_compression)
    zeropp.get_weight_gather(comm.weight_gather)  # an unknown name, before the combinations
    reducer = reduce_lib.Reducer.for_layout(layout, method, bucket_bytes=comm.bucket_bytes,
                                            reduce_dtype=policy.reduce_dtype)
    chosen = options_lib.Chosen(model, layout, reducer, given_policy, comm, grad_accum=grad_accum,
                                microbatches=microbatches, staleness=staleness_lib.check_staleness(staleness),
                                stage_layers=stage_layers, layerwise=layerwise, loose=loose)
    microbatches, schedule = grads_lib.check_options(model, layout, grad_accum, microbatches, schedule)
    options_lib.check(chosen)  # every refused combination of options, before anything is traced
    grads_lib.check_params(model, policy)
    stage_layers = grads_lib.check_stage_layers(model, layout, stage_layers)
    rows_split = math.prod(layout.mesh.shape[a] for a in layout.batch_axes)
    blocks_lib.remat_policy(block_recompute)  # an unknown name, before anything is traced
    call = ModelCall.for_layout(model, layout, policy, rows_split, axis_alias=axis_name)
    call = dataclasses.replace(call, block_recompute=block_recompute)
    call = dataclasses.replace(call, gather=_weight_gather(comm.weight_gather, method, reducer, layout, call))
    provider = grads_lib.for_layout(call, reducer, layout, grad_accum=grad_accum, microbatches=microbatches,
                                    schedule=schedule, stage_layers=stage_layers)
    placement = offload_lib.get_offload(offload)
    offload_lib.check_backend(placement, layout.mesh.devices.flat)
    with _optimizer_trees_noted(model):
        sharding = state_sharding(model, tx, layout, policy, reducer, placement)
    update = update_lib.Update(tx, policy, layout.state_shardings(), layout.param_shardings(), lr_schedule,
                               offloaded=opt_state_sharding(model, tx, layout) if placement.opt_state else None,
                               gather_bucket_bytes=buckets_lib.checked_limit("gather_bucket_bytes", comm.gather_bucket_bytes))
    tau = chosen.staleness
    if layerwise is not False and not options_lib.conflicts(chosen, "layerwise"):
        provider = layerwise_lib.attach(provider, layout)
    queued = dataclasses.replace(sharding, pending=staleness_lib.queue_sharding(tau, layout, reducer))
    step_options = backend_lib.step_compiler_options(layout.mesh, reducer.reduce_dtype, compiler_options)
    step = (staleness_lib.train_step if tau else _train_step)(layout, provider, reducer, update, queued, donate,
                                                               step_options)
    init = initializer(model, tx, layout, policy, reducer, sharding)
    eval_step = _eval_step(layout, provider, model, backend_lib.step_compiler_options(layout.mesh, None, compiler_options))
    return TrainProgram(model, tx, layout, staleness_lib.with_queue(init, tau, layout, reducer, queued),
                        _CheckedStep(step, layout, microbatches, queued, donate), eval_step, queued,
                        transient_initializer(model, layout, policy, reducer, sharding))


def _with_backend(layout: Layout) -> Layout:
    """``layout`` with the backend policy of its mesh's devices, resolved once for the step built
    from it (`shardlib.backend.forced` wins): every backend-dependent choice of the step reads it
    from here, not from JAX's default backend, so a TPU topology's program compiled on a CPU
    host takes the TPU policy."""
    backend = backend_lib.policy_for(layout.mesh)
    return layout if backend == layout.backend else dataclasses.replace(layout, backend=backend)


@contextlib.contextmanager
def _optimizer_trees_noted(model: Model) -> Iterator[None]:
    """``tx.init`` over the model's parameters: a mask or label tree built over other containers
    (a ``FrozenDict``, as older HuggingFace-Flax ``model.params`` are, where the adapters' parameters
    are plain dicts) fails in JAX with a pytree error naming neither the optimizer nor the fix."""
    try:
        yield
    except ValueError as err:
        if "pytree structure" in str(err):
            top = type(model.abstract()).__name__
            err.add_note(f"shardlib: build's tx.init over the model's parameters ({top} containers) failed: a tree your "
                         "optimizer holds (optax.masked / add_decayed_weights mask=, multi_transform labels) must have "
                         "the parameters' containers; build it from a function of the parameters "
                         "(mask=lambda params: ..., labels as a function), or with flax.core.unfreeze(tree) "
                         "when it was made from a FrozenDict")
        raise


def _weight_gather(weight_gather: str, method: compression_lib.Compression, reducer: reduce_lib.Reducer,
                   layout: Layout, call: ModelCall):
    """ZeRO++'s gather for ``call`` (None: the plain all-gather): int8 weights (qwZ) and, where the
    Reducer leaves zero3's reduce-scatter to the gather's backward, its compression (qgZ)."""
    backward = method if reducer.compresses_gathers else compression_lib.METHODS["none"]
    return zeropp.step_gather(weight_gather, backward, backend=layout.backend,
                              wire_dtype=call.compute_dtype if call.cast_first else None,
                              reduce_dtype=call.reduce_dtype)


def _mapped_grads(layout: Layout, provider: grads_lib.Provider, reducer: reduce_lib.Reducer):
    """The gradient half as a ``shard_map``: (params, batch, ctx, residuals) -> (loss, aux,
    gradients in the state layout, residuals), loss and aux summed over the batch axes."""
    manual_axes = layout.manual_axes  # batch axes, and 'pipe' when pipelined
    mapped_params = layout.manual(layout.params, manual_axes)
    mapped_state = layout.manual(layout.state, manual_axes)
    vary_axes = reducer.axes + tuple(a for a in manual_axes if a not in layout.batch_axes)

    def body(params, batch, ctx, residuals):
        residuals = reducer.local(residuals)
        params = reducer.carry(reduce_lib.vary(params, mapped_params, vary_axes), residuals)  # qgZ: with residuals
        (loss, aux), grads, residuals, model_state = provider.value_and_grad(params, batch, ctx, residuals)
        residuals = reducer.stacked(residuals)
        loss, aux = jax.lax.psum(loss, reducer.axes), jax.lax.psum(aux, reducer.axes)
        return loss, aux, grads, residuals, average_state(model_state, reducer.axes)

    residual_specs = reducer.residual_specs(manual_axes)

    def grads_fn(params, batch, ctx, residuals):
        batch = batch_lib.in_context_order(layout, batch)
        return jax.shard_map(
            body, mesh=layout.mesh,
            in_specs=(mapped_params, batch_lib.specs(layout, batch), P(), residual_specs),
            out_specs=(P(), P(), mapped_state, residual_specs, P()),
            axis_names=set(manual_axes),
        )(params, batch, ctx, residuals)

    return grads_fn


def _train_step(layout: Layout, provider: grads_lib.Provider, reducer: reduce_lib.Reducer,
                update: update_lib.Update, sharding: TrainState, donate: bool, options: dict[str, str] | None):
    """The jitted ``step(state, batch) -> (state, metrics)``, compiled with XLA ``options``."""
    grads_fn = _mapped_grads(layout, provider, reducer)

    def step_fn(state: TrainState, batch):
        scale = update_lib.loss_scale(state)
        ctx = StepContext(scale=scale, key=step_key(state), model_state=state.model_state, step=state.step)
        loss, aux, grads, residuals, model_state = grads_fn(state.params, batch, ctx, state.grad_residual)
        produced = {"grad_residual": residuals, "model_state": model_state}
        new_state, grad_norm, finite = update(state, grads, loss, scale, produced)
        return new_state, update.metrics(state, loss, aux, grad_norm, finite)

    return jax.jit(step_fn, in_shardings=(sharding, None), out_shardings=(sharding, NamedSharding(layout.mesh, P())),
                   donate_argnums=(0,) if donate else (), compiler_options=options)


def _eval_step(layout: Layout, provider: grads_lib.Provider, model: Model, options: dict[str, str] | None):
    """The jitted ``evaluate(params, batch, model_state=None) -> {"loss", **aux}``; the model runs in
    eval mode (no dropout, BatchNorm's running averages). Each value is every data-parallel device's
    value over its rows, averaged over the devices: the global batch's mean for a mean over the rows
    (or `global_mean`), a device's share for a plain sum over the rows (`global_sum` gives the sum)."""
    axes = reduce_lib.active_axes(layout)

    def eval_fn(params, batch, model_state):
        batch = batch_lib.in_context_order(layout, batch)

        def body(p, b, s):
            loss, aux = provider.loss(p, b, StepContext(model_state=s, train=False))
            return {"loss": jax.lax.psum(loss, axes), **jax.lax.psum(aux, axes)}

        return jax.shard_map(
            body, mesh=layout.mesh, in_specs=(layout.manual(layout.params, layout.manual_axes),
                                              batch_lib.specs(layout, batch), P()),
            out_specs=P(), axis_names=set(layout.manual_axes),
        )(params, batch, model_state)

    replicated = NamedSharding(layout.mesh, P())
    jitted = jax.jit(eval_fn, in_shardings=(layout.param_shardings(), None, replicated), out_shardings=replicated,
                     compiler_options=options)
    abstract_params = functools.cache(model.abstract)  # traced once, on the first evaluation
    abstract_state_of_model = functools.cache(lambda: abstract_model_state(model))

    def evaluate(params, batch, model_state=None):
        given.refuse_train_state(params, model)
        if model.stateful and model_state is None:
            raise ValueError("this model carries mutable state (BatchNorm statistics): evaluate with "
                             "program.evaluate(state.params, batch, state.model_state)")
        batch_lib.check(layout, batch)
        batch_lib.refuse_donated({"params": params, "model_state": model_state}, "evaluate's")
        params = given.in_model_containers(params, abstract_params, "parameters")
        if model_state is not None:
            model_state = given.one_entry(given.pure(model_state), abstract_state_of_model())
            model_state = given.in_model_containers(model_state, abstract_state_of_model, "model_state")
        try:
            return jitted(params, batch_lib.place(layout, batch), model_state)
        except (TypeError, ValueError) as err:
            _note_evaluation_key(err, model)
            raise

    return evaluate


# What JAX, linen's apply and nnx.Rngs say when handed a None key.
_NONE_KEY_ERRORS = ("PRNG key type <class 'NoneType'>", "passed to an apply function should be a ``jax.PRNGKey``",
                    "Invalid rng value: None")


def _note_evaluation_key(err: Exception, model: Model) -> None:
    """A loss that draws from ``call.key`` unconditionally fails in evaluate, where the key is None
    by design (eval mode draws nothing); JAX's error names neither evaluate nor the fix."""
    if model.uses_key and any(marker in str(err) for marker in _NONE_KEY_ERRORS):
        err.add_note("shardlib: program.evaluate runs the model in eval mode, where call.key is None and call.train "
                     "False, so the loss got no key to draw from; draw only in training, e.g. "
                     "rngs={'dropout': call.key} if call.train else None (Flax modules with "
                     "deterministic=not call.train then draw nothing); when evaluation itself must be random (a VAE's "
                     "noise), from_functions(..., eval_key=True) gives call.key in evaluate too, from a fixed key "
                     "per device (from_linen / from_nnx: eval_rng_streams=('noise',))")


def _refuse_state_in_batch(state: Any, batch: Any) -> None:
    """A batch leaf that is one of the state's own arrays (``{**batch, "step": state.step}``) reaches
    the step twice, once donated, and XLA:CPU then ends the process ("Attempt to use a buffer that
    was previously donated"), raising nothing: name the leaf instead."""
    held = {id(x) for x in jax.tree.leaves(state) if isinstance(x, jax.Array)}  # paths only for a hit: every step
    for path, x in jax.tree_util.tree_leaves_with_path(batch):
        if id(x) in held:
            owner = next(rules_lib.path_str(p) for p, y in jax.tree_util.tree_leaves_with_path(state) if y is x)
            raise ValueError(
                f"batch {rules_lib.path_str(path)!r} is the state's own {owner!r}, which "
                "program.step donates: a loss that reads the step takes a step argument (loss_fn(..., step); "
                "from_functions(takes_call=True): call.step); for another value pass a copy (jnp.copy(...)), "
                "or build(..., donate=False)")


class _CheckedStep:
    """The jitted step, with a readable error for a batch the data axes (and microbatches) cannot
    split (`shardlib.step.batch`: any pytree of arrays), and a bounded queue of steps in flight.

    Up to ``steps_in_flight`` dispatched steps are held; dispatching one more first waits for the
    oldest. The bound is the backend policy's (`shardlib.backend.BackendPolicy.steps_in_flight`)
    for the layout's mesh, read once here, when `build` makes the step (so a step built inside
    ``shardlib.backend.forced("tpu")`` takes the accelerator's bound on CPU devices too).

    XLA:CPU: one. Queuing many steps without waiting deadlocks XLA:CPU's collectives on simulated
    devices (seen after ~50 queued dp steps on jaxlib 0.10.2: every device thread waits in a
    rendezvous), so the previous step is waited for before the next is dispatched.
    GPU and TPU: two. The next step is queued while one runs, so the device never idles while the
    host dispatches, and the batch is put on the devices before the wait, so its host-to-device
    copy overlaps the steps still running. The bound keeps the queue (and the batches and states
    it holds alive) short.
    """

    def __init__(self, jitted, layout: Layout, microbatches: int, state_sharding: Any, donate: bool = True,
                 steps_in_flight: int | None = None):
        from shardlib.backend import policy_for

        self._jitted, self._layout, self.microbatches, self._donate = jitted, layout, microbatches, donate
        self._structure = jax.tree.structure(state_sharding)
        self._paths = given.leaf_paths(state_sharding)
        self.steps_in_flight = policy_for(layout.mesh).steps_in_flight if steps_in_flight is None else steps_in_flight
        if self.steps_in_flight < 1:
            raise ValueError(f"steps_in_flight must be at least 1, got {self.steps_in_flight}")
        self._in_flight: list[Any] = []  # the losses of the dispatched steps not yet waited for, oldest first

    def _check_state(self, state) -> None:
        """A state of another program (another optimizer, precision or model) is named by the
        paths that differ, where jit would fail naming only a pytree structure."""
        if jax.tree.structure(state) == self._structure:
            return
        if not isinstance(state, TrainState):
            raise TypeError(f"step takes the TrainState this program's init (or a restore) made, got "
                            f"{type(state).__name__}: state = program.init(key), then state, metrics = program.step(state, batch)")
        held = given.leaf_paths(state)
        differ = [f"{p}: in the state given, not in this program's" for p in sorted(held - self._paths)]
        differ += [f"{p}: in this program's state, not in the one given" for p in sorted(self._paths - held)]
        shown = rules_lib.describe_mismatches(differ) if differ else "the same paths in other containers"
        raise ValueError("the state given was not made by this program (another optimizer, precision, staleness or "
                         f"model) {shown}; make it with this program's "
                         "init or init_from, or restore a checkpoint onto this program's abstract_state()")

    def _check(self, batch):
        batch_lib.check(self._layout, batch, microbatches=self.microbatches)

    def __call__(self, state, batch):
        self._check(batch)
        self._check_state(state)
        batch_lib.refuse_donated(state, "state")
        if self._donate:
            _refuse_state_in_batch(state, batch)
        placed = batch_lib.place(self._layout, batch)  # before the wait: the copy overlaps the steps running
        while len(self._in_flight) >= self.steps_in_flight:
            jax.block_until_ready(self._in_flight.pop(0))
        state, metrics = self._jitted(state, placed)
        self._in_flight.append(metrics["loss"])
        return state, metrics

    def lower(self, state, batch):
        self._check(batch)
        return self._jitted.lower(state, batch_lib.place(self._layout, batch))
