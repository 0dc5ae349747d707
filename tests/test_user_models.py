"""Users' own models (tests/zoo.py) through shardlib: parity with a one-device jit + optax step,
dropout keys (reproducible, per data-parallel device, the same within a tensor-parallel replica,
bitwise across a resume), BatchNorm statistics in the train state, and linen's ``inputs=``.

References are independent of shardlib: `zoo.plain_steps_with_state`, a plain
``jax.jit(jax.value_and_grad)`` + optax step on one device.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import shardlib
from shardlib import Checkpointer, build, from_functions, from_linen, from_nnx, make_layout, make_mesh
from shardlib.step.local_sgd import build_local_sgd
from tests import zoo
from tests.helpers import optimizer  # AdamW, lr 3e-3, eps=1e-5

STEPS, ROWS = 5, 16
# Parameters: Adam's step m / (sqrt(v) + eps) moves by up to lr * |dg| / eps when a gradient differs
# by dg between two summation orders. Float32 rounding of O(0.1) gradient sums is |dg| ~ 1e-8 here
# (attention's softmax sums over more terms than the MLPs of tests/helpers.py assumed), so
# lr 3e-3, eps 1e-5 and 5 steps bound the drift by 5 * 3e-3 * 1e-8 / 1e-5 = 1.5e-5: atol 1.5e-5.
# Losses are not amplified by Adam and compare at rtol 1e-5.
PARAM_ATOL = 5 * 3e-3 * 1e-8 / 1e-5
FSDP8, DATA2_FSDP4 = {"fsdp": 8}, {"data": 2, "fsdp": 4}
FSDP4_TENSOR2, DATA4_TENSOR2, DATA8 = {"fsdp": 4, "tensor": 2}, {"data": 4, "tensor": 2}, {"data": 8}


def _token_inputs(batch, train):
    return (batch["tokens"], batch["positions"]), {"train": train}


def linen_transformer(dropout_rate=0.0):
    module = zoo.LinenTransformer(dropout_rate=dropout_rate)
    return from_linen(module, zoo.linen_transformer_loss, zoo.token_batch(0), inputs=_token_inputs)


def _linen_reference():
    module = zoo.LinenTransformer()
    apply = lambda p, b: module.apply({"params": p}, *_token_inputs(b, True)[0], train=True)
    return lambda p, s, b: (zoo.linen_transformer_loss(apply(p, b), b), s)


def _nnx(make, loss):
    return from_nnx(make, loss), lambda: zoo.nnx_functional(make, loss)[2]


def _cnn(axis_name):
    """Synchronised BatchNorm over ``axis_name`` in shardlib; its one-device reference needs none."""
    model, _ = _nnx(lambda rngs: zoo.NnxCNN(rngs=rngs, bn_axis_name=axis_name), zoo.cnn_loss)
    return model, _nnx(lambda rngs: zoo.NnxCNN(rngs=rngs), zoo.cnn_loss)[1]


# name -> (model, reference loss(params, model_state, batch) -> (loss, model_state), batch maker)
MODELS = {
    "linen_transformer": lambda mesh: (linen_transformer(), _linen_reference(), zoo.token_batch),
    "nnx_transformer": lambda mesh: (*_nnx(lambda rngs: zoo.NnxTransformer(rngs=rngs), zoo.nnx_transformer_loss),
                                     zoo.token_batch),
    "mlp": lambda mesh: (from_functions(zoo.mlp_init, zoo.mlp_loss), lambda p, s, b: (zoo.mlp_loss(p, b), s),
                         zoo.regression_batch),
    "nnx_mesh_annotated": lambda mesh: (*_nnx(lambda rngs: zoo.NnxMeshAnnotated(rngs=rngs), zoo.regression_loss),
                                        zoo.regression_batch),
    # Synchronised BatchNorm: statistics over the global batch, the same math as the one-device reference.
    "nnx_cnn_sync_bn": lambda mesh: (*_cnn(shardlib.batch_axis_names(mesh)), zoo.image_batch),
}

_slow = pytest.mark.slow
CASES = [
    ("linen_transformer", "zero3", FSDP8),
    pytest.param("linen_transformer", "dp", DATA8, marks=_slow),
    pytest.param("linen_transformer", "zero1", FSDP8, marks=_slow),
    pytest.param("linen_transformer", "zero2", DATA2_FSDP4, marks=_slow),
    pytest.param("linen_transformer", "hsdp", DATA2_FSDP4, marks=_slow),
    ("linen_transformer", "fsdp_tp", FSDP4_TENSOR2),
    pytest.param("linen_transformer", "tp", DATA4_TENSOR2, marks=_slow),
    ("nnx_transformer", "hsdp", DATA2_FSDP4),
    pytest.param("nnx_transformer", "dp", DATA8, marks=_slow),
    pytest.param("nnx_transformer", "zero1", FSDP8, marks=_slow),
    pytest.param("nnx_transformer", "zero2", FSDP8, marks=_slow),
    pytest.param("nnx_transformer", "zero3", DATA2_FSDP4, marks=_slow),
    ("mlp", "dp", DATA8),
    ("mlp", "zero1", FSDP8),
    ("mlp", "zero2", DATA2_FSDP4),
    ("mlp", "zero3", FSDP8),
    ("mlp", "hsdp", DATA2_FSDP4),
    ("nnx_mesh_annotated", "zero3", FSDP8),
    ("nnx_mesh_annotated", "fsdp_tp", FSDP4_TENSOR2),
    ("nnx_mesh_annotated", "tp", DATA4_TENSOR2),
    ("nnx_mesh_annotated", "as_annotated", FSDP4_TENSOR2),
    ("nnx_cnn_sync_bn", "zero3", FSDP8),
    ("nnx_cnn_sync_bn", "dp", DATA8),
    pytest.param("nnx_cnn_sync_bn", "hsdp", DATA2_FSDP4, marks=_slow),
]


def _host(tree):
    return jax.tree.map(np.asarray, tree)


_train = zoo.program_steps


# A conv bias right before BatchNorm has a zero gradient (BN subtracts the mean), so its gradient
# is rounding noise alone, which Adam scales up to steps of lr * noise / eps in either direction:
# there is nothing to compare but that both sides stay at noise level.
_BEFORE_BN = {"['conv1']['bias']", "['conv2']['bias']"}


def _assert_close(got, want):
    for path, ref in jax.tree_util.tree_leaves_with_path(want):
        value = dict(jax.tree_util.tree_leaves_with_path(got))[path]
        if jax.tree_util.keystr(path) in _BEFORE_BN:
            assert max(np.abs(np.asarray(value)).max(), np.abs(np.asarray(ref)).max()) < 1e-4
            continue
        np.testing.assert_allclose(np.asarray(value), np.asarray(ref), rtol=1e-5, atol=PARAM_ATOL,
                                   err_msg=jax.tree_util.keystr(path))


REFERENCE_RUNS: dict = {}  # one reference run per model, shared by its strategies (tests.zoo.shared_run)


@pytest.mark.parametrize("name, strategy, sizes", CASES)
def test_matches_one_device_jit_and_optax(name, strategy, sizes):
    mesh = make_mesh(sizes)
    model, reference, make_batch = MODELS[name](mesh)
    program = build(model, optimizer(), make_layout(model, strategy, mesh))
    state = program.init(jax.random.key(0))
    params0, stats0 = _host(state.params), _host(state.model_state)
    batches = [make_batch(i, ROWS) for i in range(STEPS)]
    state, losses = _train(program, state, batches)
    loss = lambda: reference() if name.startswith("nnx") else reference
    ref_params, ref_stats, ref_losses = zoo.shared_run(
        REFERENCE_RUNS, name, (params0, stats0, batches),
        lambda: zoo.plain_steps_with_state(loss(), params0, stats0, optimizer(), batches))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    _assert_close(state.params, ref_params)
    if stats0 is not None:
        _assert_close(state.model_state, ref_stats)


def test_nnx_init_is_the_modules_own():
    """shardlib's init of an NNX module holds the values ``make(nnx.Rngs(seed))`` creates."""
    make = lambda rngs: zoo.NnxCNN(rngs=rngs)
    params, stats, _ = zoo.nnx_functional(make, zoo.cnn_loss)
    model = from_nnx(make, zoo.cnn_loss)
    jax.tree.map(np.testing.assert_array_equal, model.init(jax.random.key(0)), params)
    jax.tree.map(np.testing.assert_array_equal, model.init_state(jax.random.key(0)), stats)


