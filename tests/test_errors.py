"""Bad input is refused with a message that names the tensor, axis or batch and says what to do."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from shardlib.models import GPTConfig, trainable
from shardlib import RuleError, build, from_functions, make_layout, make_mesh
from shardlib.sharding.strategies import get_strategy


def test_indivisible_dimension_when_replication_is_forbidden():
    # d_model=36 cannot be split over 8 fsdp devices; the mlp/heads fallbacks take over for
    # matrices, but the norm scales (36,) have nothing else to shard and stay replicated.
    model = trainable(GPTConfig(vocab_size=256, d_model=36, n_layers=1, n_heads=2, d_ff=64, max_seq_len=16))
    mesh = make_mesh({"fsdp": 8})
    layout = make_layout(model, "zero3", mesh)  # allowed by default, and reported
    assert "not divisible by fsdp=8" in layout.report()
    with pytest.raises(RuleError, match=r"final_norm/scale \(36,\): dim 0 \(embed=36\) not divisible by fsdp=8"):
        make_layout(model, "zero3", mesh, max_replicated_bytes=0)


def test_batch_not_divisible_by_the_data_axes():
    model = from_functions(lambda key: {"w": jnp.zeros((4, 4))}, lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2),
                           logical_axes={"w": ("embed", "mlp")})
    program = build(model, optax.sgd(0.1), make_layout(model, "dp", make_mesh({"data": 8})))
    state = program.init(jax.random.key(0))
    with pytest.raises(ValueError, match="batch 'x' has 12 rows, which the 8 data-parallel devices .* use a multiple of 8 such as 8"):
        program.step(state, {"x": np.ones((12, 4), np.float32)})


def test_unknown_strategy_lists_the_choices():
    with pytest.raises(ValueError, match="unknown strategy 'zero4'; choose one of dp, zero1"):
        get_strategy("zero4")


def test_model_that_does_not_gather_what_it_declares():
    """A model claiming to gather its own weights but skipping one is caught when the step traces."""
    from flax import nnx

    class Forgetful(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(jnp.ones((8, 8)), out_sharding=("embed", "mlp"))

        def __call__(self, x):
            return x @ self.w[...]

    from shardlib import from_nnx

    model = from_nnx(Forgetful, lambda m, b: jnp.mean(m(b["x"])), gathers_params=True)
    program = build(model, optax.sgd(0.1), make_layout(model, "zero3", make_mesh({"fsdp": 8})))
    state = program.init(jax.random.key(0))
    with pytest.raises(ValueError, match="never passed w through shardlib.model.hooks.gather_layer"):
        program.step(state, {"x": np.ones((8, 8), np.float32)})
