"""`from_nnx` (over 600 lines: the adapter and the NNX misuses it refuses, which follow NNX's API).

A Flax NNX module as a `Model` (parameters trained, other variables carried as model state, rng
streams re-seeded from the step's key, sown intermediates dropped)."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from shardlib import compat
from shardlib.model.adapters import Batch, Call, Model, Stages, loss_out, with_call, noting_no_step, with_eval_key
from shardlib.model import blocks as blocks_lib
from shardlib.model import hooks, nnx_blocks
from shardlib.model.hooks import SPEC_METADATA
from shardlib.sharding import rules as rules_lib

EAGER_SHARDING_ENV = "FLAX_ALWAYS_SHARD_VARIABLE"


def parameters_placed_by_shardlib() -> Any:
    """A context in which Flax's eager sharding is off, unless ``FLAX_ALWAYS_SHARD_VARIABLE`` is set.

    Flax 0.12 places each annotated parameter as it is created, on a mesh whose axes are the
    annotation's names, so ``Model(nnx.Rngs(0))`` annotated with logical names fails with "An auto
    mesh context or metadata is required". shardlib places the parameters itself (the rule tables
    map logical names to mesh axes), so where it runs the user's model code (`shardlib train
    --model pkg.mod:factory`) it runs it inside this; ``FLAX_ALWAYS_SHARD_VARIABLE`` set keeps
    Flax's own choice (docs/nnx.md). Flax's global config is never changed.
    """
    import contextlib
    import os

    from flax import nnx

    return contextlib.nullcontext() if EAGER_SHARDING_ENV in os.environ else nnx.use_eager_sharding(False)


# What shardlib does with each kind of NNX variable; the first kind a variable is an instance of
# wins. "carried" is the model state (TrainState.model_state): BatchNorm statistics, nnx.Cache,
# plain nnx.Variable buffers and user subclasses such as a step counter.
TREATMENT = (
    ("Param", "trained", "the parameters: differentiated and updated by the optimizer"),
    ("RngState", "reseeded", "rng streams: each call re-seeds them from the step's key"),
    ("Intermediate", "dropped", "sown values (self.sow): their shape follows the batch; never carried"),
    ("Perturbation", "dropped", "nnx.perturb taps: only meaningful inside the user's own grad"),
    ("Variable", "carried", "model state: replicated, checkpointed, averaged over the batch axes if it differs"),
)


def _kinds(treatment: str) -> tuple[type, ...]:
    from flax import nnx

    return tuple(getattr(nnx, name) for name, how, _ in TREATMENT if how == treatment)


def from_nnx(
    make: Callable[[Any], Any] | Any,
    loss_fn: Callable[[Any, Batch], Any],
    *,
    gathers_params: bool = False,
    blocks: str | Sequence[str] = blocks_lib.AUTO,
    pipeline: Stages | None = None,
    wrt: Any = None,
    path_rules: rules_lib.PathRules = (),
    eval_rng_streams: tuple[str, ...] = (),
    eval_module: Callable[[Any], Any] | Any = None,
) -> Model:
    """Adapt ``make(rngs) -> nnx.Module`` (or a module already built) and ``loss_fn(module, batch)``.

    ``make`` is called with ``rngs=nnx.Rngs(key)`` (keyword when it takes ``rngs``, so a class with
    ``__init__(self, *, rngs)`` works as is); ``init(key)`` then creates the parameters from ``key``.
    Given an already-built module instead, ``init`` returns *its* parameters and model state (the
    key seeds dropout only), as NNX code that holds its model expects; the instance itself is not
    updated by training (``nnx.update(module, nnx.State(params))`` copies the result back).

    Variables are treated by kind (`TREATMENT`): ``nnx.Param`` is trained, logical names from its
    ``out_sharding`` metadata (``nnx.with_partitioning``); rng streams are re-seeded from the step's
    key on each call; ``self.sow`` intermediates are dropped; every other variable (BatchNorm's
    ``nnx.BatchStat``, ``nnx.Cache``, ``nnx.Variable`` buffers, a counter subclass) is the model
    state, kept in ``TrainState.model_state`` (an ``nnx.Cache`` the training call writes from the
    rows, a decoding cache, is refused). A ``Param`` declared narrower than the step's master
    weights (``param_dtype=jnp.bfloat16``) reaches the module cast to its declared dtype.

    ``loss_fn(module, batch)`` may also take an ``rngs`` argument (``loss_fn(model, rngs, batch)``,
    for modules whose ``__call__`` takes the rngs): it receives an ``nnx.Rngs`` seeded from the
    step's key. A ``train`` argument (``loss_fn(model, batch, train)``, for modules whose train/eval
    switch is a call argument) receives True in the step and False in evaluation, and a ``step``
    argument the train state's step (None in evaluation), for loss weights on a schedule. It returns the
    loss, or ``(loss, aux)``: aux's scalar entries (a dict) become metrics; anything else (the
    tutorial's ``(loss, logits)``) is dropped, with a warning. Evaluation runs the module after
    ``module.eval()`` (dropout off, BatchNorm on running averages); training runs it as given, so
    an instance left in eval mode is warned about. ``eval_rng_streams`` names the streams a module
    draws from in evaluation too (a VAE's ``self.rngs.noise()``): evaluation then seeds the rngs
    (and a loss's ``rngs``) from `hooks.eval_key`, fixed with the device's index folded in, as
    ``from_linen(eval_rng_streams=...)`` does; otherwise every device would draw the same numbers.

    ``eval_module`` (a constructor or module like ``make``) is the module evaluation runs, for one
    whose train/eval switch is a field of its config that it passes at call time (the Flax lm1b
    NNX example's ``deterministic=config.deterministic``), which ``module.eval()`` cannot reach:
    ``eval_module=lambda rngs: Model(eval_config, rngs=rngs)``. It must hold the same parameters
    (docs/your-model.md, "A train/eval switch in the config").

    ``wrt`` (an NNX filter, as ``nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)``) trains only the
    matching parameters: the others are frozen (no gradient flows into them; `build` masks the
    optimizer to the trained ones, so they get neither updates nor optimizer state) but stay
    parameters, stored and sharded as the strategy places them. None: every ``nnx.Param`` trains.

    ``path_rules`` (regex on the parameter's path such as ``blocks/0/attn/query/kernel``, first
    match wins) name the parameters that carry no annotation of their own, so a model written
    without ``nnx.with_partitioning`` (the tutorials' ``nnx.MultiHeadAttention``) can be split by
    ``tp`` without touching its code; an annotation wins over a rule. Names fewer than a parameter's
    dims name its leading dims, with a warning (an ``nnx.vmap`` stack that does not record its axis).

    Under ZeRO-3 / FSDP the step holds one block's weights at a time: ``blocks`` (default
    ``"auto"``: the members of every stack of identical sibling submodules, such as the blocks of
    an unrolled ``for`` loop, `shardlib.model.blocks`; or your own submodule paths, as FSDP2's
    ``fully_shard`` per block; ``()``: none) are each gathered when their ``__call__`` runs, under
    ``nnx.remat`` so the backward pass gathers them again, and the other parameters once at the
    top of the step. Set ``gathers_params=True`` instead when the module calls
    `shardlib.model.hooks.gather_layer` on all its parameters itself (as `models.gpt` does: per
    layer inside its scan). ``pipeline`` gives the module-level `Stages`
    (functions of the bound module) for pipeline parallelism.
    """
    source = _Source.of(make)
    _warn_if_eval_mode(make)
    abstract = source.abstract()
    _refuse_decode_mode(abstract)
    parts = _NnxParts.of(abstract)
    logical = _with_path_rules(rules_lib.logical_axes_of(nnx_pure_dict(parts.params, keep_variables=True)),
                               nnx_pure_dict(parts.params), path_rules)
    _warn_short_names(nnx_pure_dict(parts.params), logical)
    stateful = bool(jax.tree.leaves(parts.carried))
    call_loss, loss_extras = _loss_caller(loss_fn)
    frozen = _frozen_mask(parts.params, wrt)
    keyed = with_eval_key if _checked_eval_streams(eval_rng_streams, parts.rngs, loss_extras) else (lambda c: c)
    evaluated = _eval_parts(eval_module, parts)
    per_block = _blocks(blocks, parts, gathers_params, pipeline)

    def run(params, batch, specs, call):
        call = keyed(call)
        if frozen is not None:
            # frozen is a prefix of params: a layerwise step's parameter is a `Carried` (weight + twin)
            params = jax.tree.map(lambda f, p: jax.lax.stop_gradient(p) if f else p, frozen, params)
        module = (parts if call.train or evaluated is None else evaluated).bind(params, specs, call.state, call.key)
        hooks.rebind_axis_name(module)
        hooks.vary_nnx_carries(module)
        if per_block and specs is not None:
            nnx_blocks.gather_per_block(module, per_block)
        if call.train:
            _train_undecided(module)
        else:
            module.eval()
        loss, aux = loss_out(call_loss(module, batch, call))
        if call.train and stateful:
            _refuse_rows_in_cache(module)
        return loss, aux, parts.carried_of(module) if stateful else None

    uses_key = bool(jax.tree.leaves(parts.rngs)) or "rngs" in loss_extras
    return Model(init=source.params, loss=with_call(run, uses_key or stateful), logical_axes=logical,
                 gathers_params=gathers_params or bool(per_block), gathered_blocks=per_block, apply=parts.apply,
                 pipeline=_stages(pipeline, parts), takes_call=uses_key or stateful or bool(loss_extras),
                 uses_key=uses_key, init_state=source.carried if stateful else None, frozen=frozen)


def _blocks(blocks: str | Sequence[str], parts: _NnxParts, gathers_params: bool, pipeline: Any) -> tuple[str, ...]:
    """The submodules gathered per call (`nnx_blocks`): none for a module that gathers its own
    parameters or is pipelined (its stages are the units), where only ``"auto"`` is accepted."""
    if gathers_params or pipeline is not None:
        if blocks != blocks_lib.AUTO and tuple(blocks):
            raise ValueError("from_nnx: blocks= names the submodules shardlib gathers per call, which a module "
                             f"that {'gathers its own parameters (gathers_params=True)' if gathers_params else 'is pipelined'}"
                             " does not use: drop blocks=")
        return ()
    return blocks_lib.resolve(blocks, blocks_lib.leaves_of(nnx_pure_dict(parts.params)))


def _eval_parts(eval_module: Any, parts: _NnxParts) -> _NnxParts | None:
    """``eval_module`` split like the trained module, when it holds the same parameters and model
    state (paths and shapes); else a ValueError naming what differs."""
    if eval_module is None:
        return None
    other = _NnxParts.of(_Source.of(eval_module).abstract())
    shapes = lambda *trees: {rules_lib.path_str(p): tuple(x.shape) for tree in trees
                             for p, x in jax.tree_util.tree_leaves_with_path(nnx_pure_dict(tree))}
    mine, theirs = shapes(parts.params, parts.carried), shapes(other.params, other.carried)
    if mine != theirs:
        differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        raise ValueError(f"from_nnx(eval_module=...) holds other parameters or state than the module it evaluates "
                         f"({rules_lib.listed(differ)}); build the same model with only its train/eval setting changed")
    return other


def _checked_eval_streams(streams: tuple[str, ...], rngs: Any, loss_extras: frozenset[str]) -> tuple[str, ...]:
    """``eval_rng_streams`` must name streams the module holds, unless it has a ``default`` one (which
    NNX draws from for a stream it lacks) or the loss takes ``rngs``: a typo would draw nothing."""
    tags = {getattr(v, "tag", None) for v in _variables(rngs)}
    unknown = [s for s in streams if s not in tags]
    if unknown and "default" not in tags and "rngs" not in loss_extras:
        raise ValueError(f"from_nnx: eval_rng_streams names {unknown!r}, which the module's nnx.Rngs do not hold "
                         f"(its streams: {sorted(t for t in tags if t)!r}); name the streams it draws from in evaluation")
    return tuple(streams)


def _with_path_rules(logical: Any, abstract: Any, path_rules: rules_lib.PathRules) -> Any:
    """``logical`` with the names ``path_rules`` give to the parameters that have none of their own."""
    if not path_rules:
        return logical
    ruled = rules_lib.logical_from_paths(abstract, path_rules)
    return jax.tree.map(lambda own, rule: rule if own is None else own, logical, ruled,
                        is_leaf=rules_lib.is_names)


STACK_AXIS = "layers"  # the logical name of a scanned stack's layer axis, which no strategy splits


def _warn_short_names(abstract: Any, logical: Any) -> None:
    """Names shorter than a parameter's rank name its leading dims (as in JAX and Flax). In NNX the
    usual cause is a layer stack built by ``nnx.vmap`` without ``transform_metadata``: each kernel
    keeps its per-layer names, so the stack axis takes the first one (``"embed"`` on the layers
    dim, split by ZeRO or ``tp``) and every name lands one dim early. Say so, per tensor; names of
    the stack axis alone (``path_rules`` ``("layers",)`` on an unannotated stack) are meant so."""
    short = [f"{rules_lib.path_str(path)} {tuple(leaf.shape)} {tuple(names)}"
             for (path, leaf), names in zip(jax.tree_util.tree_leaves_with_path(abstract),
                                            rules_lib.logical_leaves(abstract, logical))
             if names is not None and 0 < len(names) < len(leaf.shape) and set(names) - {STACK_AXIS, None}]
    if short:
        warnings.warn(
            f"from_nnx: these parameters have fewer logical names than dims, so the names are placed on their "
            f"leading dims and the trailing ones stay unnamed: {rules_lib.listed(short, sep='; ')}. A layer stack "
            "made with nnx.vmap keeps each layer's names unless the vmap adds the stack axis: write "
            "nnx.vmap(..., transform_metadata={nnx.PARTITION_NAME: 'layers'}) (or begin the path_rules names "
            "with 'layers'); if the trailing dims are meant unnamed, pad the names with None to the rank",
            UserWarning, stacklevel=3)


def _refuse_rows_in_cache(module: Any) -> None:
    """An ``nnx.Cache`` written from the device's rows in training is a decoding cache (keys and
    values for one batch): each device fills only its own rows and the step would then average the
    caches over the batch axes into a tensor no single run computes. Refuse it, naming it."""
    from flax import nnx

    written = sorted("/".join(map(str, path)) for path, variable in nnx.to_flat_state(nnx.state(module, nnx.Cache))
                     if compat.varying_axes(variable.get_value()))
    if written:
        raise ValueError(
            f"from_nnx: the training call wrote the device's rows into nnx.Cache {rules_lib.listed(written)}: a "
            "decoding cache sized for one batch, which each device fills only in part. Train the module without "
            "it (create the cache, init_cache, only on the copy that samples, after nnx.update with the trained "
            "weights), or, for a running statistic of the rows, declare it an nnx.BatchStat or your own "
            "nnx.Variable subclass (averaged over the batch axes after each step)")


def _frozen_mask(params: Any, wrt: Any) -> Any:
    """True for each parameter ``wrt`` does not select; None when it selects them all. A filter
    that selects none is refused: nothing would train."""
    from flax import nnx

    if wrt is None:
        return None
    selects = nnx.filterlib.to_predicate(wrt)
    variables = nnx_pure_dict(params, keep_variables=True)
    frozen = jax.tree_util.tree_map_with_path(lambda path, v: not selects(rules_lib.path_keys(path), v),
                                              variables, is_leaf=lambda v: isinstance(v, nnx.Variable))
    flags = jax.tree.leaves(frozen)
    if all(flags):
        leaves = jax.tree.leaves(variables, is_leaf=lambda v: isinstance(v, nnx.Variable))
        kinds = sorted({type(v).__name__ for v in leaves})
        raise ValueError(f"from_nnx: wrt={wrt!r} selects none of the module's parameters (kinds: {', '.join(kinds)}), "
                         "so nothing would train; pass the filter that matches the ones to train")
    return frozen if any(flags) else None


# The attributes `nnx.Module.eval` sets to True (a fresh nnx.Dropout / nnx.BatchNorm has them False).
EVAL_FLAGS = ("deterministic", "use_running_average")


def _train_undecided(module: Any) -> None:
    """Set each eval-mode flag left None to False, as ``module.train()`` would: a layer built
    undecided (``nnx.MultiHeadAttention(dropout_rate=0.1)`` has ``deterministic=None``) otherwise
    refuses to run, and a user's own loop calls ``model.train()`` first. Flags the module set
    itself (an instance in eval mode for fine-tuning) are kept, and a call argument still wins."""
    from flax import nnx

    for _, sub in nnx.iter_modules(module):
        for flag in EVAL_FLAGS:
            if hasattr(sub, flag) and getattr(sub, flag) is None:
                setattr(sub, flag, False)


def _eval_flags(module: Any) -> list[str]:
    """``path (Class): flag=True`` for each submodule whose eval-mode flag is set; a ``deterministic``
    that changes nothing (dropout rate 0) is left out."""
    from flax import nnx

    found = []
    for path, sub in nnx.iter_modules(module):
        rate = getattr(sub, "rate", getattr(sub, "dropout_rate", None))
        for flag in EVAL_FLAGS:
            if getattr(sub, flag, None) is True and not (flag == "deterministic" and rate == 0):
                name = "/".join(map(str, path)) or "the module itself"
                found.append(f"{name} ({type(sub).__name__}): {flag}=True")
    return sorted(found)


def _refuse_decode_mode(module: Any) -> None:
    """Attention built with ``decode=True`` keeps an autoregressive cache sized for the whole batch
    and one token per call: the step feeds each device its rows of full sequences, so flax fails
    with a cache-shape error that names neither. Refuse it by path, as from_linen refuses 'cache'."""
    from flax import nnx

    found = sorted("/".join(map(str, path)) or "the module itself"
                   for path, sub in nnx.iter_modules(module) if getattr(sub, "decode", None) is True)
    if found:
        raise ValueError(
            f"from_nnx: {', '.join(found)} {'is' if len(found) == 1 else 'are'} built with decode=True (an "
            "autoregressive cache for sampling one token at a time, sized for one batch); train a decode=False "
            "module and sample with a decode=True copy holding the trained weights (nnx.update)")


def _warn_if_eval_mode(make: Any) -> None:
    """A held module left in eval mode (``module.eval()``, or built with ``deterministic=True`` /
    ``use_running_average=True``) would train with dropout off and BatchNorm statistics frozen,
    silently: say so. A constructor builds a fresh module, in train mode unless asked otherwise."""
    from flax import nnx

    if not isinstance(make, nnx.Module):
        return
    found = _eval_flags(make)
    if not found:
        return
    shown = rules_lib.listed(found, 8, sep="; ")
    effects = " and ".join(effect for flag, effect in _EVAL_EFFECTS.items() if any(f": {flag}=True" in f for f in found))
    warnings.warn(
        f"from_nnx was given a module in eval mode: {shown}. Training runs the module as given, so {effects} "
        "there; call module.train() before from_nnx to train in train mode, or ignore this warning if that is "
        "intended (fine-tuning). Evaluation switches to eval mode by itself.", UserWarning, stacklevel=3)


# What training a module with each eval-mode flag set does, for `_warn_if_eval_mode`.
_EVAL_EFFECTS = {"deterministic": "dropout stays off", "use_running_average": "BatchNorm statistics stay frozen"}


def _stages(pipeline: Stages | None, parts: _NnxParts) -> Stages | None:
    """The module-level pipeline stages as functions of parameter pytrees (`Model.pipeline`)."""
    if pipeline is None:
        return None
    return Stages(
        stacked=pipeline.stacked,
        embed=lambda params, batch, specs=None: pipeline.embed(parts.bind(params, specs), batch),
        stage=lambda params, x, specs=None: pipeline.stage(parts.bind(params, specs), x),
        head_loss=lambda params, x, batch, specs=None: loss_out(
            pipeline.head_loss(parts.bind(params, specs), x, batch)),
    )


def nnx_pure_dict(state: Any, keep_variables: bool = False) -> Any:
    """An NNX state as a nested dict of arrays (or of the variables themselves)."""
    from flax import nnx

    return nnx.to_pure_dict(state, extract_fn=(lambda v: v) if keep_variables else None)


@dataclasses.dataclass(frozen=True)
class _Source:
    """Where a module comes from: a constructor called with fresh rngs per key, or an instance
    whose own values are the initial ones."""

    build: Callable[[jax.Array], Any]

    @classmethod
    def of(cls, make: Any) -> _Source:
        from flax import nnx

        if isinstance(make, nnx.Module):
            return cls(lambda key: make)
        if isinstance(make, nnx.Optimizer):  # the NNX tutorials' loop holds both: from_nnx takes the model
            raise TypeError("from_nnx takes the module, got an nnx.Optimizer: pass the model you built it over, "
                            "from_nnx(model, loss_fn), and the optax transformation to build (optimizer.tx)")
        if not callable(make):
            raise TypeError(f"from_nnx takes a module or make(rngs) -> nnx.Module, got {type(make).__name__}")
        missing = _required_besides_rngs(make)
        if missing:
            name = getattr(make, "__name__", "make")
            raise TypeError(
                f"from_nnx calls make(rngs) to build the module, and {name} also requires {', '.join(missing)}: pass "
                f"lambda rngs: {name}({', '.join(missing)}, rngs=rngs) with your values, or an instance "
                f"{name}(..., rngs=nnx.Rngs(0)) (its weights are then the initial ones)")
        by_keyword = "rngs" in _parameter_names(make)

        def build(key):
            with nnx.use_eager_sharding(False):
                rngs = nnx.Rngs(key)
                return make(rngs=rngs) if by_keyword else make(rngs)

        return cls(build)

    def abstract(self) -> Any:
        from flax import nnx

        return nnx.eval_shape(lambda: self.build(jax.random.key(0)))

    def params(self, key: jax.Array) -> Any:
        from flax import nnx

        return nnx_pure_dict(nnx.state(self.build(key), nnx.Param))

    def carried(self, key: jax.Array) -> Any:
        from flax import nnx

        return nnx_pure_dict(nnx.state(self.build(key), _carried_filter()))


def _parameters(make: Callable) -> list[inspect.Parameter]:
    """What ``make`` takes (a class: its ``__init__``'s past ``self``, which NNX's metaclass hides);
    empty for a builtin or C callable (then called positionally, unchecked)."""
    try:
        params = list(inspect.signature(make.__init__ if isinstance(make, type) else make).parameters.values())
    except (TypeError, ValueError):
        return []
    return params[1:] if isinstance(make, type) else params


def _parameter_names(make: Callable) -> tuple[str, ...]:
    return tuple(p.name for p in _parameters(make))


def _required(params: list[inspect.Parameter]) -> list[str]:
    """The names among ``params`` a call must give: no default, not ``*args`` / ``**kwargs``."""
    return [p.name for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _required_besides_rngs(make: Callable) -> list[str]:
    """The arguments ``make`` cannot do without besides the rngs it is given (by keyword where it
    names ``rngs``, else as its first argument)."""
    params = _parameters(make)
    required = _required(params)
    if "rngs" in (p.name for p in params):
        return [name for name in required if name != "rngs"]
    return required[1:]


# Parameters of the user's loss that shardlib fills in itself, by name.
LOSS_EXTRAS = ("rngs", "train", "step")


def _loss_caller(loss_fn: Callable) -> tuple[Callable[[Any, Batch, Call], Any], frozenset[str]]:
    """``(module, batch, call) -> loss_fn(...)`` and the `LOSS_EXTRAS` the loss names: ``rngs``
    (``loss_fn(model, rngs, batch)``, for modules whose ``__call__`` takes the rngs) gets an
    ``nnx.Rngs`` seeded from this step's and device's key; ``train`` (for modules whose train/eval
    switch is a call argument) True in the step and False in evaluation, since ``module.eval()``
    cannot reach a call argument; ``step`` the train state's step (None in evaluation), for loss
    weights on a schedule, which a loop over ``nnx.Optimizer`` reads from ``optimizer.step``."""
    from flax import nnx

    params = _parameters(loss_fn)
    taken = frozenset(p.name for p in params) & frozenset(LOSS_EXTRAS)
    _refuse_unfilled(loss_fn, params)
    if not taken:
        return (lambda module, batch, call: loss_fn(module, batch)), taken
    positional, keyword = _loss_slots(params)

    def run(module, batch, call):
        given = iter((module, batch))
        extras = {"train": call.train, "step": call.step}
        if "rngs" in taken:  # eval: key None, module.eval() draws nothing
            extras["rngs"] = nnx.Rngs(jax.random.key(0) if call.key is None else call.key)
        args = [extras[slot] if slot in extras else next(given) for slot in positional]
        with noting_no_step(call.step if "step" in taken else 0):
            return loss_fn(*args, **{name: extras[name] for name in keyword})

    return run, taken


def _refuse_unfilled(loss_fn: Callable, params: list[inspect.Parameter]) -> None:
    """A loss needing more than (module, batch) and the extras shardlib fills by name (a flag
    called ``deterministic``) would fail at the first step inside the trace: say so up front."""
    required = [name for name in _required(params) if name not in LOSS_EXTRAS]
    if len(required) > 2:
        raise TypeError(
            f"from_nnx: the loss {getattr(loss_fn, '__name__', loss_fn)!r} requires {', '.join(required[2:])} besides "
            f"(module, batch) ({', '.join(required[:2])}); shardlib fills in only parameters named "
            "rngs or train (train: True in the step, False in evaluate) or step (the train state's step): rename it, "
            "or give it a default")


def _loss_slots(params: list[inspect.Parameter]) -> tuple[list[str | None], list[str]]:
    """Where the loss takes its arguments: positional slots in order (None for the module and the
    batch, the first two of its own parameters; a `LOSS_EXTRAS` name where it declares one) and the
    extras passed by keyword (keyword-only ones, or those after a parameter left to its default)."""
    positional, keyword, data, gap = [], [], 0, False
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name in LOSS_EXTRAS:
            by_keyword = p.kind is p.KEYWORD_ONLY or (gap and p.kind is not p.POSITIONAL_ONLY)
            (keyword if by_keyword else positional).append(p.name)
        elif data < 2 and p.kind is not p.KEYWORD_ONLY:
            positional.append(None)
            data += 1
        else:
            gap = True
    return positional, keyword


def _carried_filter() -> Any:
    from flax import nnx

    return nnx.All(nnx.Not(_kinds("trained") + _kinds("reseeded") + _kinds("dropped")))


@dataclasses.dataclass(frozen=True)
class _NnxParts:
    """A module split by `TREATMENT`: trained parameters, rng streams (re-seeded per call),
    dropped variables (sown at construction, kept as they were) and carried model state."""

    graphdef: Any
    params: Any
    rngs: Any
    dropped: Any
    carried: Any

    @classmethod
    def of(cls, module: Any) -> _NnxParts:
        from flax import nnx

        return cls(*nnx.split(module, nnx.Param, _kinds("reseeded"), _kinds("dropped"), ...))

    def carried_of(self, module: Any) -> Any:
        """The model state after a call (sown intermediates are not part of it)."""
        from flax import nnx

        return nnx_pure_dict(nnx.state(module, _carried_filter()))

    def apply(self, params: Any, *args: Any, model_state: Any = None, **kwargs: Any) -> Any:
        """`Model.apply`: the module over ``params`` (and its ``model_state``, BatchNorm statistics
        included) called in eval mode, as `evaluate` runs it: sampling, or a user's own inference on
        `load_exported` weights. The call's state updates (a counter) are not kept."""
        module = self.bind(params, carried=model_state)
        module.eval()
        return module(*args, **kwargs)

    def bind(self, params: Any, specs: Any = None, carried: Any = None, key: jax.Array | None = None) -> Any:
        """The module over these values; sharded parameters carry their spec for `gather_layer`."""
        from flax import nnx

        if carried is None and jax.tree.leaves(self.carried):
            kinds = sorted({type(v).__name__ for v in _variables(self.carried)})
            raise ValueError(f"this NNX module holds model state ({', '.join(kinds)} variables): call "
                             "model.apply(params, *args, model_state=state.model_state) (or the model_state "
                             "load_exported(path, model_state=True) returns)")
        states = [_bound_state(self.params, params, specs, declared_dtype=True), self.rng_state(key), self.dropped]
        if carried is not None:
            states.append(_bound_state(self.carried, carried))
        return nnx.merge(self.graphdef, *states)

    def rng_state(self, key: jax.Array | None) -> Any:
        """Every rng stream of the module seeded from ``key`` (its own fold per stream, one key per
        element of a stacked stream, as `nnx.split_rngs` leaves them), counts at 0: the module's
        rngs are a function of the step's key, never a trained or carried value."""
        from flax import nnx
        from flax.nnx import traversals

        key = jax.random.key(0) if key is None else key  # eval / no key: no stream is drawn from
        flat = {}
        for i, (path, variable) in enumerate(nnx.to_flat_state(self.rngs)):
            shape = variable.get_value()
            if isinstance(variable, nnx.RngKey):
                value = jax.random.fold_in(key, i)
                value = jax.random.split(value, shape.shape) if shape.shape else value
            else:
                value = jnp.zeros(shape.shape, shape.dtype)
            flat[path] = variable.replace(value)
        return nnx.State(traversals.unflatten_mapping(flat))


def _variables(state: Any) -> list[Any]:
    from flax import nnx

    return [v for _, v in nnx.to_flat_state(state)]


def _declared(value: jax.Array, template: Any) -> jax.Array:
    """``value`` in the dtype its variable was declared with, when that is a narrower float (a
    ``param_dtype=jnp.bfloat16`` layer computes in bfloat16 over float32 master weights)."""
    declared, dtype = getattr(template, "dtype", None), getattr(value, "dtype", None)
    if declared is None or dtype is None:  # a carried shard (layerwise, qgZ): cast by its gather
        return value
    narrower = (jnp.issubdtype(declared, jnp.floating) and jnp.issubdtype(dtype, jnp.floating)
                and jnp.finfo(declared).bits < jnp.finfo(dtype).bits)
    return value.astype(declared) if narrower else value


def _value_at(values: dict[tuple, Any], path: tuple) -> Any:
    """The value at ``path``, whose list indices (``nnx.List``, ``nnx.Sequential``) may be spelled as
    strings: a tree read back without a target (Orbax metadata, `load_exported`) keys them so, as
    ``nnx.replace_by_pure_dict`` accepts."""
    if path in values:
        return values[path]
    spelled = tuple(map(str, path))
    if spelled not in values:
        raise KeyError(f"no value for the module's variable {'/'.join(spelled)}: the tree passed has "
                       f"{len(values)} leaves, none at that path; pass the parameters this module was trained with")
    return values[spelled]


def _bound_state(template: Any, values: Any, specs: Any = None, declared_dtype: bool = False) -> Any:
    """The NNX state ``template`` (abstract variables) holding ``values`` (a pure dict), each
    variable tagged with its storage spec from ``specs`` when given."""
    from flax import nnx
    from flax.nnx import traversals

    values = traversals.flatten_mapping(values)
    spec_of = traversals.flatten_mapping(specs) if specs is not None else {}
    flat = {}
    for path, variable in nnx.to_flat_state(template):
        value = _value_at(values, path)
        bound = variable.replace(_declared(value, variable.get_value()) if declared_dtype else value)
        if path in spec_of:
            bound.set_metadata(**{SPEC_METADATA: ("/".join(map(str, path)), tuple(spec_of[path]))})
        flat[path] = bound
    return nnx.State(traversals.unflatten_mapping(flat))
