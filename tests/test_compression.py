"""Compressed gradient reductions: accuracy bounds, error feedback, chunk layout and wire bytes.

Every reduction runs inside ``jax.shard_map`` over 8 simulated devices with the default VMA
checking that ``step.py`` uses. Per-device inputs are stacked on a leading device axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from shardlib.step import compression as C
from shardlib.tools.report import collective_stats

N = 8
BF16_UNIT_ROUNDOFF = 2.0 ** -8  # 8 significand bits


def mesh8():
    return jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,))


def gradients(shape, seed=0) -> np.ndarray:
    """Per-device gradients [N, *shape] whose magnitudes vary by 1e3 along the tensor, so blocks
    get very different scales (a single global scale would fail the per-block bound)."""
    rng = np.random.default_rng(seed)
    size = int(np.prod(shape))
    magnitude = np.logspace(-2, 1, size).reshape(shape)
    return (rng.standard_normal((N, *shape)) * magnitude).astype(np.float32)


def psum_fn(method, mesh=None, feedback=False):
    """jit(shard_map): per-device x [, residual] -> (sum (invariant), residual per device)."""
    def body(x, r=None):
        out, res = C.compressed_psum(x[0], "data", method, None if r is None else r[0])
        return out, (jnp.zeros_like(x) if res is None else res[None])

    in_specs = (P("data"), P("data")) if feedback else (P("data"),)
    return jax.jit(jax.shard_map(body, mesh=mesh or mesh8(), in_specs=in_specs, out_specs=(P(), P("data"))))


def scatter_fn(method, dim):
    """jit(shard_map): per-device x -> (this device's chunk, jax.lax.psum_scatter's chunk), stacked."""
    def body(x):
        mine, _ = C.compressed_psum_scatter(x[0], "data", dim, method)
        ref = jax.lax.psum_scatter(x[0], "data", scatter_dimension=dim % (x.ndim - 1), tiled=True)
        return mine[None], ref[None]

    return jax.jit(jax.shard_map(body, mesh=mesh8(), in_specs=P("data"), out_specs=(P("data"), P("data"))))


def block_scales(v: np.ndarray, plan: C.ChunkPlan) -> np.ndarray:
    """Each element's int8 step (max|block| / 127) for a flat vector, blocked as ``plan`` says."""
    padded = np.zeros(N * plan.chunk, np.float64)
    padded[:v.size] = np.abs(v)
    rows = np.zeros((N, plan.padded_chunk))
    rows[:, :plan.chunk] = padded.reshape(N, plan.chunk)
    scale = rows.reshape(N, plan.n_blocks, plan.block).max(-1, keepdims=True) / 127
    full = np.broadcast_to(scale, (N, plan.n_blocks, plan.block)).reshape(N, plan.padded_chunk)
    return full[:, :plan.chunk].reshape(-1)[:v.size]


def bf16_bound(x: np.ndarray) -> np.ndarray:
    """Rounding of the N inputs and of up to N partial sums (whatever order the backend adds in)."""
    return BF16_UNIT_ROUNDOFF * (N * np.abs(x).sum(0) + np.abs(x.astype(np.float64).sum(0)))


def int8_bound(x: np.ndarray, gather: bool) -> np.ndarray:
    """Half a quantisation step per device per element, plus half the gather's step (psum only)."""
    flat = x.reshape(N, -1).astype(np.float64)
    plan = C.plan_chunks(flat.shape[1], N, C.METHODS["int8"].block_size)
    local = sum(block_scales(flat[d], plan) for d in range(N)) / 2
    bound = local.copy()
    if gather:  # the reduced value is within `local` of the exact sum, so bound its block max
        bound += block_scales(np.abs(flat.sum(0)) + local, plan) / 2
    slack = 1e-6 * np.abs(flat).sum(0)  # float32 arithmetic of the dequantised sum
    return (bound + slack).reshape(x.shape[1:])


# ----------------------------------------------------------------------------------------------


