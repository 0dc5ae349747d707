"""`from_linen` (over 600 lines: the adapter and the linen misuses it refuses, which follow linen's API).

A Flax linen module as a `Model` (the ``params`` collection trained, every other collection
carried as model state, rng streams drawn from the step's key).

Not every linen collection is state the step may carry: a ``cache`` exists in decode mode
only and is sized by the batch, and a collection written with ``self.sow`` holds a tuple that
grows with every call (an output, not state). Those are refused at adaptation time, naming the
collection and what to do, instead of failing later inside the step with a pytree error.

ZeRO-3 without touching the module: linen reads every parameter through ``self.param``, which
unboxes ``AxisMetadata``; the step's shards arrive in a box whose unbox is the gather
(`_gathered_on_read`), so each layer's weights are whole only while it runs, inside
``nn.scan`` and ``nn.remat`` as well.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import re
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import jax

from shardlib.model import blocks as blocks_lib
from shardlib.model import hooks
from shardlib.model.adapters import Batch, Model, loss_out, with_call, noting_no_step
from shardlib.sharding import rules as rules_lib

Inputs = Callable[[Batch, bool], tuple[tuple[Any, ...], dict[str, Any]]]

# Collections that Flax convention reserves for something other than training state, and why.
_NOT_STATE = {
    "cache": "the decoding cache linen attention creates in decode mode (decode=True); it is sized by "
             "the batch and is not trained: build the module for training with decode=False "
             "(decode with model.apply on a decode=True copy of the module)",
}


def _single_input(batch: Batch, train: bool) -> tuple[tuple[Any, ...], dict[str, Any]]:
    del train  # the one-input call of earlier versions takes no flag
    if not isinstance(batch, Mapping) or "inputs" not in batch:
        raise ValueError(
            f"from_linen without inputs= calls the module with batch['inputs'], and this batch is a "
            f"{type(batch).__name__} without it: pass inputs=, e.g. for a batch (x, y): "
            "from_linen(module, loss_fn, example_batch, inputs=lambda batch, train: ((batch[0],), {}))")
    return (batch["inputs"],), {}


# Keywords by which linen modules switch dropout and BatchNorm between training and evaluation.
_MODE_FLAGS = ("train", "training", "is_training", "deterministic", "use_running_average")


def _mode_flag(module: Any) -> inspect.Parameter | None:
    """The first argument of the module's ``__call__`` that switches it between training and evaluation."""
    try:
        parameters = inspect.signature(module.__call__).parameters.values()
    except (TypeError, ValueError):  # a callable inspect cannot read: nothing to say
        return None
    return next((p for p in parameters if p.name in _MODE_FLAGS), None)


def _flag_value(flag: inspect.Parameter) -> str:
    """What ``inputs`` should pass for ``flag``, written in terms of its ``train`` argument."""
    return "not train" if flag.name in ("deterministic", "use_running_average") else "train"


def _check_mode_flags(module: Any) -> None:
    """Without ``inputs=`` the module is called as ``module(batch["inputs"])``: a train / deterministic
    flag is never passed, so a required one fails at init and a defaulted one (big_vision's
    ``train=False``) stays at its default when training too, dropout off, with no error."""
    flag = _mode_flag(module)
    if flag is None:
        return
    recipe = (f"pass inputs=lambda batch, train: ((batch['inputs'],), {{{flag.name!r}: {_flag_value(flag)}}}), "
              "which training calls with train=True and evaluation with train=False")
    if flag.default is inspect.Parameter.empty:
        raise ValueError(f"from_linen without inputs= calls module(batch['inputs']), which does not pass the "
                         f"module's required {flag.name!r} argument: {recipe}")
    warnings.warn(f"from_linen without inputs= calls module(batch['inputs']), so {type(module).__name__}'s "
                  f"{flag.name!r} keeps its default ({flag.default!r}) in training as in evaluation: {recipe}",
                  UserWarning, stacklevel=3)


