"""Flax linen models in the ecosystem's usual styles, through `shardlib.from_linen`.

The models are written the way the Flax docs and examples write them (no shardlib import): the
MNIST CNN called as ``model.apply({'params': p}, x)``, a ``setup()`` MLP fed a tuple batch, an
lm1b-style LM (weight-tied ``embed.attend``, ``deterministic`` flag, a tuple returned), layers
stacked with ``nn.remat`` + ``nn.scan`` and ``PARTITION_NAME`` metadata, t5x-style
``nn.with_logical_constraint`` on activations, a ResNet with BatchNorm and ``functools.partial``
layers, a sown auxiliary loss, a non-'dropout' rng stream and a decode-mode cache.

References are independent of shardlib: ``module.apply`` inside a plain one-device
``jax.jit(jax.value_and_grad)`` + optax step (`tests.zoo.plain_steps_with_state`), the lowered
HLO's sharding constraints, and bitwise checkpoint comparison.
"""

from __future__ import annotations

import functools
import re
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import errors as flax_errors
from flax import linen as nn
from flax.linen import partitioning as nn_partitioning

import shardlib
from shardlib import Checkpointer, build, from_linen, make_layout, make_mesh
from tests import zoo
from tests.helpers import optimizer  # AdamW, lr 3e-3, eps=1e-5

STEPS, ROWS = 3, 16
VOCAB, SEQ, D = zoo.VOCAB, zoo.SEQ, 32
pytestmark = pytest.mark.filterwarnings("ignore::shardlib.ReplicationWarning")


# ---- the models, as their authors write them ---------------------------------------------------

class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.avg_pool(nn.relu(nn.Conv(features=16, kernel_size=(3, 3))(x)), window_shape=(2, 2), strides=(2, 2))
        x = nn.avg_pool(nn.relu(nn.Conv(features=32, kernel_size=(3, 3))(x)), window_shape=(2, 2), strides=(2, 2))
        x = nn.relu(nn.Dense(features=128)(x.reshape((x.shape[0], -1))))
        return nn.Dense(features=10)(x)


class SetupMLP(nn.Module):
    features: tuple = (256, 8)

    def setup(self):
        self.layers = [nn.Dense(f) for f in self.features]

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i != len(self.layers) - 1:
                x = nn.relu(x)
        return x


class DecoderBlock(nn.Module):
    dropout_rate: float

    @nn.compact
    def __call__(self, x, mask, deterministic: bool):
        y = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=D, dropout_rate=self.dropout_rate,
                                            deterministic=deterministic)(nn.LayerNorm()(x), mask=mask)
        x = x + nn.Dropout(rate=self.dropout_rate)(y, deterministic=deterministic)
        y = nn.Dense(D)(nn.gelu(nn.Dense(4 * D)(nn.LayerNorm()(x))))
        return x + nn.Dropout(rate=self.dropout_rate)(y, deterministic=deterministic)


class TiedLM(nn.Module):
    """lm1b-style: the output head is the embedding (``embed.attend``); returns (logits, aux)."""

    dropout_rate: float = 0.1
    n_layers: int = 1

    @nn.compact
    def __call__(self, tokens, positions, *, deterministic: bool):
        embed = nn.Embed(VOCAB, D, embedding_init=nn.initializers.normal(stddev=1.0), name="embed")
        x = embed(tokens) + self.param("pos_embedding", nn.initializers.normal(0.02), (SEQ, D))[positions]
        mask = nn.make_causal_mask(tokens)
        for i in range(self.n_layers):
            x = DecoderBlock(self.dropout_rate, name=f"block_{i}")(x, mask, deterministic)
        x = nn.LayerNorm(name="final_norm")(x)
        return embed.attend(x), {"hidden_rms": jnp.sqrt(jnp.mean(jnp.square(x)))}


