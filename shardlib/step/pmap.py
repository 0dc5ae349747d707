"""Data parallelism the ``jax.pmap`` way, for code that still uses it.

Each device holds a full replica with a leading device axis and runs the per-device step; the
gradients are averaged with ``lax.pmean``. Numerically this is the `dp` strategy (tests check
both against one device); new code should prefer `shardlib.build` with a mesh.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from shardlib.model import Model, hooks
from shardlib.step import axis_names
from shardlib.step import grads as grads_lib


def replicate(tree: Any, n_devices: int | None = None) -> Any:
    """Stack ``tree`` ``n_devices`` times along a new leading axis (pmap places one copy per device)."""
    n = n_devices or jax.local_device_count()
    return jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (n, *np.shape(x))), tree)


def split_batch(batch: Any, n_devices: int) -> Any:
    """``[B, ...]`` -> ``[n_devices, B / n_devices, ...]``, with a clear error when B does not divide."""

    def split(x):
        if x.shape[0] % n_devices:
            raise ValueError(f"batch of {x.shape[0]} rows cannot be split over {n_devices} devices for pmap")
        return x.reshape(n_devices, x.shape[0] // n_devices, *x.shape[1:])

    return jax.tree.map(split, batch)


def pmap_step(model: Model, tx: optax.GradientTransformation, axis_name: str = "data") -> Callable:
    """``step(params, opt_state, batch) -> (params, opt_state, metrics)``, pmapped over ``axis_name``."""
    grads_lib.refuse_key_and_state(model, "pmap_step", "use shardlib.build(model, tx, layout) (its axis_name= binds "
                                   "a pmap-era name your modules use, nn.BatchNorm(axis_name='batch'), to the batch axes)")

    def step(params, opt_state, batch):
        try:
            with hooks.compute_context(hooks.pmap_context(axis_name)):  # global_mean, gather_batch over axis_name
                (loss, aux), grads = jax.value_and_grad(lambda p: model.loss(p, batch, None), has_aux=True)(params)
        except Exception as err:
            axis_names.raise_unbound_axis(err, (axis_name,), None, step="pmap_step")
            raise
        grads = jax.lax.pmean(grads, axis_name)
        updates, opt_state = tx.update(grads, opt_state, params)
        metrics = {"loss": jax.lax.pmean(loss, axis_name), "grad_norm": optax.tree.norm(grads),
                   **jax.lax.pmean(aux, axis_name)}
        return optax.apply_updates(params, updates), opt_state, metrics

    return jax.pmap(step, axis_name=axis_name, donate_argnums=(0, 1))


def unreplicate(tree: Any) -> Any:
    """The first replica of a pmapped tree."""
    return jax.tree.map(lambda x: jnp.asarray(x[0]), tree)
