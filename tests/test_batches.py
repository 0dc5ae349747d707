"""What users' training loops feed shardlib, and the plain-pytree models of the Flax ``TrainState``
world (``init = lambda key: module.init(key, x)['params']``, the loss calling ``module.apply``).

Batches: tuples, nested dicts, NamedTuples and ``flax.struct.dataclass``es; uint8 / bool / int32 /
float leaves of different trailing shapes; a scalar leaf (replicated); numpy arrays, arrays on one
device, arrays the user sharded on a mesh of their own; a global batch that changes size.
Parameters: bf16 leaves, ``None`` and ``{}`` entries, a frozen sub-tree, integer leaves (refused).

Every loss is compared with an independent reference: the same loss function in a plain
``jax.jit(jax.value_and_grad)`` + optax step on one device (`tests.zoo.plain_steps`), rtol 1e-5 as
in tests/test_user_models.py.
"""

from __future__ import annotations

from typing import NamedTuple

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from jax.sharding import NamedSharding, PartitionSpec as P

import shardlib
from shardlib import Call, Checkpointer, ReplicationWarning, build, from_functions, make_layout, make_mesh
from tests import zoo
from tests.helpers import optimizer  # AdamW, lr 3e-3, eps=1e-5
from tests.test_user_models import _train  # (state, per-step losses) of program.step over batches

ROWS, STEPS = 16, 3
FSDP8, DATA8, DATA2_FSDP4 = {"fsdp": 8}, {"data": 8}, {"data": 2, "fsdp": 4}


class Classifier(nn.Module):
    """A linen classifier over an image, a token sequence and a padding mask, as a Flax user writes it."""

    @nn.compact
    def __call__(self, image, tokens, mask):
        pooled = jnp.sum(nn.Embed(32, 16)(tokens) * mask[..., None], axis=1) / jnp.maximum(mask.sum(1, keepdims=True), 1)
        x = jnp.concatenate([image.reshape(image.shape[0], -1), pooled], axis=-1)
        return nn.Dense(10)(nn.relu(nn.Dense(64)(x)))


MODULE = Classifier()


def _arrays(seed: int, rows: int = ROWS):
    """uint8 images (8x8), int32 tokens (rows, 6), bool masks (rows, 6), int32 labels."""
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, size=(rows, 8, 8), dtype=np.uint8), rng.integers(0, 32, size=(rows, 6), dtype=np.int32),
            rng.random((rows, 6)) > 0.3, rng.integers(0, 10, size=(rows,), dtype=np.int32))


def init(key):
    image, tokens, mask, _ = _arrays(0, 2)
    return MODULE.init(key, image.astype(np.float32), tokens, mask)["params"]


def _loss(params, image, tokens, mask, labels, temperature=1.0):
    logits = MODULE.apply({"params": params}, image.astype(jnp.float32) / 255.0, tokens, mask) / temperature
    return zoo.cross_entropy(logits, labels)


class Example(NamedTuple):
    image: np.ndarray
    tokens: np.ndarray
    mask: np.ndarray
    label: np.ndarray


@flax.struct.dataclass
class Tempered:
    inputs: dict
    label: jax.Array
    temperature: jax.Array  # a scalar: the same on every device


# name -> (batch maker, loss over that batch)
BATCHES = {
    "tuple": (lambda s: ((a := _arrays(s))[0], a[1], a[2], a[3]), lambda p, b: _loss(p, *b)),
    "nested": (lambda s: {"inputs": dict(zip(("image", "tokens", "mask"), (a := _arrays(s))[:3])), "targets": a[3]},
               lambda p, b: _loss(p, **b["inputs"], labels=b["targets"])),
    "namedtuple": (lambda s: Example(*_arrays(s)), lambda p, b: _loss(p, b.image, b.tokens, b.mask, b.label)),
    "dataclass_scalar": (
        lambda s: Tempered(dict(zip(("image", "tokens", "mask"), (a := _arrays(s))[:3])), a[3], np.float32(1.5 + s)),
        lambda p, b: _loss(p, **b.inputs, labels=b.label, temperature=b.temperature)),
}


