"""After training: a user's evaluation loop, predictions and export, against one device.

The models are written as Flax users write them (a linen CNN with BatchNorm and dropout called
with ``train=``, an NNX text classifier); references are the modules' own ``apply`` / eval mode
on one device over the whole dataset, and exported trees compared bit for bit.
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import shardlib
from shardlib import Checkpointer
from shardlib.tools.export import export_params, load_exported

pytestmark = pytest.mark.filterwarnings("ignore::shardlib.ReplicationWarning")
ROWS, DATASET = 16, 45  # the last batch holds 13 rows: not a multiple of the 8 devices


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(8, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.Dropout(0.2, deterministic=not train)(nn.relu(x).reshape((x.shape[0], -1)))
        return nn.Dense(10)(x)


def cnn_loss(logits, batch):
    """The Flax examples' eval metrics over a padded batch: a mask, and sums to divide at the end
    (global_sum: the batch's sum; a plain jnp.sum would be a device's share)."""
    mask = batch["mask"]
    correct = (logits.argmax(-1) == batch["label"]).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    return shardlib.global_mean(ce, mask), {"accuracy": shardlib.global_mean(correct, mask),
                                            "correct": shardlib.global_sum(correct, mask),
                                            "count": shardlib.global_sum(mask), "share": jnp.sum(mask)}


def _dataset():
    rng = np.random.default_rng(0)
    return {"image": rng.normal(size=(DATASET, 8, 8, 1)).astype(np.float32),
            "label": rng.integers(0, 10, DATASET).astype(np.int32), "mask": np.ones(DATASET, np.float32)}


def _padded_batches(data):
    """Batches of ROWS rows; the last one padded with zero rows of mask 0, as the Flax examples pad."""
    for start in range(0, DATASET, ROWS):
        rows = {k: v[start:start + ROWS] for k, v in data.items()}
        pad = ROWS - len(rows["label"])
        yield len(rows["label"]), {k: np.concatenate([v, np.zeros((pad,) + v.shape[1:], v.dtype)]) for k, v in rows.items()}


# The one-device references run as one jitted program each: run eagerly, each of their operations
# compiled a program of its own (about 100 in the NNX test; issue 47). Same module, same inputs.
_cnn_eval = jax.jit(lambda variables, image: CNN().apply(variables, image, train=False))


@pytest.mark.parametrize("strategy, axes", [("dp", {"data": 8}), ("zero3", {"fsdp": 8})])
def test_linen_eval_loop_over_a_ragged_dataset_predictions_and_export_match_one_device(strategy, axes, tmp_path):
    data = _dataset()
    model = shardlib.from_linen(CNN(), cnn_loss, {k: v[:ROWS] for k, v in data.items()},
                                inputs=lambda b, train: ((b["image"],), {"train": train}))
    program = shardlib.build(model, optax.adam(1e-2), shardlib.make_layout(model, strategy, shardlib.make_mesh(axes)))
    state, _ = program.step(program.init(jax.random.key(0)), {k: v[:ROWS] for k, v in data.items()})
    variables = {"params": jax.tree.map(np.asarray, state.params), **jax.tree.map(np.asarray, state.model_state)}
    logits = _cnn_eval(variables, data["image"])  # one device, the whole dataset
    want_loss = float(optax.softmax_cross_entropy_with_integer_labels(logits, data["label"]).mean())
    want_correct = float(np.sum(np.asarray(logits.argmax(-1)) == data["label"]))

    with pytest.raises(ValueError, match=r"'image' has 13 rows, which the 8 data-parallel devices .* pad it"):
        program.evaluate(state.params, {k: v[32:] for k, v in data.items()}, state.model_state)
    totals = np.zeros(5)
    for n, batch in _padded_batches(data):
        got = program.evaluate(state.params, batch, state.model_state)
        totals += [float(got["loss"]) * n, float(got["accuracy"]) * n, float(got["correct"]), float(got["count"]),
                   float(got["share"])]
    np.testing.assert_allclose(totals[:2] / DATASET, [want_loss, want_correct / DATASET], rtol=1e-6)
    np.testing.assert_allclose(totals[2:4], [want_correct, DATASET], rtol=1e-6)
    # A plain sum over the rows comes back divided by the 8 devices (evaluate averages them).
    np.testing.assert_allclose(totals[4], DATASET / 8, rtol=1e-6)

    # A Flax TrainState's trees as they are: FrozenDict params, batch_stats without the collection's name.
    flax_style = program.evaluate(flax.core.freeze(variables["params"]), batch, variables["batch_stats"])
    assert float(flax_style["loss"]) == float(got["loss"])
    with pytest.raises(ValueError, match=r"got a whole train state: write program.evaluate\(state.params, batch, state.model_state\)"):
        program.evaluate(state, batch, state.model_state)

    # Predictions: the module's apply over the sharded weights, each device computing its rows.
    predict = jax.jit(lambda p, s, x: model.apply(p, x, train=False, model_state=s))
    rows = jax.device_put(data["image"][:32], program.layout.batch_sharding(data["image"][:32]))
    predicted = predict(state.params, state.model_state, rows)
    assert predicted.sharding.spec[0] == program.layout.batch_spec(2)[0]
    np.testing.assert_allclose(np.asarray(predicted), np.asarray(logits[:32]), rtol=1e-5, atol=1e-6)

    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(1, state, data_state={"step": 1}, config={"model": "cnn"}, force=True)
    export_params(tmp_path / "ckpt", tmp_path / "cnn.npz")
    params, model_state = load_exported(tmp_path / "cnn.npz", model_state=True)
    exported = {"params": params, **model_state}  # what module.apply takes
    assert jax.tree.structure(exported) == jax.tree.structure(variables)
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: a.dtype == b.dtype and np.array_equal(a, b), exported, variables)))
    assert np.array_equal(np.asarray(_cnn_eval(exported, data["image"])), np.asarray(logits))


class TextClassifier(nnx.Module):
    """The NNX tutorials' shape: embeddings, a list of blocks, BatchNorm, dropout, a mean over tokens."""

    def __init__(self, vocab: int = 64, d: int = 16, classes: int = 4, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(d, d, rngs=rngs) for _ in range(2)])
        self.bn = nnx.BatchNorm(d, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.head = nnx.Linear(d, classes, rngs=rngs)

    def __call__(self, tokens, mask):
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + nnx.gelu(block(h))
        h = (h * mask[..., None]).sum(1) / jnp.maximum(mask.sum(1, keepdims=True), 1.0)
        return self.head(self.dropout(self.bn(h)))


def text_loss(model, batch):
    logits = model(batch["tokens"], batch["mask"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


@nnx.jit
def _text_eval(module, batch):
    """The module's logits and `text_loss` on one device, as it is (its eval mode included)."""
    return module(batch["tokens"], batch["mask"]), text_loss(module, batch)


def test_nnx_classifier_evaluates_predicts_and_exports_under_fsdp_tp(tmp_path):
    rng = np.random.default_rng(1)
    batch = {"tokens": rng.integers(0, 64, (16, 12)).astype(np.int32),
             "mask": (rng.random((16, 12)) > 0.2).astype(np.float32), "label": rng.integers(0, 4, 16).astype(np.int32)}
    held = TextClassifier(rngs=nnx.Rngs(0))
    model = shardlib.from_nnx(held, text_loss)
    mesh = shardlib.make_mesh({"fsdp": 4, "tensor": 2})
    program = shardlib.build(model, optax.adam(1e-2), shardlib.make_layout(model, "fsdp_tp", mesh))
    state, _ = program.step(program.init(jax.random.key(0)), batch)
    nnx.update(held, nnx.State(jax.tree.map(np.asarray, state.params)), nnx.State(jax.tree.map(np.asarray, state.model_state)))
    held.eval()  # the reference: the module itself, on one device
    want, want_loss = _text_eval(held, batch)
    evaluated = program.evaluate(state.params, batch, state.model_state)
    np.testing.assert_allclose(float(evaluated["loss"]), float(want_loss), rtol=1e-6)
    predicted = jax.jit(model.apply)(state.params, batch["tokens"], batch["mask"], model_state=state.model_state)
    np.testing.assert_allclose(np.asarray(predicted), np.asarray(want), rtol=1e-5, atol=1e-6)

    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(1, state, data_state={"step": 1}, config={"model": "text"}, force=True)
    export_params(tmp_path / "ckpt", tmp_path / "text.safetensors")
    params, model_state = load_exported(tmp_path / "text.safetensors", model_state=True)
    assert list(params["blocks"]) == ["0", "1"]  # nnx.List indices, as any tree Orbax restores without a target
    assert all(str(leaf.dtype) == "float32" and leaf.dtype.byteorder == "=" for leaf in jax.tree.leaves((params, model_state)))
    # evaluate takes the exported trees as they come, and so does the module, through the documented recipe
    assert float(program.evaluate(params, batch, model_state)["loss"]) == float(evaluated["loss"])
    served = TextClassifier(rngs=nnx.Rngs(7))
    variables = nnx.state(served)
    nnx.replace_by_pure_dict(variables, params)  # one call per tree: both hold a 'bn' entry
    nnx.replace_by_pure_dict(variables, model_state)
    nnx.update(served, variables)
    served.eval()
    assert np.array_equal(np.asarray(_text_eval(served, batch)[0]), np.asarray(want))


# ---------------------------------------------------------------- a train/eval switch in the config


class ConfigSwitched(nn.Module):
    """The Flax lm1b / WMT style: ``deterministic`` is a field of the module, not a call argument."""
    deterministic: bool = False

    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.Dropout(0.5, deterministic=self.deterministic)(nn.relu(nn.Dense(16)(x))))


class NnxConfig(flax.struct.PyTreeNode):
    deterministic: bool = False


class NnxConfigSwitched(nnx.Module):
    """The Flax lm1b NNX style: the config's ``deterministic`` is passed at call time, past ``module.eval()``."""

    def __init__(self, config, *, rngs):
        self.config = config
        self.l1, self.drop, self.l2 = nnx.Linear(4, 16, rngs=rngs), nnx.Dropout(0.5, rngs=rngs), nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.l1(x)), deterministic=self.config.deterministic))


