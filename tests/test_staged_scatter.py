"""`shardlib.sharding.staged`: the two-stage reduce-scatter lands every device on the chunk the
one-stage reduce-scatter gives it, with the same sums, and ZeRO-3's gather differentiates to it.
(Its bytes on a TPU slice: tests/test_tpu_scale.py.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from shardlib import backend as backend_lib
from shardlib import make_mesh
from shardlib.model import hooks
from shardlib.sharding import staged


def _scatter(mesh, axes, fn):
    spec = P(axes if len(axes) > 1 else axes[0])
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec))


@pytest.mark.parametrize("sizes, axes", [({"fsdp": 8}, ("fsdp",)), ({"data": 2, "fsdp": 4}, ("data", "fsdp"))])
def test_two_stages_give_each_device_the_one_stage_chunk(sizes, axes):
    mesh = make_mesh(sizes)
    n = 8
    # each device its own rows; integer-valued floats: every order of summation gives the same bits
    x = jnp.asarray(np.random.default_rng(0).integers(-50, 50, size=(n * n * 32, 6)), jnp.float32)
    one = _scatter(mesh, axes, lambda v: jax.lax.psum_scatter(v, axes, scatter_dimension=0, tiled=True))(x)
    two = _scatter(mesh, axes, lambda v: staged.psum_scatter(v, axes, 0, staged.inner_size(n)))(x)
    np.testing.assert_array_equal(np.asarray(two), np.asarray(one))
    # and both are the sum over devices of their inputs, chunked in device order
    np.testing.assert_array_equal(np.asarray(one), np.asarray(x).reshape(n, n * 32, 6).sum(0))


def test_the_gather_with_stages_differentiates_to_the_same_gradient():
    mesh = make_mesh({"fsdp": 8})
    w = jnp.asarray(np.random.default_rng(1).integers(-8, 8, size=(16, 4)), jnp.float32)

    def grad(stages):
        def loss(shard):
            full = hooks.gather_dim(shard, "fsdp", 0, stages=stages)
            return jnp.sum(full * jnp.arange(full.size, dtype=jnp.float32).reshape(full.shape))
        return jax.jit(jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp")))(w)

    np.testing.assert_array_equal(np.asarray(grad(2)), np.asarray(grad(None)))


def test_only_a_policy_that_stages_asks_the_compiler():
    mesh = make_mesh({"fsdp": 8})
    assert staged.stages_for(mesh, [("fsdp",)], backend_lib.get_policy("cpu")) == {}
    assert staged.stages_for(mesh, [("fsdp",)], None) == {}
    assert [staged.inner_size(n) for n in (8, 16, 32, 64, 128, 6)] == [2, 4, 4, 8, 8, 2]
