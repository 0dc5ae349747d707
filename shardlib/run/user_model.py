"""`shardlib train --model package.module:factory`: the user's own model in the CLI's run loop.

The factory is called with no arguments and returns a `shardlib.Model` (what `from_nnx`,
`from_linen` and `from_functions` return), whose loss reads the loader's batch
(``{"inputs": int32[B, T], "targets": int32[B, T]}``). The module is imported as ``python -m``
would, with the working directory first on the path, so a ``mymodel.py`` beside the user works.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from shardlib.run.config import TrainConfigError

LIBRARY_MODEL = "model passed to train()"  # the run header's name for `train(config, model=...)`


def is_factory(name: str) -> bool:
    """``pkg.mod:make`` names a factory; a bare name is a built-in config."""
    return ":" in name


def load(spec: str) -> Any:
    """The `Model` that the factory ``spec`` (``package.module:function``) returns."""
    from shardlib.model.nnx_adapter import parameters_placed_by_shardlib

    with parameters_placed_by_shardlib():  # an NNX instance built on import or by the factory needs no mesh
        return _factory_model(spec)


def _factory_model(spec: str) -> Any:
    from shardlib.model.adapters import Model

    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise TrainConfigError("model", f"{spec!r} is not package.module:factory (e.g. mymodel:make)")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is None or not module_name.startswith(err.name):
            raise  # the module itself imports something missing: its own traceback says what
        raise TrainConfigError("model", f"cannot import {module_name!r} (no module {err.name!r} on the path, which "
                                        f"starts with the working directory {os.getcwd()})") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise TrainConfigError("model", f"{module_name} has no function {attr!r} (it defines: "
                                        f"{', '.join(n for n in vars(module) if not n.startswith('_'))})")
    model = factory()
    if not isinstance(model, Model):
        raise TrainConfigError("model", f"{spec}() returned a {type(model).__name__}, not a shardlib Model: return "
                                        "from_nnx(...), from_linen(...) or from_functions(...) (docs/your-model.md)")
    return model


def param_count(model: Any) -> int:
    import math

    import jax

    return sum(math.prod(x.shape) for x in jax.tree.leaves(model.abstract()))
