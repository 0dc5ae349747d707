"""A Hugging Face model in one call each: `from_pretrained` places a model directory's weights on
a mesh under a strategy and opens its tokenizer; `save_pretrained` writes a model back as
transformers reads it. They chain what ``shardlib train --init-from`` and ``shardlib export --hf``
do (`open_pretrained`, `trainable`, `make_layout`, `load_params`, `from_params`), so the weights
are read shard by shard, never whole on a host.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from shardlib.hf.load import Pretrained, PretrainedError, open_pretrained
from shardlib.models import GPTConfig

DTYPES = {"float32": np.float32, "bfloat16": "bfloat16"}  # the parameters' dtype, and the compute dtype


@dataclasses.dataclass
class PretrainedModel:
    """A decoder placed on a mesh: ``config``, ``params`` (sharded by ``layout``), and the directory
    it came from (``source``: its config.json and architecture, which `save_pretrained` writes back).
    ``module()`` is the Flax NNX model holding the parameters, callable on token ids."""

    config: GPTConfig
    params: dict[str, Any]
    layout: Any  # shardlib.sharding.layout.Layout
    source: Pretrained

    def module(self) -> Any:
        from shardlib.models import from_params

        return from_params(self.config, self.params)


def from_pretrained(directory: str | os.PathLike[str], *, strategy: str = "zero3",
                    mesh: Any = None, dtype: str = "float32", seq_len: int | None = None,
                    tokenizer: bool = True) -> tuple[PretrainedModel, Any]:
    """(the model, its `shardlib.hf.tokenizer.Tokenizer` or None) of a Hugging Face model directory,
    or ``org/name`` as cached locally (never downloaded).

    ``strategy``: how the parameters are sharded (a name such as "zero3", "dp", "tp", or a
    `Strategy`); ``mesh``: a `jax.sharding.Mesh`, axis sizes such as ``{"fsdp": -1}``, or None for
    the strategy's default over all devices; ``dtype``: "float32" (exact) or "bfloat16", for the
    parameters and the compute. ``tokenizer``: open the directory's tokenizer.json (None when it has none)."""
    from jax.sharding import Mesh

    from shardlib.hf.hub_cache import resolve
    from shardlib.hf.load import load_params
    from shardlib.models import trainable
    from shardlib.sharding.layout import make_layout
    from shardlib.sharding.mesh import make_mesh
    from shardlib.sharding.strategies import get_strategy

    if dtype not in DTYPES:
        raise PretrainedError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    path, _ = resolve(str(directory))
    pretrained = open_pretrained(path, seq_len=seq_len)
    config = dataclasses.replace(pretrained.model_config, compute_dtype=dtype)
    chosen = get_strategy(strategy)
    if not isinstance(mesh, Mesh):
        mesh = make_mesh(dict(mesh) if isinstance(mesh, Mapping) else dict(chosen.default_mesh))
    layout = make_layout(trainable(config), chosen, mesh)
    params = load_params(pretrained, layout.param_shardings(), DTYPES[dtype])
    found = None
    if tokenizer and (path / "tokenizer.json").is_file():
        from shardlib.hf.tokenizer import load_tokenizer

        found = load_tokenizer(path)
    return PretrainedModel(config, params, layout, pretrained), found


def save_pretrained(model: PretrainedModel, out: str | os.PathLike[str], *, like: PretrainedModel | None = None,
                    dtype: str = "bf16", tokenizer: Any = None) -> Path:
    """Write ``model`` to the directory ``out`` as transformers reads it (`shardlib.hf.save.save_pretrained`:
    only a new directory or an earlier export is replaced). ``like``: the model whose config.json and
    architecture are written back (default: the one ``model`` came from); ``dtype``: "bf16" or "f32"
    (bit-exact); ``tokenizer``: one copied beside the weights (default: ``like``'s directory's, with its
    chat template) and the source's generation_config.json. Returns ``out``."""
    from shardlib.hf.generation_config import read_generation_config
    from shardlib.hf.save import save_pretrained as write

    source = (like or model).source
    if tokenizer is None and (source.directory / "tokenizer.json").is_file():
        tokenizer = source.directory / "tokenizer.json"
    tokenizer_file = getattr(tokenizer, "path", tokenizer)
    written = write(model.params, model.config, out, hf_config=source.hf_config, architecture=source.architecture.name,
                    dtype=dtype, tokenizer_file=tokenizer_file,
                    generation_config=read_generation_config(source.directory))
    return Path(written.directory)


def generate(model: PretrainedModel, tokenizer: Any, prompts: str | list[str], max_new_tokens: int = 64, *,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             seed: int = 0) -> list[str]:
    """The text each prompt continues with (greedy by default), as ``shardlib generate`` decodes it
    (`shardlib.models.decoding.generate`: a KV cache, the prompts of different lengths left-padded
    into one batch). A row stops at its first stop id (`shardlib.hf.generation_config.stop_ids`:
    ``generation_config.json``'s, config.json's, else the tokenizer's end-of-sequence id), which is
    not part of the text."""
    import jax

    from shardlib.hf.generation_config import stop_ids
    from shardlib.models.decoding import generate as sample, left_pad, until_stop

    stops = stop_ids(model.source.directory, tokenizer)  # as `shardlib generate` stops
    rows = [tokenizer.encode(prompt) for prompt in ([prompts] if isinstance(prompts, str) else list(prompts))]
    tokens, lengths = left_pad(rows, pad_id=stops[0] if stops else 0)
    out = sample(model.module(), tokens, max_new_tokens, rng=jax.random.key(seed), temperature=temperature,
                 top_k=top_k, top_p=top_p, stop_token=stops or None, lengths=lengths)
    new = np.asarray(jax.device_get(out))[:, tokens.shape[1]:]
    return [tokenizer.decode([int(t) for t in until_stop(row, stops)]) for row in new]
