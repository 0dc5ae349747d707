"""Models written the way the Flax ecosystem writes them, not the way shardlib's GPT is.

None of them imports shardlib: they are what a user brings. Each comes with a batch maker and
the loss a user would write, so tests can train them through shardlib and through a plain
single-device ``jax.jit(jax.value_and_grad)`` + optax step written in the test.

- `LinenTransformer`: a decoder from `nn.Embed`, `nn.MultiHeadDotProductAttention` and
  `nn.Dense`, with `nn.with_logical_partitioning` names as Flax's lm1b/wmt examples write them
  (two names on the 3-D attention kernels), `nn.Dropout`, two inputs and a ``train`` flag.
- `NnxCNN`: the NNX MNIST-tutorial shape: `nnx.Conv`, `nnx.BatchNorm`, `nnx.Dropout`,
  `nnx.Linear`; no annotations.
- `mlp_init` / `mlp_loss`: a plain pytree MLP; no annotations.
- `NnxTransformer`: `nnx.Embed`, `nnx.MultiHeadAttention`, `nnx.LayerNorm`, `nnx.Linear`,
  `nnx.Dropout`; no annotations.
- `NnxMeshAnnotated`: an NNX MLP whose kernels carry mesh-axis names directly
  (`nnx.with_partitioning(init, ("fsdp", "tensor"))`), as MaxText and Flax's Gemma do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx

VOCAB, SEQ, D_MODEL, HEADS, D_FF = 64, 16, 64, 4, 128


def token_batch(seed: int, batch: int = 16) -> dict[str, np.ndarray]:
    """Next-token data: ``tokens`` and ``positions`` (two inputs) and ``targets``."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, size=(batch, SEQ + 1), dtype=np.int32)
    positions = np.broadcast_to(np.arange(SEQ, dtype=np.int32), (batch, SEQ)).copy()
    return {"tokens": tokens[:, :-1], "positions": positions, "targets": tokens[:, 1:]}


def image_batch(seed: int, batch: int = 16) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"image": rng.normal(size=(batch, 8, 8, 1)).astype(np.float32),
            "label": rng.integers(0, 10, size=(batch,), dtype=np.int32)}


def regression_batch(seed: int, batch: int = 16, features: int = 32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, features)).astype(np.float32)
    return {"x": x, "y": np.sin(x[:, :8])}


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()


# ---- linen, with logical names as Flax's examples write them ---------------------------------

def _logical(init, names):
    return nn.with_logical_partitioning(init, names)


class LinenBlock(nn.Module):
    dropout_rate: float

    @nn.compact
    def __call__(self, x, *, train: bool):
        dense_init = nn.initializers.xavier_uniform()
        y = nn.LayerNorm(scale_init=_logical(nn.initializers.ones, ("embed",)))(x)
        y = nn.MultiHeadDotProductAttention(
            num_heads=HEADS, qkv_features=D_MODEL, kernel_init=_logical(dense_init, ("embed", "kv")),
            bias_init=_logical(nn.initializers.zeros, ("kv",)), dropout_rate=self.dropout_rate,
            deterministic=not train)(y, mask=nn.make_causal_mask(jnp.ones(x.shape[:2])))
        x = x + nn.Dropout(self.dropout_rate)(y, deterministic=not train)
        y = nn.LayerNorm(scale_init=_logical(nn.initializers.ones, ("embed",)))(x)
        y = nn.Dense(D_FF, kernel_init=_logical(dense_init, ("embed", "mlp")))(y)
        y = nn.Dense(D_MODEL, kernel_init=_logical(dense_init, ("mlp", "embed")))(nn.gelu(y))
        return x + nn.Dropout(self.dropout_rate)(y, deterministic=not train)


class LinenTransformer(nn.Module):
    dropout_rate: float = 0.0
    n_layers: int = 2

    @nn.compact
    def __call__(self, tokens, positions, *, train: bool):
        embed = nn.Embed(VOCAB, D_MODEL, embedding_init=_logical(nn.initializers.normal(0.02), ("vocab", "embed")))
        pos = nn.Embed(SEQ, D_MODEL, embedding_init=_logical(nn.initializers.normal(0.02), (None, "embed")))
        x = nn.Dropout(self.dropout_rate)(embed(tokens) + pos(positions), deterministic=not train)
        for _ in range(self.n_layers):
            x = LinenBlock(self.dropout_rate)(x, train=train)
        x = nn.LayerNorm(scale_init=_logical(nn.initializers.ones, ("embed",)))(x)
        return nn.Dense(VOCAB, kernel_init=_logical(nn.initializers.xavier_uniform(), ("embed", "vocab")))(x)


def linen_transformer_loss(logits, batch):
    return cross_entropy(logits, batch["targets"])


# ---- NNX, no annotations ---------------------------------------------------------------------

class NnxCNN(nnx.Module):
    """The NNX MNIST tutorial's CNN, shrunk to 8x8 images, with BatchNorm after each conv."""

    def __init__(self, *, rngs: nnx.Rngs, dropout_rate: float = 0.0, bn_axis_name=None):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.bn1 = nnx.BatchNorm(32, axis_name=bn_axis_name, rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.bn2 = nnx.BatchNorm(64, axis_name=bn_axis_name, rngs=rngs)
        self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)
        self.linear1 = nnx.Linear(64 * 2 * 2, 512, rngs=rngs)
        self.linear2 = nnx.Linear(512, 10, rngs=rngs)

    def __call__(self, x):
        pool = lambda y: nnx.avg_pool(y, window_shape=(2, 2), strides=(2, 2))
        x = pool(nnx.relu(self.bn1(self.conv1(x))))
        x = pool(nnx.relu(self.bn2(self.conv2(x))))
        x = self.dropout(x.reshape(x.shape[0], -1))
        return self.linear2(nnx.relu(self.linear1(x)))


