"""Model code from the pmap era and the MaxText era, through shardlib's public API.

A MaxText-style decoder (logical partitioning, logical constraints, ``nn.scan`` with
``PARTITION_NAME``) hands shardlib its own ``nn.logical_axis_rules`` table with
`Strategy.with_logical_rules`, and trains inside the user's ``nn.logical_axis_rules`` and
``jax.set_mesh`` contexts like a plain one-device ``jax.jit`` + optax step.

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
from flax import nnx

import shardlib
from shardlib import build, from_linen, make_layout, make_mesh
from shardlib.step.axis_names import UnboundAxisError
from tests import zoo

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


PMAP_RUNS: dict = {}  # the pmap loop is the same for every strategy: run once (tests.zoo.shared_run)


@pytest.mark.parametrize("strategy,sizes", [("dp", {"data": 8}), ("zero3", {"data": 2, "fsdp": 4})])
def test_imagenet_resnet_with_its_pmap_axis_name_trains_like_its_pmap_loop(strategy, sizes):
    model = resnet_model()
    program = build(model, example_optimizer(), make_layout(model, strategy, make_mesh(sizes)), axis_name="batch")
    state, losses = program.init(jax.random.key(0)), []
    params0, stats0 = jax.tree.map(np.asarray, (state.params, state.model_state["batch_stats"]))
    for batch in imagenet_batches():
        state, metrics = program.step(state, batch)
        losses.append(float(metrics["loss"]))
    ref_params, ref_stats, ref_losses = zoo.shared_run(PMAP_RUNS, "resnet", (params0, stats0),
                                                       lambda: pmap_reference(params0, stats0, imagenet_batches()))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-5),
                 jax.tree.map(np.asarray, (state.params, state.model_state["batch_stats"])), (ref_params, ref_stats))


def test_an_unbound_pmap_axis_name_is_named_with_its_module_and_the_fix():
    model = resnet_model()
    layout = make_layout(model, "dp", make_mesh({"data": 8}))
    with pytest.raises(UnboundAxisError) as caught:
        build(model, example_optimizer(), layout).step(build(model, example_optimizer(), layout, donate=False)
                                                        .init(jax.random.key(0)), imagenet_batches(1)[0])
    said = str(caught.value)  # the message itself, what str(e) and loggers show
    assert "BatchNorm 'bn_init'" in said and "axis 'batch'" in said and "build(..., axis_name='batch')" in said
    assert isinstance(caught.value.__cause__, AssertionError)  # flax's own error, chained
    with pytest.raises(ValueError, match="'data' is a mesh axis"):
        build(model, example_optimizer(), layout, axis_name="data")


class NnxNormed(nnx.Module):
    """The NNX spelling: ``nnx.BatchNorm(axis_name="batch")``, as code written for pmap has it."""

    def __init__(self, rngs, axis_name="batch"):
        self.conv = nnx.Conv(3, 8, kernel_size=(3, 3), rngs=rngs)
        self.norm = nnx.BatchNorm(8, momentum=0.9, axis_name=axis_name, rngs=rngs)
        self.head = nnx.Linear(8, CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.norm(self.conv(x))).mean(axis=(1, 2)))


def test_nnx_batchnorm_with_a_pmap_axis_name_normalises_over_the_global_batch():
    """The reference is the same module with no axis name, on one device over the global batch:
    what synchronised statistics must reproduce."""
    user = NnxNormed(nnx.Rngs(0), axis_name=None)
    params, stats = jax.tree.map(np.asarray, (nnx.state(user, nnx.Param), nnx.state(user, nnx.BatchStat)))
    tx = example_optimizer()
    opt = nnx.Optimizer(user, tx, wrt=nnx.Param)

    @nnx.jit
    def reference_step(module, opt, batch):
        loss, grads = nnx.value_and_grad(lambda m: cross_entropy_loss(m(batch["image"]), batch["label"]))(module)
        opt.update(module, grads)
        return loss

    model = shardlib.from_nnx(lambda rngs: NnxNormed(rngs), lambda m, b: cross_entropy_loss(m(b["image"]), b["label"]))
    program = build(model, tx, make_layout(model, "dp", make_mesh({"data": 8})), axis_name="batch")
    state, losses, ref_losses = program.init_from(params, model_state=stats), [], []
    for batch in imagenet_batches():
        state, metrics = program.step(state, batch)
        losses.append(float(metrics["loss"]))
        ref_losses.append(float(reference_step(user, opt, batch)))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(state.model_state["norm"]["var"]), np.asarray(user.norm.var[...]), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(state.params["head"]["kernel"]), np.asarray(user.head.kernel[...]),
                               rtol=1e-4, atol=1e-6)
    assert user.norm.axis_name is None


# ---- a MaxText-style decoder with the user's own logical-axis rules -----------------------------

VOCAB, D, MLP, SEQ = 32, 16, 32, 8

# What MaxText / t5x users pass to nn.logical_axis_rules, activation names included.
MAXTEXT_RULES = (
    ("activation_batch", ("data", "fsdp")), ("activation_length", None), ("activation_embed", None),
    ("activation_mlp", "tensor"), ("activation_vocab", "tensor"),
    ("embed", "fsdp"), ("mlp", "tensor"), ("heads", "tensor"), ("vocab", "tensor"), ("norm", None), ("layers", None),
)


def logical_init(init, names):
    return nn.with_logical_partitioning(init, names)


class MlpLayer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        x = nn.with_logical_constraint(x, ("activation_batch", "activation_length", "activation_embed"))
        h = nn.Dense(MLP, use_bias=False, kernel_init=logical_init(nn.initializers.lecun_normal(), ("embed", "mlp")),
                     name="wi")(x)
        h = nn.with_logical_constraint(nn.gelu(h), ("activation_batch", "activation_length", "activation_mlp"))
        y = nn.Dense(D, use_bias=False, kernel_init=logical_init(nn.initializers.lecun_normal(), ("mlp", "embed")),
                     name="wo")(h)
        scale = self.param("scale", logical_init(nn.initializers.ones_init(), ("norm",)), (D,))
        return x + y * scale, None


class Decoder(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        table = self.param("token_embedder", logical_init(nn.initializers.normal(1.0), ("vocab", "embed")), (VOCAB, D))
        x = nn.with_logical_constraint(table[tokens], ("activation_batch", "activation_length", "activation_embed"))
        layers = nn.scan(nn.remat(MlpLayer), variable_axes={"params": 0}, split_rngs={"params": True}, length=2,
                         metadata_params={nn.PARTITION_NAME: "layers"})
        x, _ = layers(name="decoder")(x, None)
        logits = nn.Dense(VOCAB, use_bias=False, kernel_init=logical_init(nn.initializers.lecun_normal(), ("embed", "vocab")),
                          name="logits")(x)
        return nn.with_logical_constraint(logits, ("activation_batch", "activation_length", "activation_vocab"))


def next_token_loss(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], batch["tokens"][:, 1:]).mean()


def token_batches(n=STEPS):
    rng = np.random.default_rng(1)
    return [{"tokens": rng.integers(0, VOCAB, (ROWS, SEQ)).astype(np.int32)} for _ in range(n)]


def test_maxtext_decoder_with_its_own_rule_table_places_and_trains_as_asked():
    model = from_linen(Decoder(), next_token_loss, token_batches(1)[0],
                       inputs=lambda batch, train: ((batch["tokens"],), {}), rng_streams=())
    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    strategy = shardlib.get_strategy("fsdp_tp").with_logical_rules(MAXTEXT_RULES)
    layout = make_layout(model, strategy, mesh)
    specs = jax.tree.map(lambda s: s.spec, layout.param_shardings())
    P = jax.sharding.PartitionSpec
    assert specs["decoder"]["wi"]["kernel"] == P(None, "fsdp", "tensor")  # ("layers", "embed", "mlp")
    assert specs["token_embedder"] == P("tensor", "fsdp") and specs["logits"]["kernel"] == P("fsdp", "tensor")

    tx = optax.adamw(3e-3, eps=1e-5, weight_decay=0.1)
    program = build(model, tx, layout, grad_accum=2)
    state, losses = program.init(jax.random.key(0)), []
    params0 = jax.tree.map(np.asarray, state.params)
    with nn.logical_axis_rules(MAXTEXT_RULES), jax.set_mesh(mesh):  # as a MaxText train loop wraps its step
        for batch in token_batches():
            state, metrics = program.step(state, batch)
            losses.append(float(metrics["loss"]))

    @jax.jit
    def reference_step(params, opt_state, batch):  # one device, the global batch, no rules in force
        loss, grads = jax.value_and_grad(lambda p: next_token_loss(Decoder().apply({"params": p}, batch["tokens"]),
                                                                   batch))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params, opt_state, ref_losses = params0, tx.init(params0), []
    for batch in token_batches():
        params, opt_state, loss = reference_step(params, opt_state, batch)
        ref_losses.append(float(loss))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-6),
                 jax.tree.map(np.asarray, state.params), jax.tree.map(np.asarray, params))

    with pytest.warns(UserWarning, match=r"no rule for: decoder/wi/kernel dim 2 'mlp'"):
        make_layout(model, shardlib.get_strategy("fsdp_tp").with_logical_rules(
            [rule for rule in MAXTEXT_RULES if rule[0] != "mlp"]), mesh)
    with pytest.raises(ValueError, match=r"'model' is not a mesh axis of shardlib .* write 'tensor'"):
        shardlib.get_strategy("fsdp_tp").with_logical_rules([("mlp", "model")])
