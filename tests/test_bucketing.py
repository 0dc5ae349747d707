"""Gradient buckets (`shardlib.step.buckets`, ``build(bucket_bytes=)``): the same shards as one
collective per tensor, the same bytes on the wire, fewer collectives, and the same training.

The unbucketed step (``bucket_bytes=0``) is the reference here: it is itself parity-tested
against plain ``jax.jit`` + optax in tests/test_parity.py.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from shardlib import build, make_layout, make_mesh
from shardlib.step import buckets as buckets_lib
from shardlib.step.reduce import Reducer
from shardlib.tools.report import collective_stats
from tests.helpers import batches, optimizer, tiny_model

MESHES = {"dp": {"data": 8}, "zero1": {"fsdp": 8}, "zero2": {"fsdp": 8}, "hsdp": {"data": 2, "fsdp": 4},
          "tp": {"data": 2, "tensor": 4}}  # tp: tensor-sharded gradients stay out of buckets (no resharding)
STEPS = 2


# ---------------------------------------------------------------- the bucket collectives alone


def test_pack_fills_buckets_in_order_and_puts_large_tensors_alone():
    assert buckets_lib.pack([4, 4, 4, 20, 4], limit=10) == [[0, 1], [2], [3], [4]]
    assert buckets_lib.pack([], limit=10) == []


def _per_device(fn, xs):
    """Run ``fn`` on 8 devices, each with its own copy of ``xs`` (device i: xs * (i + 1))."""
    mesh = make_mesh({"data": 8})
    stacked = [np.stack([np.asarray(x) * (i + 1) for i in range(8)]) for x in xs]  # on the host: no eager compiles

    @partial(jax.shard_map, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    def run(args):
        return [out[None] for out in fn([a[0] for a in args])]

    return [np.asarray(o) for o in jax.jit(run)(stacked)]


SHAPES_DIMS = [((16, 3), 0), ((5, 8, 2), 1), ((4, 24), 1), ((8,), 0)]


def test_bucketed_psum_scatter_gives_each_device_the_per_tensor_shards():
    rng = np.random.default_rng(0)
    xs = [jnp.asarray(rng.normal(size=shape), jnp.float32) for shape, _ in SHAPES_DIMS]
    dims = [d for _, d in SHAPES_DIMS]
    got = _per_device(lambda a: buckets_lib.psum_scatter(a, dims, ("data",)), xs)
    want = _per_device(lambda a: [jax.lax.psum_scatter(x, "data", scatter_dimension=d, tiled=True)
                                  for x, d in zip(a, dims)], xs)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_array_equal(g, w)


def test_bucketed_psum_equals_the_per_tensor_psum():
    rng = np.random.default_rng(1)
    xs = [jnp.asarray(rng.normal(size=shape), jnp.float32) for shape, _ in SHAPES_DIMS]
    got = _per_device(lambda a: buckets_lib.psum(a, ("data",)), xs)
    want = _per_device(lambda a: [jax.lax.psum(x, "data") for x in a], xs)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def _gather_case():
    """A tree in ZeRO-1/2-like state shardings and its storage shardings, on data=4 x tensor=2:
    two f32 leaves gathered over data (one keeps its tensor split), a bf16 leaf (a bucket of its
    own dtype) and a leaf whose storage is its state layout (nothing to gather)."""
    mesh = make_mesh({"data": 4, "tensor": 2})
    rng = np.random.default_rng(2)
    leaves = {"w": (P("data"), P(), jnp.float32, (8, 6)), "tp_w": (P("tensor", "data"), P("tensor"), jnp.float32, (4, 12)),
              "b": (P(None, "data"), P(), jnp.bfloat16, (3, 4)), "same": (P("data"), P("data"), jnp.float32, (8,))}
    source = {k: NamedSharding(mesh, s) for k, (s, _, _, _) in leaves.items()}
    target = {k: NamedSharding(mesh, t) for k, (_, t, _, _) in leaves.items()}
    tree = {k: jax.device_put(jnp.asarray(rng.normal(size=shape), dtype), source[k])
            for k, (_, _, dtype, shape) in leaves.items()}
    return tree, source, target


def _gathered(tree, source, target, limit):
    compiled = jax.jit(lambda t: buckets_lib.gather(t, source, target, limit), out_shardings=target).lower(tree).compile()
    return compiled(tree), collective_stats(compiled)


def test_bucketed_gather_is_bitwise_the_per_tensor_resharding():
    tree, source, target = _gather_case()
    (got, stats), (want, plain) = _gathered(tree, source, target, 2**20), _gathered(tree, source, target, 0)
    for k in tree:
        assert got[k].sharding.is_equivalent_to(target[k], tree[k].ndim), k
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(tree[k]))
        np.testing.assert_array_equal(np.asarray(want[k]), np.asarray(tree[k]))
    # GSPMD: one all-gather per resharded tensor; buckets: one per dtype.
    assert plain.count_by_kind()["all-gather"] == 3 and stats.count_by_kind()["all-gather"] == 2, stats.table()
    assert stats.bytes_by_kind() == plain.bytes_by_kind(), stats.table()


def test_negative_bucket_bytes_is_refused_by_name():
    model = tiny_model()
    layout = make_layout(model, "dp", make_mesh(MESHES["dp"]))
    with pytest.raises(ValueError, match="bucket_bytes must be >= 0"):
        build(model, optimizer(), layout, bucket_bytes=-1)


def test_compressed_reductions_stay_per_tensor():
    model = tiny_model()
    layout = make_layout(model, "zero1", make_mesh(MESHES["zero1"]))
    from shardlib.step.compression import get_compression

    assert not Reducer.for_layout(layout, get_compression("int8"), bucket_bytes=2**20).bucketed
    assert Reducer.for_layout(layout, get_compression("none"), bucket_bytes=2**20).bucketed


# ---------------------------------------------------------------- the train step


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def _run(model, strategy, bucket_bytes, start=None):
    """(collective stats of the compiled step, per-step losses, final params, the start state on the
    host) of STEPS steps, with ``bucket_bytes`` for the reductions and zero1/zero2's parameter
    all-gather alike, from ``start`` (a host state) or else the program's own init.
    ``layerwise=False``: the Reducer's buckets after the backward pass are what is tested here;
    the per-layer reductions (and their per-call buckets) are tests/test_layerwise.py's."""
    program = build(model, optimizer(), make_layout(model, strategy, make_mesh(MESHES[strategy])),
                    bucket_bytes=bucket_bytes, gather_bucket_bytes=bucket_bytes, layerwise=False)
    rows = batches(STEPS)
    sharded = [jax.device_put(r, program.layout.batch_sharding(r)) for r in rows]
    state = program.init(jax.random.key(0)) if start is None else jax.device_put(start[1], program.state_sharding)
    if start is not None:  # the same state, laid out the same way: bucketing changes the step only
        assert jax.tree.leaves(program.state_sharding) == jax.tree.leaves(start[0])
    start = (program.state_sharding, jax.tree.map(np.asarray, state))
    compiled = program.step.lower(state, sharded[0]).compile()
    losses = []
    for batch in sharded:
        state, metrics = compiled(state, batch)
        losses.append(float(metrics["loss"]))
    return collective_stats(compiled), np.array(losses), jax.tree.map(np.asarray, state.params), start