class ScanBlock(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, x, _):
        init = nn.initializers.lecun_normal()
        y = nn.Dense(self.hidden, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(nn.LayerNorm()(x))
        y = nn.Dense(x.shape[-1], kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")))(nn.relu(y))
        return x + y, None


class ScannedLM(nn.Module):
    features: int = D
    hidden: int = 64
    n_layers: int = 4

    @nn.compact
    def __call__(self, tokens):
        embed_init = nn.with_logical_partitioning(nn.initializers.normal(1.0), ("vocab", "embed"))
        x = nn.Embed(VOCAB, self.features, embedding_init=embed_init)(tokens)
        stack = nn.scan(nn.remat(ScanBlock), variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
                        length=self.n_layers, metadata_params={nn.PARTITION_NAME: "layers"})
        x, _ = stack(self.hidden, name="layers")(x, None)
        return nn.Dense(VOCAB, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "vocab")))(x)


class T5xMLP(nn.Module):
    """t5x / MaxText in linen: logical names on the parameters, boxed (MaxText) or in t5x's
    ``params_axes`` collection (``param_with_axes``), and on the activations."""

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        x = nn.with_logical_constraint(x, ("batch", "embed"))
        h = nn.Dense(256, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")),
                     bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("mlp",)))(x)
        h = nn.with_logical_constraint(nn.relu(h), ("batch", "mlp"))
        wo = nn_partitioning.param_with_axes("wo", init, (256, 8), axes=("mlp", "embed"))
        return h @ wo


class ResNetBlock(nn.Module):
    filters: int
    conv: Any
    norm: Any

    @nn.compact
    def __call__(self, x):
        y = nn.relu(self.norm()(self.conv(self.filters, (3, 3))(x)))
        y = self.norm(scale_init=nn.initializers.zeros_init())(self.conv(self.filters, (3, 3))(y))
        return nn.relu(x + y)


class ResNet(nn.Module):
    axis_name: Any = None
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = True):
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype, param_dtype=jnp.float32)
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5,
                                 dtype=self.dtype, param_dtype=jnp.float32, axis_name=self.axis_name)
        x = nn.relu(norm(name="bn_init")(conv(16, (3, 3), name="conv_init")(x)))
        x = ResNetBlock(16, conv=conv, norm=norm)(x)
        return nn.Dense(10, dtype=self.dtype)(jnp.mean(x, axis=(1, 2))).astype(jnp.float32)


class SownAuxLoss(nn.Module):
    """An auxiliary loss sown into its own collection (as mixture-of-experts layers do)."""

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(256)(x))
        self.sow("losses", "activation_l2", jnp.mean(h ** 2))
        return nn.Dense(8)(h)


