"""Mixed precision: which dtype the weights are stored, computed and reduced in, and fp16 loss scaling.

Master weights and optimizer state stay in ``param_dtype`` (float32). Before the forward pass
the step casts the (local shards of the) weights to ``compute_dtype``; under ZeRO-3 the cast
happens before the all-gather, so the gathers and the gradient reduce-scatters move half the
bytes, as in FSDP's mixed precision. Models keep their own numerically sensitive parts in
float32 (norm statistics, softmax, logits, loss).

float16 has too little range for raw gradients, so ``fp16`` scales the loss: the scale doubles
after ``growth_interval`` finite steps and halves on a step whose gradients overflow, which is
then skipped. Non-finite gradients are detected (and their step skipped) in every precision.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from shardlib.registry import lookup


@dataclasses.dataclass(frozen=True)
class Precision:
    name: str
    param_dtype: Any = jnp.float32
    compute_dtype: Any = jnp.float32
    dynamic_loss_scale: bool = False
    initial_scale: float = 2.0**15
    growth_interval: int = 200
    # Cast the weight shards before the ZeRO-3 all-gather (half the bytes on the wire). None:
    # yes, except on XLA:CPU, which aborts compiling some low-precision reduce-scatters (a
    # ChangeOpDataType check failure seen on jaxlib 0.10.2) and upcasts those collectives to
    # float32 anyway, so casting after the gather costs nothing there.
    cast_before_gather: bool | None = None

    def casts_before_gather(self, platform: str) -> bool:
        if self.cast_before_gather is not None:
            return self.cast_before_gather
        return platform != "cpu"


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
