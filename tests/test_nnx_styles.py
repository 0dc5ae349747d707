"""Flax NNX models written the ways NNX code is written (tutorial CNN held as an instance, a loss
returning ``(loss, logits)``, keyword-only ``rngs``, counters and buffers as custom variables,
``self.sow``, layers stacked with ``nnx.vmap`` and applied with ``nnx.scan`` + ``nnx.remat``,
``param_dtype=jnp.bfloat16``, tied embeddings, ``nnx.Sequential`` / ``nnx.List`` / ``nnx.Dict``),
trained through shardlib and compared with a plain one-device ``jax.jit`` + optax step written
here with ``nnx.split`` / ``nnx.merge``.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import shardlib
from shardlib import Checkpointer, build, from_nnx, make_layout, make_mesh
from shardlib.step.local_sgd import build_local_sgd
from shardlib.model import Call
from tests import zoo
from tests.helpers import optimizer
from tests.test_user_models import _assert_close, _host, _train  # (conv biases before BatchNorm: compared as noise)

STEPS, ROWS = 3, 16
FSDP8 = {"fsdp": 8}


# ---------------------------------------------------------------- user models


class TutorialCNN(nnx.Module):
    """The NNX MNIST tutorial's CNN, shrunk to 8x8 images."""

    def __init__(self, *, rngs: nnx.Rngs, dropout_rate: float = 0.0, bn_axis_name=None):
        self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(8, axis_name=bn_axis_name, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=dropout_rate, rngs=rngs)
        self.avg_pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(8 * 4 * 4, 10, rngs=rngs)

    def __call__(self, x):
        x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x)))))
        return self.linear1(x.reshape(x.shape[0], -1))


def tutorial_loss_fn(model, batch):
    """The tutorial's loss: ``(loss, logits)``."""
    logits = model(batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=batch["label"]).mean(), logits


def loss_with_metrics(model, batch):
    loss, logits = tutorial_loss_fn(model, batch)
    return loss, {"accuracy": jnp.mean(logits.argmax(-1) == batch["label"]), "logits": logits}


def tuple_loss(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


class Count(nnx.Variable):
    pass


class Counted(nnx.Module):
    """A call counter (integer, the same on every device), a running mean of the outputs (float,
    from this device's rows), a constant table, an nnx.Cache and a sown intermediate."""

    def __init__(self, din, dout, *, rngs):
        self.linear = nnx.Linear(din, dout, rngs=rngs)
        self.calls = Count(jnp.array(0))
        self.output_mean = Count(jnp.zeros((dout,)))
        self.scale = nnx.Variable(jnp.linspace(0.5, 1.5, dout))
        self.last = nnx.Cache(jnp.zeros((dout,)))

    def __call__(self, x):
        self.calls[...] += 1
        y = self.linear(x) * self.scale[...]
        self.output_mean[...] = 0.9 * self.output_mean[...] + 0.1 * y.mean(0)
        self.sow(nnx.Intermediate, "y", y)
        return y


LAYERS, D, FF = 3, 32, 64


class ScanBlock(nnx.Module):
    def __init__(self, rngs, dropout_rate):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(D, FF, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), rngs=rngs)
        self.down = nnx.Linear(FF, D, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")), rngs=rngs)
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)

    def __call__(self, x):
        return x + self.dropout(self.down(nnx.gelu(self.up(self.norm(x)))))


class ScanLM(nnx.Module):
    """Layers created stacked (split_rngs + vmap), applied with scan + remat."""

    def __init__(self, *, rngs, dropout_rate=0.1):
        init = nnx.with_partitioning(nnx.initializers.normal(0.02), ("vocab", "embed"))
        self.embed = nnx.Embed(zoo.VOCAB, D, embedding_init=init, rngs=rngs)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make(rngs):
            return ScanBlock(rngs, dropout_rate)

        self.layers = make(rngs)
        self.head = nnx.Linear(D, zoo.VOCAB, rngs=rngs)

    def __call__(self, tokens):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        @nnx.remat
        def forward(x, layer):
            return layer(x)

        return self.head(forward(self.embed(tokens), self.layers))


