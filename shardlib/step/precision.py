"""Mixed precision: which dtype the weights are stored, computed and reduced in, and fp16 loss scaling.

Master weights and optimizer state stay in ``param_dtype`` (float32). Before the forward pass
the step casts the (local shards of the) weights to ``compute_dtype``; under ZeRO-3 on GPU/TPU
the cast happens before the all-gather (`shardlib.backend.BackendPolicy.cast_before_gather`), so
the gathers move half the bytes, as in FSDP's mixed precision. Gradients are reduced (the
reduce-scatter / all-reduce over the batch axes) in ``reduce_dtype``, float32 by default, as
PyTorch FSDP's ``MixedPrecision(reduce_dtype=torch.float32)``: the ZeRO-3 gather's backward casts
the bf16 cotangent to float32 before its reduce-scatter (`shardlib.model.hooks.gather_dim`).
``reduce_dtype=jnp.bfloat16`` (or "bf16") halves those bytes and sums in bf16. Models keep their
own numerically sensitive parts in float32 (norm statistics, softmax, logits, loss).

float16 has too little range for raw gradients, so ``fp16`` scales the loss: the scale doubles
after ``growth_interval`` finite steps and halves on a step whose gradients overflow, which is
then skipped. Non-finite gradients are detected (and their step skipped) in every precision.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from shardlib import backend as backend_lib
from shardlib.registry import lookup


# The names ``reduce_dtype`` (and `shardlib train --reduce-dtype`) accept beside a dtype.
REDUCE_DTYPES: dict[str, Any] = {"f32": jnp.float32, "bf16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class Precision:
    name: str
    param_dtype: Any = jnp.float32
    compute_dtype: Any = jnp.float32
    dynamic_loss_scale: bool = False
    initial_scale: float = 2.0**15
    growth_interval: int = 200
    # Cast the weight shards before the ZeRO-3 all-gather (half the bytes on the wire). None: as
    # the backend policy says (`shardlib.backend.BackendPolicy.cast_before_gather`: yes on GPU/TPU,
    # no on XLA:CPU, which aborts compiling some low-precision reduce-scatters and upcasts bf16
    # collectives to float32 anyway, so casting after the gather costs nothing there).
    cast_before_gather: bool | None = None
    # The dtype gradients are reduced in over the batch axes (ZeRO-3's reduce-scatter in the
    # gather's backward, the Reducer's psum / psum_scatter): float32, or bf16 for half the bytes.
    # A dtype or one of REDUCE_DTYPES' names ("f32", "bf16").
    reduce_dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        object.__setattr__(self, "reduce_dtype", parse_reduce_dtype(self.reduce_dtype))

    def casts_before_gather(self, backend: Any) -> bool:
        """Whether ZeRO-3 casts the shards before their gather on ``backend`` (a
        `shardlib.backend.BackendPolicy`, or a platform name: "cpu", "gpu", "tpu")."""
        if self.cast_before_gather is not None:
            return self.cast_before_gather
        if isinstance(backend, str):
            backend = backend_lib.get_policy(backend)
        return backend.cast_before_gather


def parse_reduce_dtype(value: Any) -> Any:
    """``reduce_dtype`` as a numpy dtype: "f32" / "bf16" (or any floating dtype jnp.dtype accepts)."""
    dtype = REDUCE_DTYPES.get(value, value) if isinstance(value, str) else value
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"reduce_dtype={value!r} is not a floating dtype; use one of {', '.join(REDUCE_DTYPES)} "
                         "(or a floating dtype such as jnp.float32)")
    return dtype


POLICIES: dict[str, Precision] = {
    "f32": Precision("f32"),
    "bf16": Precision("bf16", compute_dtype=jnp.bfloat16),
    "fp16": Precision("fp16", compute_dtype=jnp.float16, dynamic_loss_scale=True),
}


def get_precision(name: str | Precision) -> Precision:
    """The named preset, or the object itself; an unknown name lists the known ones."""
    return lookup(POLICIES, name, Precision, "precision")


def cast_floating(tree: Any, dtype: Any) -> Any:
    """Cast the floating-point leaves of ``tree`` (integers and keys untouched)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def init_loss_scale(policy: Precision) -> dict[str, jax.Array] | None:
    if not policy.dynamic_loss_scale:
        return None
    return {"scale": jnp.asarray(policy.initial_scale, jnp.float32), "good_steps": jnp.zeros((), jnp.int32)}


def update_loss_scale(state: dict[str, jax.Array] | None, finite: jax.Array, policy: Precision):
    """Halve on overflow; double after ``growth_interval`` consecutive finite steps."""
    if state is None:
        return None
    good = jnp.where(finite, state["good_steps"] + 1, 0)
    grow = good >= policy.growth_interval
    scale = jnp.where(finite, jnp.where(grow, state["scale"] * 2.0, state["scale"]), state["scale"] * 0.5)
    return {"scale": jnp.maximum(scale, 1.0), "good_steps": jnp.where(grow, 0, good)}
