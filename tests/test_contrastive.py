"""Losses over the whole batch: a CLIP / SigLIP two-tower model, written in linen as big_vision
writes it (image and text towers, a learned temperature and bias, a ``{"image", "text"}`` batch),
whose loss reads the global B x B logits matrix through `shardlib.gather_batch`.

Each data-parallel device sees only its rows, so without the gather it trains on its b x b block
of the logits: a weaker objective, silently. The reference is one device over the global batch
(plain ``jax.jit(jax.value_and_grad)`` + optax, `tests.zoo.plain_steps`), with no shardlib code.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

import shardlib
from shardlib import build, from_functions, from_linen, make_layout, make_mesh
from tests import zoo
from tests.helpers import optimizer  # AdamW, lr 3e-3, eps=1e-5

STEPS, ROWS, D, VOCAB, SEQ = 3, 16, 16, 32, 8
RTOL = 1e-5  # losses against the one-device reference, as tests/test_linen_styles.py
pytestmark = pytest.mark.filterwarnings("ignore::shardlib.ReplicationWarning")


# ---- the model, as its authors write it --------------------------------------------------------

class ImageTower(nn.Module):
    width: int = D

    @nn.compact
    def __call__(self, image):
        x = nn.gelu(nn.Conv(8, (3, 3), strides=2, name="conv")(image))
        return nn.Dense(self.width, name="head")(x.reshape(x.shape[0], -1))


class TextTower(nn.Module):
    width: int = D

    @nn.compact
    def __call__(self, text):
        x = nn.Embed(VOCAB, self.width, name="embedding")(text).mean(axis=1)
        return nn.Dense(self.width, name="head")(x)


class TwoTowers(nn.Module):
    @nn.compact
    def __call__(self, image, text):
        zimg, ztxt = ImageTower(name="img")(image), TextTower(name="txt")(text)
        zimg = zimg / jnp.linalg.norm(zimg, axis=-1, keepdims=True)
        ztxt = ztxt / jnp.linalg.norm(ztxt, axis=-1, keepdims=True)
        t = self.param("t", nn.initializers.constant(jnp.log(10.0)), (1,))
        b = self.param("b", nn.initializers.constant(-10.0), (1,))
        return zimg, ztxt, {"t": jnp.exp(t), "b": b}


def batch(i: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(i)
    return {"image": rng.normal(size=(ROWS, 8, 8, 3)).astype(np.float32),
            "text": rng.integers(0, VOCAB, size=(ROWS, SEQ)).astype(np.int32)}


def _softmax_ce(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def clip_loss(out, batch, gather=shardlib.gather_batch):
    """Every device computes the whole B x B loss from the gathered embeddings (big_vision's way)."""
    zimg, ztxt, extras = out
    zimg, ztxt = gather((zimg, ztxt))
    logits = zimg @ ztxt.T * extras["t"]
    labels = jnp.arange(logits.shape[0])
    return (_softmax_ce(logits, labels) + _softmax_ce(logits.T, labels)) / 2


def clip_loss_of_local_rows(out, batch):
    """The same loss as the mean over this device's rows against every device's: the labels need
    where its rows sit in the gathered batch."""
    zimg, ztxt, extras = out
    (all_img, all_txt), offset = shardlib.gather_batch((zimg, ztxt), return_offset=True)
    labels = jnp.arange(zimg.shape[0]) + offset
    return (_softmax_ce(zimg @ all_txt.T * extras["t"], labels) + _softmax_ce(ztxt @ all_img.T * extras["t"], labels)) / 2


def siglip_loss(out, batch, gather=shardlib.gather_batch):
    zimg, ztxt, extras = out
    zimg, ztxt = gather((zimg, ztxt))
    logits = zimg @ ztxt.T * extras["t"] + extras["b"]
    signs = 2 * jnp.eye(logits.shape[0]) - 1
    return -jnp.sum(jax.nn.log_sigmoid(signs * logits)) / logits.shape[0]


MODULE = TwoTowers()
INPUTS = lambda b, train: ((b["image"], b["text"]), {})
forward = lambda p, b: MODULE.apply({"params": p}, b["image"], b["text"])
whole = lambda x: x  # the reference's "gather": one device holds the global batch


# ---- helpers --------------------------------------------------------------------------------------

def _program(loss, strategy, sizes, **options):
    model = from_linen(MODULE, loss, batch(0), inputs=INPUTS, rng_streams=())
    return build(model, optimizer(), make_layout(model, strategy, make_mesh(sizes)), **options)


def _train(program):
    state, losses = program.init(jax.random.key(0)), []
    start = jax.tree.map(np.asarray, state.params)
    for i in range(STEPS):
        state, metrics = program.step(state, batch(i))
        losses.append(float(metrics["loss"]))
    return start, state, losses


def _microbatch(b, i: int, k: int, devices: int):
    """Microbatch i of k: rows i*h .. (i+1)*h of each device's block of rows, what grad_accum=k gives."""
    per = ROWS // devices
    h = per // k
    rows = np.concatenate([np.arange(d * per + i * h, d * per + (i + 1) * h) for d in range(devices)])
    return jax.tree.map(lambda x: x[rows], b)


def _reference(loss, k: int = 1, devices: int = 8):
    """The loss on one device over the global batch (the mean of the k microbatches' losses)."""
    return lambda p, b: sum(loss(forward(p, _microbatch(b, i, k, devices)), None, gather=whole) for i in range(k)) / k


@functools.cache
def _one_device(loss):
    """``loss`` of the forward on one device over the rows given, as one jitted program: compiled
    once for every device's block of rows (and once for the evaluation batch), where running it op
    by op compiled each of its operations for each shape (about 100 compiles a case)."""
    return jax.jit(lambda params, b: loss(forward(params, b), None, gather=whole))


def _per_device_blocks(loss, params, b, devices: int) -> float:
    """The first step's loss had each device computed ``loss`` on its own rows only (no gather)."""
    per = ROWS // devices
    block = lambda d: jax.tree.map(lambda x: x[d * per:(d + 1) * per], b)
    return float(np.mean([_one_device(loss)(params, block(d)) for d in range(devices)]))


# ---- tests ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("loss,reference,strategy,sizes,grad_accum", [
    (clip_loss, clip_loss, "dp", {"data": 8}, 1),
    (siglip_loss, siglip_loss, "zero3", {"fsdp": 8}, 2),
    # rows split over two batch axes (data-major); tensor splits no rows, so nothing is gathered over it
    (clip_loss_of_local_rows, clip_loss, "fsdp_tp", {"data": 2, "fsdp": 2, "tensor": 2}, 1),
], ids=["clip-dp", "siglip-zero3-accum2", "clip-offset-fsdp_tp"])
def test_a_loss_over_the_gathered_batch_trains_like_one_device(loss, reference, strategy, sizes, grad_accum):
    program = _program(loss, strategy, sizes, grad_accum=grad_accum)
    params0, state, losses = _train(program)
    ref_params, ref_losses = zoo.plain_steps(_reference(reference, grad_accum), params0, optimizer(),
                                             [batch(i) for i in range(STEPS)])
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), state.params, ref_params)
    blocks = _per_device_blocks(reference, params0, batch(0), program.layout.batch_size_multiple)
    # Without the gather the first loss alone would already fail the check above, ten times over.
    assert abs(blocks - ref_losses[0]) > 10 * RTOL * abs(ref_losses[0])
    evaluation = program.evaluate(state.params, batch(STEPS))["loss"]  # the eval step gathers too
    np.testing.assert_allclose(evaluation, _one_device(reference)(ref_params, batch(STEPS)), rtol=RTOL)


