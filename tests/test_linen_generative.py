"""Generative and GAN-style linen models, as their codebases write them, through `from_linen`.

The Flax examples' VAE draws its reparameterisation noise with ``self.make_rng("noise")`` on every
call, evaluation included, and returns several outputs; a GAN discriminator wraps its layers in
``nn.SpectralNorm`` (power-iteration vectors in ``batch_stats``, updated with ``update_stats``) and
``nn.WeightNorm``. References are independent of shardlib: ``module.apply`` in a one-device
``jax.jit`` + optax step (`tests.zoo`), drawing each device's and microbatch's noise with the key
docs/dropout-and-batchnorm.md "Keys" documents, and a checkpoint compared bit for bit.
"""

from __future__ import annotations

import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

import shardlib
from shardlib import Checkpointer, build, from_linen, make_layout, make_mesh
from tests import zoo
from tests.helpers import optimizer

DEVICES, MICRO = 8, 2
pytestmark = pytest.mark.filterwarnings("ignore::shardlib.ReplicationWarning")


class VAE(nn.Module):
    """The Flax examples' VAE, its noise drawn from a module stream instead of an argument."""
    latents: int = 8

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(32, name="fc1")(x))
        mean, logvar = nn.Dense(self.latents, name="fc2_mean")(h), nn.Dense(self.latents, name="fc2_logvar")(h)
        z = mean + jnp.exp(0.5 * logvar) * jax.random.normal(self.make_rng("noise"), logvar.shape)
        return nn.Dense(x.shape[-1], name="fc2_dec")(nn.relu(nn.Dense(32, name="fc1_dec")(z))), mean, logvar


class Denoiser(nn.Module):
    """A diffusion codebase's layer: dropout behind a defaulted ``train=False``."""

    @nn.compact
    def __call__(self, x, *, train=False):
        return nn.Dense(x.shape[-1])(nn.Dropout(0.1, deterministic=not train)(x))


def vae_loss(outputs, batch):
    recon, mean, logvar = outputs
    bce = optax.sigmoid_binary_cross_entropy(recon, batch["image"]).sum(-1).mean()
    return bce + (-0.5 * jnp.sum(1 + logvar - mean ** 2 - jnp.exp(logvar), -1)).mean()


class Discriminator(nn.Module):
    @nn.compact
    def __call__(self, x, *, train: bool):
        x = nn.leaky_relu(nn.WeightNorm(nn.Conv(32, (3, 3), strides=(2, 2)))(x), 0.2)
        x = nn.leaky_relu(nn.SpectralNorm(nn.Conv(32, (3, 3), strides=(2, 2)))(x, update_stats=train), 0.2)
        return nn.SpectralNorm(nn.Dense(1))(x.reshape(x.shape[0], -1), update_stats=train)[:, 0]


def gan_loss(logits, batch):
    return optax.sigmoid_binary_cross_entropy(logits, batch["real"]).mean()


def _per_device(fn, rows):
    """``fn(d, device_rows)`` averaged over the devices, device d holding rows [d*R, (d+1)*R)."""
    split = jax.tree.map(lambda x: x.reshape(DEVICES, -1, *x.shape[1:]), rows)
    return jax.vmap(fn)(jnp.arange(DEVICES), split).mean()


