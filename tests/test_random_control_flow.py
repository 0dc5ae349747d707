"""Randomness and control flow inside a user's loss, inside the step: mixup with a Beta draw and a
permutation of the rows, flips, crops and random erasing, label noise, stochastic depth, and a
diffusion loss (timesteps, noise, a schedule table, a ``fori_loop`` from zeros, a ``lax.cond``).

Each device draws from its own key by design, so the one-device reference (plain ``jax.jit`` +
optax) computes the loss of each device's rows with that device's documented key (the step's key
``fold_in(TrainState.rng, step)`` with the device index folded in) and averages them."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

import shardlib
from shardlib import build, from_functions, make_layout, make_mesh
from tests import zoo

SEQ, FEATURES, CLASSES, STEPS_T, DEVICES = 4, 8, 5, 10, 8


def _batches(n=2, rows=16):
    rng = np.random.default_rng(0)
    return [{"x": rng.normal(size=(rows, SEQ, FEATURES)).astype(np.float32),
             "label": rng.integers(0, CLASSES, rows).astype(np.int32)} for _ in range(n)]


class ResMLP(nn.Module):
    """big_vision-style residual blocks over tokens, stochastic depth as a whole-row dropout."""

    @nn.compact
    def __call__(self, x, train):
        x = nn.Dense(32)(x)
        for _ in range(2):
            y = nn.gelu(nn.Dense(32)(nn.LayerNorm()(x)))
            x = x + nn.Dropout(0.25, broadcast_dims=(1, 2), deterministic=not train)(y)
        return nn.Dense(CLASSES)(x.mean(axis=1))


def mixup_loss(params, batch, call):
    """Flip, crop, erase a Poisson number of tokens, mix up rows, noisy labels, then the model."""
    k_flip, k_crop, k_erase, k_lam, k_perm, k_noise, k_drop = jax.random.split(call.key, 7)
    x, rows = batch["x"], batch["x"].shape[0]
    x = jnp.where(jax.random.bernoulli(k_flip, 0.5, (rows, 1, 1)), x[:, ::-1], x)
    x = jax.lax.dynamic_slice_in_dim(x, jax.random.randint(k_crop, (), 0, 2), SEQ - 1, axis=1)
    erased = jax.random.poisson(k_erase, shardlib.batch_varying(jnp.full((rows, 1), 1.0)))  # the sampler's loop
    x = jnp.where((jnp.arange(SEQ - 1) < erased)[:, :, None], 0.0, x)
    # label noise: jax.random.choice(k, CLASSES, (rows,), p=probs) fails in the step (docs): categorical draws the same
    probs = jnp.full((CLASSES,), 0.1 / (CLASSES - 1)).at[0].set(0.9)
    labels = (batch["label"] + jax.random.categorical(k_noise, jnp.log(probs), shape=(rows,))) % CLASSES
    y = jax.nn.one_hot(labels, CLASSES)
    lam, perm = jax.random.beta(k_lam, 0.2, 0.2), jax.random.permutation(k_perm, rows)
    x, y = lam * x + (1 - lam) * x[perm], lam * y + (1 - lam) * y[perm]
    logits = ResMLP().apply({"params": params}, x, train=call.train, rngs={"dropout": k_drop})
    return optax.softmax_cross_entropy(logits, y).mean()


class Denoiser(nn.Module):
    @nn.compact
    def __call__(self, x, t):
        h = nn.Dense(128)(x) + nn.Embed(STEPS_T, 128)(t)[:, None]
        return nn.Dense(FEATURES)(nn.silu(h))


def diffusion_loss(params, batch, call):
    """DDPM's noise-prediction loss, refined by a fixed-point loop from zeros, with a cond on t."""
    alphas_bar = jnp.cumprod(1.0 - jnp.linspace(1e-3, 0.3, STEPS_T))
    k_t, k_noise = jax.random.split(call.key)
    x0 = batch["x"]
    t = jax.random.randint(k_t, (x0.shape[0],), 0, STEPS_T)
    noise = jax.random.normal(k_noise, x0.shape)
    ab = alphas_bar[t][:, None, None]
    pred = Denoiser().apply({"params": params}, jnp.sqrt(ab) * x0 + jnp.sqrt(1 - ab) * noise, t)
    refined = jax.lax.fori_loop(0, 3, lambda i, z: 0.5 * (z + pred),
                                shardlib.batch_varying(jnp.zeros(x0.shape)))  # the documented recipe
    late = jax.lax.cond(t.max() > STEPS_T // 2, lambda: jnp.mean((refined - noise) ** 2),
                        lambda: shardlib.batch_varying(jnp.float32(0.0)))
    err = jax.lax.associative_scan(jnp.add, (pred - noise) ** 2, axis=1)
    return jnp.mean(jnp.cumsum(err, axis=2)) / FEATURES + 0.1 * late


