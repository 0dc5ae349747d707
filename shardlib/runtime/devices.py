"""Simulated CPU devices and the one XLA flag every multi-device CPU run needs.

XLA:CPU aborts a collective that some device thread joins more than 40 s late. Many simulated
devices on a few loaded cores reach that (seen with 8 devices on 2 cores), so every
multi-device CPU run raises the watchdog to 15 minutes. This module is the one place that
knows the flag; it imports JAX only inside `simulate_cpu_devices`, so launchers stay light.
"""

from __future__ import annotations

import os

CPU_COLLECTIVE_TIMEOUT_FLAG = "--xla_cpu_collective_call_terminate_timeout_seconds=900"


def with_cpu_collective_timeout(flags: str) -> str:
    """``flags`` (an XLA_FLAGS value) with the CPU collective watchdog raised, unless it is set."""
    name = CPU_COLLECTIVE_TIMEOUT_FLAG.split("=")[0]
    return flags if name in flags else f"{flags} {CPU_COLLECTIVE_TIMEOUT_FLAG}".strip()


def raise_cpu_collective_timeout() -> None:
    """Raise the watchdog for this process; effective only before the JAX backend starts."""
    os.environ["XLA_FLAGS"] = with_cpu_collective_timeout(os.environ.get("XLA_FLAGS", ""))


def simulate_cpu_devices(n: int) -> int:
    """Make this process see ``n`` CPU devices; call it first, before any JAX computation.

    On a machine without an accelerator, ``shardlib.simulate_cpu_devices(8)`` at the top of a
    script gives 8 devices to build meshes over. Returns the device count JAX then sees. If the
    backend has already started (a notebook cell ran JAX first), the count cannot change: an
    error says so unless it already matches.
    """
    if n < 1:
        raise ValueError(f"simulate_cpu_devices needs a positive device count, got {n}")
    raise_cpu_collective_timeout()
    import jax
    from shardlib.compat import backends_initialized

    if not backends_initialized():
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", n)
    have = len(jax.devices("cpu"))
    if have != n:
        raise RuntimeError(
            f"JAX already started with {have} CPU devices in this process, so {n} cannot be simulated: "
            f"call shardlib.simulate_cpu_devices({n}) before any JAX computation, or restart the process"
        )
    return have