class GatheredScanLM(ScanLM):
    """ScanLM whose scan body gathers its own layer (`shardlib.gather_layer` on the sliced module),
    so ZeRO-3 holds one layer's whole weights at a time: ``from_nnx(..., gathers_params=True)``."""

    def __call__(self, tokens):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        @nnx.remat
        def forward(x, layer):
            return shardlib.gather_layer(layer)(x)

        embed, head = shardlib.gather_layer(self.embed), shardlib.gather_layer(self.head)
        return head(forward(embed(tokens), self.layers))


class TiedBlock(nnx.Module):
    def __init__(self, *, rngs):
        self.norm1 = nnx.RMSNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=4, in_features=D, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(D, rngs=rngs)
        self.mlp = nnx.Sequential(nnx.Linear(D, FF, rngs=rngs), nnx.gelu, nnx.Linear(FF, D, rngs=rngs))

    def __call__(self, x, mask):
        x = x + self.attn(self.norm1(x), mask=mask)
        return x + self.mlp(self.norm2(x))


class TiedLM(nnx.Module):
    """Embedding tied to the output (``embed.attend``), blocks in an nnx.List, heads in an nnx.Dict,
    no annotations."""

    def __init__(self, *, rngs):
        self.embed = nnx.Embed(zoo.VOCAB, D, rngs=rngs)
        self.blocks = nnx.List([TiedBlock(rngs=rngs)])
        self.norms = nnx.Dict({"final": nnx.RMSNorm(D, rngs=rngs)})

    def __call__(self, tokens):
        x, mask = self.embed(tokens), nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.embed.attend(self.norms["final"](x))


def lm_loss(model, batch):
    return zoo.cross_entropy(model(batch["tokens"]), batch["targets"])


class Bf16MLP(nnx.Module):
    def __init__(self, din, dmid, dout, *, rngs):
        self.linear1 = nnx.Linear(din, dmid, param_dtype=jnp.bfloat16, rngs=rngs)
        self.linear2 = nnx.Linear(dmid, dout, param_dtype=jnp.bfloat16, rngs=rngs)

    def __call__(self, x):
        return self.linear2(nnx.relu(self.linear1(x)))


# ---------------------------------------------------------------- the independent reference


def functional(module, loss_fn, param_dtype=None):
    """``(params, carried, loss(params, carried, batch) -> ((loss, aux), carried))`` of an NNX module,
    with nnx.split / nnx.merge: every variable besides Param, rng state and sown values is carried.
    ``param_dtype``: the dtype the parameters are computed in (float32 masters cast to it)."""
    graphdef, params, rngs, carried = nnx.split(module, nnx.Param, nnx.RngState, ...)

    def loss(param_values, carried_values, batch):
        p, c = jax.tree.map(lambda x: x, params), jax.tree.map(lambda x: x, carried)
        cast = (lambda x: x.astype(param_dtype)) if param_dtype else (lambda x: x)
        nnx.replace_by_pure_dict(p, jax.tree.map(cast, param_values))
        nnx.replace_by_pure_dict(c, carried_values)
        bound = nnx.merge(graphdef, p, jax.tree.map(lambda x: x, rngs), c)  # fresh rng variables in this trace
        out = loss_fn(bound, batch)
        kept = nnx.state(bound, nnx.Not(nnx.Any(nnx.Param, nnx.RngState, nnx.Intermediate)))
        return out, nnx.to_pure_dict(kept)

    return nnx.to_pure_dict(params), nnx.to_pure_dict(carried), loss


def plain_steps(loss, params, carried, batches, tx, microbatches=1):
    """`zoo.plain_steps_with_state` (one device, ``jax.jit(jax.value_and_grad)`` + optax) over the
    mean of ``microbatches`` losses on rows ``i::k`` in turn, the model state flowing from one to
    the next: the gradient of that mean is the average of the microbatches' gradients."""

    def mean_loss(params, carried, batch):
        total = 0.0
        for i in range(microbatches):
            out, carried = loss(params, carried, jax.tree.map(lambda x: x[i::microbatches], batch))
            total += (out[0] if isinstance(out, tuple) else out) / microbatches
        return total, carried

    return zoo.plain_steps_with_state(mean_loss, params, carried, tx, batches)


# ---------------------------------------------------------------- the tutorial CNN, held as an instance