@pytest.fixture(scope="module", params=list(MESHES))
def pair(request, model):
    """The strategy's step unbucketed and with one bucket for all (the tiny model is < 1 MiB), both
    from the unbucketed program's init (one init compile per strategy, not two)."""
    plain = _run(model, request.param, 0)
    return request.param, plain, _run(model, request.param, 2**20, start=plain[3])


def test_bucketing_keeps_the_bytes_on_the_wire(pair):
    _, (plain, *_), (bucketed, *_) = pair
    assert bucketed.bytes_by_kind() == plain.bytes_by_kind(), bucketed.table()


def test_bucketing_runs_no_more_collectives_and_one_reduce_scatter_for_zero(pair):
    strategy, (plain, *_), (bucketed, *_) = pair
    before, after = plain.count_by_kind(), bucketed.count_by_kind()
    assert sum(after.values()) <= sum(before.values()), bucketed.table()
    if strategy in ("zero1", "zero2"):
        # Every weight is reduce-scattered by the Reducer: one per tensor before, one bucket now;
        # the updated state shards come back to replicated parameters in one all-gather.
        assert before["reduce-scatter"] > 1 and after["reduce-scatter"] == 1, bucketed.table()
        assert before["all-gather"] > 1 and after["all-gather"] == 1, bucketed.table()


def test_bucketing_trains_like_the_per_tensor_step(pair):
    _, (_, losses, params, _), (_, b_losses, b_params, _) = pair
    # Each element is the same sum of the same device values; only the packing differs.
    np.testing.assert_allclose(b_losses, losses, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(b_params), jax.tree.leaves(params)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
