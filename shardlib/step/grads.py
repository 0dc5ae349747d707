"""Per-device loss and gradients, in interchangeable variants: one pass over all rows (`Plain`),
K microbatches accumulated in a scan (`Accumulated`), or microbatches streamed through the
pipeline's stages (`Pipelined`).

Each runs inside the step's ``shard_map`` and has two methods:

* ``value_and_grad(params, batch, ctx, residuals) -> ((loss, aux), grads, residuals, model_state)``:
  this device's share of the loss and aux metrics, the gradients of ``ctx.scale * loss`` already
  reduced into the optimizer-state layout by its `Reducer`, and this device's model state after
  the pass (BatchNorm statistics; None without);
* ``loss(params, batch, ctx) -> (loss, aux)``: the same loss, forward only (evaluation).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
import jax.numpy as jnp

from shardlib.model import Model
from shardlib.sharding import rules as rules_lib
from shardlib.sharding.layout import Layout
from shardlib.step import layerwise as layerwise_lib
from shardlib.step import pipeline as pipeline_lib
from shardlib.step import stage_balance
from shardlib.step.compute import ModelCall, StepContext
from shardlib.step.precision import Precision
from shardlib.step.reduce import Reducer


def _scaled_value_and_grad(call: ModelCall, params: Any, rows: Any, ctx: StepContext, twins: layerwise_lib.Twins):
    """((loss, aux), d(scale * loss)/d params, model state) of ``rows`` (scale None: the loss's
    own); unreduced, but for ``twins``' parameters, whose gradients come back as state shards."""
    def objective(p, b):
        loss, aux, state = call.loss(twins.join(p, params), b, ctx)
        return (loss if ctx.scale is None else loss * ctx.scale), (loss, aux, state)

    inputs = twins.inputs(params)
    (_, (loss, aux, state)), grads = jax.value_and_grad(objective, has_aux=True, allow_int=True)(inputs, rows)
    return (loss, aux), jax.tree.map(_carried_zero, grads, inputs), state


def _mean(total: jax.Array, k: int) -> jax.Array:
    return total / k if jnp.issubdtype(total.dtype, jnp.inexact) else total  # a carried zero stays one


def _carried_zero(grad: jax.Array, param: jax.Array) -> jax.Array:
    """A frozen integer leaf's (QLoRA's codes: `check_params`) place in the gradient tree: not
    differentiated (``allow_int``'s float0), held as a constant int8 zero of its shape (int8, not
    its own dtype: NF4's uint4 has no sum for the gradient norm), so that the reduction and the
    masked update see a tree like the parameters; XLA folds it away (no collective:
    tests/test_qlora.py)."""
    return jnp.zeros(param.shape, jnp.int8) if grad.dtype == jax.dtypes.float0 else grad


@dataclasses.dataclass(frozen=True)
class Plain:
    """One pass over all of this device's rows; one reduction."""

    call: ModelCall
    reducer: Reducer
    # reduce-scatter inside the backward loop (`shardlib.step.layerwise.attach`); None: after it
    layerwise: layerwise_lib.Layerwise | None = dataclasses.field(default=None, kw_only=True)

    def twins(self, params: Any, batch: Any, ctx: StepContext) -> layerwise_lib.Twins:
        if self.layerwise is None:
            return layerwise_lib.no_twins(self.reducer)
        return self.layerwise.twins(self.call, self.reducer, params, batch, ctx)

    def value_and_grad(self, params: Any, batch: Any, ctx: StepContext, residuals: Any):
        twins = self.twins(params, batch, ctx)
        (loss, aux), grads, state = _scaled_value_and_grad(self.call, params, batch, ctx, twins)
        grads, residuals = twins.reducer(grads, residuals)
        return (loss, aux), grads, residuals, state

    def loss(self, params: Any, batch: Any, ctx: StepContext):
        loss, aux, _ = self.call.loss(params, batch, ctx)
        return loss, aux