@pytest.fixture(scope="module")
def held_cnn():
    """The tutorial CNN built by the user (``CNN(rngs=nnx.Rngs(0))``) with synchronised BatchNorm,
    given to from_nnx as the instance; its reference twin (no axis_name) holds the same weights."""
    mesh = make_mesh(FSDP8)
    held = TutorialCNN(rngs=nnx.Rngs(0), bn_axis_name=shardlib.batch_axis_names(mesh))
    twin = TutorialCNN(rngs=nnx.Rngs(1))
    nnx.update(twin, nnx.state(held, nnx.Param))
    model = from_nnx(held, loss_with_metrics)
    layout = make_layout(model, "zero3", mesh)
    batches = [zoo.image_batch(i, ROWS) for i in range(STEPS)]
    return held, twin, model, layout, build(model, optimizer(), layout), batches


def test_an_instance_trains_from_its_own_weights_like_plain_jit(held_cnn):
    held, twin, _, _, program, batches = held_cnn
    with pytest.warns(UserWarning, match="non-scalar aux entries 'logits'"):
        state = program.init(jax.random.key(7))  # the key seeds dropout only
        jax.tree.map(np.testing.assert_array_equal, _host(state.params), nnx.to_pure_dict(nnx.state(held, nnx.Param)))
        state, losses = _train(program, state, batches[:-1])
        state, metrics = program.step(state, batches[-1])
    losses.append(float(metrics["loss"]))
    params, carried, loss = functional(twin, loss_with_metrics)
    ref_params, ref_carried, ref_losses = plain_steps(loss, params, carried, batches, optimizer())
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    _assert_close(state.params, ref_params)
    _assert_close(state.model_state, ref_carried)
    assert set(metrics) >= {"loss", "accuracy"} and "logits" not in metrics


def test_evaluate_is_the_modules_eval_mode(held_cnn):
    _, twin, _, _, program, batches = held_cnn
    with pytest.warns(UserWarning, match="non-scalar aux"):
        state = program.init(jax.random.key(0))
        got = program.evaluate(state.params, batches[0], state.model_state)
    module = nnx.clone(twin)
    module.eval()
    loss, logits = tutorial_loss_fn(module, batches[0])
    np.testing.assert_allclose(float(got["loss"]), float(loss), rtol=1e-5)
    np.testing.assert_allclose(float(got["accuracy"]), float(jnp.mean(logits.argmax(-1) == batches[0]["label"])))


def test_grad_accum_on_batchnorm_and_dropout_matches_microbatched_plain_jit(held_cnn):
    _, twin, model, layout, _, batches = held_cnn
    program = build(model, optimizer(), layout, grad_accum=2)
    with pytest.warns(UserWarning, match="non-scalar aux"):
        state, losses = _train(program, program.init(jax.random.key(0)), batches)
    params, carried, loss = functional(twin, loss_with_metrics)
    ref_params, ref_carried, ref_losses = plain_steps(loss, params, carried, batches, optimizer(), microbatches=2)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    _assert_close(state.params, ref_params)
    _assert_close(state.model_state, ref_carried)


def test_a_tuple_aux_is_dropped_with_a_warning_that_says_what_to_return():
    model = from_nnx(TutorialCNN, tutorial_loss_fn)  # keyword-only rngs: the class itself
    jax.tree.map(np.testing.assert_array_equal, model.init(jax.random.key(3)),
                 nnx.to_pure_dict(nnx.state(TutorialCNN(rngs=nnx.Rngs(jax.random.key(3))), nnx.Param)))
    call = Call(key=jax.random.key(0), state=model.init_state(jax.random.key(0)))
    with pytest.warns(UserWarning, match=r"an array aux of shape \(4, 10\).*Return \(loss, \{'accuracy'"):
        loss, aux, _ = model.loss(model.init(jax.random.key(0)), zoo.image_batch(0, 4), None, call)
    assert aux == {} and loss.shape == ()


class CallTimeDropout(nnx.Module):
    """Dropout whose rngs come with the call (``model(x, rngs)``), not held by the module."""

    def __init__(self, *, rngs):
        self.linear = nnx.Linear(32, 8, rngs=rngs)
        self.dropout = nnx.Dropout(0.5)

    def __call__(self, x, rngs=None):
        return self.linear(self.dropout(x, rngs=rngs))


