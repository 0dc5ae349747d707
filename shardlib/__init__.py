"""shardlib: device meshes, logical sharding rules and ZeRO / FSDP / TP training steps for JAX.

The data flow of a run: mesh -> strategy (rule tables) -> layout of the model's parameters ->
train program (sharded init, step, eval) -> batches -> checkpoints.
"""

from shardlib.sharding.mesh import MESH_AXES, MeshError, make_mesh, parse_mesh
from shardlib.sharding.rules import LeafLayout, RuleError, check_replication, layout_tree
from shardlib.sharding.strategies import STRATEGIES, Strategy, get_strategy
from shardlib.sharding.layout import Layout, ReplicationWarning, make_layout, sharding_report
from shardlib.model import Call, Model, Stages, from_functions, from_linen, from_nnx
from shardlib.model.hooks import batch_varying, constrain, gather_batch, gather_layer, global_mean, global_sum
from shardlib.step import TrainProgram, TrainState, build
from shardlib.step.batch import per_device
from shardlib.step.compute import batch_axis_names
from shardlib.step.precision import POLICIES, Precision
from shardlib.step.pipeline import SCHEDULES, bubble_fraction
from shardlib.runtime.devices import simulate_cpu_devices
from shardlib.runtime.xla_flags import set_gpu_overlap_flags

# Heavier parts (Orbax, the planner) load on first use, so `import shardlib` stays quick.
_LAZY = {
    "Checkpointer": "shardlib.runtime.checkpoint",
    "PreemptionGuard": "shardlib.runtime.checkpoint",
    "load_exported": "shardlib.tools.export",
    "build_local_sgd": "shardlib.step.local_sgd",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'shardlib' has no attribute {name!r}")


__all__ = [
    "Call", "Checkpointer", "POLICIES", "batch_axis_names", "PreemptionGuard", "Precision", "build_local_sgd", "load_exported",
    "MESH_AXES", "SCHEDULES", "STRATEGIES", "Stages", "bubble_fraction", "LeafLayout", "Layout", "MeshError", "Model", "ReplicationWarning", "RuleError", "Strategy",
    "TrainProgram", "TrainState", "batch_varying", "build", "check_replication", "constrain", "from_functions",
    "from_linen", "from_nnx", "gather_batch", "gather_layer", "get_strategy", "global_mean", "global_sum", "layout_tree", "make_layout",
    "make_mesh", "parse_mesh", "per_device", "set_gpu_overlap_flags", "sharding_report", "simulate_cpu_devices",
]
__version__ = "0.1.0"
