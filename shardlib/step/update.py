"""The update half of the step (GSPMD): unscale the reduced gradients, run the optax update in
the optimizer-state layout, reshard the new parameters to storage (ZeRO-1/2's all-gather), and
skip the whole update, counted, when the loss or the gradient norm is not finite.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from shardlib.step import buckets as buckets_lib
from shardlib.step import offload as offload_lib
from shardlib.step import precision as precision_lib
from shardlib.step.state import TrainState, took_step


def loss_scale(state: TrainState) -> jax.Array:
    """The scale this step's gradients are taken of: fp16's dynamic loss scale, else 1."""
    return jnp.ones((), jnp.float32) if state.loss_scale is None else state.loss_scale["scale"]


def _learning_rates(opt_state: Any, step: jax.Array, schedule: Callable | None) -> dict[str, jax.Array]:
    """``{"lr": rate}``: the schedule's, else the one injected hyperparameter; several injected
    rates (``multi_transform`` of ``inject_hyperparams``) each as ``lr/<label or chain index>``.
    Under ``MultiSteps`` the schedule runs on its update count (``gradient_step``), as the rate applied does."""
    if schedule is not None:
        counts = optax.tree_utils.tree_get_all_with_path(opt_state, "gradient_step")
        return {"lr": jnp.asarray(schedule(counts[0][1] if len(counts) == 1 else step), jnp.float32)}
    found = optax.tree_utils.tree_get_all_with_path(opt_state, "learning_rate")
    if len(found) == 1:
        return {"lr": jnp.asarray(found[0][1], jnp.float32)}
    return {f"lr/{_label(path)}": jnp.asarray(value, jnp.float32) for path, value in found}


def optimizer_update(tx: Any, grads: Any, opt_state: Any, params: Any, loss: jax.Array) -> tuple[Any, Any]:
    """``tx.update``, given the step's loss as ``value=`` where it takes extra arguments (optax's
    chains, ``MultiSteps``): ``optax.contrib.reduce_on_plateau`` needs it, the others drop it."""
    accepts = inspect.signature(tx.update).parameters.values()
    if any(p.kind is p.VAR_KEYWORD or p.name == "value" for p in accepts):
        return tx.update(grads, opt_state, params, value=loss)
    return tx.update(grads, opt_state, params)


def _label(path: tuple[Any, ...]) -> str:
    """A rate's place in the optimizer: its ``multi_transform`` labels and chain indices."""
    keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path[:-1]
            if not isinstance(k, optax.tree_utils.NamedTupleKey)]
    return "/".join(str(k) for k in keys if k is not None)


@dataclasses.dataclass(frozen=True)
class Update:
    """``(state, reduced grads, loss) -> new state``, and the step's metrics."""

    tx: optax.GradientTransformation
    policy: precision_lib.Precision
    state_shardings: Any  # the optimizer-state layout of the parameters
    param_shardings: Any  # their storage layout
    lr_schedule: Callable | None = None
    # The optimizer state's device shardings when it lives in host memory (offload="opt_state"), else None.
    offloaded: Any = None
    # ZeRO-1/2's all-gather of the new parameters in buckets of this many bytes (`buckets.gather`); 0: per tensor.
    gather_bucket_bytes: int = 0

    def _opt_state_to(self, opt_state: Any, kind: str) -> Any:
        """The optimizer state moved to memory ``kind``; unchanged without offload."""
        return opt_state if self.offloaded is None else offload_lib.to_memory(opt_state, self.offloaded, kind)

    def __call__(self, state: TrainState, grads: Any, loss: jax.Array, scale: jax.Array,
                 produced: dict[str, Any]) -> tuple[TrainState, jax.Array, jax.Array]:
        """-> (new state, gradient norm, finite). ``produced``: state fields the gradient pass
        computed (e.g. ``grad_residual``), adopted only when the step is applied."""
        if state.loss_scale is not None:  # fp16 only: without a loss scale there is nothing to divide by
            grads = jax.tree.map(lambda g: g / scale, grads)
        grads = jax.lax.with_sharding_constraint(grads, self.state_shardings)
        params_s = jax.lax.with_sharding_constraint(state.params, self.state_shardings)
        # The skip test reads only the loss and the norm the metrics report anyway: a NaN or inf
        # anywhere in the gradients makes their norm non-finite, so no other pass over them is needed.
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        opt_in = self._opt_state_to(state.opt_state, offload_lib.DEVICE_MEMORY)  # host -> device when offloaded

        def apply_update(_):
            updates, opt_state = optimizer_update(self.tx, grads, opt_in, params_s, loss)
            return optax.apply_updates(params_s, updates), opt_state, produced

        def skip_update(_):
            return params_s, opt_in, {name: getattr(state, name) for name in produced}

        # A branch, not a select over the whole state: only one side runs, and no second copy
        # of the parameters and optimizer state stays alive for the select.
        # Not optax.apply_if_finite: it wraps opt_state, checks gradients only and keeps no residuals or step count.
        shards, opt_state, produced = jax.lax.cond(finite, apply_update, skip_update, None)
        # ZeRO-1/2's all-gather runs after the branch, on the state shards either side returns (a
        # skipped step gathers the old parameters back exactly): the branch's outputs stay
        # shard-sized and the gather writes the output parameters directly.
        params = buckets_lib.gather(shards, self.state_shardings, self.param_shardings, self.gather_bucket_bytes)
        new_state = dataclasses.replace(
            state,
            step=state.step + finite.astype(jnp.int32),
            params=params,
            opt_state=self._opt_state_to(opt_state, offload_lib.HOST_MEMORY),  # back to the host when offloaded
            loss_scale=precision_lib.update_loss_scale(state.loss_scale, finite, self.policy),
            **produced,
        )
        return took_step(new_state), grad_norm, finite  # the dropout keys advance on skipped steps too

    def metrics(self, state: TrainState, loss: jax.Array, aux: dict[str, jax.Array], grad_norm: jax.Array,
                finite: jax.Array) -> dict[str, jax.Array]:
        """The step's metrics, from the state it started from."""
        metrics = {"loss": loss, "grad_norm": grad_norm, "skipped": (~finite).astype(jnp.int32), **aux}
        if state.loss_scale is not None:
            metrics["loss_scale"] = state.loss_scale["scale"]
        opt_state = self._opt_state_to(state.opt_state, offload_lib.DEVICE_MEMORY)  # only the rate is read
        return {**metrics, **_learning_rates(opt_state, state.step, self.lr_schedule)}
