"""Rotary scalings beyond Llama 3.1's, each computed as transformers computes it.

``rope_type`` in a checkpoint's ``rope_parameters`` picks one: ``linear`` divides every frequency
by ``factor``; ``yarn`` blends the interpolated (``/ factor``) and original frequencies along a
ramp between the correction dimensions of ``beta_fast`` and ``beta_slow`` rotations, and scales
sin and cos by an attention factor; ``dynamic`` (NTK) raises the base only once a sequence is
longer than ``max_position_embeddings``, so up to that length it is the default rope (longer
runs are refused where the checkpoint is read). `to_hf` gives back the fields that reproduce it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp


def _base_powers(head_dim: int, theta: float) -> jnp.ndarray:
    """float32 ``theta^(2i / head_dim)``, in transformers' order of operations."""
    return theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearRope:
    """``rope_type: linear``: positions interpolated ``factor`` times (every frequency divided)."""

    factor: float
    attention_factor = 1.0

    def frequencies(self, head_dim: int, theta: float) -> jnp.ndarray:
        return (1.0 / _base_powers(head_dim, theta)) / self.factor

    def to_hf(self) -> dict[str, Any]:
        return {"rope_type": "linear", "factor": self.factor}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DynamicRope:
    """``rope_type: dynamic``: the default rope up to ``max_len`` (``max_position_embeddings``);
    past it transformers raises the base per forward, which is refused where the checkpoint is read."""

    factor: float
    max_len: int
    attention_factor = 1.0

    def frequencies(self, head_dim: int, theta: float) -> jnp.ndarray:
        return 1.0 / _base_powers(head_dim, theta)

    def to_hf(self) -> dict[str, Any]:
        return {"rope_type": "dynamic", "factor": self.factor}


@dataclasses.dataclass(frozen=True, kw_only=True)
class YarnRope:
    """``rope_type: yarn`` (YaRN): interpolation below the ``beta_slow`` correction dimension,
    extrapolation above ``beta_fast``'s, a linear ramp between; sin and cos times ``attention_factor``
    (resolved from ``mscale`` / ``mscale_all_dim`` or 0.1 ln(factor) + 1 where the file leaves it out)."""

    factor: float
    original_max_len: int
    attention_factor: float
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True

    def _correction_dim(self, rotations: float, head_dim: int, theta: float) -> float:
        return head_dim * math.log(self.original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    def frequencies(self, head_dim: int, theta: float) -> jnp.ndarray:
        low = self._correction_dim(self.beta_fast, head_dim, theta)
        high = self._correction_dim(self.beta_slow, head_dim, theta)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        powers = _base_powers(head_dim, theta)
        ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
        extrapolated = 1 - ramp
        return (1.0 / (self.factor * powers)) * (1 - extrapolated) + (1.0 / powers) * extrapolated

    def to_hf(self) -> dict[str, Any]:
        return {"rope_type": "yarn", "factor": self.factor, "original_max_position_embeddings": self.original_max_len,
                "attention_factor": self.attention_factor, "beta_fast": self.beta_fast, "beta_slow": self.beta_slow,
                "truncate": self.truncate}


def yarn_attention_factor(factor: float, mscale: float | None, mscale_all_dim: float | None) -> float:
    """transformers' default YaRN attention factor: 0.1 ln(factor) + 1, or the ratio of the two
    mscales' when both are given (DeepSeek's form); 1 for factor <= 1."""
    def get(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    if mscale and mscale_all_dim:
        return float(get(factor, mscale) / get(factor, mscale_all_dim))
    return get(factor)
