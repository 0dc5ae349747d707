"""The train state: its fields, their shardings, and its sharded initialisation.

Every part of the step that carries something from one step to the next owns one field: the
optimizer its state, fp16 loss scaling its scale, int8 compression its residuals, a model that
draws random numbers its seed, a model with BatchNorm its statistics. A new carried quantity is
one more field, sharded and initialised here.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from shardlib.model import Model
from shardlib.sharding import rules as rules_lib
from shardlib.sharding.layout import WARN_REPLICATED_FRACTION, Layout, ReplicationWarning, has_own_layout
from shardlib.step import offload as offload_lib
from shardlib.step import precision as precision_lib
from shardlib.step.reduce import Reducer


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any
    loss_scale: Any = None  # {"scale", "good_steps"} under fp16 dynamic loss scaling, else None
    grad_residual: Any = None  # per-device error-feedback residuals under int8 gradient compression
    rng: Any = None  # uint32 key data of the run's dropout seed (Model.uses_key), else None: see `step_key`
    model_state: Any = None  # mutable model state (BatchNorm statistics), replicated; None without
    pending: Any = None  # under staleness tau: the last tau local (unreduced) gradients, oldest first (`staleness`)
    steps_taken: Any = None  # with ``rng``: every step run, applied or skipped (``step`` counts applied ones): `step_key`


# The root of the step keys: folded into the init key so that dropout never reuses a parameter
# initialisation's draws.
_DROPOUT_STREAM = 1


def _key_data(key: jax.Array) -> jax.Array:
    """Raw uint32 key data: it checkpoints as a plain array with Orbax (typed keys would not)."""
    return jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key


def step_key(state: TrainState) -> jax.Array | None:
    """This step's key: the run's seed with the steps taken folded in, so that every step draws
    its own masks (a skipped step's successor too, and each step under staleness) and a resumed
    run draws what an uninterrupted one would (the device index is folded in by `ModelCall`)."""
    return None if state.rng is None else jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.steps_taken)


def took_step(state: TrainState) -> TrainState:
    """``state`` one step further along its key sequence, whether or not the step applied its update."""
    return state if state.steps_taken is None else dataclasses.replace(state, steps_taken=state.steps_taken + 1)


def abstract_state(init: Callable[[jax.Array], Any], shardings: Any) -> Any:
    """Shapes and dtypes of ``init``'s output with ``shardings`` attached; nothing allocated."""
    shapes = jax.eval_shape(init, jax.random.key(0))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def opt_state_sharding(model: Model, tx: optax.GradientTransformation, layout: Layout) -> Any:
    """The optimizer state's shardings in device memory: each leaf shaped like its parameter in
    the state layout, factored leaves on their own shape, scalars replicated (`Layout.opt_state_layouts`).

    Matched by path and shape rather than by ``optax.tree_utils.tree_map_params``, which calls
    ``tx.init`` on a placeholder: that breaks callable masks and labels, masked (``MaskedNode``)
    states and factored shapes."""
    return rules_lib.shardings(layout.opt_state_layouts(jax.eval_shape(tx.init, model.abstract())), layout.mesh)


# Optimizer wrappers whose job the step already does before the optimizer runs: inside
# shardlib they never act, which a user must hear rather than discover.
REDUNDANT_WRAPPERS = {
    optax.ApplyIfFiniteState: (
        "optax.apply_if_finite: shardlib's step skips the whole update when the loss or the gradient norm "
        "is not finite (metric 'skipped', TrainState.step not advanced), so the wrapper never sees a "
        "non-finite gradient and its counters stay 0; drop it (shardlib train's --max-skips bounds skips)"),
}


def check_optimizer(model: Model, tx: optax.GradientTransformation, layout: Layout) -> None:
    """Warn about optimizer state on its own layout (factored moments, flat buffers) that a
    state-sharding strategy must leave whole (above 1% of the parameter bytes: no batch axis
    divides it), and about wrappers the step makes inert."""
    abstract_opt = jax.eval_shape(tx.init, model.abstract())
    wrappers = tuple(REDUNDANT_WRAPPERS)
    for node in jax.tree.leaves(abstract_opt, is_leaf=lambda x: isinstance(x, wrappers)):
        if isinstance(node, wrappers):
            warnings.warn(REDUNDANT_WRAPPERS[type(node)], UserWarning, stacklevel=4)
    if not layout.strategy.shards_state:
        return
    limit = WARN_REPLICATED_FRACTION * layout.param_bytes()
    replicated = rules_lib.replicated_leaves(layout.opt_state_layouts(abstract_opt), layout.mesh)
    # Moments shaped like their parameter follow it; make_layout already warned about a parameter
    # kept whole. Only state on its own layout (factored moments, flat buffers) is news here.
    big = [l for l in replicated if l.bytes() > limit and has_own_layout(l)]
    if big:
        lines = "\n".join(f"  {l.path} {l.shape}: {'; '.join(l.notes)}" for l in big)
        warnings.warn(f"{layout.strategy.name} keeps {len(big)} optimizer-state tensor(s) whole on every device:\n"
                      f"{lines}\nsee shardlib.sharding_report(layout, optimizer=tx)", ReplicationWarning, stacklevel=4)


def state_sharding(model: Model, tx: optax.GradientTransformation, layout: Layout,
                   policy: precision_lib.Precision, reducer: Reducer,
                   offload: offload_lib.Offload = offload_lib.OFFLOADS["none"]) -> TrainState:
    """Where each field lives: parameters in storage, optimizer state in the state layout
    (its scalars replicated; in pinned host memory under ``offload="opt_state"``), residuals like
    the local gradients they correct (`Reducer.residual_specs`)."""
    mesh = layout.mesh
    replicated = NamedSharding(mesh, P())
    opt_shardings = opt_state_sharding(model, tx, layout)
    check_optimizer(model, tx, layout)
    if offload.opt_state:
        opt_shardings = offload_lib.with_memory(opt_shardings, offload_lib.HOST_MEMORY)
    residual_specs = reducer.residual_specs()
    return TrainState(
        step=replicated, params=layout.param_shardings(), opt_state=opt_shardings,
        loss_scale=jax.tree.map(lambda _: replicated, precision_lib.init_loss_scale(policy)),
        grad_residual=jax.tree.map(lambda spec: NamedSharding(mesh, spec), residual_specs),
        rng=replicated if model.uses_key else None,
        model_state=jax.tree.map(lambda _: replicated, abstract_model_state(model)),  # small: replicated
        steps_taken=replicated if model.uses_key else None,
    )


# Fields that say how the step runs, not what it learned: restoring onto a layout whose precision,
# compression or device count gives them another shape (or none) starts them afresh instead.
TRANSIENT_FIELDS = {"loss_scale": "the fp16 loss scale", "grad_residual": "the int8 error-feedback residuals"}


def transient_initializer(model: Model, layout: Layout, policy: precision_lib.Precision, reducer: Reducer,
                          sharding: TrainState) -> Callable[[], dict[str, Any]]:
    """The jitted fresh values of `TRANSIENT_FIELDS` (the initial loss scale, zero residuals), in
    their shardings: what `shardlib.runtime.checkpoint` restores in their place."""
    def fresh():
        return {"loss_scale": precision_lib.init_loss_scale(policy),
                "grad_residual": reducer.zero_residuals(model.abstract(), layout.mesh)}

    return jax.jit(fresh, out_shardings={"loss_scale": sharding.loss_scale, "grad_residual": sharding.grad_residual})


def abstract_model_state(model: Model) -> Any:
    return None if model.init_state is None else jax.eval_shape(model.init_state, jax.random.key(0))


def initializer(model: Model, tx: optax.GradientTransformation, layout: Layout, policy: precision_lib.Precision,
                reducer: Reducer, sharding: TrainState) -> Callable[..., TrainState]:
    """The jitted ``init(key, params=None, model_state=None)``: parameters (the model's own init, or
    weights you already have) and optimizer state created directly in their shards."""
    state_shardings = layout.state_shardings()

    def init_fn(key, params=None, model_state=None):
        params = stored(model, model.init(key) if params is None else params, policy)
        if model_state is None and model.init_state is not None:
            model_state = model.init_state(key)
        in_state_layout = jax.lax.with_sharding_constraint(params, state_shardings)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(in_state_layout),
                          loss_scale=precision_lib.init_loss_scale(policy),
                          grad_residual=reducer.zero_residuals(params, layout.mesh),
                          rng=_key_data(jax.random.fold_in(key, _DROPOUT_STREAM)) if model.uses_key else None,
                          model_state=model_state,
                          steps_taken=jnp.zeros((), jnp.int32) if model.uses_key else None)

    return jax.jit(init_fn, out_shardings=sharding)


