"""Hugging Face checkpoints in and out: the Llama family's ``config.json`` and safetensors read
straight into the shards of any strategy (`shardlib.hf.load`), written back for ``transformers``
(`shardlib.hf.save`), with the family's architectures as data (`shardlib.hf.architectures`) and
tokenizers for training data (`shardlib.hf.tokenizer`). docs/pretrained.md is the guide."""

from shardlib.hf.load import Pretrained, load_params, open_pretrained
from shardlib.hf.save import save_pretrained

__all__ = ["Pretrained", "load_params", "open_pretrained", "save_pretrained"]