def test_a_loss_that_takes_rngs_gets_them_from_the_steps_key():
    model = from_nnx(CallTimeDropout, lambda model, rngs, batch: jnp.mean((model(batch["x"], rngs) - batch["y"]) ** 2))
    assert model.uses_key
    params, batch = model.init(jax.random.key(0)), zoo.regression_batch(0, 4)
    draw = lambda key, train=True: float(model.loss(params, batch, None, Call(key=key, train=train))[0])
    assert draw(jax.random.key(1)) == draw(jax.random.key(1)) != draw(jax.random.key(2))
    held = CallTimeDropout(rngs=nnx.Rngs(0))
    held.eval()
    np.testing.assert_allclose(draw(None, train=False), float(zoo.regression_loss(held, batch)), rtol=1e-6)


# ---------------------------------------------------------------- variables other than Param


def test_custom_variables_are_model_state_carried_averaged_and_restored(tmp_path):
    make = lambda rngs: Counted(32, 8, rngs=rngs)
    model = from_nnx(make, tuple_loss)
    program = build(model, optimizer(), make_layout(model, "zero3", make_mesh({"data": 2, "fsdp": 4})))
    state = program.init(jax.random.key(0))
    assert set(state.model_state) == {"calls", "output_mean", "scale", "last"}  # sown "y" is not carried
    batches = [(b["x"], b["y"]) for b in map(zoo.regression_batch, range(STEPS))]  # batches as (x, y) tuples
    state, losses = _train(program, state, batches)
    params, carried, loss = functional(make(nnx.Rngs(0)), tuple_loss)
    ref_params, ref_carried, ref_losses = plain_steps(loss, params, carried, batches, optimizer())
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    _assert_close(state.params, ref_params)
    assert int(state.model_state["calls"]) == STEPS  # counted once per step, not summed over devices
    _assert_close(state.model_state["output_mean"], ref_carried["output_mean"])  # averaged: the global mean
    np.testing.assert_array_equal(state.model_state["scale"], ref_carried["scale"])  # untouched, bitwise
    target = build(model, optimizer(), make_layout(model, "zero3", make_mesh({"fsdp": 4}, devices=jax.devices()[:4])))
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.save(STEPS, state, data_state={}, config={}, force=True)
        ckpt.wait()
        restored, _, _ = ckpt.restore(target.abstract_state())
    jax.tree.map(np.testing.assert_array_equal, _host(restored.model_state), _host(state.model_state))
    assert restored.model_state["calls"].dtype == jnp.int32


# ---------------------------------------------------------------- stacked layers, tied embeddings, bf16


@pytest.mark.filterwarnings("ignore::shardlib.step.compute.WholeGatherWarning")  # ScanLM gathers no layer itself
def test_layers_stacked_with_vmap_and_scanned_evaluate_under_fsdp_tp_and_draw_dropout():
    """split_rngs + vmap stacks each layer's dropout key: shardlib re-seeds one key per layer, so
    nnx.scan can slice them (one key per stream there failed inside the scan with an IndexError)."""
    model = from_nnx(lambda rngs: ScanLM(rngs=rngs), lm_loss)
    assert model.logical_axes["layers"]["up"]["kernel"] == ("layers", "embed", "mlp")
    program = build(model, optimizer(), make_layout(model, "fsdp_tp", make_mesh({"fsdp": 4, "tensor": 2})))
    state, batch = program.init(jax.random.key(0)), zoo.token_batch(0, ROWS)
    got = program.evaluate(state.params, batch)
    with nnx.use_eager_sharding(False):  # annotated: outside a mesh, names as metadata only
        module = ScanLM(rngs=nnx.Rngs(0))
    nnx.update(module, nnx.State(_host(state.params)))
    module.eval()
    np.testing.assert_allclose(float(got["loss"]), float(lm_loss(module, batch)), rtol=1e-5)
    params = _host(state.params)
    drawn = jax.jit(lambda key: model.loss(params, batch, None, Call(key=key))[0])
    train = lambda seed: float(drawn(jax.random.key(seed)))
    assert train(1) == train(1) != train(2) and np.isfinite(train(1))  # training draws dropout masks


