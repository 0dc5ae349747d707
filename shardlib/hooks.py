"""The two calls model code makes so that one model definition serves every strategy.

* ``constrain(x, ("batch", "seq", "embed"))`` pins an activation to the strategy's compute
  layout (tensor-parallel axes only: batch axes are manual inside the train step).
* ``gather_layer(layer_state)`` is called at the top of a scanned layer body. Under ZeRO-3 /
  FSDP it all-gathers that one layer's parameter shards, so full weights exist only while the
  layer runs (and, under remat, are gathered again in the backward pass); its transpose is the
  reduce-scatter of the gradients. Everywhere else it returns its input unchanged.

Both are no-ops outside a shardlib step, so the same model runs eagerly on one device.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

SPEC_METADATA = "shardlib_spec"  # Variable metadata: the parameter's storage spec (manual axes only)


@dataclasses.dataclass
class ComputeContext:
    """What the step engine tells model code while it traces the per-device body."""

    activation_spec: Callable[[Sequence[str | None], tuple[int, ...]], P]
    manual_axes: tuple[str, ...]
    layer_gathers: int = 0  # how many times gather_layer ran during tracing (checked by the engine)


_CONTEXT: contextvars.ContextVar[ComputeContext | None] = contextvars.ContextVar(
    "shardlib_compute_context", default=None
)


@contextlib.contextmanager
def compute_context(ctx: ComputeContext) -> Iterator[ComputeContext]:
    token = _CONTEXT.set(ctx)
    try:
        yield ctx
    finally:
        _CONTEXT.reset(token)


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """Sharding constraint from logical axis names; identity outside a shardlib step."""
    ctx = _CONTEXT.get()
    if ctx is None:
        return x
    if len(logical_axes) != x.ndim:
        raise ValueError(f"constrain: {len(logical_axes)} logical axes {tuple(logical_axes)} for an array of shape {x.shape}")
    spec = ctx.activation_spec(logical_axes, x.shape)
    if all(entry is None for entry in spec):
        return x
    return jax.lax.with_sharding_constraint(x, spec)


def all_gather_spec(x: jax.Array, spec: Sequence[Any]) -> jax.Array:
    """All-gather ``x`` along every dimension whose spec entry names mesh axes."""
    for dim, axes in enumerate(spec):
        if axes:
            x = jax.lax.all_gather(x, axes, axis=dim, tiled=True)
    return x


def _gather_variable(variable: Any) -> Any:
    spec = variable.get_metadata().get(SPEC_METADATA) if hasattr(variable, "get_metadata") else None
    if not spec:
        return variable
    value = variable.get_value() if hasattr(variable, "get_value") else variable.value
    spec = tuple(spec)
    if len(spec) == value.ndim + 1:  # a slice of a scanned stack: drop the 'layers' entry
        spec = spec[1:]
    if len(spec) != value.ndim:
        raise ValueError(f"gather_layer: spec {spec} does not fit a parameter of shape {value.shape}")
    return variable.replace(all_gather_spec(value, spec))


def gather_layer(layer_state: Any) -> Any:
    """Gather one scanned layer's parameter shards (ZeRO-3); identity otherwise."""
    ctx = _CONTEXT.get()
    if ctx is None:
        return layer_state
    ctx.layer_gathers += 1
    from flax import nnx  # local: keep `import shardlib.hooks` light

    return jax.tree.map(_gather_variable, layer_state, is_leaf=lambda v: isinstance(v, nnx.Variable))