def _check_flag_passed(module: Any, args: tuple, kwargs: dict) -> None:
    """With ``inputs=``, a defaulted train / deterministic flag that the training call
    ``inputs(batch, True)`` leaves out keeps its default in training (a UNet's or scenic model's
    ``train=False``: dropout never on, BatchNorm never updated), silently: warned, with the fix."""
    flag = _mode_flag(module)
    if flag is None or flag.default is inspect.Parameter.empty:
        return
    try:
        bound = inspect.signature(module.__call__).bind(*args, **kwargs)
    except TypeError:  # `_check_call_arguments` says what is wrong
        return
    if flag.name not in bound.arguments:
        warnings.warn(f"from_linen: inputs(batch, train=True) does not pass {type(module).__name__}'s {flag.name!r}, "
                      f"so it keeps its default ({flag.default!r}) in training as in evaluation: return it in "
                      f"inputs' kwargs, e.g. {{{flag.name!r}: {_flag_value(flag)}}}", UserWarning, stacklevel=3)


def _checked_inputs(inputs: Inputs) -> Inputs:
    """``inputs`` whose result must be ``(args, kwargs)``: anything else (a bare array as args, no
    kwargs dict) would be unpacked into the module's call by position and fail there with an
    argument count or unpacking error that does not name ``inputs``."""
    def checked(batch: Batch, train: bool) -> tuple[tuple[Any, ...], dict[str, Any]]:
        out = inputs(batch, train)
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], (tuple, list)) and isinstance(out[1], Mapping):
            return tuple(out[0]), dict(out[1])
        got = f"({', '.join(type(x).__name__ for x in out)})" if isinstance(out, tuple) else type(out).__name__
        raise ValueError(
            f"from_linen: inputs(batch, train) returned {got}; it must return (args, kwargs), a tuple of the "
            "module's positional arguments and a dict of its keywords, e.g. "
            "inputs=lambda batch, train: ((batch['image'],), {'train': train})")

    return checked


def _check_call_arguments(module: Any, args: tuple, kwargs: dict) -> None:
    """What ``inputs`` returns must bind to the module's ``__call__``: a batch spread into it
    (``{**batch}``, labels included) otherwise fails in Flax's init naming the argument only."""
    try:
        signature = inspect.signature(module.__call__)
    except (TypeError, ValueError):  # a callable inspect cannot read: Flax will say what is wrong
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as err:
        takes = ", ".join(signature.parameters)
        raise ValueError(f"from_linen: inputs(batch, train) returned {len(args)} positional argument(s) and keywords "
                         f"{sorted(kwargs)}, which {type(module).__name__}.__call__({takes}) cannot take ({err}): pass "
                         "only the module's call arguments; the loss function gets the whole batch (labels "
                         "included) as its second argument") from None