def test_tied_embedding_attention_lists_and_dicts_match_plain_jit():
    make = lambda rngs: TiedLM(rngs=rngs)
    model = from_nnx(make, lm_loss)
    program = build(model, optimizer(), make_layout(model, "zero2", make_mesh(FSDP8)))
    batches = [zoo.token_batch(i, ROWS) for i in range(STEPS)]
    state, losses = _train(program, program.init(jax.random.key(0)), batches)
    params, carried, loss = functional(make(nnx.Rngs(0)), lm_loss)
    ref_params, _, ref_losses = plain_steps(loss, params, carried, batches, optimizer())
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    _assert_close(state.params, ref_params)


def test_unannotated_model_under_tp_warns_that_nothing_is_split_over_tensor():
    model = from_nnx(lambda rngs: TiedLM(rngs=rngs), lm_loss)
    with pytest.warns(shardlib.ReplicationWarning, match="no logical axis names"):
        make_layout(model, "tp", make_mesh({"data": 4, "tensor": 2}))


def test_bfloat16_params_compute_in_bfloat16_over_float32_masters():
    """The train state holds float32 masters (precision "f32"); the module is handed them in its
    declared bfloat16, so it computes as written. (A multi-step comparison with a one-device run is
    not made: a last-bit difference in a master weight can flip its bfloat16 rounding.)"""
    make = lambda rngs: Bf16MLP(32, 64, 8, rngs=rngs)
    seen = lambda m, b: (zoo.regression_loss(m, b), {"bf16": jnp.float32(m.linear1.kernel[...].dtype == jnp.bfloat16)})
    model = from_nnx(make, seen)
    assert {x.dtype for x in jax.tree.leaves(model.abstract())} == {jnp.dtype(jnp.bfloat16)}
    masters = jax.tree.map(lambda x: x.astype(jnp.float32) + 1e-4, model.init(jax.random.key(0)))
    batch = zoo.regression_batch(0, ROWS)
    loss, aux = model.loss(masters, batch, None)
    assert float(aux["bf16"]) == 1.0
    params, carried, reference = functional(make(nnx.Rngs(0)), zoo.regression_loss, param_dtype=jnp.bfloat16)
    np.testing.assert_allclose(float(loss), float(reference(masters, carried, batch)[0]), rtol=1e-6)
    f32 = functional(make(nnx.Rngs(0)), zoo.regression_loss, param_dtype=jnp.float32)[2]
    assert float(f32(masters, carried, batch)[0]) != float(loss)  # the masters are not bfloat16 numbers


