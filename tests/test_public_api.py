"""The top-level API is the concepts of README's "How it works", pinned here; names that moved to
their modules still work from `shardlib` for one release, with a warning naming the new import."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

import shardlib

EXPORTED = {
    "make_mesh", "MeshError", "Strategy", "get_strategy", "RuleError",
    "make_layout", "Layout", "sharding_report", "ReplicationWarning",
    "Model", "Call", "Stages", "from_functions", "from_linen", "from_nnx",
    "constrain", "gather_layer", "gather_batch", "global_mean", "global_sum", "batch_varying", "batch_axis_names",
    "build", "TrainProgram", "TrainState", "Precision", "Checkpointer",
    "simulate_cpu_devices",
}
MOVED = {
    "LeafLayout": "shardlib.sharding.rules",
    "layout_tree": "shardlib.sharding.rules",
    "check_replication": "shardlib.sharding.rules",
    "MESH_AXES": "shardlib.sharding.mesh",
    "parse_mesh": "shardlib.sharding.mesh",
    "STRATEGIES": "shardlib.sharding.strategies",
    "POLICIES": "shardlib.step.precision",
    "SCHEDULES": "shardlib.step.pipeline",
    "bubble_fraction": "shardlib.step.pipeline",
    "per_device": "shardlib.step.batch",
    "build_local_sgd": "shardlib.step.local_sgd",
    "PreemptionGuard": "shardlib.runtime.checkpoint",
    "set_gpu_overlap_flags": "shardlib.runtime.xla_flags",
    "load_exported": "shardlib.tools.export",
}


def test_the_exported_names_are_pinned():
    assert len(shardlib.__all__) == len(set(shardlib.__all__)) <= 30
    assert set(shardlib.__all__) == EXPORTED
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in shardlib.__all__:
            assert getattr(shardlib, name) is not None
    assert not set(shardlib.__all__) & set(MOVED)


@pytest.mark.parametrize("name", sorted(MOVED))
def test_a_moved_name_still_works_and_warns_with_its_new_import(name):
    with pytest.warns(DeprecationWarning, match=rf"shardlib\.{name} is deprecated.*from {MOVED[name]} import {name}"):
        value = getattr(shardlib, name)
    assert value is getattr(importlib.import_module(MOVED[name]), name)


def test_from_import_of_a_moved_name_warns_at_the_callers_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from shardlib import LeafLayout  # noqa: F401
    (warning,) = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert warning.filename == __file__


def test_unknown_names_are_attribute_errors():
    with pytest.raises(AttributeError, match="has no attribute 'not_a_name'"):
        shardlib.not_a_name  # noqa: B018


def test_import_shardlib_leaves_the_heavy_modules_unloaded():
    """Orbax, the exporter and the planner load only when a name of theirs is used."""
    code = ("import sys, shardlib; print(sorted(m for m in ('orbax.checkpoint', 'shardlib.tools.export', "
            "'shardlib.tools.plan', 'shardlib.runtime.checkpoint') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