def _trained(init_fn, loss, make_batch, strategy, sizes, grad_accum=1):
    """(program, initial params, batches, state, per-step losses) of STEPS shardlib steps."""
    model = from_functions(init_fn, loss)
    program = build(model, optimizer(), make_layout(model, strategy, make_mesh(sizes)), grad_accum=grad_accum)
    state = program.init(jax.random.key(0))
    params0 = jax.tree.map(np.asarray, state.params)
    batches = [make_batch(i) for i in range(STEPS)]
    state, losses = _train(program, state, batches)
    return program, params0, batches, state, losses


def _parity(name, strategy, sizes, grad_accum=1):
    make_batch, loss = BATCHES[name]
    program, params0, batches, state, losses = _trained(init, loss, make_batch, strategy, sizes, grad_accum)
    ref_params, ref_losses = zoo.plain_steps(loss, params0, optimizer(), batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    evaluation = program.evaluate(state.params, batches[0])
    np.testing.assert_allclose(float(evaluation["loss"]), float(jax.jit(loss)(ref_params, batches[0])), rtol=1e-5)


@pytest.mark.parametrize("name, strategy, sizes, grad_accum", [
    ("tuple", "zero3", FSDP8, 1),
    ("nested", "hsdp", DATA2_FSDP4, 1),
    ("namedtuple", "zero1", FSDP8, 1),
    ("dataclass_scalar", "zero3", DATA2_FSDP4, 2),  # the scalar reaches every microbatch of every device
])
def test_batch_structures_train_and_evaluate_like_one_device(name, strategy, sizes, grad_accum):
    _parity(name, strategy, sizes, grad_accum)


# ---------------------------------------------------------------- where the arrays come from


@pytest.fixture(scope="module")
def nested_zero3():
    make_batch, loss = BATCHES["nested"]
    model = from_functions(init, loss)
    mesh = make_mesh(DATA2_FSDP4)
    return build(model, optimizer(), make_layout(model, "zero3", mesh)), mesh, make_batch, loss


def test_numpy_one_device_user_sharded_and_resized_batches_train_like_one_device(nested_zero3):
    """jit refuses arrays committed to devices outside the step's mesh; the step moves them (and
    compiles once for all four feeds). A batch that changes size recompiles and stays exact."""
    program, mesh, make_batch, loss = nested_zero3
    user_mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[4:])  # the user's own (Explicit) mesh
    feeds = [
        lambda b: b,  # numpy
        lambda b: jax.device_put(b, jax.devices()[0]),  # one device
        lambda b: jax.device_put(b, NamedSharding(mesh, P("data"))),  # sharded on the step's mesh, partly
        lambda b: jax.device_put(b, NamedSharding(user_mesh, P("data"))),  # on 4 of the 8 devices
    ]
    larger = {"inputs": dict(zip(("image", "tokens", "mask"), (a := _arrays(9, 32))[:3])), "targets": a[3]}
    batches = [make_batch(i) for i in range(len(feeds))] + [larger, make_batch(5)]
    state = program.init(jax.random.key(0))
    params0 = jax.tree.map(np.asarray, state.params)
    fed = [feed(b) for feed, b in zip(feeds, batches)] + batches[len(feeds):]
    _, losses = _train(program, state, fed)  # 16, 16, 16, 16, 32, 16 rows
    assert program.step._jitted._cache_size() == 2  # one program per batch shape, whatever the feed
    _, ref_losses = zoo.plain_steps(loss, params0, optimizer(), batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


@pytest.mark.parametrize("batch, message", [
    ({"x": np.zeros((16, 4)), "class_weight": np.ones((10,))},
     r"different row counts: batch 'class_weight' \(10,\), batch 'x' \(16, 4\); .* pass a per-step constant as a scalar"),
    ((np.zeros((12, 4)), np.zeros((12,))),
     r"batch '0' has 12 rows, which the 8 data-parallel devices \(mesh axes data x fsdp\) cannot split evenly; "
     r"use a multiple of 8: 8 or 16"),
    ({"inputs": {"tokens": np.zeros((8, 4)), "name": "abc"}},
     r"batch 'inputs/name' is a str; a batch holds arrays"),
])
def test_batches_the_step_cannot_split_are_refused_naming_the_leaf(nested_zero3, batch, message):
    program = nested_zero3[0]
    with pytest.raises((ValueError, TypeError), match=message):
        program.step(None, batch)  # refused before the state is looked at
    with pytest.raises((ValueError, TypeError), match=message):
        program.evaluate(None, batch)


def test_rows_that_microbatches_cannot_split_name_the_divisor():
    model = from_functions(init, BATCHES["tuple"][1])
    program = build(model, optax.sgd(0.1), make_layout(model, "zero2", make_mesh(FSDP8)), grad_accum=4)
    with pytest.raises(ValueError, match=r"batch '0' has 16 rows, which the 8 data-parallel devices \(mesh axes "
                                         r"fsdp\) times 4 microbatches cannot split evenly; use a multiple of 32: 32"):
        program.step(None, BATCHES["tuple"][0](0))


# ---------------------------------------------------------------- the parameters users bring


def _mixed_init(key):
    """linen params in bf16, a frozen table, an empty sub-tree and a None entry."""
    return {"model": jax.tree.map(lambda x: x.astype(jnp.bfloat16), init(key)),
            "frozen": {"table": jax.random.normal(key, (10, 10))}, "empty": {}, "unused": None}


def _mixed_loss(params, batch):
    logits = MODULE.apply({"params": params["model"]}, batch[0].astype(jnp.float32) / 255.0, batch[1], batch[2])
    return zoo.cross_entropy(logits @ jax.lax.stop_gradient(params["frozen"]["table"]), batch[3])


def test_bf16_none_empty_and_frozen_entries_train_and_restore_onto_another_mesh(tmp_path):
    """The default precision keeps float32 master weights: bf16 leaves are upcast at init (warned,
    naming them), and training matches the plain step over those float32 values."""
    model = from_functions(_mixed_init, _mixed_loss)
    with pytest.warns(UserWarning, match=r"precision 'f32' keeps float32 master weights: .* model/Dense_0/kernel \(bfloat16\)"):
        program = build(model, optimizer(), make_layout(model, "dp", make_mesh(DATA8)))
    state = program.init(jax.random.key(0))
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
    params0 = jax.tree.map(np.asarray, state.params)
    batches = [BATCHES["tuple"][0](i) for i in range(STEPS)]
    state, losses = _train(program, state, batches)
    ref_params, ref_losses = zoo.plain_steps(_mixed_loss, params0, optimizer(), batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    # no gradient reaches the table; AdamW's weight decay alone moves it, on both sides
    np.testing.assert_allclose(np.asarray(state.params["frozen"]["table"]), ref_params["frozen"]["table"], rtol=1e-6)
    assert state.params["empty"] == {} and state.params["unused"] is None
    target = build(model, optimizer(), make_layout(model, "zero3", make_mesh({"fsdp": 4}, devices=jax.devices()[:4])))
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.save(STEPS, state, data_state={}, config={}, force=True)
        ckpt.wait()
        restored, _, _ = ckpt.restore(target.abstract_state())
    assert jax.tree.structure(restored.params) == jax.tree.structure(state.params)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, restored.params), jax.tree.map(np.asarray, state.params))


