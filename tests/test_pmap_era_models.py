"""Model code from the pmap era and the MaxText era, through shardlib's public API.

The Flax ImageNet example's ResNet hard-codes ``nn.BatchNorm(axis_name="batch")``, the name its
``jax.pmap(train_step, axis_name="batch")`` binds; `build(..., axis_name="batch")` binds it to
the step's batch axes, and the reference is that pmap train step itself, written here as the
example writes it (gradients and metrics ``lax.pmean``-ed over "batch", synchronised statistics).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

from shardlib import build, from_linen, make_layout, make_mesh

STEPS, ROWS, CLASSES = 3, 16, 10
pytestmark = pytest.mark.filterwarnings("ignore::shardlib.ReplicationWarning")


# ---- the Flax ImageNet example's ResNet, as its authors write it -------------------------------


class ResNetBlock(nn.Module):
    filters: int
    conv: nn.Module
    norm: nn.Module
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x):
        residual = x
        y = nn.relu(self.norm()(self.conv(self.filters, (3, 3), self.strides)(x)))
        y = self.norm(scale_init=nn.initializers.zeros_init())(self.conv(self.filters, (3, 3))(y))
        if residual.shape != y.shape:
            residual = self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(residual)
            residual = self.norm(name="norm_proj")(residual)
        return nn.relu(residual + y)


class ResNet(nn.Module):
    stage_sizes: tuple[int, ...] = (1, 1)
    num_filters: int = 8
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = True):
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5,
                                 dtype=self.dtype, axis_name="batch")
        x = nn.relu(norm(name="bn_init")(conv(self.num_filters, (3, 3), name="conv_init")(x)))
        for i, block_size in enumerate(self.stage_sizes):
            for j in range(block_size):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = ResNetBlock(self.num_filters * 2 ** i, conv=conv, norm=norm, strides=strides)(x)
        x = nn.Dense(CLASSES, dtype=self.dtype)(jnp.mean(x, axis=(1, 2)))
        return jnp.asarray(x, self.dtype)


def cross_entropy_loss(logits, labels):
    return jnp.mean(optax.softmax_cross_entropy(logits, jax.nn.one_hot(labels, CLASSES)))


def imagenet_batches(n=STEPS):
    rng = np.random.default_rng(0)
    return [{"image": rng.normal(size=(ROWS, 8, 8, 3)).astype(np.float32),
             "label": rng.integers(0, CLASSES, ROWS).astype(np.int32)} for _ in range(n)]


def example_optimizer():
    return optax.sgd(0.1, momentum=0.9, nesterov=True)


def resnet_model():
    return from_linen(ResNet(), lambda logits, batch: cross_entropy_loss(logits, batch["label"]),
                      imagenet_batches(1)[0], inputs=lambda batch, train: ((batch["image"],), {"train": train}),
                      rng_streams=())


def pmap_reference(params, batch_stats, batches, devices=8):
    """The ImageNet example's own loop: ``jax.pmap(train_step, axis_name="batch")``."""
    model, tx = ResNet(), example_optimizer()

    def train_step(params, opt_state, batch_stats, batch):
        def loss_fn(p):
            logits, new_state = model.apply({"params": p, "batch_stats": batch_stats}, batch["image"],
                                            mutable=["batch_stats"])
            return cross_entropy_loss(logits, batch["label"]), new_state["batch_stats"]

        (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        grads = jax.lax.pmean(grads, axis_name="batch")
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, batch_stats, jax.lax.pmean(loss, axis_name="batch")

    step = jax.pmap(train_step, axis_name="batch", devices=jax.devices()[:devices])
    replicate = lambda tree: jax.tree.map(lambda x: np.stack([np.asarray(x)] * devices), tree)
    shard = lambda tree: jax.tree.map(lambda x: x.reshape(devices, -1, *x.shape[1:]), tree)
    params, batch_stats = replicate(params), replicate(batch_stats)
    opt_state, losses = replicate(tx.init(jax.tree.map(lambda x: x[0], params))), []
    for batch in batches:
        params, opt_state, batch_stats, loss = step(params, opt_state, batch_stats, shard(batch))
        losses.append(float(loss[0]))
    first = lambda tree: jax.tree.map(lambda x: np.asarray(x[0]), tree)
    return first(params), first(batch_stats), losses


@pytest.mark.parametrize("strategy,sizes", [("dp", {"data": 8}), ("zero3", {"data": 2, "fsdp": 4})])
def test_imagenet_resnet_with_its_pmap_axis_name_trains_like_its_pmap_loop(strategy, sizes):
    model = resnet_model()
    program = build(model, example_optimizer(), make_layout(model, strategy, make_mesh(sizes)), axis_name="batch")
    state, losses = program.init(jax.random.key(0)), []
    params0, stats0 = jax.tree.map(np.asarray, (state.params, state.model_state["batch_stats"]))
    for batch in imagenet_batches():
        state, metrics = program.step(state, batch)
        losses.append(float(metrics["loss"]))
    ref_params, ref_stats, ref_losses = pmap_reference(params0, stats0, imagenet_batches())
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-5),
                 jax.tree.map(np.asarray, (state.params, state.model_state["batch_stats"])), (ref_params, ref_stats))


def test_an_unbound_pmap_axis_name_is_named_with_its_module_and_the_fix():
    model = resnet_model()
    layout = make_layout(model, "dp", make_mesh({"data": 8}))
    with pytest.raises(Exception) as caught:
        build(model, example_optimizer(), layout).step(build(model, example_optimizer(), layout, donate=False)
                                                        .init(jax.random.key(0)), imagenet_batches(1)[0])
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "BatchNorm 'bn_init'" in notes and "axis 'batch'" in notes and "build(..., axis_name='batch')" in notes
    with pytest.raises(ValueError, match="'data' is a mesh axis"):
        build(model, example_optimizer(), layout, axis_name="data")
