"""shardlib: device meshes, logical sharding rules and ZeRO / FSDP / TP training steps for JAX.

The data flow of a run: mesh -> strategy (rule tables) -> layout of the model's parameters ->
train program (sharded init, step, eval) -> batches -> checkpoints.
"""

import importlib as _importlib
import sys as _sys
import warnings as _warnings

from shardlib.sharding.mesh import MeshError, make_mesh
from shardlib.sharding.rules import RuleError
from shardlib.sharding.strategies import Strategy, get_strategy
from shardlib.sharding.layout import Layout, ReplicationWarning, make_layout, sharding_report
from shardlib.model import Call, Model, Stages, from_functions, from_linen, from_nnx
from shardlib.model.hooks import batch_varying, constrain, gather_batch, gather_layer, global_mean, global_sum
from shardlib.step import TrainProgram, TrainState, build
from shardlib.step.compute import batch_axis_names
from shardlib.step.precision import Precision
from shardlib.runtime.devices import simulate_cpu_devices

# Importing shardlib changes neither os.environ nor Flax's config (tests/test_import_effects.py):
# the CLI, `make_mesh` and `simulate_cpu_devices` quiet libtpu where they choose devices, and
# shardlib turns Flax's eager sharding off only around the parameters it creates.

# Orbax loads on first use, so `import shardlib` stays quick.
_LAZY = {"Checkpointer": "shardlib.runtime.checkpoint"}

# Top-level names of 0.1.0 that live in their modules now; for one release the old name still
# works and warns with the new import (tests/test_public_api.py).
_MOVED = {
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


def __getattr__(name: str):
    if name in _MOVED:
        # `from shardlib import X` asks twice: importlib's hasattr first, then the caller's line (the one warned).
        if not _sys._getframe(1).f_globals.get("__name__", "").startswith("importlib."):
            _warnings.warn(f"shardlib.{name} is deprecated and will be removed in the next release; "
                           f"import it from its module: from {_MOVED[name]} import {name}", DeprecationWarning,
                           stacklevel=2)
        return getattr(_importlib.import_module(_MOVED[name]), name)
    if name in _LAZY:
        return getattr(_importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'shardlib' has no attribute {name!r}")


# The concepts of README's "How it works"; everything else is imported from its module.
__all__ = [
    # mesh, strategy, layout
    "make_mesh", "MeshError", "Strategy", "get_strategy", "RuleError",
    "make_layout", "Layout", "sharding_report", "ReplicationWarning",
    # the model and the calls model code makes
    "Model", "Call", "Stages", "from_functions", "from_linen", "from_nnx",
    "constrain", "gather_layer", "gather_batch", "global_mean", "global_sum", "batch_varying", "batch_axis_names",
    # the train program, its precision and checkpoints
    "build", "TrainProgram", "TrainState", "Precision", "Checkpointer",
    # running without accelerators
    "simulate_cpu_devices",
]
__version__ = "0.1.0"