class Noisy(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.relu(nn.Dense(64)(x))
        return nn.Dense(8)(h + 0.1 * jax.random.normal(self.make_rng("noise"), h.shape) if train else h)


class Decoding(nn.Module):
    decode: bool = False

    @nn.compact
    def __call__(self, x):
        if self.decode:
            index = self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
            index.value += 1
        return nn.Dense(8)(x)


# ---- the harness ----------------------------------------------------------------------------

def mse(out, batch):
    return jnp.mean((out - batch["y"]) ** 2)


def regression_inputs(batch, train):
    return (batch["x"],), {}


def _train(program, batches):
    state, losses = program.init(jax.random.key(0)), []
    start = jax.tree.map(np.asarray, (state.params, state.model_state))
    for batch in batches:
        state, metrics = program.step(state, batch)
        losses.append(float(metrics["loss"]))
    return start, state, losses


def _parity(model, strategy, sizes, reference, make_batch):
    """Losses of ``STEPS`` shardlib steps against ``reference(params, state, batch) -> (loss,
    state)`` in a plain one-device jit + optax step, from the same initial values."""
    program = build(model, optimizer(), make_layout(model, strategy, make_mesh(sizes)))
    batches = [make_batch(i) for i in range(STEPS)]
    (params0, state0), state, losses = _train(program, batches)
    _, ref_state, ref_losses = zoo.plain_steps_with_state(reference, params0, state0, optimizer(), batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    return program, state, ref_state


def _stateless(forward, loss):
    return lambda p, s, b: (loss(forward(p, b), b), s)


# ---- models that train as written ---------------------------------------------------------------

def test_mnist_cnn_called_the_classic_way_matches_plain_jit():
    module = CNN()
    model = from_linen(module, lambda logits, b: zoo.cross_entropy(logits, b["label"]), zoo.image_batch(0),
                       inputs=lambda b, train: ((b["image"],), {}), rng_streams=())
    _parity(model, "zero3", {"fsdp": 8}, _stateless(lambda p, b: module.apply({"params": p}, b["image"]),
                                                     lambda logits, b: zoo.cross_entropy(logits, b["label"])),
            zoo.image_batch)
    # shardlib's init is the module's own: module.init(key, x)["params"] (each jitted: one compile
    # apiece, not one per initializer op)
    ours = jax.jit(model.init)(jax.random.key(3))
    theirs = jax.jit(lambda key, x: module.init(key, x)["params"])(jax.random.key(3), zoo.image_batch(0)["image"])
    jax.tree.map(np.testing.assert_array_equal, ours, theirs)


def test_setup_mlp_on_a_tuple_batch_matches_plain_jit():
    module = SetupMLP()
    batch = lambda i: tuple(zoo.regression_batch(i).values())  # (x, y)
    model = from_linen(module, lambda out, b: jnp.mean((out - b[1]) ** 2), batch(0),
                       inputs=lambda b, train: ((b[0],), {}), rng_streams=())
    _parity(model, "zero1", {"data": 8}, lambda p, s, b: (jnp.mean((module.apply({"params": p}, b[0]) - b[1]) ** 2), s),
            batch)
    one_input = from_linen(module, lambda out, b: 0.0, batch(0)[0])  # without inputs=: batch["inputs"]
    with pytest.raises(ValueError, match=r"batch\['inputs'\].*tuple.*inputs=lambda batch, train"):
        one_input.loss(one_input.init(jax.random.key(0)), batch(0))


def test_tied_lm_with_deterministic_flag_and_tuple_output_matches_plain_jit():
    """The flag is ``deterministic``, not ``train``, and the module returns (logits, aux); dropout
    is off (rate 0) so that the one-device reference draws the same nothing."""
    module = TiedLM(dropout_rate=0.0)
    loss = lambda out, b: (zoo.cross_entropy(out[0], b["targets"]), out[1])
    inputs = lambda b, train: ((b["tokens"], b["positions"]), {"deterministic": not train})
    model = from_linen(module, loss, zoo.token_batch(0), inputs=inputs)
    reference = lambda p, s, b: (loss(module.apply({"params": p}, *inputs(b, True)[0], deterministic=False), b)[0], s)
    _, state, _ = _parity(model, "zero2", {"data": 2, "fsdp": 4}, reference, zoo.token_batch)
    # Model.apply (sampling) takes the module's own arguments, several inputs and keywords included
    batch, params = zoo.token_batch(5), jax.tree.map(np.asarray, state.params)
    both = jax.jit(lambda p, t, q: (model.apply(p, t, q, deterministic=True),
                                    module.apply({"params": p}, t, q, deterministic=True)))
    jax.tree.map(np.testing.assert_array_equal, *both(params, batch["tokens"], batch["positions"]))


def test_scanned_rematerialised_layers_keep_their_layer_axis_under_fsdp_tp():
    module = ScannedLM()
    model = from_linen(module, lambda logits, b: zoo.cross_entropy(logits, b["targets"]), zoo.token_batch(0),
                       inputs=lambda b, train: ((b["tokens"],), {}))
    assert model.logical_axes["layers"]["Dense_0"]["kernel"] == ("layers", "embed", "mlp")
    program, _, _ = _parity(model, "fsdp_tp", {"fsdp": 4, "tensor": 2},
                            _stateless(lambda p, b: module.apply({"params": p}, b["tokens"]),
                                       lambda logits, b: zoo.cross_entropy(logits, b["targets"])), zoo.token_batch)
    spec = program.layout.param_shardings()["layers"]["Dense_0"]["kernel"].spec
    assert spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")  # the stacked axis stays whole


def test_zero3_gathers_a_scanned_linen_stack_one_layer_at_a_time():
    """Linen reads each parameter through ``self.param``, which unboxes it: shardlib hands the
    shards in a box whose unbox is the ZeRO-3 gather, so inside ``nn.scan`` + ``nn.remat`` only
    one layer's weights are whole at a time. Gathering the stack up front would need its
    L x 2 x d x ff x 4 bytes of temporaries alone; the step stays below that."""
    module = ScannedLM(features=64, hidden=256, n_layers=8)
    model = from_linen(module, lambda logits, b: zoo.cross_entropy(logits, b["targets"]), zoo.token_batch(0),
                       inputs=lambda b, train: ((b["tokens"],), {}), rng_streams=())
    assert model.gathers_params
    program = build(model, optimizer(), make_layout(model, "zero3", make_mesh({"fsdp": 8})))
    batch = program.abstract_batch({k: (v.shape, v.dtype) for k, v in zoo.token_batch(0).items()})
    temporaries = program.compile_step(program.abstract_state(), batch).memory_analysis().temp_size_in_bytes
    assert temporaries < 8 * 2 * 64 * 256 * 4, temporaries


class NarrowLayer(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return jnp.tanh(nn.Dense(8)(h)), None


class DeepNarrow(nn.Module):
    """An unannotated nn.scan stack whose layer axis (16) is its largest: the ZeRO fallback would
    split it, and the scan would then iterate over a device's share of the layers."""

    @nn.compact
    def __call__(self, x):
        stack = nn.scan(NarrowLayer, variable_axes={"params": 0}, split_rngs={"params": True}, length=16)
        h, _ = stack(name="layers")(nn.Dense(8)(x), None)
        return nn.Dense(8)(h)


def test_an_unannotated_scanned_stack_keeps_its_layer_axis_whole():
    module = DeepNarrow()
    model = from_linen(module, mse, zoo.regression_batch(0), inputs=regression_inputs, rng_streams=())
    assert model.logical_axes["layers"]["Dense_0"]["kernel"] == ("layers",)  # found by nn.scan's slicing
    program, _, _ = _parity(model, "zero3", {"fsdp": 8}, _stateless(lambda p, b: module.apply({"params": p}, b["x"]), mse),
                            zoo.regression_batch)
    assert program.layout.param_shardings()["layers"]["Dense_0"]["kernel"].spec == jax.sharding.PartitionSpec(None, "fsdp", None)


def test_bf16_metrics_are_summed_in_float32():
    """An aux metric computed in bf16 (nn.Embed's output takes the bf16 weights' dtype) is summed
    over the devices in float32: a bf16 psum aborted XLA:CPU's compiler (AllReducePromotion)."""
    module = TiedLM(dropout_rate=0.0)
    loss = lambda out, b: (zoo.cross_entropy(out[0], b["targets"]), out[1])
    model = from_linen(module, loss, zoo.token_batch(0), inputs=lambda b, train: ((b["tokens"], b["positions"]),
                                                                                   {"deterministic": not train}))
    program = build(model, optimizer(), make_layout(model, "zero3", make_mesh({"fsdp": 8})), precision="bf16")
    _, metrics = program.step(program.init(jax.random.key(0)), zoo.token_batch(0))
    assert metrics["hidden_rms"].dtype == jnp.float32 and np.isfinite(float(metrics["hidden_rms"]))


# ---- t5x-style activation constraints ------------------------------------------------------

def test_with_logical_constraint_follows_the_strategys_activation_rules():
    """Outside a step Flax's own (absent) rules make the constraint a no-op; inside one, 'mlp'
    maps to 'tensor' as shardlib.constrain would, and 'batch' (manual there) to nothing."""
    module = T5xMLP()
    model = from_linen(module, mse, zoo.regression_batch(0), inputs=regression_inputs, rng_streams=())
    assert model.logical_axes["wo"] == ("mlp", "embed") and not model.stateful  # params_axes: names, not state
    program, state, _ = _parity(model, "tp", {"data": 4, "tensor": 2},
                                _stateless(lambda p, b: module.apply({"params": p}, b["x"]), mse), zoo.regression_batch)
    lowered = program.step.lower(state, zoo.regression_batch(0)).as_text()
    hidden = '<@mesh, [{}, {"tensor"}]> : tensor<4x256xf32>'  # 4 rows per data device, mlp over tensor
    assert any("sharding_constraint" in line and hidden in line for line in lowered.splitlines())
    assert any("sharding_constraint" in line and "[{}, {}]> : tensor<4x32xf32>" in line for line in lowered.splitlines())
    assert program.layout.param_shardings()["wo"].spec == jax.sharding.PartitionSpec("tensor", None)


# ---- BatchNorm, model state, Model.apply, checkpoints --------------------------------------------

@pytest.fixture(scope="module")
def resnet():
    """The ResNet with synchronised BatchNorm under zero3, trained 3 steps against its one-device
    reference (plain BatchNorm: the global batch's statistics either way)."""
    mesh = make_mesh({"fsdp": 8})
    module = ResNet(axis_name=shardlib.batch_axis_names(mesh))
    inputs = lambda b, train: ((b["image"],), {"train": train})
    model = from_linen(module, lambda logits, b: zoo.cross_entropy(logits, b["label"]), zoo.image_batch(0),
                       inputs=inputs, rng_streams=())

    def reference(params, state, batch):
        logits, new = ResNet().apply({"params": params, **state}, batch["image"], train=True, mutable=["batch_stats"])
        return zoo.cross_entropy(logits, batch["label"]), new

    program, state, ref_state = _parity(model, "zero3", {"fsdp": 8}, reference, zoo.image_batch)
    return model, program, state, ref_state


def test_resnet_batch_stats_match_plain_jit(resnet):
    _, _, state, ref_state = resnet
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6),
                 state.model_state, ref_state)


def test_evaluate_and_model_apply_use_the_running_statistics(resnet):
    model, program, state, _ = resnet
    batch = zoo.image_batch(5)
    logits = ResNet().apply({"params": jax.tree.map(np.asarray, state.params),
                             **jax.tree.map(np.asarray, state.model_state)}, batch["image"], train=False)
    want = float(zoo.cross_entropy(logits, batch["label"]))
    np.testing.assert_allclose(float(program.evaluate(state.params, batch, state.model_state)["loss"]), want, rtol=1e-5)
    applied = model.apply(*jax.tree.map(np.asarray, (state.params, batch["image"])), train=False,
                          model_state=jax.tree.map(np.asarray, state.model_state))
    np.testing.assert_allclose(np.asarray(applied), np.asarray(logits), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="batch_stats: call model.apply\\(params, \\*args, model_state="):
        model.apply(state.params, batch["image"], train=False)


def test_resnet_restores_bitwise_onto_another_mesh(resnet, tmp_path):
    model, _, state, _ = resnet
    target = build(model, optimizer(), make_layout(model, "zero3", make_mesh({"data": 2, "fsdp": 2},
                                                                             devices=jax.devices()[:4])))
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.save(STEPS, state, data_state={}, config={}, force=True)
        ckpt.wait()
        restored, _, _ = ckpt.restore(target.abstract_state())
    for got, want in zip(jax.tree.leaves((restored.params, restored.model_state, restored.opt_state)),
                         jax.tree.leaves((state.params, state.model_state, state.opt_state))):
        assert np.array_equal(np.asarray(got), np.asarray(want))


# ---- collections and rng streams that are not state ---------------------------------------------

def test_a_sown_auxiliary_loss_is_captured_not_carried():
    module = SownAuxLoss()
    with pytest.raises(ValueError, match=r"'losses' collection is written with self.sow.*capture=\('losses',\)"):
        from_linen(module, mse, zoo.regression_batch(0), inputs=regression_inputs)
    loss = lambda out, b: mse(out[0], b) + 0.1 * out[1]["losses"]["activation_l2"][0]
    model = from_linen(module, loss, zoo.regression_batch(0), inputs=regression_inputs, capture=("losses",))
    assert not model.stateful

    def reference(params, state, batch):
        out, sown = module.apply({"params": params}, batch["x"], mutable=["losses"])
        return mse(out, batch) + 0.1 * sown["losses"]["activation_l2"][0], state

    _parity(model, "zero3", {"fsdp": 8}, reference, zoo.regression_batch)


def test_capture_refuses_a_collection_that_holds_state():
    with pytest.raises(ValueError, match=r"capture=\('batch_stats',\) names 'batch_stats', which holds state"):
        from_linen(ResNet(), mse, zoo.image_batch(0), inputs=lambda b, train: ((b["image"],), {"train": train}),
                   capture=("batch_stats",))


def test_a_decode_cache_is_refused_by_name():
    with pytest.raises(ValueError, match="'cache' collection is the decoding cache.*decode=False"):
        from_linen(Decoding(decode=True), mse, zoo.regression_batch(0), inputs=regression_inputs)


def test_an_rng_stream_the_adapter_was_not_told_about_is_named():
    inputs = lambda b, train: ((b["x"],), {"train": train})
    model = from_linen(Noisy(), mse, zoo.regression_batch(0), inputs=inputs)
    with pytest.raises(ValueError, match=r"needs PRNG for \"noise\".*rng_streams=\('dropout',\).*rng_streams=\("):
        model.run(model.init(jax.random.key(0)), zoo.regression_batch(0), None, shardlib.Call(key=jax.random.key(1)))
    named = from_linen(Noisy(), mse, zoo.regression_batch(0), inputs=inputs, rng_streams=("noise",))
    params, batch = named.init(jax.random.key(0)), zoo.regression_batch(0)
    draws = [float(named.run(params, batch, None, shardlib.Call(key=jax.random.key(k)))[0]) for k in (1, 1, 2)]
    assert draws[0] == draws[1] != draws[2]  # the key decides the noise
    with pytest.raises(ValueError, match=r"no key \(model.loss without a shardlib.model.Call\)"):
        named.loss(params, batch, None)


def test_an_unannotated_module_under_tp_is_warned_about():
    """tp splits only what the rules name (heads, mlp, vocab): a module without names would train
    replicated on the tensor devices, and make_layout says so tensor by tensor."""
    model = from_linen(CNN(), lambda logits, b: zoo.cross_entropy(logits, b["label"]), zoo.image_batch(0),
                       inputs=lambda b, train: ((b["image"],), {}), rng_streams=())
    with pytest.warns(shardlib.ReplicationWarning, match=r"tp on data=4 tensor=2 keeps \d+ tensor\(s\) whole[\s\S]*"
                                                         r"Dense_0/kernel[\s\S]*no logical axis names"):
        make_layout(model, "tp", make_mesh({"data": 4, "tensor": 2}))


# ---- the TrainState habits: aux and variables that are not parameters -------------------------

class BatchNormDense(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        return nn.Dense(8)(nn.BatchNorm(use_running_average=not train)(x))


class Counting(nn.Module):
    guarded: bool

    @nn.compact
    def __call__(self, x):
        count = self.variable("counters", "count", lambda: jnp.zeros((), jnp.int32))
        if not self.guarded or self.is_mutable_collection("counters"):
            count.value += 1
        return nn.Dense(8)(x)


def _batch_stats_loss(module):
    """The Flax BatchNorm guide's loss: the statistics' updates returned in aux."""
    def loss_fn(variables, batch):
        out, updates = module.apply(variables, batch["x"], train=True, mutable=["batch_stats"])
        return mse(out, batch), {"rmse": jnp.sqrt(mse(out, batch)), "batch_stats": updates["batch_stats"]}

    return loss_fn


def test_aux_entries_that_are_not_arrays_are_dropped_by_name():
    """``jnp.ndim`` of a dict is 0: a returned ``{"batch_stats": {...}}`` (or a list) must not pass
    for a scalar metric (JAX deprecates that call); it is dropped with the non-scalars' warning."""
    module, batch = BatchNormDense(), zoo.regression_batch(0)
    variables = module.init(jax.random.key(0), batch["x"], train=False)

    def loss_fn(v, b):
        loss, aux = _batch_stats_loss(module)(v, b)
        return loss, {**aux, "seen": [1.0]}

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, aux = shardlib.from_functions(lambda key: variables, loss_fn).loss(variables, batch)
    assert not [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert any("non-scalar aux entries 'batch_stats', 'seen'" in str(w.message) for w in caught)
    out = module.apply(variables, batch["x"], train=True, mutable=["batch_stats"])[0]
    assert set(aux) == {"rmse"}
    assert float(aux["rmse"]) == pytest.approx(float(jnp.sqrt(jnp.mean((out - batch["y"]) ** 2))))


def test_from_functions_warns_once_that_flax_collections_would_train_as_parameters():
    """``init`` returning ``module.init``'s whole variables (the TrainState+BatchNorm habit) would
    train batch_stats with the optimizer and never apply the loss's updates: one warning names the
    collections and from_linen; ``variables["params"]`` alone is not warned about."""
    module, batch = BatchNormDense(), zoo.regression_batch(0)
    init = lambda key: {**module.init(key, batch["x"], train=False), "cache": {}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shardlib.from_functions(init, _batch_stats_loss(module))
    named = [str(w.message) for w in caught if w.category is UserWarning and "Flax collection" in str(w.message)]
    assert len(named) == 1
    assert re.search(r"'batch_stats', 'cache'.*as if they were parameters.*not applied.*"
                     r"shardlib\.from_linen\(module, loss, example, inputs=\.\.\.\)", named[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shardlib.from_functions(lambda key: {"params": init(key)["params"]}, lambda p, b: jnp.mean(b["y"] ** 2))


def test_an_unguarded_state_update_is_named_with_the_guard_to_write():
    """from_linen applies the module with its state read-only (to find scan stacks, and when
    evaluating): an unguarded ``count.value += 1`` fails there with the guard to write; guarded,
    training counts like ``module.apply(..., mutable=["counters"])`` and evaluation leaves it."""
    batch = zoo.regression_batch(0)
    with pytest.raises(ValueError, match=r"'counters' collection unconditionally.*read-only.*evaluation.*"
                                         r"if self\.is_mutable_collection\(\"counters\"\):") as raised:
        from_linen(Counting(guarded=False), mse, batch, inputs=regression_inputs, rng_streams=())
    assert isinstance(raised.value.__cause__, flax_errors.ModifyScopeVariableError)
    module = Counting(guarded=True)
    model = from_linen(module, mse, batch, inputs=regression_inputs, rng_streams=())
    params, state = model.init(jax.random.key(0)), model.init_state(jax.random.key(0))
    _, _, trained = model.run(params, batch, None, shardlib.Call(state=state))
    _, want = module.apply({"params": params, **state}, batch["x"], mutable=["counters"])
    assert int(trained["counters"]["count"]) == int(want["counters"]["count"]) == int(state["counters"]["count"]) + 1
    _, _, evaluated = model.run(params, batch, None, shardlib.Call(state=trained, train=False))
    assert int(evaluated["counters"]["count"]) == int(trained["counters"]["count"])


def test_an_ensemble_stacked_along_axis_1_says_where_to_stack_it_under_zero3():
    """nn.vmap with variable_axes={"params": 1}: the step gathers stacked parameters a slice at a time
    along axis 0 only, so zero3 refuses, naming the two ways out."""
    class Member(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8)(nn.relu(nn.Dense(64)(x)))

    class Ensemble(nn.Module):
        @nn.compact
        def __call__(self, x):
            members = nn.vmap(Member, in_axes=None, out_axes=0, variable_axes={"params": 1},
                              split_rngs={"params": True}, axis_size=4)
            return members(name="members")(x).mean(0)

    batch = {"x": np.ones((16, 32), np.float32), "label": np.zeros((16,), np.int32)}
    loss = lambda out, b: optax.softmax_cross_entropy_with_integer_labels(out, b["label"]).mean()
    model = from_linen(Ensemble(), loss, batch, inputs=lambda b, train: ((b["x"],), {}), rng_streams=())
    program = build(model, optax.sgd(0.1), make_layout(model, "zero3", make_mesh({"fsdp": 8})))
    with pytest.raises(ValueError, match=r"members/Dense_0/kernel: linen's nn.vmap / nn.scan stacks this parameter "
                                         r"along axis 1; .*variable_axes=\{'params': 0\}\), or train under a strategy "
                                         r"that keeps parameters whole \(dp, zero1, zero2\)"):
        program.step(program.init(jax.random.key(0)), batch)
