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
from flax.core import freeze
from flax import jax_utils, traverse_util
from flax.training import common_utils, train_state

from shardlib import build, from_linen, make_layout, make_mesh
from tests import zoo

ROWS, STEPS = 16, 3
# Adam (eps 1e-5) amplifies a gradient's reduction-order difference |dg| ~ 1e-9 by at most lr / eps per
# update: 2 updates at lr <= 1e-3 move a parameter by <= 2e-7 (5e-8 measured); SGD by lr x |dg|.
PARAM_ATOL = 1e-6


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


def test_a_flax_train_state_run_continues_with_its_statistics_optimizer_state_metrics_and_schedule():
    """init_from takes the TrainState's fields (bare ``batch_stats``; ``opt_state`` and ``step`` to go
    on with its momentum and schedule; a whole or pmap-replicated state is refused with the call to
    write); accuracy and the schedule's rate come back as metrics; synchronised BatchNorm under
    zero3 trains like the script's loop."""
    variables = jax.jit(lambda key: _CNN().init(key, jnp.ones((1, 8, 8, 1)), train=False))(jax.random.key(0))
    theirs = _TrainState.create(apply_fn=_CNN().apply, params=variables["params"], tx=_sgd(),
                                batch_stats=variables["batch_stats"])
    batches, expected = _image_batches(), []
    for batch in batches:
        theirs, metrics = _imagenet_train_step(theirs, batch)
        expected.append(jax.device_get(metrics))
        if len(expected) == 1:
            midway = theirs  # the script's state after its first step: the port goes on from there

    def loss_fn(logits, batch):
        return _xent(logits, batch["label"]), {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"])}

    model = from_linen(_CNN(bn_axis="batch"), loss_fn, batches[0],
                       inputs=lambda batch, train: ((batch["image"],), {"train": train}))
    layout = make_layout(model, "zero3", make_mesh({"data": 2, "fsdp": 4}))
    program = build(model, _sgd(), layout, axis_name="batch", lr_schedule=_SCHEDULE)
    for whole, call in [(midway, r"init_from\(state.params, model_state=\{'batch_stats': state.batch_stats\}, "
                                 r"opt_state=state.opt_state, step=state.step\)"),
                        (variables, r"init_from\(variables\['params'\], model_state=\{'batch_stats': "
                                    r"variables\['batch_stats'\]\}\)"),
                        (jax_utils.replicate(midway).params, r"jax_utils.unreplicate\(state\).params")]:
        with pytest.raises(ValueError, match=call):
            program.init_from(whole)
    state = program.init_from(midway.params, model_state=midway.batch_stats, opt_state=midway.opt_state,
                              step=midway.step)
    for batch, want in zip(batches[1:], expected[1:]):
        state, metrics = program.step(state, batch)
        np.testing.assert_allclose(metrics["loss"], want["loss"], rtol=1e-5)
        assert float(metrics["accuracy"]) == float(want["accuracy"])  # k / 16: exact
        np.testing.assert_allclose(metrics["lr"], want["learning_rate"], rtol=1e-6)  # the schedule goes on
    compare = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=PARAM_ATOL)
    jax.tree.map(compare, state.params, theirs.params)
    jax.tree.map(compare, state.model_state["batch_stats"], theirs.batch_stats)
    jax.tree.map(compare, state.opt_state, theirs.opt_state)  # momentum and the schedule's count


class _Encoder(nn.Module):
    """A HuggingFace-Flax-style sequence classifier: embeddings, a feed-forward block with dropout,
    a pooler over the unmasked tokens and a head; two inputs and a ``deterministic`` flag."""
    vocab: int = 64
    hidden: int = 32
    dropout: float = 0.0

    @nn.compact
    def __call__(self, input_ids, attention_mask, deterministic: bool = True):
        h = nn.LayerNorm(name="embeddings_norm")(nn.Embed(self.vocab, self.hidden, name="word_embeddings")(input_ids))
        f = nn.Dense(self.hidden, name="output")(nn.gelu(nn.Dense(64, name="intermediate")(h)))
        h = nn.LayerNorm(name="output_norm")(h + nn.Dropout(self.dropout)(f, deterministic=deterministic))
        mask = attention_mask[..., None].astype(h.dtype)
        pooled = nn.tanh(nn.Dense(self.hidden, name="pooler")((h * mask).sum(1) / mask.sum(1)))
        return (nn.Dense(3, name="classifier")(pooled),)


