import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from shardlib.sharding.mesh import make_mesh
from shardlib.sharding.rules import (
    RuleError, check_replication, layout_tree, logical_axes_of, logical_from_paths, report, spec_for,
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


def test_rank_mismatch_names_the_tensor(mesh):
    with pytest.raises(RuleError, match="blocks/w: 1 logical axes"):
        spec_for(("embed",), (4, 4), (), mesh, path="blocks/w")


def test_path_rules_for_unannotated_trees(mesh):
    params = {"dense": {"kernel": np.zeros((64, 32)), "bias": np.zeros((32,))}, "head": np.zeros((32, 10))}
    logical = logical_from_paths(params, [(r"dense/kernel$", ("embed", "mlp")), (r"bias$", ("mlp",))])
    assert logical == {"dense": {"kernel": ("embed", "mlp"), "bias": ("mlp",)}, "head": None}
    layouts = layout_tree(params, logical, (("embed", "fsdp"), ("mlp", "tensor")), mesh)
    assert layouts["dense"]["kernel"].spec == P("fsdp", "tensor")
    assert "unannotated" in layouts["head"].notes[0]
    with pytest.raises(RuleError, match="gives 1 names"):
        logical_from_paths(params, [(r"kernel", ("embed",))])


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