def test_integer_parameters_are_refused_naming_the_leaf():
    counted = lambda key: {"model": init(key), "step": jnp.zeros((), jnp.int32), "index": jnp.arange(10)}
    model = from_functions(counted, lambda p, b: _loss(p["model"], *b))
    with pytest.raises(TypeError, match=r"non-float leaves, .*: index \(int32\[10\]\), step \(int32\[\]\); keep "
                                        r"integer data .* out of the parameters"):
        build(model, optax.sgd(0.1), make_layout(model, "zero3", make_mesh(FSDP8)))


def test_path_rules_with_unknown_names_or_dims_that_do_not_divide_are_loud():
    with pytest.warns(UserWarning, match=r"no strategy has a rule for these logical names, .*: "
                                         r"Dense_1/kernel \(80, 64\) dim 0 'embd'"):  # linen: the head is Dense_0
        typo = from_functions(init, BATCHES["tuple"][1], path_rules=[(r"Dense_1/kernel$", ("embd", "mlp"))])
        make_layout(typo, "zero3", make_mesh(FSDP8))  # where the rules are known
    # mlp=10 on a tensor=4 mesh: the tensor stays whole, warned about with its path, dim and size
    model = from_functions(init, BATCHES["tuple"][1], path_rules=[(r"kernel$", ("embed", "mlp"))])
    with pytest.warns(ReplicationWarning, match=r"Dense_0/kernel \(64, 10\) .*: dim 1 \(mlp=10\) not divisible by tensor=4"):
        make_layout(model, "tp", make_mesh({"data": 2, "tensor": 4}))
    with pytest.warns(ReplicationWarning, match=r"Dense_1/kernel \(80, 64\) .*no logical axis names"):
        make_layout(from_functions(init, BATCHES["tuple"][1]), "tp", make_mesh({"data": 4, "tensor": 2}))
    assert typo.logical_axes["Dense_1"]["kernel"] == ("embd", "mlp")