def from_linen(
    module: Any,
    loss_fn: Callable[[Any, Batch], Any],
    example: Any,
    *,
    inputs: Inputs | None = None,
    rng_streams: tuple[str, ...] = ("dropout",),
    eval_rng_streams: tuple[str, ...] = (),
    capture: tuple[str, ...] = (),
    path_rules: rules_lib.PathRules = (),
    eval_module: Any = None,
    blocks: str | Sequence[str] = blocks_lib.AUTO,
) -> Model:
    """Adapt a linen module whose parameters use ``nn.with_logical_partitioning``, t5x's
    ``param_with_axes`` (names read from ``params_axes``, which is not state), or no names.

    ``inputs(batch, train) -> (args, kwargs)`` maps a batch to the module's call, e.g.
    ``lambda b, train: ((b["tokens"], b["positions"]), {"train": train})``; ``example`` is then
    an example batch. Without ``inputs``, ``example`` is an example of ``batch["inputs"]``, the
    module's single positional argument. ``loss_fn(outputs, batch)`` gives the loss;
    ``loss_fn(outputs, batch, step)`` also gets the train state's step (None in evaluation).

    Training calls pass ``rngs`` for each of ``rng_streams`` (from the step's key; ``()``: the
    model draws nothing) and update every variable collection besides ``params`` (linen
    ``batch_stats``), which the train state carries; evaluation calls ``inputs(batch, False)``,
    with no rngs and the collections read-only. The module is initialised with ``train=False``.
    ``eval_rng_streams`` (some of ``rng_streams``) are passed in evaluation too, for a loss that is
    random by nature (a VAE's reparameterisation noise, a diffusion loss's timesteps and noise):
    from a fixed key with the device's index folded in, so evaluation is the same on every call and
    the devices' rows draw independent noise, as the Flax VAE example's fixed ``eval_rng``.

    ``path_rules`` (regex on the parameter's path, first match wins) name the parameters that carry
    no annotation, as big_vision / scenic modules do not: ``[(r"/(query|key|value)/kernel$", ("embed",
    "heads", "head_dim"))]``. A parameter ``nn.scan`` stacks is named as one layer's slice, the
    shape the module sees; ``"layers"`` is inserted at the stacked axis, so one rule list serves the
    looped and the scanned stack alike.

    ``eval_module``: the module evaluation applies, for a module whose train/eval switch is a field
    of its config and not a call argument (the Flax lm1b / WMT examples' ``deterministic``):
    ``eval_module=module.clone(deterministic=True)``. It must hold the same parameters; training
    applies ``module``, `evaluate` ``eval_module`` (docs/your-model.md, "A train/eval switch in the config").

    ``capture`` names collections the module writes with ``self.sow`` (``"intermediates"``, an
    auxiliary ``"losses"``): each call starts them empty and ``loss_fn`` receives
    ``(outputs, {collection: values})``, what ``module.apply(..., mutable=capture)`` returns.
    Inside the step, ``nn.with_logical_constraint`` maps through the strategy's activation rules,
    and each parameter stored split over the batch axes is gathered where a layer reads it
    (`_gathered_on_read`), so ZeRO-3 holds one scanned layer's weights at a time. An unrolled
    stack's ``blocks`` (default ``"auto"``: the members of every stack of identical sibling
    submodules, `shardlib.model.blocks`; or submodule paths such as ``("LBlock_0", "LBlock_1")``;
    ``()``: none) each run under ``nn.remat`` when their parameters are stored split, so the
    backward pass reads (gathers) them again instead of keeping every block's gathered weights.
    """
    from flax import linen as nn
    from flax.core import unfreeze

    as_input = example if inputs is None else None
    if inputs is None:
        _check_mode_flags(module)
        inputs, example = _single_input, {"inputs": example}
    else:
        _check_flag_passed(module, *_checked_inputs(inputs)(example, True))
    inputs = _checked_inputs(inputs)
    capture, eval_rng_streams = tuple(capture), _checked_eval_streams(eval_rng_streams, rng_streams)

    _check_call_arguments(module, *inputs(example, False))

    def variables(key, of=module):
        args, kwargs = inputs(example, False)
        rngs = {"params": key, **_stream_keys(jax.random.fold_in(key, 1), rng_streams)}
        return unfreeze(of.init(rngs, *args, **kwargs))

    wrapped: set[str] = set()
    with _noting_wrapped_layers(wrapped), _noting_batch_as_input(as_input):
        boxed = jax.eval_shape(variables, jax.random.key(0))
    logical = _logical_axes(boxed)
    boxed = {c: tree for c, tree in boxed.items() if c not in _axes_collections(boxed)}
    collections = _state_collections(boxed, capture)
    apply_call = _Apply(module, rng_streams, collections, capture, eval_rng_streams,
                        _checked_eval_module(eval_module, boxed, variables))
    scanned = _scanned_paths(apply_call, nn.unbox(boxed), inputs(example, False), wrapped)
    logical = _with_layer_axes(_with_path_rules(logical, nn.unbox(boxed)["params"], path_rules, scanned), scanned)

    call_loss = _loss_caller(loss_fn)
    per_block = blocks_lib.resolve(blocks, blocks_lib.leaves_of(nn.unbox(boxed)["params"]))

    def run(params, batch, specs, call):
        with _remat_blocks(per_block, specs):
            return unrolled(params, batch, specs, call)

    def unrolled(params, batch, specs, call):
        args, kwargs = inputs(batch, call.train)
        # under the per-layer reduction, a scanned stack's whole parameters get their twins on read too
        stacked = scanned.keys() if hooks.reduces_per_layer() else ()
        out, state = apply_call(_gathered_on_read(params, specs, also=stacked, whole=wrapped), call, args, kwargs)
        loss, aux = loss_out(call_loss(out, batch, call.step))
        return loss, aux, state

    def init_state(key):
        return {c: v for c, v in nn.unbox(variables(key)).items() if c in collections}

    return Model(init=lambda key: nn.unbox(variables(key)["params"]), loss=with_call(run, bool(collections)),
                 logical_axes=logical, apply=apply_call.outputs, gathers_params=True, gathers_on_read=True,
                 gathered_blocks=per_block,
                 takes_call=True, uses_key=bool(rng_streams), init_state=init_state if collections else None)


