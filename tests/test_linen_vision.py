"""A big_vision-style ViT through `shardlib.from_linen`, written as its authors write it: no
logical names, ``nn.MultiHeadDotProductAttention`` (3-D DenseGeneral kernels), a ``cls`` token
and a learned position embedding, ``nn.Dropout`` behind a ``train`` flag, and an encoder that is
``nn.scan(nn.remat(Block))``; the user's own label-smoothed loss on an ``{"image", "label"}`` batch.

The reference is independent of shardlib's step: ``module.apply`` in a plain one-device
``jax.jit(jax.value_and_grad)`` + optax step, drawing each device's dropout mask from the key
the docs say that device gets (docs/dropout-and-batchnorm.md, "Keys").
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from jax.sharding import PartitionSpec as P

import shardlib
from shardlib import build, from_linen, make_layout, make_mesh
from tests.helpers import optimizer  # AdamW, lr 3e-3, eps=1e-5

STEPS, ROWS, WIDTH, HEADS = 3, 16, 32, 4
pytestmark = pytest.mark.filterwarnings("ignore::shardlib.ReplicationWarning")


# ---- the model, as big_vision writes it -----------------------------------------------------

class MlpBlock(nn.Module):
    mlp_dim: int
    dropout: float

    @nn.compact
    def __call__(self, x, deterministic=True):
        inits = dict(kernel_init=nn.initializers.xavier_uniform(), bias_init=nn.initializers.normal(stddev=1e-6))
        x = nn.Dropout(rate=self.dropout)(nn.gelu(nn.Dense(self.mlp_dim, **inits)(x)), deterministic)
        return nn.Dense(WIDTH, **inits)(x)


class Encoder1DBlock(nn.Module):
    dropout: float

    @nn.compact
    def __call__(self, x, deterministic=True):
        y = nn.LayerNorm()(x)
        y = nn.MultiHeadDotProductAttention(num_heads=HEADS, kernel_init=nn.initializers.xavier_uniform(),
                                            deterministic=deterministic)(y, y)
        x = x + nn.Dropout(rate=self.dropout)(y, deterministic)
        y = MlpBlock(mlp_dim=2 * WIDTH, dropout=self.dropout)(nn.LayerNorm()(x), deterministic)
        return x + nn.Dropout(rate=self.dropout)(y, deterministic), None  # (carry, out) for nn.scan


class ViT(nn.Module):
    depth: int = 2
    dropout: float = 0.1
    scan: bool = True

    @nn.compact
    def __call__(self, image, *, train=False):
        x = nn.Conv(WIDTH, (2, 2), strides=(2, 2), padding="VALID", name="embedding")(image)
        n, h, w, c = x.shape
        x = x.reshape(n, h * w, c)
        cls = self.param("cls", nn.initializers.zeros, (1, 1, c))
        x = jnp.concatenate([jnp.tile(cls, [n, 1, 1]), x], axis=1)
        x = x + self.param("pos_embedding", nn.initializers.normal(stddev=1 / np.sqrt(c)), (1, x.shape[1], c))
        x = nn.Dropout(rate=self.dropout)(x, not train)
        if self.scan:
            block = nn.scan(nn.remat(Encoder1DBlock, prevent_cse=False, static_argnums=(2,)),
                            variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
                            in_axes=nn.broadcast, length=self.depth)
            x, _ = block(self.dropout, name="encoderblock")(x, not train)
        else:
            for i in range(self.depth):
                x, _ = Encoder1DBlock(self.dropout, name=f"encoderblock_{i}")(x, not train)
        x = nn.LayerNorm(name="encoder_norm")(x)
        return nn.Dense(10, kernel_init=nn.initializers.zeros, name="head")(x[:, 0])


def smoothed_loss(logits, batch, smoothing=0.1):
    soft = optax.smooth_labels(jax.nn.one_hot(batch["label"], logits.shape[-1]), smoothing)
    return optax.softmax_cross_entropy(logits, soft).mean()


def vit_inputs(batch, train):
    return (batch["image"],), {"train": train}


def image_batch(seed):
    rng = np.random.default_rng(seed)
    return {"image": rng.normal(size=(ROWS, 8, 8, 1)).astype(np.float32),
            "label": rng.integers(0, 10, size=(ROWS,)).astype(np.int32)}


# Megatron's split for Flax's own layers, by path: one layer's shapes, looped or scanned.
VIT_RULES = [
    (r"/(query|key|value)/kernel$", ("embed", "heads", "head_dim")),
    (r"/(query|key|value)/bias$", ("heads", "head_dim")),
    (r"/out/kernel$", ("heads", "head_dim", "embed")),
    (r"MlpBlock_0/Dense_0/kernel$", ("embed", "mlp")),
    (r"MlpBlock_0/Dense_0/bias$", ("mlp",)),
    (r"MlpBlock_0/Dense_1/kernel$", ("mlp", "embed")),
]


# ---- the reference ------------------------------------------------------------------------------

def one_device_steps(module, params, seed, devices, batches):
    """``STEPS`` AdamW steps of ``module.apply`` on one device; device d's rows draw dropout from
    ``fold_in(fold_in(fold_in(seed, step), d), 0)`` (run seed, step, device, first rng stream)."""
    def loss(p, batch, step):
        keys = jax.vmap(lambda d: jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(seed, step), d), 0))(
            jnp.arange(devices))
        parts = jax.tree.map(lambda x: x.reshape(devices, ROWS // devices, *x.shape[1:]), batch)
        per_device = jax.vmap(lambda part, key: smoothed_loss(
            module.apply({"params": p}, part["image"], train=True, rngs={"dropout": key}), part))(parts, keys)
        return jnp.mean(per_device)

    tx = optimizer()
    grad = jax.jit(jax.value_and_grad(loss))
    opt_state, losses = tx.init(params), []
    for step, batch in enumerate(batches):
        value, grads = grad(params, batch, step)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(value))
    return params, losses


# ---- the tests ------------------------------------------------------------------------------------

def test_path_rules_split_a_scanned_vits_heads_over_tensor_and_train_like_one_device():
    """An unannotated ViT under fsdp_tp: the rules name the 3-D attention kernels, so heads go over
    ``tensor`` (column-parallel q/k/v, row-parallel out) with ``layers`` put in at the stacked axis;
    3 steps with dropout, remat and the scan match the one-device reference."""
    module = ViT()
    model = from_linen(module, smoothed_loss, image_batch(0), inputs=vit_inputs, path_rules=VIT_RULES)
    attention = model.logical_axes["encoderblock"]["MultiHeadDotProductAttention_0"]
    assert attention["query"]["kernel"] == ("layers", "embed", "heads", "head_dim")
    assert attention["out"]["kernel"] == ("layers", "heads", "head_dim", "embed")
    looped = from_linen(ViT(scan=False), smoothed_loss, image_batch(0), inputs=vit_inputs, path_rules=VIT_RULES)
    assert looped.logical_axes["encoderblock_1"]["MultiHeadDotProductAttention_0"]["query"]["kernel"] == (
        "embed", "heads", "head_dim")  # the same rules, one layer's names

    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        program = build(model, optimizer(), make_layout(model, "fsdp_tp", mesh))
    assert not [w for w in caught if "splits no parameter" in str(w.message)]
    placed = program.layout.param_shardings()["encoderblock"]
    assert placed["MultiHeadDotProductAttention_0"]["query"]["kernel"].spec == P(None, "fsdp", "tensor", None)
    assert placed["MultiHeadDotProductAttention_0"]["out"]["kernel"].spec == P(None, "tensor", "fsdp", None)
    assert placed["MlpBlock_0"]["Dense_1"]["kernel"].spec == P(None, "tensor", "fsdp")

    state = program.init(jax.random.key(0))
    params0, seed = jax.tree.map(np.asarray, state.params), jax.random.wrap_key_data(np.asarray(state.rng))
    batches = [image_batch(i) for i in range(STEPS)]
    losses = []
    for batch in batches:
        state, metrics = program.step(state, batch)
        losses.append(float(metrics["loss"]))
    want_params, want_losses = one_device_steps(module, params0, seed, devices=4, batches=batches)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6),
                 state.params, want_params)


def test_a_first_linen_users_mistakes_are_named_with_the_fix():
    """Mistakes a first from_linen user makes: ``inputs`` returning the args without the kwargs
    dict, or a bare array as args (unpacked row by row into the call), or the whole batch spread
    into the call's keywords (labels included), no inputs= for a module
    with a train flag (left at its default when training), a per-example loss, and
    fsdp_tp for a model without names, which the fsdp fallback splits whole and tensor not at all."""
    module = ViT(depth=1, scan=False)
    for wrong, got in [(lambda b, train: (b["image"],), r"\(ndarray\)"),
                       (lambda b, train: (b["image"], {"train": train}), r"\(ndarray, dict\)")]:
        with pytest.raises(ValueError, match=rf"inputs\(batch, train\) returned {got}; it must return \(args, kwargs\)"):
            from_linen(module, smoothed_loss, image_batch(0), inputs=wrong)
    with pytest.raises(ValueError, match=r"keywords \['image', 'label', 'train'\], which ViT.__call__\(image, train\) "
                                         r"cannot take .*unexpected keyword argument 'label'"):  # the batch spread in
        from_linen(module, smoothed_loss, image_batch(0), inputs=lambda b, train: ((), {**b, "train": train}))
    with pytest.warns(UserWarning, match=r"without inputs= calls module\(batch\['inputs'\]\), so ViT's 'train' keeps "
                                         r"its default \(False\) in training.*inputs=lambda batch, train: "):
        from_linen(module, smoothed_loss, image_batch(0)["image"])  # the one-input call: dropout never on
    per_example = lambda logits, b: optax.softmax_cross_entropy_with_integer_labels(logits, b["label"])
    model = from_linen(module, per_example, image_batch(0), inputs=vit_inputs)
    with pytest.warns(shardlib.ReplicationWarning, match=r"fsdp_tp on fsdp=4 tensor=2 splits no parameter over "
                                                         r"'tensor'.*path_rules="):  # unnamed: fsdp splits it all
        make_layout(model, "fsdp_tp", make_mesh({"fsdp": 4, "tensor": 2}))
    with pytest.raises(ValueError, match=r"loss of shape \(16,\) .*reduce it, e\.g\. \.mean\(\)"):
        model.run(model.init(jax.random.key(0)), image_batch(0), None, shardlib.Call(key=jax.random.key(1)))
