"""Text from a trained model: `shardlib.models.gpt.generate_with` on bytes, with the params on one device."""

from __future__ import annotations

from typing import Any


def _gather_to_host(tree: Any) -> Any:
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(tree, tiled=True)
    return jax.device_get(tree)


def sample_text(model, params: Any, prompt: str, n_tokens: int, *, context: int, seed: int = 0,
                temperature: float = 0.8) -> str:
    """Continue ``prompt`` by ``n_tokens`` bytes with ``model.apply`` (one device, full params).

    A ``context``-long window slides over the text (see `generate_with`), so the sample may be
    longer than the model's sequence length.
    """
    import jax
    import numpy as np

    from shardlib.models.gpt import generate_with
    from shardlib.runtime.data import decode, encode

    if model.apply is None:
        raise ValueError("sample_text: this model has no apply function (Model.apply is None)")
    ids = encode(prompt or "\n")[-context:]
    params = jax.device_put(_gather_to_host(params), jax.local_devices()[0])
    tokens = generate_with(model.apply, params, ids[None], n_tokens, rng=jax.random.key(seed), window=context,
                           temperature=temperature)
    return prompt + decode(np.asarray(tokens[0]))