def test_the_pipelined_step_refuses_batches_it_cannot_cut():
    from tests.helpers import tiny_model

    model = tiny_model()
    program = build(model, optax.sgd(0.1), make_layout(model, "dp", make_mesh({"data": 4, "pipe": 2})))
    with pytest.raises(ValueError, match=r"the pipelined step \(pipe=2\) takes a flat dict of arrays"):
        program.step(None, {"inputs": {"tokens": np.zeros((8, 4), np.int32)}, "targets": np.zeros((8, 4), np.int32)})


class DropoutNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        return nn.Dense(8)(nn.Dropout(0.5, deterministic=not train)(nn.relu(nn.Dense(64)(x))))


def _dropout_loss(params, batch, call):
    """The TrainState way: ``rngs={"dropout": key}`` and ``train=`` handed to ``apply``."""
    out = DropoutNet().apply({"params": params}, batch["x"], call.train, rngs={"dropout": call.key} if call.train else {})
    return jnp.mean((out - batch["y"]) ** 2)


def test_from_functions_with_a_call_draws_the_documented_keys():
    """Device i of step s draws with fold_in(fold_in(seed, s), i) (docs/dropout-and-batchnorm.md, "Keys"):
    the reference computes each device's rows with that key on one device and averages."""
    init = lambda key: DropoutNet().init(key, np.zeros((2, 32), np.float32), False)["params"]
    model = from_functions(init, _dropout_loss, takes_call=True)
    program = build(model, optimizer(), make_layout(model, "zero3", make_mesh(FSDP8)))
    state = program.init(jax.random.key(0))
    params0, seed = jax.tree.map(np.asarray, state.params), jax.random.wrap_key_data(np.asarray(state.rng))
    batches = [zoo.regression_batch(i, ROWS) for i in range(STEPS)]
    state, losses = _train(program, state, batches)

    def reference(params, batch_and_step):
        batch, step = batch_and_step
        rows = jax.tree.map(lambda x: x.reshape(8, -1, *x.shape[1:]), batch)  # device i's rows
        keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.fold_in(seed, step), jnp.arange(8))
        return jnp.mean(jax.vmap(lambda r, k: _dropout_loss(params, r, Call(key=k)))(rows, keys))

    ref_params, ref_losses = zoo.plain_steps(reference, params0, optimizer(), [(b, s) for s, b in enumerate(batches)])
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    evaluation = float(program.evaluate(state.params, batches[0])["loss"])  # train=False, no key
    np.testing.assert_allclose(evaluation, float(_dropout_loss(ref_params, batches[0], Call(train=False))), rtol=1e-5)


# ---------------------------------------------------------------- token-masked losses: shardlib.global_mean

def _token_params(key):
    k1, k2 = jax.random.split(key)
    return {"embed": jax.random.normal(k1, (32, 16)) * 0.3, "out": jax.random.normal(k2, (16, 32)) * 0.3}


