"""Gemma / Llama-style decoders written in NNX the flax 0.12 way (``nnx.Einsum`` grouped-query
attention with RoPE, a hand-written RMSNorm, a gated MLP, a tied ``embed.attend`` head with logit
soft-capping, layers stacked with ``nnx.split_rngs`` + ``nnx.vmap`` and run with ``nnx.scan`` +
``nnx.remat``, logical names the user chose), trained through shardlib and compared with the
user's own one-device ``nnx.Optimizer`` + ``nnx.value_and_grad`` loop.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from shardlib import build, from_nnx, gather_layer, get_strategy, make_layout, make_mesh
from tests.helpers import optimizer
from tests.test_user_models import _assert_close, _host, _train

VOCAB, D, HEADS, KV_HEADS, HEAD_DIM, FFW, LAYERS, ROWS, SEQ, STEPS = 64, 32, 4, 2, 8, 64, 2, 8, 8, 3
# The user's own rule table for the names their model chose (as a Gemma codebase carries one).
USER_RULES = (("vocab", "tensor"), ("embed", "fsdp"), ("q_heads", "tensor"), ("kv_heads", "tensor"),
              ("head_dim", None), ("ffw", "tensor"), ("layers", None))


def named(names):
    return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)


class RMSNorm(nnx.Module):
    def __init__(self, dim):
        self.scale = nnx.Param(jnp.zeros(dim), out_sharding=("embed",))

    def __call__(self, x):
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * (1 + self.scale[...])


def rope(x, positions):
    half = x.shape[-1] // 2
    angle = positions[..., None, None] * 10_000.0 ** (-jnp.arange(half) / half)
    first, second = x[..., :half], x[..., half:]
    return jnp.concatenate([first * jnp.cos(angle) - second * jnp.sin(angle),
                            second * jnp.cos(angle) + first * jnp.sin(angle)], axis=-1)


class Attention(nnx.Module):
    def __init__(self, *, rngs):
        self.q_einsum = nnx.Einsum("BTD,DNH->BTNH", (D, HEADS, HEAD_DIM),
                                   kernel_init=named(("embed", "q_heads", "head_dim")), rngs=rngs)
        self.kv_einsum = nnx.Einsum("BSD,CDKH->CBSKH", (2, D, KV_HEADS, HEAD_DIM),
                                    kernel_init=named((None, "embed", "kv_heads", "head_dim")), rngs=rngs)
        self.attn_vec_einsum = nnx.Einsum("BTNH,NHD->BTD", (HEADS, HEAD_DIM, D),
                                          kernel_init=named(("q_heads", "head_dim", "embed")), rngs=rngs)

    def __call__(self, x, positions):
        q = rope(self.q_einsum(x), positions)
        k, v = self.kv_einsum(x)
        k, v = (jnp.repeat(t, HEADS // KV_HEADS, axis=2) for t in (rope(k, positions), v))
        logits = jnp.einsum("BTNH,BSNH->BNTS", q, k) * HEAD_DIM ** -0.5
        probs = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((SEQ, SEQ), bool)), logits, -1e9), axis=-1)
        self.sow(nnx.Intermediate, "attn_entropy", -(probs * jnp.log(probs + 1e-9)).sum(-1).mean())
        return self.attn_vec_einsum(jnp.einsum("BNTS,BSNH->BTNH", probs, v))


class Block(nnx.Module):
    def __init__(self, *, rngs):
        self.pre_attention_norm, self.pre_ffw_norm = RMSNorm(D), RMSNorm(D)
        self.attn = Attention(rngs=rngs)
        self.gate_proj = nnx.Linear(D, FFW, use_bias=False, kernel_init=named(("embed", "ffw")), rngs=rngs)
        self.up_proj = nnx.Linear(D, FFW, use_bias=False, kernel_init=named(("embed", "ffw")), rngs=rngs)
        self.down_proj = nnx.Linear(FFW, D, use_bias=False, kernel_init=named(("ffw", "embed")), rngs=rngs)

    def __call__(self, x, positions):
        x = x + self.attn(self.pre_attention_norm(x), positions)
        h = self.pre_ffw_norm(x)
        return x + self.down_proj(nnx.gelu(self.gate_proj(h)) * self.up_proj(h))


class Decoder(nnx.Module):
    """Layers stacked by vmap; ``stack_axis_named`` is whether the vmap records the stack axis in
    the names (``transform_metadata``), as the Flax guides write it."""

    def __init__(self, *, rngs, stack_axis_named=True):
        init = nnx.with_partitioning(nnx.initializers.normal(1.0), ("vocab", "embed"))
        self.embedder = nnx.Embed(VOCAB, D, embedding_init=init, rngs=rngs)
        metadata = {nnx.PARTITION_NAME: "layers"} if stack_axis_named else {}

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata=metadata)
        def stack(rngs):
            return Block(rngs=rngs)

        self.layers = stack(rngs)
        self.final_norm = RMSNorm(D)
        self.steps = nnx.Variable(jnp.array(0, jnp.int32))

    def __call__(self, tokens):
        self.steps[...] += 1
        positions = jnp.arange(tokens.shape[1])

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        @nnx.remat
        def forward(x, layer):
            return layer(x, positions)

        x = forward(self.embedder(tokens) * jnp.sqrt(D), self.layers)
        logits = self.embedder.attend(self.final_norm(x))
        return 30.0 * jnp.tanh(logits / 30.0)


def loss_fn(model, batch):
    """Cross-entropy plus the sown attention entropy as an auxiliary loss (``nnx.capture``)."""
    logits, sown = nnx.capture(model, nnx.Intermediate)(batch["tokens"])
    entropy = jnp.mean(jnp.stack([jnp.mean(e) for e in jax.tree.leaves(sown)]))
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
    return ce + 0.01 * entropy, {"entropy": entropy}


def token_batches(n=STEPS):
    rng = np.random.default_rng(0)
    tokens = [rng.integers(0, VOCAB, size=(ROWS, SEQ + 1)).astype(np.int32) for _ in range(n)]
    return [{"tokens": t[:, :-1], "targets": t[:, 1:]} for t in tokens]


def users_own_loop(model, batches):
    """The NNX way on one device: nnx.Optimizer, nnx.value_and_grad, nnx.jit."""
    opt = nnx.Optimizer(model, optimizer(), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, opt, batch):
        (loss, _), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
        opt.update(model, grads)
        return loss

    return [float(train_step(model, opt, batch)) for batch in batches]


def user_module_holding(state):
    """The user's module over the train state's initial weights (jit's draws, to the last bit)."""
    with nnx.use_eager_sharding(False):
        module = nnx.eval_shape(lambda: Decoder(rngs=nnx.Rngs(0)))
    nnx.update(module, nnx.State(_host(state.params)), nnx.State(_host(state.model_state)))
    return module


def test_scanned_gemma_with_its_own_names_trains_under_fsdp_tp_like_its_nnx_optimizer_loop():
    """The user's names mapped by their rule table: heads and kv_heads split over `tensor`, the
    stack axis never split; the trajectory is the user's own loop's. A stack whose vmap does not
    record its axis leaves every kernel one name short: warned, per tensor, with what to write."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="from_nnx: these parameters have fewer logical names")
        model = from_nnx(Decoder, loss_fn)
    layout = make_layout(model, get_strategy("fsdp_tp").with_logical_rules(USER_RULES),
                         make_mesh({"fsdp": 4, "tensor": 2}))
    attn = layout.param_shardings()["layers"]["attn"]
    assert attn["q_einsum"]["kernel"].spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    assert attn["kv_einsum"]["kernel"].spec == jax.sharding.PartitionSpec(None, None, "fsdp", "tensor", None)
    program, batches = build(model, optimizer(), layout), token_batches()
    state = program.init(jax.random.key(0))
    held = user_module_holding(state)
    state, losses = _train(program, state, batches)
    np.testing.assert_allclose(losses, users_own_loop(held, batches), rtol=1e-5)
    _assert_close(_host(state.params), nnx.to_pure_dict(nnx.state(held, nnx.Param)))
    assert int(state.model_state["steps"]) == int(held.steps[...]) == STEPS
    with pytest.warns(UserWarning, match=r"layers/attn/q_einsum/kernel \(2, 32, 4, 8\) \('embed', 'q_heads', "
                                         r"'head_dim'\).*transform_metadata=\{nnx.PARTITION_NAME: 'layers'\}"):
        from_nnx(lambda rngs: Decoder(rngs=rngs, stack_axis_named=False), loss_fn)


class CachedAttention(Attention):
    """Attention whose keys and values go into an ``nnx.Cache`` once ``init_cache`` made one (for
    sampling), as NNX decoders write it."""

    def init_cache(self, batch_size):
        self.cache_k = nnx.Cache(jnp.zeros((batch_size, SEQ, KV_HEADS, HEAD_DIM)))
        self.cache_v = nnx.Cache(jnp.zeros((batch_size, SEQ, KV_HEADS, HEAD_DIM)))
        self.cache_index = nnx.Cache(jnp.array(0, jnp.int32))

    def __call__(self, x, positions):
        if hasattr(self, "cache_k"):
            k, v = self.kv_einsum(x)
            self.cache_k[...], self.cache_v[...] = k, v
            self.cache_index[...] += x.shape[1]
        return super().__call__(x, positions)


class CachedLM(nnx.Module):
    def __init__(self, *, rngs):
        self.embedder = nnx.Embed(VOCAB, D, rngs=rngs)
        self.attn = CachedAttention(rngs=rngs)

    def __call__(self, tokens):
        return self.embedder.attend(self.attn(self.embedder(tokens), jnp.arange(tokens.shape[1])))


class UnnamedStack(nnx.Module):
    """An unannotated vmap stack whose only dim `fsdp` divides is the layer axis (8 layers of 12 x
    100 kernels), scanned with each layer gathered (``gathers_params=True``)."""

    def __init__(self, *, rngs):
        @nnx.split_rngs(splits=8)
        @nnx.vmap(in_axes=0, out_axes=0)
        def stack(rngs):
            return nnx.Sequential(nnx.Linear(12, 100, use_bias=False, rngs=rngs), nnx.gelu,
                                  nnx.Linear(100, 12, use_bias=False, rngs=rngs))

        self.layers = stack(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x, layer):
            return x + gather_layer(layer)(x)

        return forward(x, self.layers)


def regression_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def test_a_written_decoding_cache_and_a_split_layer_axis_are_refused_by_path():
    """Each device would fill only its own rows of a cache sized for the whole batch, and the step
    would average the caches over the devices: refused, naming the caches (the index, written from
    no rows, is not). A stack whose layer axis ZeRO's fallback split would scan each device's own
    layers only: refused, saying how to name the axis; so named, it trains like the module itself."""
    with nnx.use_eager_sharding(False):
        held = CachedLM(rngs=nnx.Rngs(0))
    held.attn.init_cache(ROWS)  # the user sampled with this instance before fine-tuning it
    model = from_nnx(held, loss_fn)
    program = build(model, optimizer(), make_layout(model, "dp", make_mesh({"data": 8})))
    with pytest.raises(ValueError, match=r"wrote the device's rows into nnx.Cache attn/cache_k, attn/cache_v: a "
                                         r"decoding cache .* Train the module without it"):
        program.step(program.init(jax.random.key(0)), token_batches(1)[0])
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(16, 12)).astype(np.float32), "y": rng.normal(size=(16, 12)).astype(np.float32)}
    unnamed = from_nnx(UnnamedStack, regression_loss, gathers_params=True)
    program = build(unnamed, optax.sgd(0.1), make_layout(unnamed, "zero3", make_mesh({"fsdp": 8})))
    with pytest.raises(ValueError, match=r"gather_layer: layers/layers/0/kernel is one layer of a stack whose layer "
                                         r"axis \(dim 0\) is split over 'fsdp'.*path_rules"):
        program.step(program.init(jax.random.key(0)), batch)
    named = from_nnx(UnnamedStack, regression_loss, gathers_params=True, path_rules=[(r"^layers/", ("layers",))])
    layout = make_layout(named, "zero3", make_mesh({"fsdp": 8}))
    assert layout.param_shardings()["layers"]["layers"][0]["kernel"].spec[0] is None
    program = build(named, optax.sgd(0.1), layout)
    state = program.init(jax.random.key(0))
    module = nnx.eval_shape(lambda: UnnamedStack(rngs=nnx.Rngs(0)))
    nnx.update(module, nnx.State(_host(state.params)))
    np.testing.assert_allclose(float(program.step(state, batch)[1]["loss"]), regression_loss(module, batch), rtol=1e-6)