# ---------------------------------------------------------------- dropout keys


class _MaskProbe(nnx.Module):
    """loss = mean(dropout(1) * w): with one row per device, sgd(1)'s update of ``w`` is minus the
    mean of the devices' masks, so identical masks give only the values 0 and the maximum."""

    def __init__(self, rngs):
        self.w = nnx.Param(jnp.zeros((256,)))
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return jnp.mean(self.dropout(x) * self.w[...])


def test_data_parallel_devices_draw_different_masks():
    model = from_nnx(_MaskProbe, lambda m, b: m(b["x"]))
    program = build(model, optax.sgd(1.0), make_layout(model, "dp", make_mesh(DATA8)))
    state, _ = _train(program, program.init(jax.random.key(0)), [{"x": np.ones((8, 256), np.float32)}])
    kept = np.rint(-np.asarray(state.params["w"]) * 256 * 8 / 2).astype(int)  # devices that kept each unit
    assert set(np.unique(kept)) <= set(range(9))
    assert len(set(np.unique(kept)) - {0, 8}) > 3, kept  # masks differ between devices
    # and each device's mask is a fair draw: about half the units kept on average
    assert 0.35 < kept.mean() / 8 < 0.65


@pytest.fixture(scope="module")
def cnn_dropout():
    """The CNN with dropout 0.5 and (per-device) BatchNorm under zero3 on fsdp=8, and its batches."""
    model = from_nnx(lambda rngs: zoo.NnxCNN(rngs=rngs, dropout_rate=0.5), zoo.cnn_loss)
    layout = make_layout(model, "zero3", make_mesh(FSDP8))
    return model, layout, build(model, optimizer(), layout), [zoo.image_batch(i, ROWS) for i in range(6)]


