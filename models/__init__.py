"""Reference models whose parameters carry logical axis names for shardlib's rules."""

from .configs import CONFIGS as CONFIGS
from .configs import GPTConfig as GPTConfig
from .configs import MoEConfig as MoEConfig
from .configs import flops_per_token as flops_per_token
from .configs import get_config as get_config
from .configs import param_count as param_count
from .gpt import GPT as GPT
from .gpt import build as build
from .gpt import from_params as _gpt_from_params
from .decoding import generate as generate
from .gpt import next_token_loss as next_token_loss
from .gpt import trainable as _gpt_trainable
from .mlp import MLP as MLP
from .mlp import regression_loss as regression_loss
from .moe import MoEGPT as MoEGPT
from .moe import trainable as _moe_trainable


def from_params(config: GPTConfig, params):
    """The decoder of ``config`` holding ``params`` (`models.gpt.from_params`): the MoE GPT for an
    `MoEConfig`, else the GPT."""
    return _gpt_from_params(config, params, MoEGPT if isinstance(config, MoEConfig) else GPT)


def trainable(config: GPTConfig):
    """The decoder of ``config`` as a `shardlib.Model`: the MoE GPT for an `MoEConfig`, else the GPT."""
    return _moe_trainable(config) if isinstance(config, MoEConfig) else _gpt_trainable(config)


__all__ = [
    "CONFIGS",
    "GPT",
    "GPTConfig",
    "MLP",
    "MoEConfig",
    "MoEGPT",
    "build",
    "flops_per_token",
    "from_params",
    "generate",
    "get_config",
    "next_token_loss",
    "param_count",
    "regression_loss",
    "trainable",
]
