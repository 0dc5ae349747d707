"""Small things users trip over, each said once and plainly: a MaxText-style activation name no rule
maps, a random key left in the batch, ``model.apply`` on a ``from_functions`` model given no apply
function, and a loss that must draw noise in evaluation (a VAE's reparameterisation) under NNX and
``from_functions``. Training and evaluation are compared with one-device ``jax.jit`` references."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import shardlib
from shardlib import build, from_functions, from_linen, from_nnx, make_layout, make_mesh
from tests import zoo

ROWS = 16


class MaxTextMlp(nn.Module):
    """Activation names from MaxText's rule table, which no built-in strategy knows."""

    @nn.compact
    def __call__(self, x):
        named = lambda names: nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)
        x = nn.with_logical_constraint(x, ("activation_batch", "activation_embed"))
        h = nn.with_logical_constraint(nn.gelu(nn.Dense(32, kernel_init=named(("embed", "mlp")))(x)),
                                       ("activation_batch", "activation_mlp"))
        return nn.Dense(8, kernel_init=named(("mlp", "embed")))(h)


def mse(out, batch):
    return jnp.mean((out - batch["y"]) ** 2)


def test_unknown_activation_names_and_batch_keys_warn_once_and_a_missing_apply_says_what_to_pass():
    batches = [{**zoo.regression_batch(seed), "rng": jax.random.key(7)} for seed in range(3)]  # pure-JAX loop style
    model = from_linen(MaxTextMlp(), mse, batches[0], inputs=lambda b, train: ((b["x"],), {}), rng_streams=())
    program = build(model, optax.adam(1e-2), make_layout(model, "tp", make_mesh({"data": 4, "tensor": 2})))
    state = program.init(jax.random.key(0))
    params = jax.tree.map(np.asarray, state.params)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # as notebooks and test suites set it: still once each
        state, losses = zoo.program_steps(program, state, batches)
        program.evaluate(state.params, batches[0])
    key_warning, names_warning = sorted(str(w.message) for w in seen)  # one each, for 3 steps and evaluate
    assert key_warning.startswith("batch 'rng' looks like a random key")
    assert "activation names 'activation_batch', 'activation_embed', 'activation_mlp'" in names_warning
    assert "strategy 'tp'" in names_warning and "get_strategy('tp').with_logical_rules(rules)" in names_warning
    _, expected = zoo.plain_steps(lambda p, b: mse(MaxTextMlp().apply({"params": p}, b["x"]), b), params,
                                  optax.adam(1e-2), batches)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)

    plain = from_functions(zoo.mlp_init, zoo.mlp_loss)
    assert not plain.apply
    with pytest.raises(TypeError, match=r"without an apply function.*from_functions\(init, loss_fn, apply=fn\)"):
        plain.apply(zoo.mlp_init(jax.random.key(0)), batches[0]["x"])


class VAE(nnx.Module):
    """The NNX VAE pattern: the module keeps its rngs and draws the reparameterisation noise in
    evaluation too."""

    def __init__(self, rngs):
        self.encoder = nnx.Linear(32, 8, rngs=rngs)
        self.decoder = nnx.Linear(4, 32, rngs=rngs)
        self.rngs = rngs

    def __call__(self, x):
        mean, logvar = jnp.split(self.encoder(x), 2, axis=-1)
        z = mean + jnp.exp(0.5 * logvar) * jax.random.normal(self.rngs.noise(), mean.shape)
        return self.decoder(z), z


def vae_loss(module, batch):
    reconstruction, z = module(batch["x"])
    spread = jnp.std(shardlib.gather_batch(z)[:, 0])  # over every device's rows: 0 if all drew alike
    return jnp.mean((reconstruction - batch["x"]) ** 2), {"z_spread": spread}


def noisy_init(key):
    return {"w": jax.random.normal(key, (32, 8)) / 6}


def noisy_loss(params, batch, call):
    z = batch["x"] @ params["w"] + jax.random.normal(call.key, (batch["x"].shape[0], 8))
    return jnp.mean((z - batch["y"]) ** 2)


def test_evaluation_that_draws_noise_uses_a_fixed_key_per_device():
    mesh, batch = make_mesh({"data": 8}), zoo.regression_batch(0, ROWS)
    same = np.tile(batch["x"][:1], (ROWS, 1))  # every row alike: only the keys can tell devices apart
    vae = from_nnx(VAE, vae_loss, eval_rng_streams=("noise",))
    program = build(vae, optax.sgd(0.1), make_layout(vae, "dp", mesh))
    params = program.init(jax.random.key(0)).params
    first, again = (program.evaluate(params, {"x": same}) for _ in range(2))
    assert float(first["z_spread"]) > 0.1  # each device its own noise
    assert jax.tree.map(float, first) == jax.tree.map(float, again)  # and the same on every call

    model = from_functions(noisy_init, noisy_loss, takes_call=True, eval_key=True)
    program = build(model, optax.sgd(0.1), make_layout(model, "dp", mesh))
    params = program.init(jax.random.key(0)).params
    rows = ROWS // 8

    @jax.jit
    def reference(params, batch):  # one device: device d's rows with fold_in(key(0), d), as documented
        call = lambda d: shardlib.model.Call(key=jax.random.fold_in(jax.random.key(0), d), train=False)
        part = lambda d: jax.tree.map(lambda x: x[d * rows:(d + 1) * rows], batch)
        return jnp.mean(jnp.stack([noisy_loss(params, part(d), call(d)) for d in range(8)]))

    np.testing.assert_allclose(program.evaluate(params, batch)["loss"],
                               reference(jax.tree.map(np.asarray, params), batch), rtol=1e-6)