def test_method_table_and_chunk_plan():
    assert set(C.METHODS) == {"none", "bf16", "int8"}
    assert [C.METHODS[m].needs_residual for m in ("none", "bf16", "int8")] == [False, False, True]
    assert C.METHODS["bf16"].comm_dtype == jnp.bfloat16 and C.METHODS["int8"].comm_dtype == np.int8
    assert C.get_compression("int8") is C.METHODS["int8"]
    with pytest.raises(ValueError, match="unknown gradient compression 'fp4'.*none, bf16, int8"):
        C.get_compression("fp4")
    # 3000 over 8: chunks of 375 in two even blocks of 188 (one padded element), not 2 x 256.
    assert C.plan_chunks(3000, 8, 256) == C.ChunkPlan(3000, 8, 375, 188, 2)
    assert C.plan_chunks(100, 8, 256) == C.ChunkPlan(100, 8, 13, 13, 1)
    assert C.plan_chunks(4096, 8, 256) == C.ChunkPlan(4096, 8, 512, 256, 2)
    assert C.plan_chunks(3, 8, 256).padded_chunk == 1


@pytest.mark.parametrize("shape", [(3000,), (7,), (3, 5, 7)])
def test_bf16_psum_within_bf16_rounding(shape):
    x = gradients(shape)
    out, _ = psum_fn("bf16")(x)
    exact = x.astype(np.float64).sum(0)
    err = np.abs(np.asarray(out, np.float64) - exact)
    assert out.shape == shape and out.dtype == np.float32
    assert np.all(err <= bf16_bound(x))
    if x.size > 100:  # it really went through bf16: far from float32 accuracy somewhere
        assert np.max(err / np.abs(x).sum(0)) > 1e-4


@pytest.mark.parametrize("shape", [(3000,), (7,), (1,), (3, 5, 7)])
def test_int8_psum_error_within_block_steps(shape):
    x = gradients(shape)
    out, residual = psum_fn("int8")(x)
    exact = x.astype(np.float64).sum(0)
    err = np.abs(np.asarray(out, np.float64) - exact)
    assert out.shape == shape and residual.shape == (N, *shape)
    assert np.all(err <= int8_bound(x, gather=True))
    if x.size > 100:
        assert np.max(err / np.abs(x).sum(0)) > 1e-4  # quantised for real
        # Per-block scales: the smallest-magnitude end is as accurate, relatively, as the largest
        # (a single scale for the whole tensor would wipe out the 1e-2 end entirely).
        head = x.size // N // 10
        relative = err.reshape(-1) / np.abs(x.reshape(N, -1)).sum(0)
        assert np.max(relative[:head]) < 0.05


def tiled_chunks(full: np.ndarray, dim: int) -> np.ndarray:
    """[N, *chunk]: device i's slice i of ``dim``, the layout psum_scatter(tiled=True) gives."""
    return np.stack(np.split(full, N, axis=dim))


@pytest.mark.parametrize("method", ["none", "bf16", "int8"])
@pytest.mark.parametrize("shape,dim", [((16, 12), 0), ((4, 16, 3), 1), ((5, 8), -1), ((24, 7), 0)])
def test_psum_scatter_matches_jax_layout(method, shape, dim):
    x = gradients(shape, seed=1)
    d = dim % len(shape)
    mine, ref = map(lambda a: np.asarray(a, np.float64), scatter_fn(method, dim)(x))
    exact = tiled_chunks(x.astype(np.float64).sum(0), d)
    assert mine.shape == ref.shape == exact.shape
    np.testing.assert_allclose(ref, exact, rtol=1e-5, atol=1e-5)  # pins down jax's layout
    if method == "none":
        np.testing.assert_array_equal(mine, ref)
        return
    if method == "bf16":
        bound = bf16_bound(x)
    else:  # int8 blocks follow the flattened order with the scattered dim moved to the front
        bound = np.moveaxis(int8_bound(np.moveaxis(x, d + 1, 1), gather=False), 0, d)
    assert np.all(np.abs(mine - exact) <= tiled_chunks(bound, d))
    assert np.abs(mine - exact).max() > 1e-4 * np.abs(x).max()  # compressed for real


