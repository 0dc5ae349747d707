"""What the train step needs to know about a model: init, loss, and logical axis names.

A `Model` is three pure functions' worth of information over a plain pytree of parameters, so
that Flax NNX modules, Flax linen modules and hand-written pytrees are all trained by the same
step. Adapters: `from_functions` here, `from_nnx` (nnx_adapter.py), `from_linen`
(linen_adapter.py).

A model that draws random numbers (dropout) or carries mutable state (BatchNorm statistics)
takes a `Call` as its loss's fourth argument: the step's key for this device, the state, and
whether it trains or evaluates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardlib.model import hooks
from shardlib.sharding import rules as rules_lib

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
    ``train``: False under `TrainProgram.evaluate` (dropout off, running averages used);
    ``step``: the train state's step (an int32 scalar, the updates applied so far), for a loss
    whose weights follow a schedule; None where no train state is at hand (evaluate, pmap_step).
    """

    key: jax.Array | None = None
    state: Any = None
    train: bool = True
    step: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class Model:
    """A trainable model as data.

    init(key) -> params; loss(params, batch, specs) -> (mean loss over the batch, aux scalars),
    where ``specs`` (a tree of PartitionSpecs over the manual batch axes, or None) lets a model
    gather its own parameters with `shardlib.model.hooks.gather_layer`, one layer at a time.
    ``gathers_params`` says it does: then ``loss`` receives the local shards, and the step checks
    that every sharded parameter went through ``gather_layer``. Otherwise the step gathers the
    whole model before the forward pass (correct for any model, but all weights are alive at once).
    ``apply(params, inputs)`` gives the model's outputs (used for sampling); optional: None, or
    `NO_APPLY` for a `from_functions` model given none (falsy, and calling it says what to pass).
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
    # Every parameter read goes through the gather (linen's unbox, `from_linen`), so one the loss
    # never read (an eval-only branch, or one after the line that raised) was never computed with:
    # the step's ``gather_layer`` check has nothing to refuse.
    gathers_on_read: bool = False
    # The submodules the adapter gathers one at a time, each when its call runs (`shardlib.model.blocks`):
    # ZeRO-3 then holds one block's weights at a time in a model written without ``gather_layer``.
    gathered_blocks: tuple[str, ...] = ()
    # A tree like the parameters, True where one is frozen (``from_nnx(wrt=...)``): no gradient
    # flows into it and `build` masks the optimizer to the others; None: every parameter trains.
    frozen: Params | None = None

    def abstract(self) -> Params:
        """Parameter shapes and dtypes, without allocating anything."""
        return jax.eval_shape(self.init, jax.random.key(0))

    @property
    def stateful(self) -> bool:
        return self.init_state is not None

    def run(self, params: Params, batch: Batch, specs: Any, call: Call) -> tuple[jax.Array, dict[str, jax.Array], Any]:
        """``(loss, aux, new model state)`` whichever protocol the loss follows."""
        try:
            if self.takes_call:
                return self.loss(params, batch, specs, call)
            loss, aux = self.loss(params, batch, specs)
            return loss, aux, call.state
        except _USER_ERRORS as error:
            _note_batch(error, batch)
            raise


class _NoApply:
    """`Model.apply` of a `from_functions` model built without ``apply=``: ``model.apply(...)``
    would otherwise fail with "'NoneType' object is not callable". Falsy, so ``if model.apply:``
    still reads "has no apply function"."""

    def __bool__(self) -> bool:
        return False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("model.apply: this model was built by from_functions(init, loss_fn) without an apply "
                        "function, so shardlib cannot compute its outputs; pass one, from_functions(init, loss_fn, "
                        "apply=fn) with fn(params, *inputs) -> outputs (e.g. lambda p, x: module.apply({'params': p}, "
                        "x)), or call your own function on state.params")

    def __repr__(self) -> str:
        return "NO_APPLY"


NO_APPLY = _NoApply()


# What a loss raises when a batch leaf is not what the model reads (a shape, a dtype, a key).
_USER_ERRORS = (TypeError, ValueError, KeyError, IndexError, AttributeError)


def _note_batch(error: Exception, batch: Any) -> None:
    """Inside the step the loss sees one device's rows, so an error's shapes (``(2, 5)``) match no
    array the user built: list the batch's leaves as the loss received them, to tell which it was."""
    if any(note.startswith(_BATCH_NOTE) for note in getattr(error, "__notes__", ())):
        return  # a loss that runs another model's loss
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    shown = rules_lib.listed([f"{rules_lib.path_str(path)!r} {_dtype_shape(x)}" for path, x in leaves], _NOTE_LEAVES)
    error.add_note(f"{_BATCH_NOTE} {shown} (inside a step: this device's rows of "
                   "the global batch, split over the data-parallel devices); check the leaves the failing line reads "
                   "(their trailing shapes and dtypes, and the batch's keys)")


