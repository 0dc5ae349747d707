"""FLOP counts and model FLOP utilisation (MFU); peak FLOP/s come from the hardware profiles."""

from __future__ import annotations

from typing import Any

from shardlib.tools.hardware import profile_for_device


def flops_per_step(compiled: Any) -> float | None:
    """XLA's FLOP count for one execution on one device, or None if the backend gives none.

    Caveat (verified on jax 0.10.2 CPU): XLA's cost analysis counts a ``while`` body once, not
    once per iteration, so scanned models are under-counted; use analytic model FLOPs for MFU.
    """
    try:
        cost = compiled.cost_analysis()
    except Exception:  # some backends raise instead of returning nothing
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    if not cost or "flops" not in cost:
        return None
    flops = float(cost["flops"])
    return flops if flops >= 0 else None


def mfu(model_flops_per_step: float, step_time_s: float, n_devices: int,
        peak_flops_per_device: float) -> float:
    """Model FLOP utilisation: achieved model FLOP/s over the devices' summed peak.

    ``model_flops_per_step`` is for the whole global batch (all devices together), e.g.
    6 x params x tokens for a transformer step, without remat recomputation.
    """
    if step_time_s <= 0 or n_devices <= 0 or peak_flops_per_device <= 0:
        raise ValueError(
            f"mfu needs positive step time, device count and peak: got step_time_s={step_time_s}, "
            f"n_devices={n_devices}, peak_flops_per_device={peak_flops_per_device}"
        )
    return model_flops_per_step / (step_time_s * n_devices * peak_flops_per_device)


def peak_flops_for(device: Any) -> float | None:
    """Dense bf16 peak FLOP/s of a ``jax.Device`` (or a device_kind string); None if unknown/CPU."""
    profile = profile_for_device(device)
    return None if profile is None else profile.peak_flops["bf16"]


__all__ = ["flops_per_step", "mfu", "peak_flops_for"]