class _PreTrained:
    """What a HuggingFace-Flax user holds: ``model.module``, ``model.params``, and a call that
    takes ``params=``, ``dropout_rng=`` and ``train=``."""

    def __init__(self, seed):
        self.module = _Encoder()
        ids = jnp.zeros((1, 8), jnp.int32)
        init = jax.jit(lambda key: jax.tree.map(lambda w: w * 1.1, self.module.init(key, ids, ids)["params"]))
        self.params = init(jax.random.key(seed))  # another run's weights, not what the module's init draws

    def __call__(self, input_ids, attention_mask, params=None, dropout_rng=None, train=False):
        rngs = {"dropout": dropout_rng} if dropout_rng is not None else {}
        return self.module.apply({"params": self.params if params is None else params}, input_ids, attention_mask,
                                 not train, rngs=rngs)


_LINEAR = optax.linear_schedule(1e-3, 0.0, 10)


def _frozen_embeddings_adamw(params):
    labels = traverse_util.path_aware_map(lambda path, _: "frozen" if "embeddings" in path[0] else "trained", params)
    tx = optax.multi_transform({"trained": optax.adamw(_LINEAR, eps=1e-5, weight_decay=0.01),
                                "frozen": optax.set_to_zero()}, labels)
    return optax.MultiSteps(tx, every_k_schedule=2)


def test_a_huggingface_style_fine_tune_with_frozen_embeddings_and_multi_steps_ports_to_from_linen():
    """from_linen on ``model.module`` + ``init_from(model.params)`` trains as the user's loop does;
    the rate reported is the one MultiSteps' update applies (its schedule runs on updates); a mask
    built over FrozenDict params is refused with the fix."""
    pretrained = _PreTrained(seed=3)
    rng = np.random.default_rng(1)
    batches = [{"input_ids": rng.integers(0, 64, size=(ROWS, 8)).astype(np.int32),
                "attention_mask": (np.arange(8) < rng.integers(4, 9, size=(ROWS, 1))).astype(np.int32),
                "labels": rng.integers(0, 3, size=(ROWS,)).astype(np.int32)} for _ in range(4)]
    xent = lambda logits, labels: optax.softmax_cross_entropy(logits, jax.nn.one_hot(labels, 3)).mean()

    def users_loss(params, batch):
        return xent(pretrained(batch["input_ids"], batch["attention_mask"], params=params, train=True)[0],
                    batch["labels"])

    theirs, their_losses = zoo.plain_steps(users_loss, pretrained.params, _frozen_embeddings_adamw(pretrained.params),
                                           batches)
    model = from_linen(pretrained.module, lambda out, batch: xent(out[0], batch["labels"]), batches[0],
                       inputs=lambda b, train: ((b["input_ids"], b["attention_mask"]), {"deterministic": not train}))
    program = build(model, _frozen_embeddings_adamw(pretrained.params),
                    make_layout(model, "zero2", make_mesh({"data": 2, "fsdp": 4})), lr_schedule=_LINEAR)
    decay_on_kernels = jax.tree.map(lambda w: w.ndim > 1, freeze(pretrained.params))  # as older HF params are
    with pytest.raises(ValueError, match="FrozenDict") as refused:
        build(model, optax.adamw(1e-3, mask=decay_on_kernels), program.layout)
    assert "flax.core.unfreeze(tree)" in refused.value.__notes__[-1]
    state, losses, rates = program.init_from(pretrained.params), [], []
    for batch in batches:
        state, metrics = program.step(state, batch)
        losses.append(float(metrics["loss"]))
        rates.append(float(metrics["lr"]))
    np.testing.assert_allclose(losses, their_losses, rtol=1e-5)
    assert rates == [float(_LINEAR(update)) for update in (0, 0, 1, 1)]  # not _LINEAR(step): 1e-3, 9e-4, ...
    np.testing.assert_array_equal(np.asarray(state.params["word_embeddings"]["embedding"]),
                                  np.asarray(pretrained.params["word_embeddings"]["embedding"]))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=PARAM_ATOL),
                 state.params, theirs)