def test_vae_draws_noise_per_device_and_microbatch_and_evaluates_with_eval_rng_streams():
    rng = np.random.default_rng(0)
    batches = [{"image": rng.uniform(size=(16, 64)).astype(np.float32)} for _ in range(2)]
    vae, tx, call = VAE(), optax.adam(1e-3, eps=1e-5), lambda b, train: ((b["image"],), {})
    model = from_linen(vae, vae_loss, batches[0], inputs=call, rng_streams=("noise",), eval_rng_streams=("noise",))
    layout = make_layout(model, "zero3", make_mesh({"fsdp": DEVICES}))
    assert any(layout.param_shardings()["fc1"]["kernel"].spec)  # gathered where read
    program = build(model, tx, layout, grad_accum=MICRO)
    state = program.init(jax.random.key(0))
    seed, start = jax.random.wrap_key_data(np.asarray(state.rng)), jax.tree.map(np.asarray, state.params)
    state, losses = zoo.program_steps(program, state, batches)

    def apply(params, rows, key):  # the "noise" stream is rng_streams' first: fold_in(key, 0)
        return vae_loss(vae.apply({"params": params}, rows["image"], rngs={"noise": jax.random.fold_in(key, 0)}), rows)

    def reference(params, keyed):  # microbatch i of device d: fold_in(fold_in(step key, i), d)
        def device(d, rows):
            micro = jax.tree.map(lambda x: x.reshape(MICRO, -1, *x.shape[1:]), rows)
            key = lambda i: jax.random.fold_in(jax.random.fold_in(keyed["key"], i), d)
            return jax.vmap(lambda i, r: apply(params, r, key(i)))(jnp.arange(MICRO), micro).mean()
        return _per_device(device, keyed["rows"])

    keyed = [{"rows": b, "key": jax.random.fold_in(seed, s)} for s, b in enumerate(batches)]
    expected, expected_losses = zoo.plain_steps(reference, start, tx, keyed)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6), state.params, expected)

    # evaluation draws "noise" from a fixed key with the device folded in: the same on every call
    params = jax.tree.map(np.asarray, state.params)
    evaluated = [float(program.evaluate(state.params, batches[0])["loss"]) for _ in range(2)]
    fixed = _per_device(lambda d, rows: apply(params, rows, jax.random.fold_in(jax.random.key(0), d)), batches[0])
    assert evaluated[0] == evaluated[1]
    np.testing.assert_allclose(evaluated[0], fixed, rtol=1e-5)

    # without eval_rng_streams the evaluation's error names the option; a forgotten or unknown stream is named
    plain = from_linen(vae, vae_loss, batches[0], inputs=call, rng_streams=("noise",))
    plain_program = build(plain, tx, make_layout(plain, "dp", layout.mesh))
    with pytest.raises(ValueError, match=r"eval_rng_streams=\('noise',\)"):
        plain_program.evaluate(plain_program.init(jax.random.key(0)).params, batches[0])
    with pytest.raises(ValueError, match=r"rng_streams=\('dropout',\) when training.*rng_streams=\('dropout', 'noise'\)"):
        from_linen(vae, vae_loss, batches[0], inputs=call)  # "noise" forgotten: named for rng_streams, not eval
    with pytest.raises(ValueError, match="eval_rng_streams names \\['nosie'\\]"):
        from_linen(vae, vae_loss, batches[0], inputs=call, rng_streams=("noise",), eval_rng_streams=("nosie",))
    # an inputs= that never passes a defaulted train flag would train with dropout off: warned
    with pytest.warns(UserWarning, match=r"inputs\(batch, train=True\) does not pass Denoiser's 'train'.*'train': train"):
        from_linen(Denoiser(), lambda out, b: jnp.mean(out ** 2), batches[0], inputs=call)


def test_spectral_and_weight_norm_train_sharded_like_one_device_and_restore_onto_dp():
    rng = np.random.default_rng(1)
    batches = [{"image": rng.normal(size=(16, 8, 8, 4)).astype(np.float32),
                "real": rng.integers(0, 2, 16).astype(np.float32)} for _ in range(3)]
    # The suite's parity optimizer (tests/helpers.py: Adam's amplification of reduction-order noise,
    # lr |dg| / eps, stays under the tolerance); at lr 1e-2 one element of 9216 moved 2.3e-6 on
    # some CPUs' XLA codegen.
    disc, tx = Discriminator(), optimizer()
    model = from_linen(disc, gan_loss, batches[0], inputs=lambda b, train: ((b["image"],), {"train": train}),
                       rng_streams=())
    layout = make_layout(model, "zero3", make_mesh({"fsdp": DEVICES}))
    specs = layout.param_shardings()
    assert any(specs["Conv_0"]["kernel"].spec) and any(specs["Conv_1"]["kernel"].spec)  # both wrapped kernels split
    program = build(model, tx, layout)
    state = program.init(jax.random.key(0))
    start = jax.tree.map(np.asarray, (state.params, state.model_state))
    state, losses = zoo.program_steps(program, state, batches)

    def reference(params, stats, batch):
        logits, new = disc.apply({"params": params, **stats}, batch["image"], train=True, mutable=["batch_stats"])
        return gan_loss(logits, batch), new

    params, stats, expected_losses = zoo.plain_steps_with_state(reference, *start, tx, batches)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    jax.tree.map(close, state.params, params)
    jax.tree.map(close, state.model_state, stats)  # power-iteration u and sigma, updated in training

    with tempfile.TemporaryDirectory() as directory:
        checkpointer = Checkpointer(directory)
        checkpointer.save(len(batches), state, data_state={}, config={})
        checkpointer.wait()
        dp = build(model, tx, make_layout(model, "dp", make_mesh({"data": DEVICES})))
        restored, _, _ = checkpointer.restore(dp.abstract_state())
    same = lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    jax.tree.map(same, (restored.params, restored.model_state), (state.params, state.model_state))
