"""Users migrating a working one-device Flax script: the Flax ImageNet example's ``TrainState`` with
``batch_stats`` and a HuggingFace-Flax-style wrapper fine-tuned with frozen embeddings and
``MultiSteps``, ported through the public API and compared with the script's own loop."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import traverse_util
from flax.training import common_utils, train_state

from shardlib import build, from_linen, make_layout, make_mesh

ROWS, STEPS = 16, 3


class _CNN(nn.Module):
    """The Flax examples' CNN; ``bn_axis`` is the pmap-era BatchNorm axis name."""
    bn_axis: Any = None

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(8, (3, 3))(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, axis_name=self.bn_axis)(x))
        x = nn.avg_pool(x, (2, 2), (2, 2)).reshape((x.shape[0], -1))
        return nn.Dense(10)(nn.relu(nn.Dense(32)(x)))


class _TrainState(train_state.TrainState):
    batch_stats: Any


def _no_decay_on_biases_and_norms(params):
    flat = traverse_util.flatten_dict(params)
    return traverse_util.unflatten_dict({path: path[-1] not in ("bias", "scale") for path in flat})


_SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 0.05, warmup_steps=2, decay_steps=10)


def _sgd():
    return optax.chain(optax.add_decayed_weights(1e-2, mask=_no_decay_on_biases_and_norms),
                       optax.sgd(_SCHEDULE, momentum=0.9))


def _image_batches():
    rng = np.random.default_rng(0)
    return [{"image": rng.normal(size=(ROWS, 8, 8, 1)).astype(np.float32),
             "label": rng.integers(0, 10, size=(ROWS,)).astype(np.int32)} for _ in range(STEPS)]


def _xent(logits, labels):
    return optax.softmax_cross_entropy(logits, common_utils.onehot(labels, 10)).mean()


@jax.jit
def _imagenet_train_step(state, batch):
    """The example's train step, as written there (one device: no pmap, no axis name)."""
    def loss_fn(params):
        logits, new_model_state = state.apply_fn({"params": params, "batch_stats": state.batch_stats},
                                                 batch["image"], train=True, mutable=["batch_stats"])
        return _xent(logits, batch["label"]), (new_model_state, logits)

    (loss, (new_model_state, logits)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    metrics = {"loss": loss, "accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"]),
               "learning_rate": _SCHEDULE(state.step)}
    return state.apply_gradients(grads=grads, batch_stats=new_model_state["batch_stats"]), metrics


def test_a_flax_train_state_with_batch_stats_ports_with_its_metrics_and_schedule():
    """init_from takes the TrainState's params and bare batch_stats; the loss's accuracy and the
    schedule's rate come back as metrics; synchronised BatchNorm under zero3 trains like the loop."""
    variables = _CNN().init(jax.random.key(0), jnp.ones((1, 8, 8, 1)), train=False)
    start = _TrainState.create(apply_fn=_CNN().apply, params=variables["params"], tx=_sgd(),
                               batch_stats=variables["batch_stats"])
    batches, expected, theirs = _image_batches(), [], start
    for batch in batches:
        theirs, metrics = _imagenet_train_step(theirs, batch)
        expected.append(jax.device_get(metrics))

    def loss_fn(logits, batch):
        return _xent(logits, batch["label"]), {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"])}

    model = from_linen(_CNN(bn_axis="batch"), loss_fn, batches[0],
                       inputs=lambda batch, train: ((batch["image"],), {"train": train}))
    layout = make_layout(model, "zero3", make_mesh({"data": 2, "fsdp": 4}))
    program = build(model, _sgd(), layout, axis_name="batch", lr_schedule=_SCHEDULE)
    for whole, call in [(start, r"init_from\(state.params, model_state=\{'batch_stats': state.batch_stats\}\)"),
                        (variables, r"init_from\(variables\['params'\], model_state=\{'batch_stats': "
                                    r"variables\['batch_stats'\]\}\)")]:
        with pytest.raises(ValueError, match=call):
            program.init_from(whole)
    state = program.init_from(start.params, model_state=start.batch_stats)
    for batch, want in zip(batches, expected):
        state, metrics = program.step(state, batch)
        np.testing.assert_allclose(metrics["loss"], want["loss"], rtol=1e-5)
        assert float(metrics["accuracy"]) == float(want["accuracy"])  # k / 16: exact
        np.testing.assert_allclose(metrics["lr"], want["learning_rate"], rtol=1e-6)
    # SGD moves parameters by lr x gradient: float32 reduction-order noise stays near 1e-7
    compare = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    jax.tree.map(compare, state.params, theirs.params)
    jax.tree.map(compare, state.model_state["batch_stats"], theirs.batch_stats)