def _linen_init(module, *example):
    return lambda key: module.init(key, *example)["params"]


CASES = {
    "mixup_dp": (mixup_loss, _linen_init(ResMLP(), jnp.zeros((2, SEQ - 1, FEATURES)), False), {"data": 8}, "dp"),
    "diffusion_zero3": (diffusion_loss, _linen_init(Denoiser(), jnp.zeros((2, SEQ, FEATURES)), jnp.zeros(2, jnp.int32)),
                        {"fsdp": 8}, "zero3"),
}


def _per_device_reference(loss_fn):
    """The step's loss on one device: each device's rows with that device's key, averaged."""
    def device_loss(params, rows, d, key):
        return loss_fn(params, rows, types.SimpleNamespace(key=jax.random.fold_in(key, d), train=True))

    def loss(params, batch):
        rows = jax.tree.map(lambda x: x.reshape(DEVICES, -1, *x.shape[1:]), batch["rows"])
        return jax.vmap(device_loss, (None, 0, 0, None))(params, rows, jnp.arange(DEVICES), batch["key"]).mean()
    return loss


@pytest.mark.parametrize("case", sorted(CASES))
def test_random_augmentation_and_diffusion_losses_train_like_one_device_with_the_steps_keys(case):
    loss_fn, init, mesh, strategy = CASES[case]
    model = from_functions(init, loss_fn, takes_call=True)
    tx, batches = optax.adam(1e-2), _batches()
    program = build(model, tx, make_layout(model, strategy, make_mesh(mesh)))
    state = program.init(jax.random.key(0))
    seed, start = jax.random.wrap_key_data(np.asarray(state.rng)), jax.tree.map(np.asarray, state.params)
    state, losses = zoo.program_steps(program, state, batches)
    keyed = [{"rows": b, "key": jax.random.fold_in(seed, s)} for s, b in enumerate(batches)]
    expected, expected_losses = zoo.plain_steps(_per_device_reference(loss_fn), start, tx, keyed)
    assert np.all(np.isfinite(losses)) and losses[0] != losses[1]
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=1e-6), state.params, expected)


def _cond_returning_a_constant(params, batch, call):
    loss = diffusion_loss(params, batch, call)
    return jax.lax.cond(loss > 1.0, lambda: loss, lambda: jnp.float32(1.0))


def _poisson_from_a_constant_rate(params, batch, call):
    return diffusion_loss(params, batch, call) * jax.random.poisson(call.key, 3.0, (2,)).mean()


def _choice_with_probabilities(params, batch, call):
    noise = jax.random.choice(call.key, STEPS_T, (batch["x"].shape[0],), p=jnp.full((STEPS_T,), 1.0 / STEPS_T))
    return diffusion_loss(params, batch, call) * noise.mean()


@pytest.mark.parametrize("loss_fn, error, recipe", [
    (_cond_returning_a_constant, TypeError, "return shardlib.batch_varying(constant) from that branch"),
    (_poisson_from_a_constant_rate, TypeError, "jax.random.poisson(key, shardlib.batch_varying(rate), shape)"),
    (_choice_with_probabilities, AssertionError, "jax.random.categorical(key, jnp.log(probs), shape=shape)"),
])
def test_constants_meeting_the_rows_in_control_flow_are_told_what_to_write(loss_fn, error, recipe):
    _, init, _, _ = CASES["diffusion_zero3"]
    model = from_functions(init, loss_fn, takes_call=True)
    program = build(model, optax.sgd(0.1), make_layout(model, "dp", make_mesh({"data": 8})))
    with pytest.raises(error) as caught:
        program.step(program.init(jax.random.key(0)), _batches(1)[0])
    assert recipe in "\n".join(caught.value.__notes__)
