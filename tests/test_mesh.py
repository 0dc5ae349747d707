import jax
import pytest

from shardlib.sharding.mesh import MESH_AXES, MeshError, describe, host_axis_sizes, make_mesh, parse_mesh


def _all(**sizes):
    """Every mesh axis's size: those given, 1 for the rest."""
    return {a: sizes.get(a, 1) for a in MESH_AXES}


def test_fill_axis_takes_the_rest():
    mesh = make_mesh({"data": 2, "fsdp": -1})
    assert dict(mesh.shape) == _all(data=2, fsdp=4)
    assert mesh.axis_names == MESH_AXES
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    assert describe(mesh) == "data=2 fsdp=4"


def test_parse_mesh_string():
    assert parse_mesh("data=2, fsdp=-1") == {"data": 2, "fsdp": -1}
    assert dict(make_mesh("tensor=8").shape)["tensor"] == 8
    with pytest.raises(MeshError, match="axis=size"):
        parse_mesh("data2")
    with pytest.raises(MeshError, match="not an integer"):
        parse_mesh("data=two")


def test_sizes_that_do_not_match_the_devices():
    with pytest.raises(MeshError, match="needs 12 devices but 8 are available"):
        make_mesh({"data": 3, "fsdp": 4})
    with pytest.raises(MeshError, match="does not divide the 8 available"):
        make_mesh({"data": 3, "fsdp": -1})
    with pytest.raises(MeshError, match="only one mesh axis may be -1"):
        make_mesh({"data": -1, "fsdp": -1})


def test_unknown_axis_is_named():
    with pytest.raises(MeshError, match="unknown mesh axis 'model'"):
        make_mesh({"model": 8})


def test_subset_of_devices_and_single_device():
    mesh = make_mesh({}, devices=jax.devices()[:1])
    assert mesh.size == 1 and describe(mesh) == "single device"


def test_host_layout_puts_outer_axes_across_processes():
    full = _all(data=2, fsdp=4, tensor=2)
    assert host_axis_sizes(full, 2) == _all(data=2)
    assert host_axis_sizes(full, 4) == _all(data=2, fsdp=2)
    assert host_axis_sizes(full, 1) == _all()
    with pytest.raises(MeshError, match="cannot span"):
        host_axis_sizes(full, 3, {"fsdp": 3})
    with pytest.raises(MeshError, match="multiplies to 2, not to the 4 processes"):
        host_axis_sizes(full, 4, {"data": 2})
