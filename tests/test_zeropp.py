"""ZeRO++ under zero3: the int8 weight all-gather (qwZ) and the compressed gradient reduce-scatter
in the gather's own backward (qgZ), checked against HLO bytes, a plain jit + optax reference that
quantises the weights as the formula says, and the error-feedback identity."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from shardlib import build, make_layout, make_mesh
from shardlib.models import GPT, next_token_loss
from shardlib.step import zeropp
from shardlib.tools.hlo import collective_stats
from shardlib.tools.memory import memory_stats
from tests import zoo
from tests.helpers import BATCH, SEQ, TINY, batches, optimizer, tiny_model

STEPS, N, BLOCK = 3, 8, 256


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def layout(model):
    return make_layout(model, "zero3", make_mesh({"fsdp": N}))


def _run(model, layout, **options):
    """(collectives, per-step losses, final state) of STEPS steps, run by the one compiled step."""
    program = build(model, optimizer(), layout, **options)
    state = program.init(jax.random.key(0))
    compiled = program.compile_step(state, batches(1)[0])
    losses = []
    for rows in batches(STEPS):
        state, metrics = compiled(state, rows)
        losses.append(float(metrics["loss"]))
    return collective_stats(compiled), np.array(losses), state, memory_stats(compiled).argument_bytes


@pytest.fixture(scope="module")
def plain(model, layout):
    program = build(model, optimizer(), layout)  # read, not run: its abstract state, so init is not compiled
    return collective_stats(program.compile_step(program.abstract_state(), batches(1)[0]))


@pytest.fixture(scope="module")
def qwz(model, layout):
    return _run(model, layout, weight_gather="int8")


@pytest.fixture(scope="module")
def both(model, layout):
    return _run(model, layout, weight_gather="int8", grad_compression="int8")


# ------------------------------------------------------------------ bytes in the compiled step


def test_qwz_gathers_int8_at_most_0_3_of_f32(plain, qwz):
    """int8 codes + one float32 scale per 256-element block: (256 + 4) / 1024 = 0.254 of f32."""
    gathers = qwz[0].of_kind("all-gather")
    assert {r.dtype for r in plain.of_kind("all-gather")} == {"f32"}
    assert {r.dtype for r in gathers} == {"s8", "f32"}  # codes and their scales
    ratio = qwz[0].bytes_by_kind()["all-gather"] / plain.bytes_by_kind()["all-gather"]
    assert 0.25 <= ratio <= 0.3
    assert qwz[0].bytes_by_kind()["reduce-scatter"] == plain.bytes_by_kind()["reduce-scatter"]  # qwZ alone: f32


def test_qgz_reduce_scatters_int8_at_most_0_3_of_f32(plain, both):
    """qgZ's reduce-scatter is compression's int8 all-to-all of blocks and scales."""
    sent = both[0].bytes_by_kind()
    assert sent["reduce-scatter"] == 0
    assert {r.dtype for r in both[0].of_kind("all-to-all")} == {"s8", "f32"}
    assert 0.25 <= sent["all-to-all"] / plain.bytes_by_kind()["reduce-scatter"] <= 0.3


def _int8_bytes(record) -> float:
    """docs/zeropp.md's formula for the int8 form of one float32 gather (or reduce-scatter) record:
    per device s = S / N elements in n_b = ceil(s / 256) even blocks of b, each b bytes + a 4-byte
    scale, sent with the ring's (N - 1) / N."""
    n = record.group_size
    s = record.buffer_bytes // 4 // n
    n_b = -(-s // BLOCK)
    b = -(-s // n_b)
    return record.multiplicity * (n - 1) / n * n * n_b * (b + 4)


def test_bytes_match_the_block_formula(plain, qwz, both):
    """Every f32 gather of plain zero3, in int8 blocks, adds up to qwZ's gather bytes; every
    reduce-scatter to qgZ's all-to-all bytes (README strategy table, docs/zeropp.md)."""
    gathers = sum(_int8_bytes(r) for r in plain.of_kind("all-gather"))
    scatters = sum(_int8_bytes(r) for r in plain.of_kind("reduce-scatter"))
    assert qwz[0].bytes_by_kind()["all-gather"] == pytest.approx(gathers, rel=1e-6)
    assert both[0].bytes_by_kind()["all-to-all"] == pytest.approx(scatters, rel=1e-6)


def test_persistent_bytes_match_the_table(model, qwz, both):
    """README rows: qwZ keeps zero3's 12 Psi / N; qgZ int8 adds each device's f32 residual of its
    whole local gradient, 4 Psi (every tiny GPT parameter is gathered under zero3)."""
    psi = sum(x.size for x in jax.tree.leaves(model.abstract()))
    rows = 2 * BATCH * SEQ * 4 // N  # this device's int32 inputs and targets
    assert qwz[3] - rows == pytest.approx(12 * psi / N, rel=0.02)
    assert both[3] - rows == pytest.approx(12 * psi / N + 4 * psi, rel=0.02)


# ------------------------------------------------------------------ training against a reference


def _quantised(x: jax.Array, dim: int) -> jax.Array:
    """The formula: each of the N shards of ``dim``, flattened, in the fewest equal blocks of at
    most 256 elements; codes round(x / s) with s = max|block| / 127; dequantised codes * s."""
    shards = jnp.moveaxis(x.reshape(*x.shape[:dim], N, -1, *x.shape[dim + 1:]), dim, 0)
    flat = shards.reshape(N, -1)
    n_blocks = -(-flat.shape[1] // BLOCK)
    block = -(-flat.shape[1] // n_blocks)
    rows = jnp.pad(flat, ((0, 0), (0, n_blocks * block - flat.shape[1]))).reshape(N, n_blocks, block)
    scale = jnp.max(jnp.abs(rows), axis=-1, keepdims=True) / 127
    codes = jnp.where(scale > 0, jnp.round(rows / jnp.where(scale > 0, scale, 1.0)), 0.0)
    out = (codes * scale).reshape(N, -1)[:, :flat.shape[1]].reshape(shards.shape)
    return jnp.moveaxis(out, 0, dim).reshape(x.shape)


def _straight_through(layout):
    """params -> params as qwZ computes with them; gradients pass straight through (the gather's
    backward is the plain reduce-scatter of the gradient at the quantised weights)."""
    specs = {jax.tree_util.keystr(path): spec for path, spec in
             jax.tree_util.tree_flatten_with_path(layout.manual(layout.params))[0]}

    def one(path, w):
        spec = specs[jax.tree_util.keystr(path)]
        dims = [d for d, axes in enumerate(spec) if axes]
        if not dims:
            return w
        stacked = "blocks" in jax.tree_util.keystr(path)
        dim = dims[0] - stacked
        return jax.vmap(lambda x: _quantised(x, dim))(w) if stacked else _quantised(w, dim)

    @jax.custom_vjp
    def quantise(params):
        return jax.tree_util.tree_map_with_path(one, params)

    quantise.defvjp(lambda p: (quantise(p), None), lambda _, g: (g,))
    return quantise


def test_qwz_trains_like_a_plain_step_on_quantised_weights(layout, qwz):
    """The same AdamW steps on one device, the loss taken at the formula's quantised weights:
    agreement to the parity tests' float32 summation-order tolerance (docs/design.md)."""
    params, _, loss = zoo.nnx_functional(lambda rngs: GPT(TINY, rngs=rngs), lambda m, b: next_token_loss(m, b)[0],
                                         seed=jax.random.key(0))
    quantise = _straight_through(layout)
    _, losses = zoo.plain_steps(lambda p, b: loss(quantise(p), None, b)[0], params, optimizer(), batches(STEPS))
    np.testing.assert_allclose(qwz[1], losses, rtol=1e-5)


def test_qgz_trains_like_qwz_alone_and_keeps_residuals(layout, qwz, both):
    """Measured: the losses of steps 2 and 3 within 1.9e-4 and 3.4e-4 of qwZ alone's. Over three
    steps the error feedback barely acts (3.1e-4 without it): its test is the identity below."""
    losses, state = both[1], both[2]
    assert losses[0] == pytest.approx(qwz[1][0], rel=1e-6)  # the first loss precedes any reduction
    np.testing.assert_allclose(losses, qwz[1], rtol=1e-3)
    gathered = {jax.tree_util.keystr(p) for p, s in jax.tree_util.tree_flatten_with_path(
        layout.manual(layout.params))[0] if any(s)}
    flat_params = dict(jax.tree_util.tree_flatten_with_path(state.params)[0])
    for path, residual in jax.tree_util.tree_flatten_with_path(state.grad_residual)[0]:
        if jax.tree_util.keystr(path) in gathered:  # the whole local gradient, one per device
            param = flat_params[path]
            assert residual.shape == (N, *param.shape) and residual.sharding.spec[0] == "fsdp"
            assert residual.addressable_shards[0].data.shape == (1, *param.shape)
            assert float(jnp.abs(residual).max()) > 0


# ------------------------------------------------------------------ the gather on its own


@functools.lru_cache(maxsize=None)
def _feedback_run(steps: int, feedback: bool):
    """``steps`` backward passes of the qgZ gather of one [64, 8] shard per device, each device
    with its own cotangent: (sum of the reduced shards, exact sum, largest block scale)."""
    mesh = make_mesh({"fsdp": N})
    policy = zeropp.GatherPolicy(zeropp.get_weight_gather("int8"), zeropp.compression_lib.get_compression("int8"))

    def body(x, ct):
        def one(carry, _):
            total, residual = carry
            _, vjp = jax.vjp(lambda s, r: zeropp.gather_dim(s, r, ("fsdp",), 0, policy), x, residual)
            grad, new = vjp(ct[0])
            return (total + grad, new if feedback else residual), None

        start = (jnp.zeros_like(x), jnp.zeros((N * x.shape[0], x.shape[1]), jnp.float32))
        (total, _), _ = jax.lax.scan(one, start, length=steps)
        exact = jax.lax.psum_scatter(ct[0], "fsdp", scatter_dimension=0, tiled=True)
        scale = jax.lax.pmax(jnp.max(jnp.abs(ct[0])) / 127, "fsdp")
        return total, steps * exact, scale

    x = jnp.zeros((N * 64, 8), jnp.float32)
    ct = jax.random.normal(jax.random.key(1), (N, N * 64, 8)) * jnp.linspace(0.1, 3.0, N)[:, None, None]
    out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("fsdp"), P("fsdp")),
                                out_specs=(P("fsdp"), P("fsdp"), P()), check_vma=False))(x, ct)
    return tuple(np.asarray(o) for o in out)


def test_error_feedback_keeps_the_accumulated_error_bounded():
    """Sum of T reduced outputs = T * exact - sum over devices of the last residuals, each
    element of which is at most half a block scale: the error stays under N * scale / 2 for any
    T, while without feedback it grows with T."""
    total, exact, scale = _feedback_run(8, True)
    err = np.abs(total - exact).max()
    assert err <= N * float(scale) / 2
    no_feedback = np.abs(np.subtract(*_feedback_run(8, False)[:2])).max()
    assert err < no_feedback / 2


def test_bf16_shard_gathers_back_to_bf16_within_half_a_step():
    """Under precision='bf16' with the cast first the shard is bf16: quantised from it, returned in it."""
    mesh = make_mesh({"fsdp": N})
    x = jax.random.normal(jax.random.key(2), (N * 32, 16)).astype(jnp.bfloat16)
    gather = lambda s: zeropp.gather_spec(s, P("fsdp"), zeropp.GatherPolicy(zeropp.get_weight_gather("int8")))
    out = jax.jit(jax.shard_map(gather, mesh=mesh, in_specs=P("fsdp"), out_specs=P(), check_vma=False))(x)
    assert out.dtype == jnp.bfloat16
    blocks = np.asarray(x, np.float32).reshape(N, -1, BLOCK)  # 512-element shards: two blocks each
    half_step = (np.abs(blocks).max(axis=-1, keepdims=True) / 127 / 2 * np.ones_like(blocks)).reshape(x.shape)
    bf16_rounding = np.abs(np.asarray(x, np.float32)) * 2.0**-8
    assert np.all(np.abs(np.asarray(out, np.float32) - np.asarray(x, np.float32)) <= half_step + bf16_rounding)


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize("strategy, mesh, options, named", [
    ("dp", {"data": N}, {"weight_gather": "int8"}, "weight_gather='int8'"),
    ("zero3", {"fsdp": N}, {"grad_compression": "int8", "grad_accum": 2}, "grad_accum=1"),
    ("zero3", {"fsdp": N}, {"weight_gather": "fp4"}, "weight gather"),
    ("fsdp_tp", {"fsdp": 4, "tensor": 2}, {"weight_gather": "int8"}, "tensor=1"),
])
def test_refusals_name_the_option(model, strategy, mesh, options, named):
    with pytest.raises(ValueError, match=named):
        build(model, optimizer(), make_layout(model, strategy, make_mesh(mesh)), **options)