def test_same_seed_reproduces_a_run_and_another_seed_differs(cnn_dropout):
    _, _, program, batches = cnn_dropout
    a, losses_a = _train(program, program.init(jax.random.key(0)), batches[:3])
    b, losses_b = _train(program, program.init(jax.random.key(0)), batches[:3])
    assert losses_a == losses_b
    jax.tree.map(np.testing.assert_array_equal, _host(a.params), _host(b.params))
    reseeded = dataclasses.replace(program.init(jax.random.key(0)), rng=program.init(jax.random.key(1)).rng)
    c, losses_c = _train(program, reseeded, batches[:3])  # same parameters, another dropout seed
    assert losses_c[0] != losses_a[0]
    assert not np.array_equal(np.asarray(c.params["linear2"]["kernel"]), np.asarray(a.params["linear2"]["kernel"]))


def _assert_replicated_and_equal(state_a, state_b=None):
    for leaf in jax.tree.leaves(state_a.model_state):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        assert len(shards) == len(leaf.sharding.mesh.devices.flat)
        for shard in shards[1:]:
            np.testing.assert_array_equal(shard, shards[0])  # the same statistics on every device


def test_batchnorm_statistics_are_the_same_on_every_device_and_move(cnn_dropout):
    model, _, program, batches = cnn_dropout
    state, _ = _train(program, program.init(jax.random.key(0)), batches[:3])
    _assert_replicated_and_equal(state)
    init = model.init_state(jax.random.key(0))
    for got, start in zip(jax.tree.leaves(state.model_state), jax.tree.leaves(init)):
        assert not np.allclose(np.asarray(got), np.asarray(start))


def test_resume_from_a_checkpoint_is_bitwise(cnn_dropout, tmp_path):
    model, layout, program, batches = cnn_dropout
    straight, _ = _train(program, program.init(jax.random.key(0)), batches)
    first, _ = _train(program, program.init(jax.random.key(0)), batches[:3])
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.save(3, first, data_state={}, config={}, force=True)
        ckpt.wait()
        fresh = build(model, optimizer(), layout)
        restored, _, _ = ckpt.restore(fresh.abstract_state())
    resumed, _ = _train(fresh, restored, batches[3:])
    jax.tree.map(np.testing.assert_array_equal, _host(resumed), _host(straight))  # params, stats, rng, step


def test_batchnorm_statistics_restore_onto_another_mesh(cnn_dropout, tmp_path):
    model, _, program, batches = cnn_dropout
    state, _ = _train(program, program.init(jax.random.key(0)), batches[:2])
    target = build(model, optimizer(), make_layout(model, "zero3", make_mesh({"data": 2, "fsdp": 2},
                                                                             devices=jax.devices()[:4])))
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.save(2, state, data_state={}, config={}, force=True)
        ckpt.wait()
        restored, _, _ = ckpt.restore(target.abstract_state())
    jax.tree.map(np.testing.assert_array_equal, _host(restored.model_state), _host(state.model_state))
    jax.tree.map(np.testing.assert_array_equal, _host(restored.params), _host(state.params))
    _assert_replicated_and_equal(restored)
    assert len(jax.tree.leaves(restored.model_state)[0].sharding.mesh.devices.flat) == 4


def test_evaluate_uses_running_statistics_and_no_dropout(cnn_dropout):
    model, _, program, batches = cnn_dropout
    state, _ = _train(program, program.init(jax.random.key(0)), batches[:2])
    first = program.evaluate(state.params, batches[0], state.model_state)
    assert float(first["loss"]) == float(program.evaluate(state.params, batches[0], state.model_state)["loss"])
    # eval mode: the module's own eval() with the running statistics, on one device (one jit, not
    # op by op: ~60 eager compiles)
    @jax.jit
    def eval_loss(params, stats, batch):
        module = zoo.NnxCNN(rngs=nnx.Rngs(0), dropout_rate=0.5)
        nnx.update(module, nnx.State(params), nnx.State(stats))
        module.eval()
        return zoo.cnn_loss(module, batch)

    want = eval_loss(_host(state.params), _host(state.model_state), batches[0])
    np.testing.assert_allclose(float(first["loss"]), float(want), rtol=1e-5)
    with pytest.raises(ValueError, match="state.model_state"):
        program.evaluate(state.params, batches[0])