def _token_batch(seed: int, rows: int = ROWS):
    """Next-token targets under a padding mask whose valid count differs a lot between rows (1..12)."""
    rng = np.random.default_rng(seed)
    lengths = rng.permutation(np.arange(rows) % 12 + 1)
    return {"tokens": rng.integers(0, 32, size=(rows, 12), dtype=np.int32),
            "targets": rng.integers(0, 32, size=(rows, 12), dtype=np.int32),
            "mask": (np.arange(12)[None, :] < lengths[:, None]).astype(np.float32)}


def _token_ce(params, batch):
    logits = jnp.tanh(params["embed"][batch["tokens"]]) @ params["out"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])


def _masked_loss(params, batch):  # what the user writes: the mean over the valid tokens of the batch
    return shardlib.global_mean(_token_ce(params, batch), batch["mask"])


def _per_device_masked_loss(params, batch):  # the usual one-device formula, normalised by this device's tokens
    ce = _token_ce(params, batch)
    return (ce * batch["mask"]).sum() / batch["mask"].sum()


def _token_run(loss, strategy, sizes, grad_accum=1):
    return _trained(_token_params, loss, _token_batch, strategy, sizes, grad_accum)[1:]


MASKED_REFERENCE: dict = {}  # one one-device run for the three strategies (tests.zoo.shared_run)


@pytest.mark.parametrize("strategy,sizes", [("zero3", FSDP8), ("dp", DATA8), ("hsdp", DATA2_FSDP4)])
def test_global_mean_makes_a_token_masked_loss_equal_one_device(strategy, sizes):
    """The mean over the valid tokens of the whole batch, trained on 8 devices, equals plain jit on one
    (where global_mean is the weighted mean); the per-device formula does not (the reason it exists)."""
    params0, batches, state, losses = _token_run(_masked_loss, strategy, sizes)
    ref_params, ref_losses = zoo.shared_run(MASKED_REFERENCE, "masked", (params0, batches),
                                            lambda: zoo.plain_steps(_per_device_masked_loss, params0, optimizer(), batches))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), state.params, ref_params)
    if strategy == "zero3":  # every case splits the rows over 8 devices: the per-device formula's loss is one
        _, _, _, naive = _token_run(_per_device_masked_loss, strategy, sizes)
        assert abs(naive[0] - ref_losses[0]) > 1e-3 * abs(ref_losses[0])


def test_global_mean_under_grad_accum_is_the_mean_of_the_microbatch_means():
    """grad_accum=2 on data=8: each microbatch (every device's first / second half of its rows) is
    normalised by its own global token count, and the step averages the two."""
    params0, batches, _, losses = _token_run(_masked_loss, "dp", DATA8, grad_accum=2)
    per_device = ROWS // 8

    def half(batch, i):  # microbatch i: rows i*h .. (i+1)*h of each device's block of rows
        h = per_device // 2
        rows = np.concatenate([np.arange(d * per_device + i * h, d * per_device + (i + 1) * h) for d in range(8)])
        return jax.tree.map(lambda x: x[rows], batch)

    reference = lambda p, b: (_per_device_masked_loss(p, half(b, 0)) + _per_device_masked_loss(p, half(b, 1))) / 2
    _, ref_losses = zoo.plain_steps(reference, params0, optimizer(), batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


def test_global_sum_is_the_batchs_sum_in_the_step_under_grad_accum_and_in_evaluate():
    """A loss summed over the valid tokens and a token count, both with global_sum, on data=8 with
    grad_accum=2: losses and parameters are plain jit's of the summed loss over the whole batch, and
    the count is the batch's (a plain jnp.sum comes back as a device's share of a microbatch's)."""
    def loss(params, batch):
        return shardlib.global_sum(_token_ce(params, batch), batch["mask"]), {
            "tokens": shardlib.global_sum(batch["mask"]), "share": batch["mask"].sum()}

    program, params0, batches, state, losses = _trained(_token_params, loss, _token_batch, "dp", DATA8, grad_accum=2)
    summed = lambda p, b: (_token_ce(p, b) * b["mask"]).sum()
    ref_params, ref_losses = zoo.plain_steps(summed, params0, optimizer(), batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), state.params, ref_params)
    tokens = float(batches[0]["mask"].sum())
    _, metrics = program.step(program.init(jax.random.key(0)), batches[0])
    evaluation = program.evaluate(state.params, batches[0])
    assert (float(metrics["tokens"]), float(evaluation["tokens"])) == (tokens, tokens)
    np.testing.assert_allclose(float(metrics["share"]), tokens / 16, rtol=1e-6)  # 8 devices x 2 microbatches
    np.testing.assert_allclose(float(evaluation["loss"]), float(summed(ref_params, batches[0])), rtol=1e-5)
    np.testing.assert_allclose(shardlib.global_sum(batches[0]["mask"]), tokens)  # outside a step: the sum