def test_bf16_compute_sums_the_gathered_rows_cotangents_in_float32():
    """Under precision="bf16" the embeddings are bf16; the gather's backward (a reduce-scatter) in bf16
    aborted XLA:CPU's compiler (AllReducePromotion), as a bf16 psum does. The reference computes in
    bf16 on one device: the sums' order differs, hence bf16's tolerance (measured 2.3e-4; float32's
    losses differ from it by 2.3e-3 at step 3)."""
    params0, _, losses = _train(_program(siglip_loss, "zero3", {"fsdp": 8}, precision="bf16"))
    in_bf16 = lambda p: jax.tree.map(lambda x: x.astype(jnp.bfloat16), p)
    reference = lambda p, b: siglip_loss(forward(in_bf16(p), b), None, gather=whole).astype(jnp.float32)
    _, ref_losses = zoo.plain_steps(reference, params0, optimizer(), [batch(i) for i in range(STEPS)])
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-3)


def test_one_device_is_the_identity_pmap_step_gathers_and_scalars_are_refused():
    """Eagerly it returns its input (offset 0). `pmap_step` averages the devices' losses as the mesh
    step does, so it gathers there too (it used to see no step and train each device's block)."""
    z = np.arange(12, dtype=np.float32).reshape(6, 2)
    assert shardlib.gather_batch(z) is z
    tree, offset = shardlib.gather_batch((z, z[:, :1]), return_offset=True)
    assert tree[0] is z and offset == 0

    from shardlib.step.pmap import pmap_step, replicate, split_batch
    params = {"w": np.eye(3, D, dtype=np.float32)}
    loss = lambda p, b, gather=shardlib.gather_batch: clip_loss((b["x"] @ p["w"], b["y"] @ p["w"], {"t": 1.0}), b, gather)
    rows = {"x": np.random.default_rng(0).normal(size=(ROWS, 3)).astype(np.float32), "y": np.ones((ROWS, 3), np.float32)}
    rows["y"][::2] = -1
    tx = optax.sgd(0.1)
    _, _, metrics = pmap_step(from_functions(lambda key: params, loss), tx)(replicate(params, 8), replicate(tx.init(params), 8),
                                                                          split_batch(rows, 8))
    np.testing.assert_allclose(metrics["loss"][0], loss(params, rows, gather=whole), rtol=RTOL)

    with pytest.raises(ValueError, match=r"gather_batch: x has leaves of shapes \[\(6, 2\), \(\)\].*temperature"):
        shardlib.gather_batch((z, jnp.float32(2.0)))
    with pytest.raises(ValueError, match=r"return_offset=True\): the leaves of x have \[3, 6\] rows"):
        shardlib.gather_batch((z, z[:3]), return_offset=True)
