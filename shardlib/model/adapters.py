"""What the train step needs to know about a model: init, loss, and logical axis names.

A `Model` is three pure functions' worth of information over a plain pytree of parameters, so
that Flax NNX modules, Flax linen modules and hand-written pytrees are all trained by the same
step. Adapters: `from_nnx`, `from_linen`, `from_functions`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax

from shardlib.sharding import rules as rules_lib
from shardlib.model.hooks import SPEC_METADATA

Params = Any
Batch = Mapping[str, jax.Array]
LossOut = tuple[jax.Array, dict[str, jax.Array]]


@dataclasses.dataclass(frozen=True)
class Stages:
    """How a pipeline cuts a model whose layers are stacked along a leading axis.

    ``stacked`` names the top-level entry of the parameters that holds the layer stack (leading
    logical axis ``"layers"``); a stage receives the parameters with only its slice of that stack.
    ``embed(p, batch) -> x`` runs on the first stage, ``stage(p, x) -> x`` on every stage (over its
    slice of layers), ``head_loss(p, x, batch) -> (loss, aux)`` on the last. Composed in that
    order they must equal the model's loss. `Model` holds them over parameter pytrees (with a
    trailing ``specs`` argument, as ``Model.loss``); `from_nnx` accepts them over the module.
    """

    stacked: str
    embed: Callable[..., Any]
    stage: Callable[..., Any]
    head_loss: Callable[..., LossOut]


@dataclasses.dataclass(frozen=True)
class Model:
    """A trainable model as data.

    init(key) -> params; loss(params, batch, specs) -> (mean loss over the batch, aux scalars),
    where ``specs`` (a tree of PartitionSpecs over the manual batch axes, or None) lets a model
    gather its own parameters with `shardlib.model.hooks.gather_layer`, one layer at a time.
    ``gathers_params`` says it does: then ``loss`` receives the local shards, and the step checks
    that every sharded parameter went through ``gather_layer``. Otherwise the step gathers the
    whole model before the forward pass (correct for any model, but all weights are alive at once).
    ``apply(params, inputs)`` gives the model's outputs (used for sampling); optional.
    ``pipeline`` (`Stages`) lets the step split the layer stack over the ``pipe`` mesh axis.
    """

    init: Callable[[jax.Array], Params]
    loss: Callable[[Params, Batch, Any], LossOut]
    logical_axes: Params
    gathers_params: bool = False
    apply: Callable[[Params, Any], Any] | None = None
    pipeline: Stages | None = None

    def abstract(self) -> Params:
        """Parameter shapes and dtypes, without allocating anything."""
        return jax.eval_shape(self.init, jax.random.key(0))


def _loss_out(out: Any) -> LossOut:
    loss, aux = out if isinstance(out, tuple) else (out, {})
    return loss, dict(aux)


def from_functions(
    init: Callable[[jax.Array], Params],
    loss_fn: Callable[[Params, Batch], Any],
    *,
    logical_axes: Params | None = None,
    path_rules: rules_lib.PathRules = (),
    apply: Callable[[Params, Any], Any] | None = None,
) -> Model:
    """A plain-pytree model; logical names given as a tree, or from regex rules on paths."""
    if logical_axes is None:
        logical_axes = rules_lib.logical_from_paths(jax.eval_shape(init, jax.random.key(0)), path_rules)
    return Model(init=init, loss=lambda p, b, specs=None: _loss_out(loss_fn(p, b)),
                 logical_axes=logical_axes, apply=apply)


def from_nnx(
    make: Callable[[Any], Any],
    loss_fn: Callable[[Any, Batch], Any],
    *,
    gathers_params: bool = False,
    pipeline: Stages | None = None,
) -> Model:
    """Adapt ``make(rngs) -> nnx.Module`` and ``loss_fn(module, batch)``.

    Only ``nnx.Param`` variables are trained; logical names come from their ``out_sharding``
    metadata (``nnx.with_partitioning``). Set ``gathers_params=True`` when the module calls
    `shardlib.model.hooks.gather_layer` on all its parameters (as `models.gpt` does: per layer inside
    its scan), so ZeRO-3 gathers one layer at a time instead of the whole model. ``pipeline``
    gives the module-level `Stages` (functions of the bound module) for pipeline parallelism.
    """
    from flax import nnx
    from flax.nnx import traversals

    def build(key):
        with nnx.use_eager_sharding(False):
            return make(nnx.Rngs(key))

    abstract_module = nnx.eval_shape(lambda: build(jax.random.key(0)))
    graphdef, abstract_params, rest = nnx.split(abstract_module, nnx.Param, ...)
    if jax.tree.leaves(rest):
        raise ValueError(
            "shardlib trains nnx.Param variables only; this module also holds "
            f"{', '.join(sorted({type(v).__name__ for v in jax.tree.leaves(rest, is_leaf=lambda x: isinstance(x, nnx.Variable))}))} "
            "state: pass rngs at call time instead of storing them, or keep batch statistics outside the module"
        )
    template = dict(nnx.to_flat_state(abstract_params))
    logical = rules_lib.logical_axes_of(nnx.to_pure_dict(abstract_params, extract_fn=lambda v: v))

    def init(key):
        return nnx.to_pure_dict(nnx.state(build(key), nnx.Param))

    def bind(params, specs=None):
        values = traversals.flatten_mapping(params)
        spec_of = traversals.flatten_mapping(specs) if specs is not None else {}
        flat = {}
        for path, variable in template.items():
            bound = variable.replace(values[path])
            if path in spec_of:
                bound.set_metadata(**{SPEC_METADATA: ("/".join(map(str, path)), tuple(spec_of[path]))})
            flat[path] = bound
        return nnx.merge(graphdef, nnx.State(traversals.unflatten_mapping(flat)), rest)

    def loss(params, batch, specs=None):
        return _loss_out(loss_fn(bind(params, specs), batch))

    stages = None
    if pipeline is not None:
        stages = Stages(
            stacked=pipeline.stacked,
            embed=lambda params, batch, specs=None: pipeline.embed(bind(params, specs), batch),
            stage=lambda params, x, specs=None: pipeline.stage(bind(params, specs), x),
            head_loss=lambda params, x, batch, specs=None: _loss_out(pipeline.head_loss(bind(params, specs), x, batch)),
        )
    return Model(init=init, loss=loss, logical_axes=logical, gathers_params=gathers_params,
                 apply=lambda params, inputs: bind(params)(inputs), pipeline=stages)


def from_linen(module: Any, loss_fn: Callable[[Any, Batch], Any], example_input: Any) -> Model:
    """Adapt a linen module whose parameters use ``nn.with_logical_partitioning``.

    ``loss_fn(outputs, batch)`` receives ``module.apply(params, batch["inputs"])``.
    """
    from flax import linen as nn

    def boxed_init(key):
        return module.init(key, example_input)["params"]

    logical = rules_lib.logical_axes_of(jax.eval_shape(boxed_init, jax.random.key(0)))

    def init(key):
        return nn.unbox(boxed_init(key))

    def loss(params, batch, specs=None):
        return _loss_out(loss_fn(module.apply({"params": params}, batch["inputs"]), batch))

    return Model(init=init, loss=loss, logical_axes=logical,
                 apply=lambda params, inputs: module.apply({"params": params}, inputs))