@dataclasses.dataclass(frozen=True)
class Accumulated(Plain):
    """This device's rows as ``microbatches`` slices in one scan. With ``reduce_each`` (ZeRO-2/3's
    ``shard_grad_buffer``) every microbatch is reduce-scattered into a buffer 1/N the size of the
    gradients (`Reducer.scatter`, trading K reduce-scatters for memory) and the sum over the axes
    left (hsdp's ``data``: the slow link) runs once, on that buffer (`Reducer.finish`); otherwise
    full gradients add up, reduced once."""

    microbatches: int
    reduce_each: bool

    def _one(self, params: Any, rows: Any, ctx: StepContext, residuals: Any, twins: layerwise_lib.Twins):
        """One microbatch: ((loss, aux, grads), residuals, model state after it)."""
        (loss, aux), grads, state = _scaled_value_and_grad(self.call, params, rows, ctx, twins)
        if self.reduce_each:
            # Per tensor, never in buckets: a bucket's concatenated copy would sit beside the 1/N
            # buffer that shard_grad_buffer exists to keep small (K collectives per tensor here).
            grads, residuals = dataclasses.replace(twins.reducer, bucket_bytes=0).scatter(grads, residuals)
        return (loss, aux, grads), residuals, state

    def value_and_grad(self, params: Any, batch: Any, ctx: StepContext, residuals: Any):
        """Microbatch i draws with ``fold_in(key, i)`` and sees the model state the one before left;
        a scalar leaf of the batch (`shardlib.step.batch`) is the same in every microbatch."""
        k = self.microbatches
        split = lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]) if x.ndim else jnp.broadcast_to(x, (k,))
        micro = jax.tree.map(split, batch)
        context = lambda i, state: dataclasses.replace(ctx.for_microbatch(i), model_state=state, microbatches=k)
        twins = self.twins(params, jax.tree.map(lambda x: x[0], micro), ctx)
        first = self._one(params, jax.tree.map(lambda x: x[0], micro), context(0, ctx.model_state), residuals, twins)

        def add(carry, xs):
            total, residuals, state = carry
            i, rows = xs
            out, residuals, state = self._one(params, rows, context(i, state), residuals, twins)
            return (jax.tree.map(jnp.add, total, out), residuals, state), None

        rest = (jnp.arange(1, k), jax.tree.map(lambda x: x[1:], micro))
        (total, residuals, state), _ = jax.lax.scan(add, first, rest)
        loss, aux, grads = jax.tree.map(lambda x: x / k, total[:2]) + (jax.tree.map(lambda g: _mean(g, k), total[2]),)
        finish = twins.reducer.finish if self.reduce_each else twins.reducer
        grads, residuals = finish(grads, residuals)
        return (loss, aux), grads, residuals, state


