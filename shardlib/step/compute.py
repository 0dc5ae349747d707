"""How a step calls the model on one device: the compute view of the parameters, and the context
that model code sees while it is traced (`shardlib.model.hooks.ComputeContext`).

Every call into the model (the loss, or a pipeline's three stage functions) goes through
`ModelCall`, and receives a `StepContext`: what the step hands the model besides parameters and
rows. Per-step inputs of the loss are new fields there, not new branches in the step.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from shardlib.model import Model, Stages, hooks
from shardlib.sharding import rules as rules_lib
from shardlib.sharding.layout import Layout, restrict, spec_axes
from shardlib.step import precision as precision_lib


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepContext:
    """What one step gives the model besides parameters and rows; traced into the shard_map as a
    replicated argument.

    The seam for per-step inputs of the loss (a dropout key derived from the run's seed and the
    step, mutable model state such as BatchNorm statistics): each is a field here, read by
    `ModelCall`, so the gradient providers and the step's wiring pass it through unchanged.
    """

    scale: Any = None  # the loss scale the gradients are taken of (fp16's, else 1); None: unscaled


def activation_spec(layout: Layout) -> Callable[[Any, tuple[int, ...]], P]:
    """Activation constraints over the axes left to GSPMD (the batch axes are manual in the step)."""
    rules = layout.strategy.activation_rules
    auto = tuple(a for a in layout.mesh.axis_names if a not in layout.batch_axes)

    @functools.lru_cache(maxsize=None)
    def resolve(logical: tuple, shape: tuple) -> P:
        spec, _ = rules_lib.spec_for(logical, shape, rules, layout.mesh)
        return restrict(spec, auto)

    return lambda logical, shape: resolve(tuple(logical), tuple(shape))


def sharded_paths(layout: Layout) -> tuple[str, ...]:
    """Parameters whose storage is split over a batch axis: the ones ZeRO-3 must gather."""
    return tuple(l.path for l in jax.tree.leaves(layout.params, is_leaf=rules_lib.is_layout)
                 if spec_axes(restrict(l.spec, layout.batch_axes)))


@dataclasses.dataclass(frozen=True)
class ModelCall:
    """The model as one device computes it: parameters cast to the compute dtype and gathered
    (up front, or by the model's own ``gather_layer`` calls), traced in a compute context."""

    model: Model
    specs: Any  # storage specs over the manual batch axes: what the gathers read
    must_gather: tuple[str, ...]
    activation_spec: Callable[[Any, tuple[int, ...]], P]
    compute_dtype: Any
    cast_first: bool  # cast the shards before the gather (half the bytes on GPU / TPU)
    rows_split: int  # devices the rows are split over: the loss is a mean over all of them

    @classmethod
    def for_layout(cls, model: Model, layout: Layout, policy: precision_lib.Precision,
                   rows_split: int) -> ModelCall:
        cast_first = policy.casts_before_gather(layout.mesh.devices.flat[0].platform)
        return cls(model, layout.manual(layout.params), sharded_paths(layout), activation_spec(layout),
                   policy.compute_dtype, cast_first, rows_split)

    def _compute(self, tree: Any) -> Any:
        return precision_lib.cast_floating(tree, self.compute_dtype)

    def _model_specs(self) -> Any:
        return self.specs if self.model.gathers_params else None

    def view(self, params: Any) -> Any:
        """Parameters as the model computes with them: in the compute dtype, and fully gathered
        up front for a model that does not gather its own (sharded weights of one that does are
        cast by gather_layer, after their gather, unless the cast comes first)."""
        if self.cast_first:
            params = self._compute(params)
        if not self.model.gathers_params:
            params = jax.tree.map(hooks.all_gather_spec, params, self.specs)
            return params if self.cast_first else self._compute(params)
        unsharded = lambda p, spec: p if spec_axes(spec) else self._compute(p)
        return params if self.cast_first else jax.tree.map(unsharded, params, self.specs)

    def traced(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` in a compute context; name any sharded parameter the model never gathered."""
        ctx = hooks.ComputeContext(self.activation_spec, cast_to=None if self.cast_first else self.compute_dtype)
        with hooks.compute_context(ctx):
            try:
                out = fn()
            except Exception as err:  # a shape error from an ungathered shard: say which parameter
                self._check_gathered(ctx, err)
                raise
        self._check_gathered(ctx)
        return out

    def _check_gathered(self, ctx: hooks.ComputeContext, err: Exception | None = None) -> None:
        missed = [p for p in self.must_gather if p not in ctx.gathered] if self.model.gathers_params else []
        if missed:
            raise ValueError(
                f"the model declares gathers_params=True but never passed {', '.join(missed)} through "
                "shardlib.model.hooks.gather_layer, so it computed with parameter shards; gather them, "
                "or build the model with gathers_params=False"
            ) from err

    def loss(self, params: Any, rows: Any, ctx: StepContext) -> tuple[jax.Array, dict[str, jax.Array]]:
        """This device's share of the mean loss over all rows (and of the aux metrics)."""
        del ctx  # the seam for per-step model inputs; the model reads none yet
        loss, aux = self.traced(lambda: self.model.loss(self.view(params), rows, self._model_specs()))
        return loss / self.rows_split, jax.tree.map(lambda a: a / self.rows_split, aux)

    def stages(self, ctx: StepContext) -> Stages:
        """The model's pipeline stages over the parameters as stored (call them inside `traced`)."""
        del ctx  # as in `loss`
        pipe, specs = self.model.pipeline, self._model_specs()
        return Stages(
            stacked=pipe.stacked,
            embed=lambda p, b: pipe.embed(self.view(p), b, specs),
            stage=lambda p, x: pipe.stage(self.view(p), x, specs),
            head_loss=lambda p, x, b: pipe.head_loss(self.view(p), x, b, specs),
        )