# ---------------------------------------------------------------- linen: inputs, dropout, tensor parallelism


def test_linen_multi_input_dropout_trains_and_evaluates_deterministically():
    model = linen_transformer(dropout_rate=0.2)
    program = build(model, optimizer(), make_layout(model, "zero3", make_mesh(FSDP8)))
    batches = [zoo.token_batch(i % 2, ROWS) for i in range(STEPS)]
    state, losses = _train(program, program.init(jax.random.key(0)), batches)
    assert losses[-1] < losses[0]
    evals = [float(program.evaluate(state.params, batches[0])["loss"]) for _ in range(2)]
    assert evals[0] == evals[1]  # train=False: no dropout


@pytest.mark.slow
def test_tensor_parallel_devices_of_one_replica_draw_the_same_mask():
    """tp on data=4 x tensor=2 trains like dp on the 4 data devices alone: the key depends on the
    batch-axis index only, and the two tensor devices of a replica draw one mask between them."""
    model = linen_transformer(dropout_rate=0.2)
    batches = [zoo.token_batch(i, ROWS) for i in range(3)]
    runs = []
    for strategy, mesh in (("tp", make_mesh(DATA4_TENSOR2)), ("dp", make_mesh({"data": 4}, devices=jax.devices()[:4]))):
        program = build(model, optimizer(), make_layout(model, strategy, mesh))
        runs.append(_train(program, program.init(jax.random.key(0)), batches))
    np.testing.assert_allclose(runs[0][1], runs[1][1], rtol=1e-5)
    _assert_close(runs[0][0].params, _host(runs[1][0].params))


# ---------------------------------------------------------------- refusals


def test_steps_without_keys_or_state_refuse_such_models():
    model = from_nnx(lambda rngs: zoo.NnxCNN(rngs=rngs, dropout_rate=0.5), zoo.cnn_loss)
    layout = make_layout(model, "dp", make_mesh(DATA8))
    with pytest.raises(ValueError, match="build_local_sgd does not support models that need a random key"):
        build_local_sgd(model, optax.sgd(0.1), layout, sync_every=2)
    from shardlib.step.pmap import pmap_step
    with pytest.raises(ValueError, match="BatchNorm statistics"):
        pmap_step(model, optax.sgd(0.1))
    with pytest.raises(ValueError, match="model.loss\\(params, batch, specs, shardlib.model.Call"):
        model.loss(model.init(jax.random.key(0)), zoo.image_batch(0), None)


def test_nnx_integer_state_that_differs_between_devices_is_refused():
    """Other NNX variables are model state (tests/test_nnx_styles.py); an integer one computed
    from this device's rows has no exact average, so the step names it instead."""
    class Counter(nnx.Variable):
        pass

    class Counting(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(4, 4, rngs=rngs)
            self.positives = Counter(jnp.zeros((), jnp.int32))

        def __call__(self, x):
            self.positives[...] += jnp.sum(x > 0).astype(jnp.int32)
            return self.linear(x)

    model = from_nnx(Counting, lambda m, b: m(b["x"]).mean())
    program = build(model, optax.sgd(0.1), make_layout(model, "dp", make_mesh(DATA8)))
    with pytest.raises(ValueError, match=r"model state \['positives'\] \(int32\) depends on this device's rows"):
        program.step(program.init(jax.random.key(0)), {"x": np.ones((8, 4), np.float32)})


def test_a_loss_returning_per_example_outputs_keeps_scalar_metrics_and_says_what_it_drops():
    """The Flax tutorials' ``(loss, logits)`` and dicts mixing scalars with arrays: every adapter
    keeps the scalar entries as metrics and warns about the rest, instead of failing in dict()."""
    params, batch = zoo.mlp_init(jax.random.key(0)), zoo.regression_batch(0)

    def with_outputs(p, b):
        loss = zoo.mlp_loss(p, b)
        return loss, {"rmse": jnp.sqrt(loss), "residuals": b["y"] - loss}

    with pytest.warns(UserWarning, match="non-scalar aux entries 'residuals'"):
        loss, aux = from_functions(zoo.mlp_init, with_outputs).loss(params, batch)
    assert set(aux) == {"rmse"} and float(aux["rmse"]) == pytest.approx(float(jnp.sqrt(loss)))
    with pytest.warns(UserWarning, match=r"an array aux of shape \(16, 8\)"):
        _, aux = from_functions(zoo.mlp_init, lambda p, b: (zoo.mlp_loss(p, b), b["y"])).loss(params, batch)
    assert aux == {}
