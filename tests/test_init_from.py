"""`TrainProgram.init_from`: fine-tuning starts from weights the user already has, placed in the
strategy's shards, against a one-device `jax.jit` + optax loop that starts from the same weights."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

from shardlib import build, from_linen, from_nnx, make_layout, make_mesh
from tests import zoo

ROWS = 16


class _Classifier(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64, name="hidden")(x))
        return nn.Dense(8, name="head")(x)


def _loss(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def _batches(n):
    rng = np.random.default_rng(1)
    return [{"inputs": rng.normal(size=(ROWS, 32)).astype(np.float32),
             "label": rng.integers(0, 8, size=(ROWS,)).astype(np.int32)} for _ in range(n)]


def _pretrained():
    """Weights that are not what the model's init draws: another seed, scaled and shifted."""
    params = _Classifier().init(jax.random.key(7), jnp.zeros((1, 32)))["params"]
    return jax.tree.map(lambda w: np.asarray(w) * 1.5 + 0.01, params)


@pytest.mark.parametrize("strategy,sizes", [("zero3", {"fsdp": 8}), ("zero1", {"data": 8})])
def test_training_from_pretrained_weights_matches_the_users_loop_from_them(strategy, sizes):
    model = from_linen(_Classifier(), _loss, np.zeros((ROWS, 32), np.float32), rng_streams=())
    tx = optax.adamw(1e-2, eps=1e-5)
    program = build(model, tx, make_layout(model, strategy, make_mesh(sizes)))
    pretrained, batches = _pretrained(), _batches(3)
    state = program.init_from(pretrained)
    assert state.params["hidden"]["kernel"].sharding.spec == program.state_sharding.params["hidden"]["kernel"].spec
    np.testing.assert_array_equal(np.asarray(state.params["head"]["kernel"]), pretrained["head"]["kernel"])
    losses = []
    for batch in batches:
        state, metrics = program.step(state, batch)
        losses.append(float(metrics["loss"]))
    user_loss = lambda p, batch: _loss(_Classifier().apply({"params": p}, batch["inputs"]), batch)
    expected, expected_losses = zoo.plain_steps(user_loss, jax.tree.map(jnp.asarray, pretrained), tx, batches)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6),
                 state.params, expected)


class _Normed(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([nnx.Linear(32, 32, rngs=rngs) for _ in range(2)])
        self.norm = nnx.BatchNorm(32, rngs=rngs)
        self.head = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = nnx.relu(block(x))
        return self.head(self.norm(x))


def test_nnx_weights_and_statistics_from_another_run_are_kept_and_misfits_are_named():
    user = _Normed(nnx.Rngs(3))
    user.norm.mean.value = jnp.full((32,), 0.5)  # statistics of the user's earlier run
    model = from_nnx(_Normed, lambda m, b: _loss(m(b["inputs"]), b))
    program = build(model, optax.adam(1e-3), make_layout(model, "zero3", make_mesh({"fsdp": 8})))
    weights = nnx.state(user, nnx.Param)
    exported = {"blocks": {str(i): w for i, w in weights.to_pure_dict()["blocks"].items()},  # load_exported's keys
                **{k: v for k, v in weights.to_pure_dict().items() if k != "blocks"}}
    for given in (weights, exported):
        state = program.init_from(given, model_state=nnx.state(user, nnx.BatchStat))
        np.testing.assert_array_equal(np.asarray(state.params["blocks"][1]["kernel"]), np.asarray(user.blocks[1].kernel.value))
        np.testing.assert_array_equal(np.asarray(state.model_state["norm"]["mean"]), np.full((32,), 0.5))
        assert all(float(jnp.abs(m).max()) == 0 for m in jax.tree.leaves(state.opt_state[0].mu))
    with pytest.warns(UserWarning, match="init_from without model_state=: the model's state"):
        program.init_from(weights)
    wrong = weights.to_pure_dict()
    wrong["head"]["kernel"] = np.zeros((32, 9), np.float32)
    del wrong["blocks"][0]["bias"]
    with pytest.raises(ValueError, match=r"\(2 difference\(s\)\): blocks/0/bias: not in the parameters given .*"
                                         r"head/kernel: \(32, 9\) given, the model's is \(32, 8\)"):
        program.init_from(wrong)


def test_fine_tuning_from_a_checkpoint_of_another_optimizer_and_mesh(tmp_path):
    """Pretrained with Adam under zero3, fine-tuned with SGD under dp: the checkpoint's parameters
    only (Orbax's partial restore, straight into dp's shards), then init_from builds SGD's state."""
    from shardlib import Checkpointer

    model = from_linen(_Classifier(), _loss, np.zeros((ROWS, 32), np.float32), rng_streams=())
    pretrain = build(model, optax.adam(1e-2), make_layout(model, "zero3", make_mesh({"fsdp": 8})))
    state = pretrain.init(jax.random.key(0))
    for batch in _batches(2):
        state, _ = pretrain.step(state, batch)
    saved = jax.tree.map(np.asarray, state.params)
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(2, state, data_state={}, config={"note": "pretraining"})
    ckpt.close()
    tune = build(model, optax.sgd(0.1, momentum=0.9), make_layout(model, "dp", make_mesh({"data": 8})))
    params = Checkpointer(tmp_path / "ckpt").restore_subtree({"params": tune.abstract_state().params})["params"]
    tuned = tune.init_from(params)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, tuned.params), saved)
    assert all(float(jnp.abs(t).max()) == 0 for t in jax.tree.leaves(tuned.opt_state[0].trace))
    tuned, metrics = tune.step(tuned, _batches(1)[0])
    assert np.isfinite(float(metrics["loss"]))