@dataclasses.dataclass(frozen=True)
class Pipelined:
    """Microbatches through the stages of the ``pipe`` axis (`shardlib.step.pipeline`); the
    schedule accumulates, so the stack's gradients are this stage's, reduced once."""

    call: ModelCall
    reducer: Reducer
    schedule: pipeline_lib.Schedule
    n_stages: int
    microbatches: int
    branch: bool  # first / last stage alone run the embedding / head (only without collectives in them)
    stage_layers: stage_balance.StageLayers | str | None = None  # checked by check_options

    def _rows(self, batch: Any) -> pipeline_lib.Rows:
        return pipeline_lib.Rows(n_stages=self.n_stages, microbatches=self.microbatches, branch=self.branch,
                                 loss_weight=1.0 / (self.call.rows_split * self.microbatches),
                                 stage_layers=self.split(batch))

    def split(self, batch: Any) -> stage_balance.StageLayers | None:
        """Layers per stage; ``"auto"`` compiles the stage pieces for this device's microbatch
        shape (cached) and balances them."""
        if self.stage_layers != "auto":
            return self.stage_layers
        params = self.call.model.abstract()
        rows = {k: jax.ShapeDtypeStruct((x.shape[0] // self.microbatches, *x.shape[1:]), x.dtype) for k, x in batch.items()}
        pieces = stage_balance.measure_pieces(self.call.model.pipeline, params, rows)
        n_layers = jax.tree.leaves(params[self.call.model.pipeline.stacked])[0].shape[0]
        return pieces.auto(n_layers, self.n_stages, embed_everywhere=not self.branch)

    def value_and_grad(self, params: Any, batch: Any, ctx: StepContext, residuals: Any):
        (loss, aux), grads = self.call.traced(lambda: pipeline_lib.value_and_grad(
            self.call.stages(ctx), params, batch, self._rows(batch), schedule=self.schedule, seed=ctx.scale))
        grads, residuals = self.reducer(grads, residuals)
        return (loss, aux), grads, residuals, None  # check_options refuses stateful models

    def loss(self, params: Any, batch: Any, ctx: StepContext):
        return self.call.traced(lambda: pipeline_lib.loss(self.call.stages(ctx), params, batch, self._rows(batch)))


Provider = Plain | Pipelined  # Accumulated is a Plain


def for_layout(call: ModelCall, reducer: Reducer, layout: Layout, *, grad_accum: int, microbatches: int,
               schedule: pipeline_lib.Schedule, stage_layers: Any = None) -> Provider:
    """The variant ``layout`` and the step's options ask for (checked by `check_options` and
    `shardlib.step.options`)."""
    if layout.pipeline_stages > 1:
        # The embedding / head may sit in a branch only when they hold no collective: no parameter
        # gathered over the batch axes, no tensor parallelism.
        branch = not call.must_gather and layout.mesh.shape.get("tensor", 1) == 1
        if not branch and isinstance(stage_layers, tuple) and len(set(stage_layers)) > 1:
            warnings.warn(
                f"stage_layers={','.join(map(str, stage_layers))} cannot make the slowest stage faster here: with "
                "collectives in the embedding / head / layers (ZeRO-3 gathers or tensor parallelism) every stage "
                "computes the embedding and the head, and computes its padded layer slots and discards them; "
                "use stage_layers=None (or 'auto', which keeps the even split)", UserWarning, stacklevel=3)
        return Pipelined(call, reducer, schedule, layout.pipeline_stages, microbatches, branch, stage_layers)
    if grad_accum == 1:
        return Plain(call, reducer)
    return Accumulated(call, reducer, grad_accum, layout.strategy.shard_grad_buffer)


def refuse_key_and_state(model: Model, step: str, instead: str) -> None:
    """Steps that do not pass keys or model state yet say so, rather than train without them."""
    needs = [what for what, needed in (("a random key (nnx.Rngs / dropout)", model.uses_key),
                                       ("mutable state (BatchNorm statistics)", model.stateful),
                                       ("frozen parameters (from_nnx(wrt=...))", model.frozen is not None)) if needed]
    if needs:
        raise ValueError(f"{step} does not support models that need {' or '.join(needs)} yet; {instead}, "
                         "or build the model without them (linen: from_linen(..., rng_streams=()))")


def check_options(model: Model, layout: Layout, grad_accum: int, microbatches: int | None,
                  schedule: str | pipeline_lib.Schedule) -> tuple[int, pipeline_lib.Schedule | None]:
    """Refuse values and models the variants cannot run, with the fix (the combinations of options:
    `shardlib.step.options`); return (microbatches, schedule)."""
    if grad_accum < 1:
        raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
    n_stages = layout.pipeline_stages
    if n_stages == 1:
        return grad_accum, None
    if model.pipeline is None:
        raise ValueError(
            f"the mesh has pipe={n_stages} but the model does not say how to cut it into stages: "
            "build it with pipeline=shardlib.Stages(...) (models.trainable does), or use pipe=1"
        )
    refuse_key_and_state(model, f"the pipelined step (pipe={n_stages})", "use pipe=1")
    microbatches = 2 * n_stages if microbatches is None else microbatches
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    return microbatches, pipeline_lib.get_schedule(schedule)


def check_params(model: Model, policy: Precision) -> None:
    """Every trained parameter is differentiated, updated and stored in ``policy.param_dtype``:
    refuse its integer and boolean leaves by name (``jax.grad`` would fail naming none; a frozen
    one, QLoRA's codes, is carried as it is), and say which floating leaves the model wrote in
    another dtype (bf16 leaves) become master weights."""
    leaves = [(rules_lib.path_str(path), leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(model.abstract())]
    frozen = [None] * len(leaves) if model.frozen is None else jax.tree.leaves(model.frozen)
    bad = [f"{path} ({leaf.dtype}{list(leaf.shape)})" for (path, leaf), still in zip(leaves, frozen)
           if not jnp.issubdtype(leaf.dtype, jnp.inexact) and not still]
    if bad:
        raise TypeError(
            f"the parameters hold non-float leaves, which the step cannot differentiate or update: {', '.join(bad)}; "
            "keep integer data (step counters, index tables) out of the parameters: close over it in the loss, "
            "pass it in the batch, store it as float, or freeze it (from_nnx(wrt=...))")
    recast = [f"{path} ({leaf.dtype})" for (path, leaf), still in zip(leaves, frozen)
              if leaf.dtype != policy.param_dtype and not still]  # frozen: stored in the compute dtype
    if recast:
        master, compute = jnp.dtype(policy.param_dtype).name, jnp.dtype(policy.compute_dtype).name
        warnings.warn(
            f"precision {policy.name!r} keeps {master} master weights: these parameters are stored and updated in "
            f"{master}, not in the dtype the model wrote, and handed to the model in {compute} (an NNX module casts "
            f"them back to the dtype it declared): {', '.join(recast[:8])}"
            f"{' ...' if len(recast) > 8 else ''}; pass precision='bf16' to compute in bf16, or "
            "precision=shardlib.Precision(name, param_dtype=..., compute_dtype=...) to keep them as written",
            UserWarning, stacklevel=3)


def check_stage_layers(model: Model, layout: Layout, stage_layers: Any) -> stage_balance.StageLayers | str | None:
    """``stage_layers`` (None, "auto" or layers per stage) checked against the model's layer stack."""
    if stage_layers is None or layout.pipeline_stages == 1:  # with pipe=1: refused by options
        return None
    stack = model.abstract()[model.pipeline.stacked]
    return stage_balance.check_stage_layers(stage_layers, jax.tree.leaves(stack)[0].shape[0], layout.pipeline_stages)