def _checked_eval_module(eval_module: Any, boxed: Any, variables: Callable[..., Any]) -> Any:
    """``eval_module`` when it is a linen module holding the same variables (``boxed``: paths and
    shapes) as the module it evaluates, else a ValueError naming what differs."""
    if eval_module is None:
        return None
    from flax import linen as nn

    if not isinstance(eval_module, nn.Module):
        raise ValueError(f"from_linen(eval_module=...) takes a linen module (module.clone(deterministic=True)), "
                         f"got {type(eval_module).__name__}")
    theirs = jax.eval_shape(lambda key: variables(key, of=eval_module), jax.random.key(0))
    shapes = lambda tree: {rules_lib.path_str(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(
        nn.unbox({c: t for c, t in tree.items() if c in boxed}))}
    mine, other = shapes(boxed), shapes(theirs)
    if mine != other:
        differ = sorted(k for k in mine.keys() | other.keys() if mine.get(k) != other.get(k))
        raise ValueError(f"from_linen(eval_module=...) holds other variables than the module it evaluates "
                         f"({rules_lib.listed(differ)}); pass the same module with only its train/eval field "
                         "changed: module.clone(deterministic=True)")
    return eval_module


def _loss_caller(loss_fn: Callable) -> Callable[[Any, Batch, Any], Any]:
    """``(outputs, batch, step) -> loss_fn(...)``: a loss with a ``step`` parameter gets the train
    state's step by keyword (None in evaluation), for loss weights on a schedule, which a
    ``TrainState`` loop reads from ``state.step``; any other loss gets ``(outputs, batch)``."""
    try:
        takes_step = "step" in inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        takes_step = False
    if not takes_step:
        return lambda out, batch, step: loss_fn(out, batch)

    def call(out, batch, step):
        with noting_no_step(step):
            return loss_fn(out, batch, step=step)

    return call


def _checked_eval_streams(eval_streams: tuple[str, ...], streams: tuple[str, ...]) -> tuple[str, ...]:
    """``eval_rng_streams`` must be streams the module is given in training (a typo would otherwise
    surface as Flax's missing-rng error in the first evaluation only)."""
    unknown = [s for s in eval_streams if s not in streams]
    if unknown:
        raise ValueError(f"from_linen: eval_rng_streams names {unknown!r}, which rng_streams={streams!r} does not: "
                         "list every stream the module draws from in rng_streams, and those evaluation draws "
                         "from too in eval_rng_streams as well")
    return tuple(eval_streams)


def _axes_collections(boxed: dict[str, Any]) -> set[str]:
    """Collections of ``flax.linen.partitioning.AxisMetadata`` (``params_axes``, which t5x's
    ``param_with_axes`` fills): the names of another collection's variables, not state."""
    from flax.linen import partitioning

    is_meta = lambda x: isinstance(x, partitioning.AxisMetadata)
    return {c for c, tree in boxed.items() if c.endswith("_axes")
            and all(is_meta(x) for x in jax.tree.leaves(tree, is_leaf=is_meta))}


def _logical_axes(boxed: dict[str, Any]) -> Any:
    """Each parameter's names: from its box (``nn.with_logical_partitioning``), else from
    ``params_axes`` (``param_with_axes``, t5x: ``<name>_axes`` beside the parameter's path)."""
    logical = rules_lib.logical_axes_of(boxed["params"])
    axes = boxed.get("params_axes")
    if not axes:
        return logical

    def from_axes(path, names):
        if names is not None:
            return names
        *parents, leaf = [key.key for key in path]
        node = axes
        for parent in parents:
            node = node.get(parent, {}) if isinstance(node, Mapping) else {}
        meta = node.get(f"{leaf}_axes") if isinstance(node, Mapping) else None
        return None if meta is None else tuple(meta.names)

    return jax.tree_util.tree_map_with_path(from_axes, logical, is_leaf=rules_lib.is_names)


def _state_collections(boxed: dict[str, Any], capture: tuple[str, ...]) -> tuple[str, ...]:
    """The collections the train state carries: every one besides ``params`` and ``capture``;
    refused with what to do where the collection is not state (`_NOT_STATE`, sown tuples)."""
    collections = tuple(c for c in boxed if c != "params" and c not in capture)
    held = [c for c in capture if c in boxed and not _sown_paths(boxed[c])]
    if held:
        raise ValueError(f"from_linen: capture={capture!r} names {', '.join(map(repr, held))}, which holds state "
                         "(variables, not self.sow tuples): captured collections start empty on every call, so "
                         "its values would never carry over; leave it out of capture")
    for name in collections:
        if name in _NOT_STATE:
            raise ValueError(f"from_linen: the module's {name!r} collection is {_NOT_STATE[name]}")
        sown = _sown_paths(boxed[name])
        if sown:
            raise ValueError(
                f"from_linen: the module's {name!r} collection is written with self.sow ({', '.join(sown)} hold "
                f"tuples that grow with every call), so it is an output, not state the step can carry: pass "
                f"from_linen(..., capture=({name!r},)) and loss_fn receives (outputs, {{{name!r}: values}})")
    return collections


def _sown_paths(tree: Any) -> list[str]:
    """Paths of the tuples in a collection: what ``self.sow``'s default ``init_fn`` leaves."""
    found = []
    jax.tree_util.tree_map_with_path(lambda path, x: found.append(rules_lib.path_str(path)) if isinstance(x, tuple) else None,
                                     tree, is_leaf=lambda x: isinstance(x, tuple))
    return found


def _gathered_on_read(params: Any, specs: Any, box_all: bool = False, also: Collection[str] = (),
                      whole: Collection[str] = ()) -> Any:
    """Each parameter the step stores split over the batch axes (and those at the paths ``also``),
    boxed so that linen gathers it where a layer reads it (``self.param`` unboxes): ZeRO-3 one
    layer at a time, inside ``nn.scan`` and ``nn.remat`` too; the layerwise reduction of an
    ``nn.scan`` stack's whole parameters inside the backward loop. Parameters of the layers in
    ``whole`` (`_noting_wrapped_layers`) are gathered here instead, never boxed. ``specs`` None (no
    step): the parameters as they are."""
    if specs is None:
        return params

    def box(path, value, spec):
        name = rules_lib.path_str(path)
        if any(name.startswith(f"{layer}/") for layer in whole):
            return _GatherOnRead(value, name, tuple(spec)).unbox() if any(spec) else value
        if box_all or any(spec) or name in also:
            return _GatherOnRead(value, name, tuple(spec))
        return value

    carried = lambda x: hasattr(x, "residual")  # ZeRO++'s shard with its residual (hooks._fit reads it alike)
    return jax.tree_util.tree_map_with_path(box, params, specs, is_leaf=carried)


@functools.cache
def _gather_on_read_class():
    """`_GatherOnRead`, defined on first use so that importing shardlib does not import flax."""
    from flax import nnx, struct
    from flax.core import meta

    class GatherOnRead(struct.PyTreeNode, meta.AxisMetadata):
        """A parameter shard whose ``unbox`` (linen's read of it) is `hooks.gather_layer`'s gather.
        ``spec`` is the stored parameter's spec over the batch axes; under ``nn.scan`` the value
        is one layer's slice and the gather drops the stacked axis's entry (``hooks._fit``)."""

        value: Any
        path: str = struct.field(pytree_node=False)
        spec: tuple = struct.field(pytree_node=False)

        def unbox(self) -> Any:
            stamped = nnx.Param(self.value, **{hooks.SPEC_METADATA: (self.path, self.spec)})
            return hooks.gather_layer(stamped).get_value()

        def replace_boxed(self, val: Any) -> GatherOnRead:
            return self.replace(value=val)

        def add_axis(self, index: int, params: dict) -> GatherOnRead:
            return self

        def remove_axis(self, index: int, params: dict) -> GatherOnRead:
            seen = _SCANNED.get()
            if seen is not None:  # `_scanned_paths`' abstract call: note it, nothing to gather
                seen[self.path] = index
                return self
            if index != 0:
                raise ValueError(
                    f"{self.path}: linen's nn.vmap / nn.scan stacks this parameter along axis {index}; under a "
                    f"strategy that shards parameters (here stored as {self.spec}) shardlib gathers a stacked parameter "
                    "one slice at a time only along axis 0: stack it there (variable_axes={'params': 0}), or train "
                    "under a strategy that keeps parameters whole (dp, zero1, zero2)")
            if self.spec[0]:
                raise ValueError(
                    f"{self.path}: linen transforms its axis {index}, which the step stores as {self.spec}; "
                    "shardlib gathers a scanned parameter one layer at a time when its stacked axis is axis 0 "
                    "and whole on every device: name it 'layers' (nn.scan(..., metadata_params="
                    "{nn.PARTITION_NAME: 'layers'}) with nn.with_logical_partitioning)")
            return self

    return GatherOnRead


def _GatherOnRead(value: Any, path: str, spec: tuple) -> Any:  # noqa: N802 (a class, made lazily)
    return _gather_on_read_class()(value, path, spec)


_SCANNED: contextvars.ContextVar[dict[str, int] | None] = contextvars.ContextVar("linen_scanned", default=None)


def _scanned_paths(apply_call: _Apply, abstract: dict[str, Any], example_call: tuple,
                   wrapped: Collection[str] = ()) -> dict[str, int]:
    """Parameter path -> the axis a linen transform (``nn.scan``) slices it along, from one abstract
    evaluation call with every parameter boxed but those of ``wrapped`` layers (`_GatherOnRead.remove_axis`
    notes each)."""
    from shardlib.model.adapters import Call

    spec_free = jax.tree.map(lambda x: (None,) * x.ndim, abstract["params"])
    state = {c: abstract[c] for c in apply_call.collections} or None
    # a key for every stream: a module that draws in eval mode too (a VAE's reparameterisation) is
    # still inspected; whether evaluation may draw is `_Apply`'s to say, not this abstract call's
    inspect = lambda s: Call(key=jax.random.key(0), state=s, train=False)
    seen: dict[str, int] = {}
    token = _SCANNED.set(seen)
    try:
        jax.eval_shape(lambda p, s: apply_call(_gathered_on_read(p, spec_free, box_all=True, whole=wrapped), inspect(s),
                                               *example_call), abstract["params"], state)
    finally:
        _SCANNED.reset(token)
    return seen


def _with_path_rules(logical: Any, abstract: Any, path_rules: rules_lib.PathRules, scanned: dict[str, int]) -> Any:
    """Names from ``path_rules`` for the parameters without an annotation of their own. A stacked
    parameter's rule names one slice (what ``self.param`` returns inside ``nn.scan``), and
    ``"layers"`` goes in at the stacked axis, unless the rule names ``"layers"`` itself."""
    if not path_rules:
        return logical
    from_rules = rules_lib.logical_from_paths(abstract, path_rules)

    def pick(path, own, ruled, leaf):
        if own is not None or ruled is None:
            return own
        name = rules_lib.path_str(path)
        axis = scanned.get(name)
        if axis is None or "layers" in ruled:
            return tuple(ruled)
        one = leaf.shape[:axis] + leaf.shape[axis + 1:]
        names = rules_lib.names_for_rank(ruled, one, f"{name} (one layer of the nn.scan stack {tuple(leaf.shape)})")
        return (*names[:axis], "layers", *names[axis:])

    return jax.tree_util.tree_map_with_path(pick, logical, from_rules, abstract, is_leaf=rules_lib.is_names)


def _with_layer_axes(logical: Any, scanned: dict[str, int]) -> Any:
    """A stack that ``nn.scan`` slices along axis 0 gets the leading name ``"layers"`` where it
    has none, so that no strategy's fallback splits the axis the scan iterates over."""
    def name(path, names):
        if scanned.get(rules_lib.path_str(path)) != 0 or (names and names[0] is not None):
            return names
        return ("layers", *(names or ())[1:])

    return jax.tree_util.tree_map_with_path(name, logical, is_leaf=rules_lib.is_names)


class _Apply:
    """``module.apply`` as the step calls it (rngs from the step's key, the state collections
    mutable when training, captured collections fresh on every call) and as users call it."""

    def __init__(self, module: Any, rng_streams: tuple[str, ...], collections: tuple[str, ...],
                 capture: tuple[str, ...], eval_streams: tuple[str, ...] = (), eval_module: Any = None):
        self.module, self.rng_streams, self.collections, self.capture = module, rng_streams, collections, capture
        self.eval_streams, self.eval_module = eval_streams, eval_module

    def _rngs(self, call: Any) -> dict[str, jax.Array] | None:
        """The step's key split into the streams; evaluation (no key) passes only ``eval_streams``,
        from `hooks.eval_key` (a fixed key with this device's index folded in)."""
        if call.key is not None:
            return _stream_keys(call.key, self.rng_streams)
        if call.train or not self.eval_streams:
            return None
        device_key = hooks.eval_key()
        return {name: jax.random.fold_in(device_key, self.rng_streams.index(name)) for name in self.eval_streams}

    def __call__(self, params: Any, call: Any, args: tuple, kwargs: dict) -> tuple[Any, Any]:
        """(outputs, new model state), outputs paired with the captured collections if any."""
        from flax.core import unfreeze

        rngs = self._rngs(call)
        state = dict(call.state or {})
        mutable = [*(self.collections if call.train else ()), *self.capture]
        keyed = rngs is not None or not self.rng_streams  # rng_streams=(): the step passes no key at all
        when = "evaluation" if not call.train else "training" if keyed else "training without a key"
        module = self.module if call.train or self.eval_module is None else self.eval_module
        with (_named_rng_errors(self.rng_streams, when), _named_read_only_errors(self.collections),
              _logical_constraints(), _varying_carries()):
            if not mutable:  # evaluation (or no state): the state goes back as it came
                out = module.apply({"params": params, **state}, *args, rngs=rngs, **kwargs)
                return out, state if self.collections else None
            out, written = module.apply({"params": params, **state}, *args, rngs=rngs, mutable=mutable, **kwargs)
        written = unfreeze(written)
        if self.capture:
            out = (out, {c: written.get(c, {}) for c in self.capture})
        if not self.collections:
            return out, None
        return out, {c: written[c] for c in self.collections} if call.train else state

    def outputs(self, params: Any, *args: Any, model_state: Any = None, **kwargs: Any) -> Any:
        """`Model.apply`: ``module.apply({"params": params, **model_state}, *args, **kwargs)``
        (sampling, or a user's own evaluation); a module with batch_stats needs ``model_state``."""
        if self.collections and model_state is None:
            raise ValueError(
                f"this linen module carries {', '.join(self.collections)}: call model.apply(params, *args, "
                "model_state=state.model_state, **kwargs), with the module's own eval flag (train=False)")
        return self.module.apply({"params": params, **(model_state or {})}, *args, **kwargs)


# Why a call had no rng for a stream, by the kind of call: what the error tells the user.
_MISSING_RNG = {
    "training": "shardlib passes the streams rng_streams={streams!r} when training: name every stream the "
                "module draws from, e.g. from_linen(..., rng_streams={wanted!r})",
    "training without a key": "this call had no key (model.loss without a shardlib.model.Call): call "
                              "model.run(params, batch, specs, shardlib.model.Call(key=...))",
    "evaluation": "evaluation (train=False) passes no rngs unless named. A module whose train/eval switch is a "
                  "config field (deterministic=...) needs its eval copy: from_linen(..., "
                  "eval_module=module.clone(deterministic=True)). A module switched by a call argument draws only "
                  "when training (dropout). Only a loss random in evaluation too (a VAE's reparameterisation, a "
                  "diffusion loss's noise) names the stream in from_linen(..., eval_rng_streams=({stream!r},)), "
                  "which evaluation then draws from a fixed key",
}


@contextlib.contextmanager
def _named_rng_errors(streams: tuple[str, ...], when: str) -> Iterator[None]:
    """Flax's missing-stream error, with what passes the stream in shardlib: a stream missing from
    ``streams`` is named for ``rng_streams`` whatever the call (from_linen's own eval-mode
    inspection included), one listed there for what ``when`` lacks."""
    from flax import errors

    try:
        yield
    except errors.InvalidRngError as err:
        found = re.search(r'needs PRNG for "([^"]+)"', str(err))
        stream = found.group(1) if found else None  # Flax's wording changed: say what `when` lacks
        unlisted = stream is not None and stream not in streams
        wanted = (*streams, stream) if unlisted else streams
        raise ValueError(f"from_linen: the module asked for an rng stream it was not given ({err}); "
                         + _MISSING_RNG["training" if unlisted else when].format(
                             streams=streams, wanted=wanted, stream=stream or "<stream>")) from err


@contextlib.contextmanager
def _named_read_only_errors(collections: tuple[str, ...]) -> Iterator[None]:
    """Flax's error for a state variable updated where its collection is read-only (an unguarded
    ``count.value += 1``), with why shardlib applies the module so and the guard to write."""
    from flax import errors

    try:
        yield
    except errors.ModifyScopeVariableError as err:
        found = re.search(r'collection "([^"]+)" is immutable', str(err))
        name = found.group(1) if found else None
        if name not in collections:  # not model state (params): Flax's own message says it
            raise
        raise ValueError(
            f"from_linen: the module updates its {name!r} collection unconditionally ({err}); shardlib applies "
            f"the module with its state collections read-only, once to inspect it (from_linen finds nn.scan stacks "
            f"so) and in every evaluation (train=False): guard the update with "
            f'`if self.is_mutable_collection("{name}"):`') from err


@contextlib.contextmanager
def _logical_constraints() -> Iterator[None]:
    """Inside a shardlib step, ``nn.with_logical_constraint`` resolves through the strategy's
    activation rules (as `shardlib.constrain` does), and its names are checked against them;
    outside one, the user's own rules apply."""
    rules = hooks.logical_rules()
    if rules is None:
        yield
        return
    from flax import linen as nn

    with nn.logical_axis_rules(rules), hooks.noting_flax_constraints():
        yield


@contextlib.contextmanager
def _noting_batch_as_input(example: Any) -> Iterator[None]:
    """Without ``inputs=``, ``example`` is the module's one input; a whole batch passed there (a
    dict or tuple, as the ``inputs=`` form takes) fails inside the module's first layer with an
    error (``IndexError: tuple index out of range``) that names neither."""
    try:
        yield
    except Exception as err:
        if isinstance(example, (Mapping, tuple, list)):
            first = repr(next(iter(example))) if isinstance(example, Mapping) and example else "0"
            err.add_note(f"shardlib: from_linen without inputs= calls the module on example as its one input, and "
                         f"example is a {type(example).__name__}; if it is a batch, say which entries the module "
                         f"takes: from_linen(module, loss_fn, batch, inputs=lambda batch, train: ((batch[{first}],), {{}}))")
        raise


@contextlib.contextmanager
def _noting_wrapped_layers(found: set[str]) -> Iterator[None]:
    """Adds to ``found`` the path of every layer an ``nn.SpectralNorm`` / ``nn.WeightNorm`` wraps.
    Those read the layer's variables through ``map_variables``, which walks the raw tree (a box's
    fields included: Flax's ``dict_key.key`` then fails on the box) and normalises what it finds,
    which must be the whole weight, not a shard: `_gathered_on_read` gathers them before the call."""
    from flax import linen as nn

    def note(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if isinstance(context.module, (nn.SpectralNorm, nn.WeightNorm)) and context.method_name == "__call__":
            found.add("/".join(context.module.layer_instance.path))
        return out

    with nn.intercept_methods(note):
        yield


@contextlib.contextmanager
def _remat_blocks(blocks: tuple[str, ...], specs: Any) -> Iterator[None]:
    """While the step's module runs: each submodule at ``blocks`` runs its ``__call__`` under
    ``nn.remat`` when its parameters are stored split, so the weights it gathers on read live while
    it runs and are gathered again in the backward pass (`shardlib.model.blocks`)."""
    stored = {} if specs is None else {rules_lib.path_str(p): tuple(spec) for p, spec in
                                       jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda x: isinstance(x, tuple))}
    if not blocks or not blocks_lib.sharded(blocks, stored):
        yield
        return
    from flax import linen as nn

    running: set[str] = set()  # the blocks inside their remat: their own call passes through

    def remat(next_fun, args, kwargs, context):
        path = "/".join(context.module.path) if context.module.scope is not None else None
        if context.method_name != "__call__" or path not in blocks or path in running:
            return next_fun(*args, **kwargs)
        arrays, rebuild = blocks_lib.split_static((args, kwargs), lambda x: isinstance(x, nn.Module))

        def body(block, arrays):
            args, kwargs = rebuild(arrays)
            running.add(path)
            try:
                return block(*args, **kwargs)
            finally:
                running.discard(path)

        return nn.remat(body, policy=blocks_lib.remat_policy(hooks.block_recompute()))(context.module, arrays)

    with nn.intercept_methods(remat):
        yield


@contextlib.contextmanager
def _varying_carries() -> Iterator[None]:
    """An RNN cell's initial carry (``initialize_carry``'s zeros) typed as varying with the rows
    (`hooks.batch_varying`): ``nn.RNN``'s scan would otherwise fail inside the step, its carry
    constant going in and varying coming out."""
    from flax import linen as nn

    def mark(next_fun, args, kwargs, context):
        cell = getattr(context.module, "cell", None)
        if not isinstance(context.module, nn.RNN) or context.method_name != "__call__" or cell is None:
            return next_fun(*args, **kwargs)
        hooks.vary_initial_carry(cell)  # initialize_carry is @nowrap: no interceptor sees it
        try:
            return next_fun(*args, **kwargs)
        finally:
            object.__delattr__(cell, "initialize_carry")

    with nn.intercept_methods(mark):
        yield


def _stream_keys(key: jax.Array, streams: tuple[str, ...]) -> dict[str, jax.Array]:
    return {name: jax.random.fold_in(key, i) for i, name in enumerate(streams)}
