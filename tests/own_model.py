"""A user's own model for `shardlib train --model tests.own_model:make` (tests/test_own_model.py).

A byte-level NNX language model written the usual way (no shardlib hooks): an embedding, two
unrolled causal blocks (each mixes a token with the one before it) and a head, its loss on the
loader's ``batch["inputs"]`` / ``batch["targets"]``.
"""

from __future__ import annotations

import jax.numpy as jnp
import optax
from flax import nnx

import shardlib

VOCAB, WIDTH = 256, 32


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        init = nnx.initializers.lecun_normal()
        self.now = nnx.Linear(WIDTH, WIDTH, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), rngs=rngs)
        self.before = nnx.Linear(WIDTH, WIDTH, use_bias=False,
                                 kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), rngs=rngs)

    def __call__(self, x):
        previous = jnp.pad(x, ((0, 0), (1, 0), (0, 0)))[:, :-1]  # causal: the token before, zeros at the start
        return x + nnx.gelu(self.now(x) + self.before(previous))


class ByteLM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(VOCAB, WIDTH, embedding_init=nnx.with_partitioning(
            nnx.initializers.normal(0.02), ("vocab", "embed")), rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(2)])
        self.head = nnx.Linear(WIDTH, VOCAB, kernel_init=nnx.with_partitioning(
            nnx.initializers.lecun_normal(), ("embed", "vocab")), rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def loss(model, batch):
    logits = model(batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def make():
    return shardlib.from_nnx(ByteLM, loss)


def not_a_model():
    return ByteLM
