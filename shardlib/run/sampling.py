"""Text from a trained model: `shardlib.models.decoding.generate_with`, with the params on one device."""

from __future__ import annotations

from typing import Any

from shardlib.runtime.host import to_host


def sample_text(model, params: Any, prompt: str, n_tokens: int, *, context: int, seed: int = 0,
                temperature: float = 0.0, tokenizer: Any = None) -> str:
    """Continue ``prompt`` by up to ``n_tokens`` tokens with ``model.apply`` (one device, full
    params): bytes, or the ids of ``tokenizer`` (`shardlib.hf.tokenizer.Tokenizer`). Greedy unless
    ``temperature`` > 0; the text ends before the tokenizer's end-of-sequence token.

    A ``context``-long window slides over the text (see `generate_with`), so the sample may be
    longer than the model's sequence length.
    """
    import jax
    import numpy as np

    from shardlib.models.decoding import generate_with, until_stop
    from shardlib.runtime.data import decode, encode

    if model.apply is None:
        raise ValueError("sample_text: this model has no apply function (Model.apply is None)")
    ids = (np.asarray(tokenizer.encode(prompt or "\n"), np.int32) if tokenizer is not None
           else encode(prompt or "\n"))[-context:]
    stop = getattr(tokenizer, "eos_id", None)
    params = jax.device_put(to_host(params), jax.local_devices()[0])
    tokens = generate_with(model.apply, params, ids[None], n_tokens, rng=jax.random.key(seed), window=context,
                           temperature=temperature, stop_token=stop)
    new = until_stop(tokens[0], stop)
    return prompt + (tokenizer.decode(new) if tokenizer is not None else decode(new))
