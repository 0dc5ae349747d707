"""What the train step needs to know about a model: init, loss, and logical axis names.

A `Model` is three pure functions' worth of information over a plain pytree of parameters, so
that Flax NNX modules, Flax linen modules and hand-written pytrees are all trained by the same
step. Adapters: `from_nnx`, `from_linen`, `from_functions`.

A model that draws random numbers (dropout) or carries mutable state (BatchNorm statistics)
takes a `Call` as its loss's fourth argument: the step's key for this device, the state, and
whether it trains or evaluates.
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
class Call:
    """What the step hands a model besides parameters, rows and specs.

    ``key``: this step's and this data-parallel device's random key (None in eval and for models
    that draw none); ``state``: the mutable model state (BatchNorm statistics) or None;
    ``train``: False under `TrainProgram.evaluate` (dropout off, running averages used).
    """

    key: jax.Array | None = None
    state: Any = None
    train: bool = True


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

    ``takes_call``: ``loss(params, batch, specs, call)`` receives a `Call` and returns
    ``(loss, aux, new model state)``; the adapters set it only where the call matters (a key,
    state, or linen's train flag), so a model without them keeps the three-argument loss that
    code wrapping ``Model.loss`` with ``dataclasses.replace`` expects. ``uses_key``: the step
    derives a key per step and device (`Call.key`). ``init_state(key)``: the mutable model state
    (kept replicated in the train state, averaged over data-parallel devices after each step).
    """

    init: Callable[[jax.Array], Params]
    loss: Callable[[Params, Batch, Any], LossOut]
    logical_axes: Params
    gathers_params: bool = False
    apply: Callable[[Params, Any], Any] | None = None
    pipeline: Stages | None = None
    takes_call: bool = False
    uses_key: bool = False
    init_state: Callable[[jax.Array], Any] | None = None

    def abstract(self) -> Params:
        """Parameter shapes and dtypes, without allocating anything."""
        return jax.eval_shape(self.init, jax.random.key(0))

    @property
    def stateful(self) -> bool:
        return self.init_state is not None

    def run(self, params: Params, batch: Batch, specs: Any, call: Call) -> tuple[jax.Array, dict[str, jax.Array], Any]:
        """``(loss, aux, new model state)`` whichever protocol the loss follows."""
        if self.takes_call:
            return self.loss(params, batch, specs, call)
        loss, aux = self.loss(params, batch, specs)
        return loss, aux, call.state


def _loss_out(out: Any) -> LossOut:
    loss, aux = out if isinstance(out, tuple) else (out, {})
    return loss, dict(aux)