def stored(model: Model, params: Any, policy: precision_lib.Precision) -> Any:
    """``params`` in their storage dtypes: master weights in ``param_dtype``, and a frozen
    parameter (``from_nnx(wrt=...)``: a LoRA base), which is never updated, in ``compute_dtype``,
    the dtype the step hands it to the model in."""
    if model.frozen is None:
        return precision_lib.cast_floating(params, policy.param_dtype)
    return jax.tree.map(lambda p, frozen: precision_lib.cast_floating(
        p, policy.compute_dtype if frozen else policy.param_dtype), params, model.frozen)


def like_model(tree: Any, abstract: Any, what: str) -> Any:
    """``tree`` rebuilt in the structure of ``abstract`` (the model's own parameters or state), each
    leaf found by its path as `rules.path_str` spells it, so weights from elsewhere fit whatever
    container held them (a dict of a `TrainState.create`, `load_exported`'s string list indices,
    an NNX ``State``). Every missing, extra, misshapen or non-float leaf is named."""
    given = {rules_lib.path_str(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}
    wanted = jax.tree_util.tree_leaves_with_path(abstract)
    names = [rules_lib.path_str(path) for path, _ in wanted]
    problems = [f"{name}: not in the {what} given (the model has {tuple(leaf.shape)} {leaf.dtype})"
                for name, (_, leaf) in zip(names, wanted) if name not in given]
    problems += [f"{name}: in the {what} given, not in the model" for name in sorted(given.keys() - set(names))]
    for name, (_, leaf) in zip(names, wanted):
        mine = given.get(name)
        if mine is None:
            continue
        if tuple(jnp.shape(mine)) != tuple(leaf.shape):
            problems.append(f"{name}: {tuple(jnp.shape(mine))} given, the model's is {tuple(leaf.shape)}")
        elif jnp.issubdtype(leaf.dtype, jnp.inexact) != jnp.issubdtype(jnp.result_type(mine), jnp.inexact):
            problems.append(f"{name}: {jnp.result_type(mine)} given, the model's is {leaf.dtype}")
    if problems:
        raise ValueError(f"the {what} given do not fit this model {rules_lib.describe_mismatches(problems)}; "
                         f"pass the {what} of the same model (paths as in jax.tree_util.tree_leaves_with_path)")
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(abstract), [given[name] for name in names])