_BATCH_NOTE, _NOTE_LEAVES = "shardlib: raised by the loss on the batch", 20


@contextlib.contextmanager
def noting_no_step(step: Any) -> Iterator[None]:
    """A loss that reads its ``step`` fails in evaluate, which has no train state and passes None,
    with Python's "unsupported operand type(s) ... 'NoneType'", which names neither."""
    try:
        yield
    except TypeError as err:
        if step is None and "NoneType" in str(err):
            err.add_note("shardlib: program.evaluate passes the loss step=None (evaluation has no train state); "
                         "use the step only when it is given, e.g. w = schedule(step) if step is not None else 1.0")
        raise


def _dtype_shape(x: Any) -> str:
    """``int32[2,5]``, as JAX writes avals; a python value by its type."""
    if not hasattr(x, "shape"):
        return type(x).__name__
    return f"{np.dtype(x.dtype).name}[{','.join(map(str, x.shape))}]"


def loss_out(out: Any) -> LossOut:
    """``(loss, metrics)`` from what ``loss_fn`` returned: aux's scalar entries are metrics
    (averaged over the batch like the loss); the rest is dropped, and the warning says what."""
    loss = out[0] if isinstance(out, tuple) else out
    if isinstance(loss, (int, float, np.generic)):  # float(...), .item(), np.mean: cut off from the parameters
        raise TypeError(f"the loss function returned a {type(loss).__name__} ({loss!r}), not a JAX array computed "
                        "from the parameters, so its gradient is zero and nothing would train: return the jnp "
                        "expression itself (no float(...), .item() or NumPy on traced values)")
    if jnp.ndim(loss) != 0:  # per-row losses: JAX's own error would name only this device's share of rows
        raise ValueError(f"the loss function returned a loss of shape {jnp.shape(loss)} (this device's rows) where "
                         "a scalar is differentiated: reduce it, e.g. .mean(); the step averages the devices' losses")
    if not isinstance(out, tuple):
        return out, {}
    aux = out[1] if len(out) == 2 else out[1:]
    if not isinstance(aux, dict):
        _warn_dropped(f"an array aux of shape {jnp.shape(aux)}" if hasattr(aux, "shape") else f"aux of type {type(aux).__name__}")
        return loss, {}
    dropped = [k for k, v in aux.items() if not _is_scalar(v)]
    if dropped:
        _warn_dropped(f"non-scalar aux entries {', '.join(map(repr, dropped))}")
    return loss, {k: v for k, v in aux.items() if k not in dropped}


def _is_scalar(value: Any) -> bool:
    """An array or number of shape ``()``; a dict or list (``{"batch_stats": ...}``) is not one,
    although ``jnp.ndim`` says 0 for a dict (and warns that it will fail)."""
    return isinstance(value, (jax.Array, np.ndarray, np.generic, int, float, complex)) and jnp.ndim(value) == 0


def _warn_dropped(what: str) -> None:
    warnings.warn(
        f"the loss function returned {what}; shardlib reports scalar metrics only (averaged over "
        "the global batch), so it drops them. Return (loss, {'accuracy': ...}) with scalars to see them in "
        "the step's metrics, or compute per-example outputs with model.apply / the module outside the step",
        UserWarning, stacklevel=2)


