"""`from_linen`: a Flax linen module as a `Model` (the ``params`` collection trained, every other
collection carried as model state, rng streams drawn from the step's key)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from shardlib.model.adapters import Batch, Model, _loss_out, _with_call
from shardlib.sharding import rules as rules_lib


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
