"""The step's gradient reductions: how often each runs, over which axes, and where their state lives.

* hsdp with gradient accumulation sums over the slow ``data`` axis once per step (not once per
  microbatch), on the 1/F shard, and still trains like one large batch;
* a state table that shards two dims over batch axes is reduce-scattered on both;
* int8 residuals are sharded like the local gradient they correct, and count in argument bytes;
* hsdp's data-axis all-reduce can be compressed; a pipelined step compresses in bf16.
"""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from shardlib import build, from_functions, make_layout, make_mesh
from shardlib.models import trainable
from shardlib.sharding.rules import is_layout
from shardlib.sharding.strategies import get_strategy
from shardlib.tools.report import collective_stats
from tests.helpers import TINY, batches, optimizer, tiny_model, train

HSDP_MESH = {"data": 2, "fsdp": 4}


def _train(program, steps=2, batch=16, init_of=None):
    """``train``, started by ``init_of``'s init where given: a program whose step alone differs
    (compression, microbatches) has a byte-identical init program, compiled once this way."""
    return train(program if init_of is None else dataclasses.replace(program, init=init_of.init), steps, batch)


def _plain_reference(model, steps=2, batch=16):
    """One device, plain ``jax.jit(jax.value_and_grad)`` + optax on the model's pure loss."""
    tx = optimizer()
    params = jax.jit(model.init)(jax.random.key(0))
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, rows):
        loss, grads = jax.value_and_grad(lambda p: model.loss(p, rows, None)[0])(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for rows in batches(steps, batch=batch):
        params, opt_state, loss = step(params, opt_state, rows)
        losses.append(float(loss))
    return np.array(losses), jax.tree.map(np.asarray, params)


def _assert_trains_like(got, ref):
    """Same as tests/test_parity.py: another summation order moves float32 in its last bits only."""
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(ref[1])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _lowered(program, rows=16):
    shapes = {k: ((rows, 32), jnp.int32) for k in ("inputs", "targets")}
    return program.step.lower(program.abstract_state(), program.abstract_batch(shapes))


def _shard_bytes(layout, mesh, axis):
    """Bytes of one device's shard of the parameters stored over ``axis`` (float32)."""
    leaves = jax.tree.leaves(layout.params, is_leaf=is_layout)
    return sum(leaf.bytes() // mesh.shape[axis] for leaf in leaves if axis in jax.tree.leaves(tuple(leaf.spec)))


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def reference(model):
    return _plain_reference(model)


@pytest.fixture(scope="module")
def hsdp(model):
    """hsdp programs by gradient accumulation (1: the plain step), built once: the sums test
    compiles a step for 16 rows, which the training tests then run without compiling it again."""
    programs = {}

    def program(grad_accum=1):
        if grad_accum not in programs:
            programs[grad_accum] = build(model, optimizer(), make_layout(model, "hsdp", make_mesh(HSDP_MESH)),
                                         grad_accum=grad_accum)
        return programs[grad_accum]

    return program


# ---------------------------------------------------------------- 1. hsdp x grad_accum


@pytest.mark.parametrize("k", [1, 2])  # 2: a reduction per microbatch would show multiplicity 2
def test_hsdp_accumulation_sums_over_data_once_per_step(hsdp, k):
    program = hsdp(k)
    layout, mesh = program.layout, program.mesh
    stats = collective_stats(_lowered(program).compile())
    over_data = [r for r in stats.of_kind("all-reduce") if r.group_size == HSDP_MESH["data"]]
    assert over_data and all(r.multiplicity == 1 for r in over_data), stats.table()
    # One ring all-reduce of the 1/F shard of every fsdp-stored parameter: 2 (D-1)/D S.
    expected = 2 * (HSDP_MESH["data"] - 1) / HSDP_MESH["data"] * _shard_bytes(layout, mesh, "fsdp")
    assert sum(r.bytes_per_step for r in over_data) == pytest.approx(expected, rel=1e-3), stats.table()


def test_hsdp_accumulation_trains_like_one_batch(hsdp, reference):
    _assert_trains_like(_train(hsdp(2), init_of=hsdp(1)), reference)


# ---------------------------------------------------------------- 2. two state-sharded dims


def _two_dim_strategy():
    """State rules that shard a weight's embed dim over data and its mlp / heads / vocab dim over fsdp."""
    base = get_strategy("zero1")
    rules = (("embed", "data"), ("mlp", "fsdp"), ("heads", "fsdp"), ("vocab", "fsdp"))
    return base.with_rules(name="zero1_two_dims", state_rules=rules)


def test_state_sharded_on_two_dims_is_reduce_scattered_on_both(model, reference):
    layout = make_layout(model, _two_dim_strategy(), make_mesh(HSDP_MESH))
    two = [l for l in jax.tree.leaves(layout.state, is_leaf=is_layout) if sum(e is not None for e in l.spec) == 2]
    assert two, "the table should shard some tensor on two dims"
    program = build(model, optimizer(), layout)
    losses, params, state = _train(program)
    _assert_trains_like((losses, params), reference)
    # The optimizer state really lives in the table's layout, both dims sharded where it says.
    for moment, leaf in zip(jax.tree.leaves(state.opt_state[0].mu), jax.tree.leaves(layout.state, is_leaf=is_layout)):
        assert moment.sharding.spec == leaf.spec, leaf.path


# ---------------------------------------------------------------- 3. int8 residual layout and bytes


def _argument_bytes(model, strategy, sizes, method):
    program = build(model, optimizer(), make_layout(model, strategy, make_mesh(sizes)), grad_compression=method)
    return _lowered(program).compile().memory_analysis().argument_size_in_bytes, program


@pytest.mark.parametrize("strategy", ["dp", "tp"])
def test_int8_residuals_are_sharded_like_the_gradient_and_counted(model, strategy):
    sizes = {"data": 4, "tensor": 2}
    with_residuals, program = _argument_bytes(model, strategy, sizes, "int8")
    without, _ = _argument_bytes(model, strategy, sizes, "none")
    mesh = program.mesh
    # One float32 residual per data device, each sharded over tensor as its parameter is.
    expected = 0
    for leaf in jax.tree.leaves(program.layout.params, is_leaf=is_layout):
        split = int(np.prod([mesh.shape[a] for a in jax.tree.leaves(tuple(leaf.spec)) if a is not None]))
        expected += 4 * int(np.prod(leaf.shape)) // split
    assert with_residuals - without == expected
    for residual, leaf in zip(jax.tree.leaves(program.state_sharding.grad_residual),
                              jax.tree.leaves(program.layout.params, is_leaf=is_layout)):
        assert residual.spec == jax.sharding.PartitionSpec("data", *leaf.spec)


def test_hsdp_int8_residuals_hold_the_fsdp_shard(model):
    program = build(model, optimizer(), make_layout(model, "hsdp", make_mesh(HSDP_MESH)), grad_compression="int8")
    abstract = program.abstract_state()
    for residual, param in zip(jax.tree.leaves(abstract.grad_residual), jax.tree.leaves(abstract.params)):
        assert residual.shape == (HSDP_MESH["data"], *param.shape)
        # per device: exactly the local gradient, i.e. this device's shard of the parameter
        assert residual.sharding.shard_shape(residual.shape) == (1, *param.sharding.shard_shape(param.shape))


def test_int8_says_where_a_second_reduction_sends_bf16():
    """Optimizer state sharded over fsdp only (a rule of the user's), parameters whole: the gradient is
    reduce-scattered over fsdp in int8 with its residual, then summed over data in bf16. Said at build."""
    model = from_functions(lambda k: {"w": jax.random.normal(k, (16, 64))},
                           lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2), logical_axes={"w": ("embed", "mlp")})
    strategy = get_strategy("zero2").with_rules(state_rules=(("mlp", "fsdp"),), state_fallback=())
    layout = make_layout(model, strategy, make_mesh(HSDP_MESH))
    with pytest.warns(UserWarning, match=r"grad_compression='int8'.*second sends bf16.*: w\b.*optimizer state"):
        program = build(model, optimizer(), layout, grad_compression="int8")
    stats = collective_stats(program.step.lower(program.abstract_state(), program.abstract_batch({"x": ((16, 16), jnp.float32)})))
    assert {r.dtype for r in stats.records if r.group_size == HSDP_MESH["data"]} == {"bf16"}
    assert "s8" in {r.dtype for r in stats.records if r.group_size == HSDP_MESH["fsdp"]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the built-in strategies shard the state over every batch axis
        build(model, optimizer(), make_layout(model, "zero2", make_mesh(HSDP_MESH)), grad_compression="int8")


# ---------------------------------------------------------------- 5. hsdp's data all-reduce compressed


def test_hsdp_compresses_its_data_all_reduce(model, hsdp):
    plain = hsdp(1)
    program = build(model, optimizer(), plain.layout, grad_compression="bf16")
    # Pre-optimisation HLO (XLA:CPU upcasts bf16 collectives when it optimises; GPU/TPU do not).
    stats = collective_stats(_lowered(program))
    over_data = [r for r in stats.records if r.group_size == HSDP_MESH["data"]]
    assert {r.kind for r in over_data} == {"all-to-all", "all-gather"} and {r.dtype for r in over_data} == {"bf16"}
    losses, _, _ = _train(program, steps=5, init_of=plain)
    reference_losses, _, _ = _train(plain, steps=5)
    assert losses[0] == reference_losses[0]  # the first loss is computed before any reduction
    # bf16 sends each partial gradient with a relative error <= 2^-9 (see the pipelined test for
    # why single parameters may still differ more); 4 updates at lr 3e-3 then move the loss by a
    # few 1e-5 relative (measured 1.3e-5 for the pipelined case), well inside 1e-4.
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-4)


def test_hsdp_on_one_data_device_compresses_in_the_gathers_backward(model):
    """No data axis to compress over: the fsdp reduce-scatter itself goes bf16, written in the
    weight gather's backward (qgZ, `shardlib.step.zeropp`), as a bf16 all-to-all."""
    program = build(model, optimizer(), make_layout(model, "hsdp", make_mesh({"fsdp": 8})), grad_compression="bf16")
    shapes = {k: ((16, 32), jnp.int32) for k in ("inputs", "targets")}
    stats = collective_stats(program.step.lower(program.abstract_state(), program.abstract_batch(shapes)))
    assert not stats.of_kind("reduce-scatter") and {r.dtype for r in stats.of_kind("all-to-all")} == {"bf16"}


# ---------------------------------------------------------------- 6. pipeline x bf16 compression


def test_pipelined_step_compresses_in_bf16():
    model = trainable(dataclasses.replace(TINY, n_layers=4))
    mesh = make_mesh({"data": 4, "pipe": 2})
    programs = {m: build(model, optimizer(), make_layout(model, "dp", mesh), microbatches=4, grad_compression=m)
                for m in ("none", "bf16")}
    stats = collective_stats(_lowered(programs["bf16"], rows=32))
    over_data = [r for r in stats.records if r.group_size == 4 and r.kind != "all-reduce"]
    assert over_data and {r.dtype for r in over_data} == {"bf16"}, stats.table()
    plain_bytes = sum(r.bytes_per_step for r in collective_stats(_lowered(programs["none"], rows=32)).records
                      if r.group_size == 4)
    assert sum(r.bytes_per_step for r in over_data) < 0.6 * plain_bytes  # ~half: bf16 instead of float32
    (losses, params, _), (ref_losses, ref_params, _) = (_train(programs[m], steps=5, batch=32, init_of=programs["none"])
                                                        for m in ("bf16", "none"))
    start = jax.tree.map(np.asarray, programs["none"].init(jax.random.key(0)).params)
    assert losses[0] == ref_losses[0]  # computed before any reduction
    # bf16 keeps 8 significant bits: each partial gradient is sent with a relative error <= 2^-9.
    # Where the partial gradients cancel, that error is large next to their sum, and Adam's
    # normalisation turns it into an update change of up to lr for that element; so single
    # elements may differ by a few lr * 2^-k, while the parameters as a whole must move as the exact
    # run moves them: the mean difference stays a small fraction of the mean parameter change.
    diff = np.mean([np.mean(np.abs(a - b)) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params))])
    moved = np.mean([np.mean(np.abs(b - s)) for b, s in zip(jax.tree.leaves(ref_params), jax.tree.leaves(start))])
    assert diff < 0.01 * moved  # measured 0.09%
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)  # measured 1.3e-5
