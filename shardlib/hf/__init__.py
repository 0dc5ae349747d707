"""Hugging Face checkpoints in and out: the Llama family's ``config.json`` and safetensors read
straight into the shards of any strategy (`shardlib.hf.load`), written back for ``transformers``
(`shardlib.hf.save`), with the family's architectures as data (`shardlib.hf.architectures`) and
tokenizers for training data (`shardlib.hf.tokenizer`); `from_pretrained` / `save_pretrained` / `generate`
(`shardlib.hf.api`) do each in one call. docs/pretrained.md is the guide."""

from shardlib.hf.api import PretrainedModel, from_pretrained, generate, save_pretrained
from shardlib.hf.load import Pretrained, load_params, open_pretrained

__all__ = ["Pretrained", "PretrainedModel", "from_pretrained", "generate", "load_params", "open_pretrained", "save_pretrained"]
