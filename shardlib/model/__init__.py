"""The model side: what the step needs to know about a model (`Model`, `Stages`), adapters from
Flax NNX, Flax linen and plain pytrees, and the hooks model code calls (`constrain`, `gather_layer`)."""

from shardlib.model.adapters import Call, Model, Stages, from_functions
from shardlib.model.linen_adapter import from_linen
from shardlib.model.nnx_adapter import from_nnx

__all__ = ["Call", "Model", "Stages", "from_functions", "from_linen", "from_nnx"]
