"""Trees users bring from elsewhere, matched to the model's own containers.

Pretrained weights, a Flax ``TrainState``'s fields, an NNX ``State``, `load_exported`'s trees:
`TrainProgram.init_from` and ``program.evaluate`` take them as they come and match them to the
model by path (`shardlib.step.state.like_model`). The usual mistakes (a whole train state,
``module.init``'s variables, a ``jax.pmap`` script's replicated copy) are refused here naming the
call to write, where matching by path would list every tensor as missing or misshapen.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from shardlib.model import Model
from shardlib.sharding import rules as rules_lib
from shardlib.step.state import TrainState, abstract_model_state, like_model

__all__ = ["continued", "in_model_containers", "leaf_paths", "one_entry", "pure", "refuse_init_mistakes",
           "refuse_replicated", "refuse_train_state"]


def leaf_paths(tree: Any) -> set[str]:
    return {rules_lib.path_str(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)}


def pure(tree: Any) -> Any:
    """An NNX ``State`` as the plain nested dict its paths spell; any other tree as it is."""
    return tree.to_pure_dict() if callable(getattr(tree, "to_pure_dict", None)) else tree


def one_entry(given: Any, expected: Any) -> Any:
    """``{"batch_stats": given}`` when the model's state has that one top-level entry and ``given`` is
    exactly its tree: a Flax ``TrainState`` holds ``state.batch_stats`` without the collection's name,
    and nothing else could be meant. Any other tree is returned as it is, to be matched by path."""
    if not isinstance(expected, Mapping) or len(expected) != 1:
        return given
    (name, tree), = expected.items()
    return {name: given} if leaf_paths(given) == leaf_paths(tree) else given


def _is_train_state(given: Any) -> bool:
    return hasattr(given, "params") and hasattr(given, "opt_state")


def refuse_train_state(given: Any, model: Model) -> None:
    """A whole train state passed to ``evaluate`` as the parameters: name the fields to pass,
    where jit would fail on a pytree structure naming neither."""
    if _is_train_state(given):
        state_arg = ", state.model_state" if model.stateful else ""
        raise ValueError(f"evaluate takes the parameters, and got a whole train state: write "
                         f"program.evaluate(state.params, batch{state_arg})")


def refuse_init_mistakes(given: Any, model: Model) -> None:
    """A whole Flax ``TrainState`` (or shardlib's) or ``module.init``'s variables passed to
    ``init_from`` as the parameters: say which fields to pass."""
    collections = list(abstract_model_state(model) or {})
    if _is_train_state(given):
        held = [c for c in collections if hasattr(given, c)]
        kept = f"{{{', '.join(f'{c!r}: state.{c}' for c in held)}}}" if held else "state.model_state"
        state_arg = f", model_state={kept}" if collections else ""
        raise ValueError(f"init_from takes the parameters, and got a whole train state: write "
                         f"program.init_from(state.params{state_arg}, opt_state=state.opt_state, step=state.step) to "
                         f"continue its run (the same optimizer), or program.init_from(state.params{state_arg}) to "
                         "start a fresh optimizer state from its weights")
    abstract = model.abstract()
    if isinstance(given, Mapping) and "params" in given and not (isinstance(abstract, Mapping) and "params" in abstract):
        kept = f"{{{', '.join(f'{c!r}: variables[{c!r}]' for c in collections)}}}"
        state_arg = f", model_state={kept}" if collections else ""
        raise ValueError(f"init_from takes the parameters, and got module.init's whole variables (collections "
                         f"{', '.join(map(repr, given))}): write program.init_from(variables['params']{state_arg})")


def refuse_replicated(given: Any, expected: Any, field: str) -> None:
    """Every leaf with one extra leading axis of the same size is a pmap script's
    ``flax.jax_utils.replicate``'d state, one copy per device: name it and the fix, where matching
    by path would call every tensor misshapen."""
    shapes = [tuple(np.shape(leaf)) for leaf in jax.tree.leaves(given)]
    wanted = [tuple(leaf.shape) for leaf in jax.tree.leaves(expected)]
    copies = {shape[:1] for shape in shapes}
    if not all(shapes) or len(copies) != 1 or [shape[1:] for shape in shapes] != wanted:
        return
    raise ValueError(f"init_from: every tensor given has a leading axis of {copies.pop()[0]} the model's has not: "
                     f"a jax.pmap script's replicated state (flax.jax_utils.replicate); pass one copy, "
                     f"flax.jax_utils.unreplicate(state).{field} (or jax.tree.map(lambda x: x[0], ...))")


def continued(state: TrainState, opt_state: Any, step: Any, sharding: TrainState) -> TrainState:
    """``state`` with another run's optimizer state and step number, each leaf matched by path
    (optax's state of the same chain over the same parameters), placed in its shards in its dtype."""
    if opt_state is not None:
        refuse_replicated(opt_state, state.opt_state, "opt_state")
        given = like_model(opt_state, state.opt_state, "optimizer state")
        placed = jax.device_put(given, sharding.opt_state)
        state = dataclasses.replace(state, opt_state=jax.tree.map(lambda x, a: x.astype(a.dtype), placed,
                                                                     state.opt_state))
    if step is not None:
        state = dataclasses.replace(state, step=jax.device_put(np.asarray(step, np.int32), sharding.step))
        if state.steps_taken is not None:  # the dropout keys go on from the step given
            state = dataclasses.replace(state, steps_taken=jax.device_put(np.asarray(step, np.int32),
                                                                          sharding.steps_taken))
    return state


def in_model_containers(given: Any, expected: Callable[[], Any], what: str) -> Any:
    """``given`` in the model's own containers: as it is when it already has them (the train
    state's trees), else matched by path (`like_model`), so weights held elsewhere evaluate as they
    come (a ``FrozenDict``, an NNX ``State``, ``load_exported``'s trees, a Flax ``TrainState``'s
    ``batch_stats`` without its collection's name) and a tree of another model is named by path,
    where jit would fail on a pytree structure. ``expected`` returns the abstract tree (cached)."""
    abstract = expected()
    if jax.tree.structure(given) == jax.tree.structure(abstract):
        return given
    return like_model(pure(given), abstract, what)