def test_error_feedback_converges_to_the_exact_sum():
    """20 reductions of the same gradients: with feedback the running total converges to 20x
    the exact sum (the error telescopes to sum(r_0) - sum(r_T)); without it the error grows."""
    x = gradients((4000,), seed=2)
    exact = x.astype(np.float64).sum(0)
    with_fb, without_fb = psum_fn("int8", feedback=True), psum_fn("int8")
    residual = np.zeros_like(x)
    total_fb = np.zeros_like(exact)
    total_plain = np.zeros_like(exact)
    rel_fb, rel_plain = [], []
    for t in range(1, 21):
        out, residual = with_fb(x, residual)
        total_fb += np.asarray(out, np.float64)
        total_plain += np.asarray(without_fb(x)[0], np.float64)
        norm = np.linalg.norm(t * exact)
        rel_fb.append(np.linalg.norm(total_fb - t * exact) / norm)
        rel_plain.append(np.linalg.norm(total_plain - t * exact) / norm)
        # The exact bookkeeping identity: what was lost so far is what the residuals hold.
        np.testing.assert_allclose(total_fb - t * exact, -np.asarray(residual, np.float64).sum(0),
                                   atol=2e-5 * t * np.abs(x).sum(0).max())
    assert rel_plain[-1] == pytest.approx(rel_plain[0], rel=1e-6)  # no feedback: error stays put
    assert rel_fb[0] == pytest.approx(rel_plain[0], rel=1e-6)  # same first step
    assert rel_fb[4] < rel_fb[0] / 2 and rel_fb[-1] < rel_fb[4] / 2  # ~1/T
    assert rel_fb[-1] < rel_plain[-1] / 8
    assert np.all(np.abs(residual) <= 2 * int8_bound(x, gather=True))  # residuals stay bounded


def test_tuple_and_subset_axes_on_2d_mesh():
    """Over ("data", "fsdp") the chunk order is jax's linear order; over "fsdp" alone each data
    row reduces separately and the result stays per data row."""
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    x = gradients((16, 5), seed=3)  # 8 devices

    def body(x):
        mine, _ = C.compressed_psum_scatter(x[0], ("data", "fsdp"), 0, "int8")
        ref = jax.lax.psum_scatter(x[0], ("data", "fsdp"), scatter_dimension=0, tiled=True)
        part, _ = C.compressed_psum(x[0], "fsdp", "int8")
        return mine[None], ref[None], part[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("data", "fsdp")),
                              out_specs=(P(("data", "fsdp")), P(("data", "fsdp")), P("data"))))
    mine, ref, part = map(np.asarray, f(x))
    scale = np.abs(x).sum(0).max()
    np.testing.assert_allclose(mine, ref, atol=0.02 * scale)
    rows = x.reshape(2, 4, 16, 5).astype(np.float64).sum(1)
    np.testing.assert_allclose(part, rows, atol=0.02 * scale)
    assert np.abs(part - rows).max() > 0  # quantised, not exact


def test_inside_partially_manual_shard_map_with_tensor_axis():
    """As step.py runs it for fsdp_tp: manual over the batch axis, the tensor axis left to GSPMD."""
    mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
    x = gradients((8, 6), seed=4)[:4]  # 4 data shards of an [8, 6] gradient

    def body(x):
        out, res = C.compressed_psum(x[0], "data", "int8")
        chunk, _ = C.compressed_psum_scatter(x[0], "data", 0, "int8")
        return out, chunk

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=(P(), P("data")), axis_names={"data"}))
    x_sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("data", None, "tensor")))
    out, chunk = map(np.asarray, f(x_sharded))
    exact = x.astype(np.float64).sum(0)
    np.testing.assert_allclose(out, exact, atol=0.03 * np.abs(x).sum(0).max())
    np.testing.assert_allclose(chunk, exact, atol=0.03 * np.abs(x).sum(0).max())


