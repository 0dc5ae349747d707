"""Recurrent models: a scan over time whose carry starts from constants (Flax's RNN cells, or a
user's own ``lax.scan`` from zeros) inside the step, against plain one-device ``jax.jit`` + optax."""

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

VOCAB, TAGS = 32, 5


def _batches(n=2):
    rng = np.random.default_rng(0)
    return [{"tokens": rng.integers(0, VOCAB, (16, 6)).astype(np.int32),
             "tags": rng.integers(0, TAGS, (16, 6)).astype(np.int32)} for _ in range(n)]


def _tag_loss(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tags"]).mean()


class LinenTagger(nn.Module):
    """A sequence tagger as the Flax docs write one: an LSTM, then a bidirectional GRU."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, 16)(tokens)
        x = nn.RNN(nn.OptimizedLSTMCell(16))(x)
        x = nn.Bidirectional(nn.RNN(nn.GRUCell(8)), nn.RNN(nn.GRUCell(8)))(x)
        return nn.Dense(TAGS)(x)


def test_linen_rnn_cells_train_like_one_device():
    batches = _batches()
    model = from_linen(LinenTagger(), _tag_loss, batches[0], inputs=lambda b, train: ((b["tokens"],), {}),
                       rng_streams=())
    tx = optax.adam(1e-2)
    program = build(model, tx, make_layout(model, "zero3", make_mesh({"fsdp": 8})))
    state = program.init(jax.random.key(0))
    start = jax.tree.map(np.asarray, state.params)
    state, losses = zoo.program_steps(program, state, batches)
    user_loss = lambda p, b: _tag_loss(LinenTagger().apply({"params": p}, b["tokens"]), b)
    expected, expected_losses = zoo.plain_steps(user_loss, start, tx, batches)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=1e-6), state.params, expected)


class NnxTagger(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, 16, rngs=rngs)
        self.rnn = nnx.RNN(nnx.LSTMCell(16, 16, rngs=rngs))
        self.head = nnx.Linear(16, TAGS, rngs=rngs)

    def __call__(self, tokens):
        return self.head(self.rnn(self.embed(tokens)))


def test_nnx_rnn_trains_like_its_own_loop_and_a_users_scan_is_told_what_to_write():
    user = NnxTagger(nnx.Rngs(0))
    params = jax.tree.map(np.asarray, nnx.state(user, nnx.Param))
    tx = optax.adam(1e-2)
    opt = nnx.Optimizer(user, tx, wrt=nnx.Param)

    @nnx.jit
    def reference_step(module, opt, batch):
        loss, grads = nnx.value_and_grad(lambda m: _tag_loss(m(batch["tokens"]), batch))(module)
        opt.update(module, grads)
        return loss

    model = from_nnx(NnxTagger, lambda m, b: _tag_loss(m(b["tokens"]), b))
    program = build(model, tx, make_layout(model, "zero3", make_mesh({"fsdp": 8})))
    state, losses = zoo.program_steps(program, program.init_from(params), _batches())
    np.testing.assert_allclose(losses, [float(reference_step(user, opt, b)) for b in _batches()], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(state.params["head"]["kernel"]), np.asarray(user.head.kernel[...]),
                               rtol=1e-4, atol=1e-6)

    def recurrence(start):
        def loss(p, b):
            x = jax.nn.one_hot(b["tokens"], VOCAB)
            h, _ = jax.lax.scan(lambda h, xt: (jnp.tanh(h @ p["w"] + xt), None), start(jnp.zeros((x.shape[0], VOCAB))),
                                x.swapaxes(0, 1))
            return jnp.mean(h ** 2)
        return loss

    init = lambda key: {"w": jax.random.normal(key, (VOCAB, VOCAB)) * 0.1}
    layout = make_layout(from_functions(init, recurrence(lambda h: h)), "dp", make_mesh({"data": 8}))
    bare = build(from_functions(init, recurrence(lambda h: h)), optax.sgd(0.1), layout)
    with pytest.raises(TypeError) as caught:
        bare.step(bare.init(jax.random.key(0)), _batches(1)[0])
    assert "start it from shardlib.batch_varying(initial_carry)" in "\n".join(caught.value.__notes__)
    fixed = build(from_functions(init, recurrence(shardlib.batch_varying)), optax.sgd(0.1), layout)
    state, metrics = fixed.step(fixed.init(jax.random.key(0)), _batches(1)[0])
    expected, expected_losses = zoo.plain_steps(recurrence(lambda h: h), init(jax.random.key(0)), optax.sgd(0.1),
                                                _batches(1))
    np.testing.assert_allclose(float(metrics["loss"]), expected_losses[0], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(state.params["w"]), np.asarray(expected["w"]), rtol=1e-5, atol=1e-7)
