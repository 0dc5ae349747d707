"""Reference models whose parameters carry logical axis names for shardlib's rules."""

from models.configs import CONFIGS as CONFIGS
from models.configs import GPTConfig as GPTConfig
from models.configs import flops_per_token as flops_per_token
from models.configs import get_config as get_config
from models.configs import param_count as param_count
from models.gpt import GPT as GPT
from models.gpt import build as build
from models.gpt import generate as generate
from models.gpt import next_token_loss as next_token_loss
from models.gpt import trainable as trainable
from models.mlp import MLP as MLP
from models.mlp import regression_loss as regression_loss

__all__ = [
    "CONFIGS",
    "GPT",
    "GPTConfig",
    "MLP",
    "build",
    "flops_per_token",
    "generate",
    "get_config",
    "next_token_loss",
    "param_count",
    "regression_loss",
    "trainable",
]
