"""Text from a trained model: one compiled forward pass over a sliding byte window."""

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

    A fixed ``context``-long window slides over the text, so one compiled forward pass serves
    every position: while the window is filling, logits are read at the last real token
    (attention is causal, so later padding does not affect it); once full, it shifts by one.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    from shardlib.runtime.data import decode, encode

    if model.apply is None:
        raise ValueError("sample_text: this model has no apply function (Model.apply is None)")
    ids = encode(prompt or "\n")[-context:]
    device = jax.local_devices()[0]
    params = jax.device_put(_gather_to_host(params), device)
    window = np.zeros((context,), np.int32)
    window[: len(ids)] = ids

    @jax.jit
    def run(params, window, length, key):
        def body(i, carry):
            window, length, out = carry
            logits = model.apply(params, window[None])[0, length - 1].astype(jnp.float32)
            token = jax.random.categorical(jax.random.fold_in(key, i), logits / temperature).astype(jnp.int32)
            full = length >= context
            shifted = jnp.roll(window, -1).at[context - 1].set(token)
            window = jnp.where(full, shifted, window.at[jnp.minimum(length, context - 1)].set(token))
            return window, jnp.minimum(length + 1, context), out.at[i].set(token)

        init = (window, length, jnp.zeros((n_tokens,), jnp.int32))
        return jax.lax.fori_loop(0, n_tokens, body, init)[2]

    tokens = run(params, jnp.asarray(window), jnp.int32(len(ids)), jax.random.key(seed))
    return prompt + decode(np.asarray(tokens))