@pytest.mark.parametrize("method", ["bf16", "int8"])
def test_non_finite_gradients_stay_non_finite(method):
    """The step skips updates on a non-finite gradient norm: compression must not hide an inf."""
    x = gradients((600,), seed=5)
    x[3, 17] = np.inf
    x[5, 400] = np.nan
    out = np.asarray(psum_fn(method)(x)[0])
    assert not np.isfinite(out[17]) and not np.isfinite(out[400])


def test_no_communication_and_input_errors():
    x = jnp.arange(6.0).reshape(2, 3)
    out, residual = C.compressed_psum(x, (), "int8")  # no axes: the value itself, exactly
    np.testing.assert_array_equal(out, x)
    np.testing.assert_array_equal(residual, np.zeros((2, 3)))
    assert C.compressed_psum(x, (), "bf16")[1] is None

    def scatter_bad(x):
        return C.compressed_psum_scatter(x[0], "data", 1, "int8")[0][None]

    with pytest.raises(ValueError, match=r"dimension 1 .* size 3, which does not divide by the 8 devices"):
        jax.shard_map(scatter_bad, mesh=mesh8(), in_specs=P("data"), out_specs=P("data"))(np.zeros((8, 8, 3), np.float32))

    def bad_residual(x):
        return C.compressed_psum(x[0], "data", "int8", residual=jnp.zeros((4,)))[0]

    with pytest.raises(ValueError, match=r"residual has shape \(4,\) but the gradient has \(8, 3\)"):
        jax.shard_map(bad_residual, mesh=mesh8(), in_specs=P("data"), out_specs=P())(np.zeros((8, 8, 3), np.float32))
    with pytest.raises(ValueError, match="kind must be one of"):
        C.wire_bytes(100, 8, "int8", "all_reduce")


def _lowered_bytes(method: str, kind: str, shape: tuple[int, ...]) -> int:
    def body(x):
        if kind == "psum":
            return C.compressed_psum(x[0], "data", method)[0]
        return C.compressed_psum_scatter(x[0], "data", len(shape) - 1, method)[0][None]

    out_spec = P() if kind == "psum" else P("data")
    f = jax.jit(jax.shard_map(body, mesh=mesh8(), in_specs=P("data"), out_specs=out_spec))
    # Pre-optimisation HLO: XLA:CPU upcasts bf16 collectives to f32 when it optimises.
    lowered = f.lower(jax.ShapeDtypeStruct((N, *shape), jnp.float32))
    return collective_stats(lowered).total_bytes


@pytest.mark.parametrize("kind", ["psum", "psum_scatter"])
def test_wire_bytes_match_hlo_and_savings(kind):
    shape, odd = (256, 256), (3, 1000)  # odd: 3000 elements, chunks and blocks that pad
    measured = {m: _lowered_bytes(m, kind, shape) for m in C.METHODS}
    for method, got in measured.items():
        # The formula is exact (measured: 0 bytes apart for every method, kind and shape).
        assert got == C.wire_bytes(256 * 256, N, method, kind)
        assert _lowered_bytes(method, kind, odd) == C.wire_bytes(3000, N, method, kind)
    ratio_bf16 = measured["none"] / measured["bf16"]
    ratio_int8 = measured["none"] / measured["int8"]
    print(f"\n{kind} of 65536 f32 over {N}: none {measured['none']} B, bf16 {measured['bf16']} B "
          f"({ratio_bf16:.2f}x less), int8 {measured['int8']} B ({ratio_int8:.2f}x less)")
    assert ratio_bf16 == pytest.approx(2.0, rel=0.01)
    assert 3.8 < ratio_int8 < 4.0  # 4x minus one float32 scale per 256 int8 values
    assert C.wire_bytes(256 * 256, 1, "int8", kind) == 0.0