def test_global_mean_outside_a_step_is_numpys_weighted_average():
    """One weight per row weighs all of that row's elements, as jnp.average with the weights broadcast."""
    values = np.random.default_rng(0).normal(size=(4, 3, 2)).astype(np.float32)
    rows = np.array([1.0, 0.0, 2.0, 3.0], np.float32)
    want = np.average(values, weights=np.broadcast_to(rows[:, None, None], values.shape))
    np.testing.assert_allclose(shardlib.global_mean(values, rows), want, rtol=1e-6)
    np.testing.assert_allclose(shardlib.global_mean(values), values.mean(), rtol=1e-6)


def test_global_mean_of_a_bf16_loss_sums_in_float32_and_an_empty_microbatch_adds_nothing():
    """A bf16 per-token loss (a model computing in bf16): the sums and the psum run in float32 (a bf16
    psum aborts XLA:CPU). A microbatch whose rows are all padding adds 0 instead of a 0/0 NaN."""
    bf16_loss = lambda p, b: shardlib.global_mean(_token_ce(p, b).astype(jnp.bfloat16), b["mask"])
    params0, batches, _, losses = _token_run(bf16_loss, "dp", DATA8)
    _, ref_losses = zoo.plain_steps(bf16_loss, params0, optimizer(), batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert jax.eval_shape(bf16_loss, params0, batches[0]).dtype == jnp.float32

    padded = dict(_token_batch(0))  # rows 1, 3, 5, ... (each device's second microbatch under K=2) all padding
    padded["mask"] = padded["mask"] * (np.arange(ROWS) % 2 == 0)[:, None]
    model = from_functions(_token_params, _masked_loss)
    program = build(model, optimizer(), make_layout(model, "dp", make_mesh(DATA8)), grad_accum=2)
    state = program.init(jax.random.key(0))
    start = jax.tree.map(np.asarray, state.params)
    _, metrics = program.step(state, padded)
    kept = jax.tree.map(lambda x: x[::2], padded)  # the microbatch with tokens, averaged with an empty one
    want = float(_per_device_masked_loss(start, kept)) / 2
    assert int(metrics["skipped"]) == 0
    np.testing.assert_allclose(float(metrics["loss"]), want, rtol=1e-5)


def test_host_rows_in_a_multi_process_job_are_refused_with_the_recipe(monkeypatch):
    """device_put would read each process's numpy rows as the whole batch; two processes (faked:
    the check reads jax.process_count) get the refusal, with how to build global arrays."""
    from shardlib.step import batch as batch_lib

    batch = {"x": np.ones((8, 3), np.float32), "temperature": np.float32(2.0), "y": jnp.ones((8,))}
    batch_lib._refuse_host_rows_across_processes(batch)  # one process: numpy rows are the global batch
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(TypeError, match=r"multi-process job \(2 processes\) .* batch 'x' are host arrays: .*"
                                        r"make_array_from_process_local_data"):
        batch_lib._refuse_host_rows_across_processes(batch)
    batch_lib._refuse_host_rows_across_processes({"y": jnp.ones((8,)), "temperature": np.float32(2.0)})