def _with_call(run: Callable[[Params, Batch, Any, Call], tuple], needs_call: bool) -> Callable:
    """A loss for `Model.takes_call`: called with a `Call` it returns (loss, aux, state); called
    without one (three arguments, as direct callers such as `shardlib.step.pmap` do) it returns
    (loss, aux) in training mode without a key, unless ``needs_call`` (a key or state), then it
    says what to pass."""
    def loss(params, batch, specs=None, call=None):
        if call is not None:
            return run(params, batch, specs, call)
        if needs_call:
            raise ValueError(
                "this model draws random numbers or carries mutable state (BatchNorm statistics): call "
                "model.loss(params, batch, specs, shardlib.model.Call(key=..., state=..., train=...)), "
                "or use model.run; it returns (loss, aux, new_state)")
        loss_value, aux, _ = run(params, batch, specs, Call())
        return loss_value, aux

    return loss


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

    ``nnx.Param`` variables are trained; logical names come from their ``out_sharding``
    metadata (``nnx.with_partitioning``). ``nnx.BatchStat`` variables (BatchNorm statistics) are
    the model state: kept in the train state, updated by each training call, averaged over the
    data-parallel devices. ``nnx.Rngs`` streams held by the module (``nnx.Dropout(rngs=...)``)
    are not trained: each call re-seeds them from the step's key. Evaluation runs the module
    after ``module.eval()`` (dropout off, BatchNorm on running averages).

    Set ``gathers_params=True`` when the module calls `shardlib.model.hooks.gather_layer` on all
    its parameters (as `models.gpt` does: per layer inside its scan), so ZeRO-3 gathers one layer
    at a time instead of the whole model. ``pipeline`` gives the module-level `Stages`
    (functions of the bound module) for pipeline parallelism.
    """
    from flax import nnx

    def build(key):
        with nnx.use_eager_sharding(False):
            return make(nnx.Rngs(key))

    parts = _NnxParts.of(nnx.eval_shape(lambda: build(jax.random.key(0))))
    logical = rules_lib.logical_axes_of(nnx.to_pure_dict(parts.params, extract_fn=lambda v: v))
    stateful = bool(jax.tree.leaves(parts.stats))

    def init(key):
        return nnx.to_pure_dict(nnx.state(build(key), nnx.Param))

    def init_state(key):
        return nnx.to_pure_dict(nnx.state(build(key), nnx.BatchStat))

    def run(params, batch, specs, call):
        module = parts.bind(params, specs, call.state, call.key)
        if not call.train:
            module.eval()
        loss, aux = _loss_out(loss_fn(module, batch))
        return loss, aux, nnx.to_pure_dict(nnx.state(module, nnx.BatchStat)) if stateful else None

    stages = None
    if pipeline is not None:
        stages = Stages(
            stacked=pipeline.stacked,
            embed=lambda params, batch, specs=None: pipeline.embed(parts.bind(params, specs), batch),
            stage=lambda params, x, specs=None: pipeline.stage(parts.bind(params, specs), x),
            head_loss=lambda params, x, batch, specs=None: _loss_out(pipeline.head_loss(parts.bind(params, specs), x, batch)),
        )
    uses_key = bool(jax.tree.leaves(parts.rngs))
    return Model(init=init, loss=_with_call(run, uses_key or stateful), logical_axes=logical,
                 gathers_params=gathers_params, apply=lambda params, inputs: parts.bind(params)(inputs),
                 pipeline=stages, takes_call=uses_key or stateful, uses_key=uses_key,
                 init_state=init_state if stateful else None)


@dataclasses.dataclass(frozen=True)
class _NnxParts:
    """An abstract NNX module split into what shardlib treats differently: trained parameters,
    BatchNorm statistics, rng streams (re-seeded per call) and the rest (must be empty)."""

    graphdef: Any
    params: Any
    stats: Any
    rngs: Any

    @classmethod
    def of(cls, abstract_module: Any) -> _NnxParts:
        from flax import nnx

        graphdef, params, stats, rngs, rest = nnx.split(abstract_module, nnx.Param, nnx.BatchStat, nnx.RngState, ...)
        if jax.tree.leaves(rest):
            kinds = {type(v).__name__ for v in jax.tree.leaves(rest, is_leaf=lambda x: isinstance(x, nnx.Variable))}
            raise ValueError(
                f"shardlib trains nnx.Param, carries nnx.BatchStat and re-seeds nnx.RngState; this module also "
                f"holds {', '.join(sorted(kinds))} variables, which it would neither train nor carry: make them "
                "nnx.Param, nnx.BatchStat or constants (plain arrays) of the module")
        return cls(graphdef, params, stats, rngs)

    def bind(self, params: Any, specs: Any = None, stats: Any = None, key: jax.Array | None = None) -> Any:
        """The module over these values; sharded parameters carry their spec for `gather_layer`."""
        from flax import nnx

        if stats is None and jax.tree.leaves(self.stats):
            raise ValueError("this NNX module holds nnx.BatchStat variables: pass its model state "
                             "(TrainState.model_state) to run it")
        states = [_bound_state(self.params, params, specs), self.rng_state(key)]
        if stats is not None:
            states.append(_bound_state(self.stats, stats))
        return nnx.merge(self.graphdef, *states)

    def rng_state(self, key: jax.Array | None) -> Any:
        """Every rng stream of the module seeded from ``key`` (its own fold per stream), counts at 0:
        the module's rngs are a function of the step's key, never a trained or carried value."""
        from flax import nnx
        from flax.nnx import traversals

        key = jax.random.key(0) if key is None else key  # eval / no key: no stream is drawn from
        flat = {}
        for i, (path, variable) in enumerate(nnx.to_flat_state(self.rngs)):
            shape = variable.get_value()
            value = (jax.random.fold_in(key, i) if isinstance(variable, nnx.RngKey)
                     else jax.numpy.zeros(shape.shape, shape.dtype))
            flat[path] = variable.replace(value)
        return nnx.State(traversals.unflatten_mapping(flat))


def _bound_state(template: Any, values: Any, specs: Any = None) -> Any:
    """The NNX state ``template`` (abstract variables) holding ``values`` (a pure dict), each
    variable tagged with its storage spec from ``specs`` when given."""
    from flax import nnx
    from flax.nnx import traversals

    values = traversals.flatten_mapping(values)
    spec_of = traversals.flatten_mapping(specs) if specs is not None else {}
    flat = {}
    for path, variable in nnx.to_flat_state(template):
        bound = variable.replace(values[path])
        if path in spec_of:
            bound.set_metadata(**{SPEC_METADATA: ("/".join(map(str, path)), tuple(spec_of[path]))})
        flat[path] = bound
    return nnx.State(traversals.unflatten_mapping(flat))


def _single_input(batch: Batch, train: bool) -> tuple[tuple[Any, ...], dict[str, Any]]:
    del train  # the one-input call of earlier versions takes no flag
    return (batch["inputs"],), {}


def from_linen(
    module: Any,
    loss_fn: Callable[[Any, Batch], Any],
    example: Any,
    *,
    inputs: Callable[[Batch, bool], tuple[tuple[Any, ...], dict[str, Any]]] | None = None,
    rng_streams: tuple[str, ...] = ("dropout",),
) -> Model:
    """Adapt a linen module whose parameters use ``nn.with_logical_partitioning`` (or none).

    ``inputs(batch, train) -> (args, kwargs)`` maps a batch to the module's call, e.g.
    ``lambda b, train: ((b["tokens"], b["positions"]), {"train": train})``; ``example`` is then
    an example batch. Without ``inputs``, ``example`` is an example of ``batch["inputs"]``, the
    module's single positional argument. ``loss_fn(outputs, batch)`` gives the loss.

    Training calls pass ``rngs`` for each of ``rng_streams`` (from the step's key; ``()``: the
    model draws nothing) and update every variable collection besides ``params`` (linen
    ``batch_stats``), which the train state carries; evaluation calls ``inputs(batch, False)``,
    with no rngs and the collections read-only. The module is initialised with ``train=False``.
    """
    from flax import linen as nn
    from flax.core import unfreeze

    if inputs is None:
        inputs, example = _single_input, {"inputs": example}

    def variables(key):
        args, kwargs = inputs(example, False)
        rngs = {"params": key, **_stream_keys(jax.random.fold_in(key, 1), rng_streams)}
        return unfreeze(module.init(rngs, *args, **kwargs))

    boxed = jax.eval_shape(variables, jax.random.key(0))
    logical = rules_lib.logical_axes_of(boxed["params"])
    collections = tuple(c for c in boxed if c != "params")

    def init(key):
        return nn.unbox(variables(key)["params"])

    def init_state(key):
        return {c: v for c, v in nn.unbox(variables(key)).items() if c in collections}

    def run(params, batch, specs, call):
        args, kwargs = inputs(batch, call.train)
        rngs = _stream_keys(call.key, rng_streams) if call.train and call.key is not None else None
        state = dict(call.state or {})
        if call.train and collections:
            out, state = module.apply({"params": params, **state}, *args, rngs=rngs, mutable=list(collections), **kwargs)
            state = unfreeze(state)
        else:
            out = module.apply({"params": params, **state}, *args, rngs=rngs, **kwargs)
        loss, aux = _loss_out(loss_fn(out, batch))
        return loss, aux, state if collections else None

    def apply(params, batch_inputs):
        return module.apply({"params": params}, batch_inputs)

    # A linen call without rngs in training mode fails in flax itself if the module draws any.
    return Model(init=init, loss=_with_call(run, bool(collections)), logical_axes=logical,
                 apply=apply, takes_call=True, uses_key=bool(rng_streams),
                 init_state=init_state if collections else None)


def _stream_keys(key: jax.Array, streams: tuple[str, ...]) -> dict[str, jax.Array]:
    return {name: jax.random.fold_in(key, i) for i, name in enumerate(streams)}
