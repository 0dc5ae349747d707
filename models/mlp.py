"""A small MLP regressor: the shape of a user's own model, annotated for shardlib's rules."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from shardlib.model.hooks import constrain


class MLP(nnx.Module):
    """``x -> w_out(gelu(x w_in + b_in)) + b_out`` with ``x: float32[batch, features]``."""

    def __init__(self, features: int, hidden: int, *, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.w_in = nnx.Param(init(rngs.params(), (features, hidden)), out_sharding=("embed", "mlp"))
        self.b_in = nnx.Param(jnp.zeros((hidden,)), out_sharding=("mlp",))
        self.w_out = nnx.Param(init(rngs.params(), (hidden, features)), out_sharding=("mlp", "embed"))
        self.b_out = nnx.Param(jnp.zeros((features,)), out_sharding=("embed",))

    def __call__(self, x: jax.Array) -> jax.Array:
        h = constrain(jax.nn.gelu(x @ self.w_in[...] + self.b_in[...]), ("batch", "mlp"))
        return constrain(h @ self.w_out[...] + self.b_out[...], ("batch", "embed"))


def regression_loss(model: MLP, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean squared error of ``model(batch["x"])`` against ``batch["y"]``."""
    error = model(batch["x"]) - batch["y"]
    return jnp.mean(jnp.square(error.astype(jnp.float32))), {}