class Sized(nnx.Module):
    """The NNX docs' constructor shape: sizes first, rngs by keyword."""

    def __init__(self, din, dout, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(din, dout, rngs=rngs)


def test_a_class_that_needs_more_than_rngs_is_refused_with_the_lambda_to_write():
    with pytest.raises(TypeError, match=r"Sized also requires din, dout: pass lambda rngs: Sized\(din, dout, rngs=rngs\)"):
        from_nnx(Sized, tutorial_loss_fn)
    from_nnx(lambda rngs: Sized(4, 2, rngs=rngs), tutorial_loss_fn)  # what the message says to write
    from_nnx(lambda r: Sized(4, 2, rngs=r), tutorial_loss_fn)  # positional: the rngs are its first argument


# ---------------------------------------------------------------- train / eval mode


class FlagMLP(nnx.Module):
    """BatchNorm and dropout 0.5, switched by the module's own flags (``module.eval()``) or, in
    the older NNX style, by a ``train`` call argument that overrides them."""

    def __init__(self, *, rngs):
        self.l1, self.bn = nnx.Linear(32, 16, rngs=rngs), nnx.BatchNorm(16, rngs=rngs)
        self.drop, self.l2 = nnx.Dropout(0.5, rngs=rngs), nnx.Linear(16, 8, rngs=rngs)

    def __call__(self, x, train=None):
        flag = None if train is None else not train
        x = nnx.relu(self.bn(self.l1(x), use_running_average=flag))
        return self.l2(self.drop(x, deterministic=flag))


def flag_loss(model, batch, train):
    return jnp.mean((model(batch["x"], train=train) - batch["y"]) ** 2)


def test_a_module_held_in_eval_mode_is_warned_about_and_a_fresh_one_is_not():
    held = FlagMLP(rngs=nnx.Rngs(0))
    held.eval()  # left over from an eval loop
    with pytest.warns(UserWarning, match=r"use_running_average=True.*deterministic=True.*dropout stays off and "
                      r"BatchNorm statistics stay frozen.*module\.train\(\)"):
        from_nnx(held, zoo.regression_loss)
    built_so = nnx.Sequential(nnx.Linear(32, 8, rngs=nnx.Rngs(0)), nnx.Dropout(0.1, deterministic=True))
    with pytest.warns(UserWarning, match=r"layers/1 \(Dropout\): deterministic=True") as said:
        from_nnx(built_so, zoo.regression_loss)
    assert "dropout stays off" in str(said[0].message) and "BatchNorm" not in str(said[0].message)
    only_dropout = FlagMLP(rngs=nnx.Rngs(0))
    only_dropout.drop.deterministic = True  # the statistics still update: no word of frozen ones
    with pytest.warns(UserWarning, match=r"drop \(Dropout\): deterministic=True") as said:
        from_nnx(only_dropout, zoo.regression_loss)
    assert "dropout stays off" in str(said[0].message) and "frozen" not in str(said[0].message)
    held.train()
    no_dropout = nnx.MultiHeadAttention(2, 8, decode=False, deterministic=True, rngs=nnx.Rngs(0))  # rate 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for make in (held, FlagMLP, lambda rngs: FlagMLP(rngs=rngs), no_dropout):
            from_nnx(make, zoo.regression_loss)


def test_a_loss_with_a_train_argument_gets_false_in_evaluate_and_true_in_the_step():
    held = FlagMLP(rngs=nnx.Rngs(0))
    model = from_nnx(held, flag_loss)
    program = build(model, optimizer(), make_layout(model, "dp", make_mesh({"data": 8})))
    batch = zoo.regression_batch(0, ROWS)
    state = program.init(jax.random.key(0))
    before = float(program.evaluate(state.params, batch, state.model_state)["loss"])
    trained, metrics = program.step(state, batch)  # donates state
    evaluated = float(program.evaluate(trained.params, batch, trained.model_state)["loss"])
    reference = nnx.clone(held)  # the module's own eval mode, eager on one device
    nnx.update(reference, nnx.State(_host(trained.params)), nnx.State(_host(trained.model_state)))
    np.testing.assert_allclose(evaluated, float(flag_loss(reference, batch, train=False)), rtol=1e-5)
    # the step trains: dropout draws (same weights, another seed, another loss), batch statistics move
    _, other_seed = program.step(program.init(jax.random.key(1)), batch)
    assert float(metrics["loss"]) != float(other_seed["loss"]) and float(metrics["loss"]) != before
    assert np.abs(np.asarray(trained.model_state["bn"]["mean"])).max() > 1e-4
    # a train flag alone (nothing drawn, no state) still reaches the loss in evaluation
    bare = from_nnx(lambda rngs: nnx.Linear(32, 8, rngs=rngs), lambda m, b, *, train: jnp.mean(m(b["x"])) * train)
    params = bare.init(jax.random.key(0))
    run = lambda train: float(bare.run(params, batch, None, Call(train=train))[0])
    assert run(False) == 0.0 != run(True)


@pytest.mark.filterwarnings("ignore::shardlib.step.compute.WholeGatherWarning")  # the stack gathered up front, compared
def test_a_scanned_nnx_stack_that_gathers_its_layer_trains_like_plain_jit_and_holds_one_layer():
    """The NNX scan-over-layers pattern with gather_layer on the sliced layer: zero3 trains it like one
    device, and its step needs fewer temporary bytes than the same stack gathered up front."""
    make = lambda rngs: GatheredScanLM(rngs=rngs, dropout_rate=0.0)
    model = from_nnx(make, lm_loss, gathers_params=True)
    layout = make_layout(model, "zero3", make_mesh(FSDP8))
    program = build(model, optimizer(), layout)
    state, batches = program.init(jax.random.key(0)), [zoo.token_batch(i, ROWS) for i in range(STEPS)]
    with nnx.use_eager_sharding(False):
        twin = make(nnx.Rngs(0))
    _, carried, loss = functional(twin, lm_loss)
    params0 = _host(state.params)  # the reference starts from shardlib's init (jit's draws, to the last bit)
    temps = lambda p: p.step.lower(p.init(jax.random.key(0)), batches[0]).compile().memory_analysis().temp_size_in_bytes
    state, losses = _train(program, state, batches)
    _, _, ref_losses = plain_steps(loss, params0, carried, batches, optimizer())
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    whole = from_nnx(lambda rngs: ScanLM(rngs=rngs, dropout_rate=0.0), lm_loss)  # the same stack, no gathers
    assert temps(program) < temps(build(whole, optimizer(), make_layout(whole, "zero3", make_mesh(FSDP8))))


class LoRANet(nnx.Module):
    def __init__(self, *, rngs):
        self.l1 = nnx.LoRALinear(32, 64, lora_rank=4, rngs=rngs)
        self.l2 = nnx.Linear(64, 8, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


def lora_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def test_wrt_trains_only_the_lora_params_like_an_nnx_optimizer_with_wrt():
    """from_nnx(wrt=nnx.LoRAParam) under zero3 against the NNX way on one device: nnx.Optimizer(wrt=...)
    and nnx.value_and_grad over DiffState(0, nnx.LoRAParam). The base weights stay bitwise as they
    were, and the optimizer keeps moments for the LoRA factors only."""
    rng = np.random.default_rng(0)
    batches = [{"x": rng.normal(size=(ROWS, 32)).astype(np.float32), "y": rng.normal(size=(ROWS, 8)).astype(np.float32)}
               for _ in range(STEPS)]
    model = from_nnx(lambda rngs: LoRANet(rngs=rngs), lora_loss, wrt=nnx.LoRAParam)
    program = build(model, optimizer(), make_layout(model, "zero3", make_mesh(FSDP8)))
    state = program.init(jax.random.key(0))
    start = _host(state.params)
    state, losses = _train(program, state, batches)

    reference = LoRANet(rngs=nnx.Rngs(0))
    nnx.update(reference, nnx.State(start))
    opt = nnx.Optimizer(reference, optimizer(), wrt=nnx.LoRAParam)
    grad_fn = nnx.value_and_grad(lora_loss, argnums=nnx.DiffState(0, nnx.LoRAParam))
    ref_losses = []
    for batch in batches:
        loss, grads = grad_fn(reference, batch)
        opt.update(reference, grads)
        ref_losses.append(float(loss))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    got = _host(state.params)
    _assert_close(got, nnx.to_pure_dict(nnx.state(reference, nnx.Param)))
    for layer, name in (("l1", "kernel"), ("l1", "bias"), ("l2", "kernel"), ("l2", "bias")):
        np.testing.assert_array_equal(got[layer][name], start[layer][name])  # frozen: not one bit moved
    moments = {x.shape for x in jax.tree.leaves(state.opt_state) if x.ndim}
    assert moments == {(32, 4), (4, 64)}  # Adam's mu and nu of lora_a and lora_b, nothing of the base
    with pytest.raises(ValueError, match=r"build_local_sgd does not support models that need frozen parameters"):
        build_local_sgd(model, optimizer(), make_layout(model, "dp", make_mesh({"data": 8})), sync_every=2)
    with pytest.raises(ValueError, match="wrt=.* selects none of the module's parameters"):
        from_nnx(lambda rngs: nnx.Linear(4, 4, rngs=rngs), lora_loss, wrt=nnx.LoRAParam)


def test_a_loss_needing_another_argument_is_refused_up_front_naming_it():
    """loss_fn(model, batch, deterministic): shardlib fills only rngs and train, so from_nnx says so
    before the first step (which failed inside the trace with Python's missing-argument error)."""
    def loss_fn(model, batch, deterministic):
        return jnp.mean(model(batch["x"]))

    with pytest.raises(TypeError, match=r"'loss_fn' requires deterministic besides \(module, batch\) \(model, batch\); "
                                        r"shardlib fills in only parameters named rngs or train"):
        from_nnx(lambda rngs: nnx.Linear(4, 4, rngs=rngs), loss_fn)
    from_nnx(lambda rngs: nnx.Linear(4, 4, rngs=rngs), lambda model, batch, deterministic=True: 0.0)  # a default: fine