def cnn_loss(model, batch):
    return cross_entropy(model(batch["image"]), batch["label"])


class NnxBlock(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs, dropout_rate: float):
        self.norm1 = nnx.LayerNorm(D_MODEL, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(HEADS, D_MODEL, decode=False, dropout_rate=dropout_rate,
                                       deterministic=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(D_MODEL, rngs=rngs)
        self.up = nnx.Linear(D_MODEL, D_FF, rngs=rngs)
        self.down = nnx.Linear(D_FF, D_MODEL, rngs=rngs)
        self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.dropout(self.attn(self.norm1(x), mask=mask))
        return x + self.dropout(self.down(nnx.gelu(self.up(self.norm2(x)))))


class NnxTransformer(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs, dropout_rate: float = 0.0, n_layers: int = 2):
        self.embed = nnx.Embed(VOCAB, D_MODEL, rngs=rngs)
        self.blocks = nnx.List([NnxBlock(rngs=rngs, dropout_rate=dropout_rate) for _ in range(n_layers)])
        self.norm = nnx.LayerNorm(D_MODEL, rngs=rngs)
        self.head = nnx.Linear(D_MODEL, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        mask = nnx.make_causal_mask(tokens)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def nnx_transformer_loss(model, batch):
    return cross_entropy(model(batch["tokens"]), batch["targets"])


# ---- NNX annotated with mesh axes (MaxText / Gemma style) ------------------------------------

class NnxMeshAnnotated(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs, features: int = 32, hidden: int = 256):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(features, hidden, kernel_init=nnx.with_partitioning(init, ("fsdp", "tensor")),
                             bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("tensor",)), rngs=rngs)
        self.down = nnx.Linear(hidden, 8, kernel_init=nnx.with_partitioning(init, ("tensor", "fsdp")),
                               use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.gelu(self.up(x)))


def regression_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


# ---- a plain pytree ------------------------------------------------------------------------

def mlp_init(key, features: int = 32, hidden: int = 256):
    k1, k2, k3 = jax.random.split(key, 3)
    scale = lambda fan_in: 1.0 / np.sqrt(fan_in)
    return {
        "encoder": {"kernel": jax.random.normal(k1, (features, hidden)) * scale(features), "bias": jnp.zeros(hidden)},
        "hidden": {"kernel": jax.random.normal(k2, (hidden, hidden)) * scale(hidden), "bias": jnp.zeros(hidden)},
        "decoder": {"kernel": jax.random.normal(k3, (hidden, 8)) * scale(hidden), "bias": jnp.zeros(8)},
    }


def mlp_loss(params, batch):
    h = jax.nn.relu(batch["x"] @ params["encoder"]["kernel"] + params["encoder"]["bias"])
    h = jax.nn.relu(h @ params["hidden"]["kernel"] + params["hidden"]["bias"])
    return jnp.mean((h @ params["decoder"]["kernel"] + params["decoder"]["bias"] - batch["y"]) ** 2)


def program_steps(program, state, batches):
    """``program``'s steps over ``batches`` from ``state``: the final state and the losses."""
    losses = []
    for batch in batches:
        state, metrics = program.step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


def plain_steps(loss_fn, params, tx, batches):
    """The independent reference: one device, ``jax.jit(jax.value_and_grad)`` + optax, no shardlib."""

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state, losses = tx.init(params), []
    for batch in batches:
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    return params, losses


def plain_steps_with_state(loss_fn, params, model_state, tx, batches):
    """`plain_steps` for a loss that also updates model state (BatchNorm statistics):
    ``loss_fn(params, model_state, batch) -> (loss, new model state)``."""

    @jax.jit
    def step(params, opt_state, model_state, batch):
        (loss, model_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, model_state, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, model_state, loss

    opt_state, losses = tx.init(params), []
    for batch in batches:
        params, opt_state, model_state, loss = step(params, opt_state, model_state, batch)
        losses.append(float(loss))
    return params, model_state, losses


def shared_run(memo: dict, key, start, run):
    """``run()`` once per ``key`` of ``memo``, its result reused by later calls with that key.

    For parametrized cases that train one model on several meshes: their one-device reference
    is the same computation, so it is compiled and run once per file. Each call's ``start`` (its
    initial values and batches) must equal the first call's bit for bit, or it fails."""
    if key not in memo:
        memo[key] = (start, run())
    first, result = memo[key]
    jax.tree.map(np.testing.assert_array_equal, start, first)
    return result


def nnx_functional(make, loss_fn, seed: int = 0):
    """``(params, batch_stats, loss(params, batch_stats, batch) -> (loss, batch_stats))`` of an NNX
    module, as pure dicts, written with nnx.split / nnx.merge: the module trained the NNX way.
    A module without BatchNorm has batch_stats None."""
    with nnx.use_eager_sharding(False):  # annotated modules: values on one device, names as metadata
        module = make(nnx.Rngs(seed))
    graphdef, params, stats, rest = nnx.split(module, nnx.Param, nnx.BatchStat, ...)

    def loss(param_values, stat_values, batch):
        p, s = jax.tree.map(lambda x: x, params), jax.tree.map(lambda x: x, stats)
        nnx.replace_by_pure_dict(p, param_values)
        if stat_values is not None:
            nnx.replace_by_pure_dict(s, stat_values)
        bound = nnx.merge(graphdef, p, s, rest)
        return loss_fn(bound, batch), stat_values and nnx.to_pure_dict(nnx.state(bound, nnx.BatchStat))

    return nnx.to_pure_dict(params), nnx.to_pure_dict(stats) if jax.tree.leaves(stats) else None, loss
