"""`from_nnx`: a Flax NNX module as a `Model` (parameters trained, BatchNorm statistics carried,
rng streams re-seeded from the step's key)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from shardlib.model.adapters import Batch, Model, Stages, _loss_out, _with_call
from shardlib.model.hooks import SPEC_METADATA
from shardlib.sharding import rules as rules_lib


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
