import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from shardlib.sharding.mesh import make_mesh
from shardlib.sharding.rules import (
    AutoShard, RuleError, check_replication, layout_tree, logical_axes_of, logical_from_paths, report, spec_for,
)


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"fsdp": 4, "tensor": 2})


def test_first_applicable_rule_wins(mesh):
    rules = (("embed", "fsdp"), ("embed", "tensor"), ("mlp", "tensor"))
    spec, notes = spec_for(("embed", "mlp"), (64, 128), rules, mesh)
    assert spec == P("fsdp", "tensor") and notes == ()


def test_fallback_when_not_divisible_is_noted(mesh):
    rules = (("embed", "fsdp"), ("embed", "tensor"))
    spec, notes = spec_for(("embed",), (6,), rules, mesh)
    assert spec == P("tensor")
    assert notes == ("dim 0 (embed=6) not divisible by fsdp=4",)


def test_mesh_axis_is_used_once_per_tensor(mesh):
    rules = (("embed", "fsdp"), ("mlp", "fsdp"))
    spec, notes = spec_for(("embed", "mlp"), (64, 64), rules, mesh)
    assert spec == P("fsdp", None)
    assert "already shards another dim" in notes[0]


def test_explicit_none_replicates_without_a_note(mesh):
    spec, notes = spec_for(("embed",), (64,), (("embed", None), ("embed", "fsdp")), mesh)
    assert spec == P(None) and notes == ()


def test_multi_axis_rule_and_size_one_axes_drop_out():
    mesh = make_mesh({"data": 2, "fsdp": 4})
    spec, _ = spec_for(("embed",), (64,), (("embed", ("data", "fsdp", "tensor")),), mesh)
    assert spec == P(("data", "fsdp"))


def test_rule_naming_an_unknown_mesh_axis(mesh):
    abstract = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32)}
    with pytest.raises(RuleError, match="names mesh axis 'model', which is not in the mesh"):
        layout_tree(abstract, {"w": ("embed", "mlp")}, (("embed", "model"),), mesh)


def test_more_names_than_dims_names_the_tensor(mesh):
    with pytest.raises(RuleError, match=r"blocks/w: 3 logical axes .* shape \(4, 4\) \(rank 2\)"):
        spec_for(("embed", "mlp", "heads"), (4, 4), (), mesh, path="blocks/w")


def test_fewer_names_than_dims_leave_trailing_dims_unnamed(mesh):
    """As in JAX and Flax: ("embed", "kv") on a 3-D DenseGeneral kernel names the first two dims."""
    spec, notes = spec_for(("embed", "heads"), (64, 4, 16), (("embed", "fsdp"), ("heads", "tensor")), mesh)
    assert spec == P("fsdp", "tensor", None) and notes == ()
    layouts = layout_tree({"k": jax.ShapeDtypeStruct((64, 4, 16), jnp.float32)}, {"k": ("embed",)}, (), mesh)
    assert layouts["k"].logical == ("embed", None, None)


def test_auto_shard_takes_the_largest_free_divisible_dim(mesh):
    auto = AutoShard(("fsdp",))
    spec, notes = spec_for(None, (6, 256, 64), (), mesh, auto=auto)
    assert spec == P(None, "fsdp", None) and "auto-sharded dim 1 (256) over fsdp=4" in notes[-1]
    # A dim another axis shards is not free; a rule that already shards over fsdp needs no fallback.
    spec, _ = spec_for(("mlp", None), (256, 64), (("mlp", "tensor"),), mesh, auto=auto)
    assert spec == P("tensor", "fsdp")
    spec, notes = spec_for(("embed", None), (64, 256), (("embed", "fsdp"),), mesh, auto=auto)
    assert spec == P("fsdp", None) and notes == ()
    # Stacked layers are never split over the batch axes; tiny and indivisible tensors stay whole.
    spec, notes = spec_for(("layers", None), (4096, 6), (), mesh, auto=auto)
    assert spec == P(None, None) and "no free dimension of (4096, 6) divisible by fsdp=4" in notes[-1]
    spec, notes = spec_for(None, (64,), (), mesh, auto=auto)
    assert spec == P(None) and "under 1024 elements" in notes[-1]


def test_path_rules_for_unannotated_trees(mesh):
    params = {"dense": {"kernel": np.zeros((64, 32)), "bias": np.zeros((32,))}, "head": np.zeros((32, 10))}
    logical = logical_from_paths(params, [(r"dense/kernel$", ("embed", "mlp")), (r"bias$", ("mlp",))])
    assert logical == {"dense": {"kernel": ("embed", "mlp"), "bias": ("mlp",)}, "head": None}
    layouts = layout_tree(params, logical, (("embed", "fsdp"), ("mlp", "tensor")), mesh)
    assert layouts["dense"]["kernel"].spec == P("fsdp", "tensor")
    assert "unannotated" in layouts["head"].notes[0]
    assert logical_from_paths(params, [(r"kernel", ("embed",))])["dense"]["kernel"] == ("embed",)  # trailing dim unnamed
    with pytest.raises(RuleError, match="gives 3 names .* to 'dense/kernel'"):
        logical_from_paths(params, [(r"kernel", ("embed", "mlp", "heads"))])


def test_replication_check_names_the_tensors_and_report_lists_reasons(mesh):
    abstract = {"big": jax.ShapeDtypeStruct((6, 1000), jnp.float32), "small": jax.ShapeDtypeStruct((6,), jnp.float32)}
    logical = {"big": ("embed", None), "small": ("embed",)}
    layouts = layout_tree(abstract, logical, (("embed", "fsdp"),), mesh)
    with pytest.raises(RuleError, match=r"big \(6, 1000\): dim 0 \(embed=6\) not divisible by fsdp=4") as err:
        check_replication(layouts, mesh, max_bytes=1024)
    assert "small" not in str(err.value)
    check_replication(layouts, mesh, max_bytes=10**6)
    text = report(layouts, mesh)
    assert "big" in text and "not divisible" in text and "23.44 KiB" in text


def test_logical_names_from_nnx_and_linen():
    from flax import linen as nn
    from flax import nnx

    with nnx.use_eager_sharding(False):
        layer = nnx.Linear(4, 8, kernel_init=nnx.with_partitioning(nnx.initializers.ones, ("embed", "mlp")),
                           rngs=nnx.Rngs(0))
    names = logical_axes_of(nnx.to_pure_dict(nnx.state(layer, nnx.Param), extract_fn=lambda v: v))
    assert names == {"kernel": ("embed", "mlp"), "bias": None}

    class Dense(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param("w", nn.with_logical_partitioning(nn.initializers.ones, ("embed", "mlp")), (4, 8))
            return x @ w

    boxed = jax.eval_shape(lambda: Dense().init(jax.random.key(0), jnp.ones((1, 4))))["params"]
    assert logical_axes_of(boxed) == {"w": ("embed", "mlp")}

    class Placed(nn.Module):  # mesh-axis placement (nn.Partitioned), kept by strategy as_annotated
        @nn.compact
        def __call__(self, x):
            return x @ self.param("w", nn.with_partitioning(nn.initializers.ones, ("fsdp", None)), (4, 8))

    boxed = jax.eval_shape(lambda: Placed().init(jax.random.key(0), jnp.ones((1, 4))))["params"]
    assert logical_axes_of(boxed) == {"w": ("fsdp", None)}