def _mse(out, batch):
    return jnp.mean((out - batch["y"]) ** 2)


def _switched_batch():
    rng = np.random.default_rng(0)
    return {"inputs": rng.normal(size=(ROWS, 4)).astype(np.float32), "y": rng.normal(size=(ROWS, 4)).astype(np.float32)}


def _evaluates_like(model, reference):
    """One step trains with dropout (its loss is not the eval loss at the same weights); evaluate
    then equals ``reference(params, batch)`` on one device with dropout off."""
    program = shardlib.build(model, optax.sgd(0.1), shardlib.make_layout(model, "dp", shardlib.make_mesh({"data": 8})))
    batch, state = _switched_batch(), program.init(jax.random.key(0))
    before = float(program.evaluate(state.params, batch)["loss"])
    state, metrics = program.step(state, batch)
    assert float(metrics["loss"]) != pytest.approx(before, rel=1e-3)  # the step drew dropout masks
    params = jax.tree.map(np.asarray, state.params)
    np.testing.assert_allclose(float(program.evaluate(state.params, batch)["loss"]), reference(params, batch), rtol=1e-5)


def test_a_linen_module_switched_by_a_config_field_evaluates_its_eval_module():
    module = ConfigSwitched()
    with pytest.raises(ValueError, match=r"eval_module=module\.clone\(deterministic=True\)"):
        model = shardlib.from_linen(module, _mse, _switched_batch()["inputs"])
        shardlib.build(model, optax.sgd(0.1), shardlib.make_layout(model, "dp", shardlib.make_mesh({"data": 8}))
                       ).evaluate(model.init(jax.random.key(0)), _switched_batch())
    model = shardlib.from_linen(module, _mse, _switched_batch()["inputs"], eval_module=module.clone(deterministic=True))
    _evaluates_like(model, lambda p, b: float(_mse(ConfigSwitched(deterministic=True).apply({"params": p}, b["inputs"]), b)))
    with pytest.raises(ValueError, match="eval_module=.*other variables.*Dense_1"):
        shardlib.from_linen(module, _mse, _switched_batch()["inputs"], eval_module=nn.Dense(4))


def test_an_nnx_module_switched_by_its_config_evaluates_its_eval_module():
    loss = lambda m, b: _mse(m(b["inputs"]), b)
    model = shardlib.from_nnx(lambda rngs: NnxConfigSwitched(NnxConfig(), rngs=rngs), loss,
                              eval_module=lambda rngs: NnxConfigSwitched(NnxConfig(deterministic=True), rngs=rngs))

    def reference(params, batch):
        module = NnxConfigSwitched(NnxConfig(deterministic=True), rngs=nnx.Rngs(0))
        nnx.update(module, nnx.State(params))
        return float(loss(module, batch))

    _evaluates_like(model, reference)
    with pytest.raises(ValueError, match="eval_module=.*other parameters"):
        shardlib.from_nnx(lambda rngs: NnxConfigSwitched(NnxConfig(), rngs=rngs), loss,
                          eval_module=lambda rngs: nnx.Linear(4, 4, rngs=rngs))