def with_call(run: Callable[[Params, Batch, Any, Call], tuple], needs_call: bool) -> Callable:
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
    takes_call: bool = False,
    eval_key: bool = False,
) -> Model:
    """A plain-pytree model; logical names given as a tree, or from regex rules on paths.

    ``None`` and ``{}`` entries of the parameters are kept (they hold nothing to train); a name
    no rule table maps (a typo such as ``"embd"``) is warned about by `make_layout`, which knows
    the strategy's rules (your own ``with_logical_rules`` table included).

    ``takes_call=True``: ``loss_fn(params, batch, call)`` receives a `Call`, whose ``key`` is this
    step's and this device's key (None under evaluate) and ``train`` False under evaluate: what a
    ``TrainState`` loop hands ``module.apply`` as ``rngs={"dropout": key}`` and ``train=``.
    ``eval_key=True`` gives a loss that is random in evaluation too (a VAE's reparameterisation, a
    diffusion loss's noise) ``call.key`` under evaluate as well: `hooks.eval_key`, fixed (evaluation
    repeats) with the device's index folded in, as ``from_linen(eval_rng_streams=...)`` draws.

    ``apply(params, *inputs)`` computes the outputs ``model.apply`` returns; without it
    ``model.apply`` is `NO_APPLY`, which says so when called.
    """
    if eval_key and not takes_call:
        raise ValueError("from_functions(eval_key=True) gives the loss call.key in evaluate: it needs "
                         "takes_call=True, loss_fn(params, batch, call)")
    abstract = jax.eval_shape(init, jax.random.key(0))
    if logical_axes is None:
        logical_axes = rules_lib.logical_from_paths(abstract, path_rules)
    logical_axes = _empty_nodes_named(abstract, logical_axes)
    _warn_flax_collections(abstract)
    if takes_call:
        keyed = with_eval_key if eval_key else (lambda call: call)
        run = lambda p, b, specs, call: (*loss_out(loss_fn(p, b, keyed(call))), call.state)
        return Model(init=init, loss=with_call(run, needs_call=True), logical_axes=logical_axes,
                     apply=NO_APPLY if apply is None else apply, takes_call=True, uses_key=True)
    return Model(init=init, loss=lambda p, b, specs=None: loss_out(loss_fn(p, b)),
                 logical_axes=logical_axes, apply=NO_APPLY if apply is None else apply)


def with_eval_key(call: Call) -> Call:
    """``call`` with evaluation's fixed per-device key where evaluate passes none."""
    if call.key is not None or call.train:
        return call
    return dataclasses.replace(call, key=hooks.eval_key())


# Top-level keys of ``module.init``'s variables that hold Flax collections, not parameters.
_FLAX_COLLECTIONS = ("batch_stats", "cache", "intermediates")


def _warn_flax_collections(abstract: Params) -> None:
    """The TrainState+BatchNorm habit (``init`` returns all of ``module.init``'s variables) would
    train the statistics as weights and never apply the loss's updates: say so, and what to use."""
    found = [c for c in _FLAX_COLLECTIONS if isinstance(abstract, Mapping) and c in abstract]
    if not found:
        return
    names = ", ".join(map(repr, found))
    warnings.warn(
        f"from_functions: init returned the Flax collection(s) {names} beside the parameters (module.init's "
        f"whole variables dict): the optimizer would train them as if they were parameters (gradients, weight "
        f"decay), and the updates your loss returns for them (module.apply(..., mutable=[...])) are not applied. "
        f"Use shardlib.from_linen(module, loss, example, inputs=...), which trains 'params' and keeps every "
        f"other collection as model state, or return only module.init(...)['params'] from init",
        UserWarning, stacklevel=3)


def _empty_nodes_named(abstract: Params, logical: Params) -> Params:
    """A ``None`` in the parameters is an empty node; its names become ``{}`` (no leaves), where a
    ``None`` would read as one unnamed tensor and miscount the tree."""
    return jax.tree.map(lambda p, names: {} if p is None else names, abstract, logical, is_leaf=lambda x: x is None)
