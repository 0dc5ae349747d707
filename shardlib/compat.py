"""The one place shardlib reaches into JAX past its public API, so a JAX release that moves
something breaks here, with an error that names it, and not deep inside a training run.

Which JAX versions were checked (the range pyproject.toml allows, jax>=0.10.2,<0.13): the
sources of jax 0.10.2, 0.11.2 and 0.12.0.1. In all three, every public name shardlib uses is
present with the same signature: ``jax.shard_map(f, mesh=, in_specs=, out_specs=,
axis_names=)``, ``jax.sharding.AxisType`` (Auto/Explicit/Manual), ``jax.lax.pcast(x, axes,
to="varying")``, ``jax.typeof(x).mat.varying`` (also ``.manual_axis_type``), the
``jax_num_cpu_devices`` / ``jax_platforms`` options, and memory kinds (``Sharding.memory_kind``,
``with_memory_kind("pinned_host" | "device")``: offloaded optimizer state, `shardlib.step.offload`).
So none of them needs a shim, and none is written: ``jax.experimental.shard_map`` and
``jax.lax.pvary`` (removed in jax 0.10.0 in favour of ``pcast``) are not used. jax 0.11 removed
names from ``jax.core`` and ``jax.interpreters`` (moved to ``jax.extend``); shardlib uses neither module.

What remains are JAX's private modules below (present and unchanged in 0.10.2 to 0.12.0.1, but
with no promise, so each is looked up here alone) and one private hook of CPython's ``threading``.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["at_exit_before_threads", "backends_initialized", "bind_cpu_collectives", "cluster_env", "distributed_state", "on_cloud_tpu_vm",
           "varying_axes"]


def _private(module: str, name: str) -> Any:
    """``jax._src.<module>.<name>``, or an error naming it and the tested JAX range."""
    import importlib

    try:
        return getattr(importlib.import_module(f"jax._src.{module}"), name)
    except (ImportError, AttributeError) as e:
        raise RuntimeError(
            f"shardlib needs jax._src.{module}.{name}, which jax {jax.__version__} does not have; "
            "shardlib is tested with jax>=0.10.2,<0.13 (docs/install.md): install a jax in that range"
        ) from e


def backends_initialized() -> bool:
    """True once a JAX backend started in this process; after that the CPU device count and the
    platform can no longer change. JAX has no public call for this (private in 0.10.2-0.12.0.1)."""
    return bool(_private("xla_bridge", "backends_are_initialized")())


def bind_cpu_collectives(hostname: str | None, interface: str | None) -> bool:
    """Make the CPU backend's gloo collectives listen on ``hostname`` or ``interface``; False when
    JAX does not use gloo. JAX creates them with neither (``jax._src.xla_bridge.make_cpu_client``),
    so they listen wherever this host's name resolves, a LAN address on most machines. Call after
    ``jax.distributed.initialize`` and before the backend starts (private in 0.10.2)."""
    if jax.config.jax_cpu_collectives_implementation != "gloo":
        return False
    make_gloo = _private("lib", "_jax").make_gloo_tcp_collectives
    make_cpu_client = _private("xla_bridge", "make_cpu_client")

    def factory() -> Any:
        collectives = make_gloo(distributed_client=distributed_state().client, hostname=hostname, interface=interface)
        return make_cpu_client(collectives=collectives)

    _private("xla_bridge", "register_backend_factory")("cpu", factory, priority=0, fail_quietly=False)
    return True


def distributed_state() -> Any:
    """``jax.distributed``'s process state (its client and preemption sync manager), which JAX
    does not expose publicly (private ``global_state`` in 0.10.2-0.12.0.1)."""
    return _private("distributed", "global_state")


def on_cloud_tpu_vm() -> bool:
    """Whether this process runs on a Cloud TPU VM, as JAX's own TPU setup decided (private
    ``cloud_tpu_init.running_in_cloud_tpu_vm``); False where that name is gone."""
    try:
        return bool(_private("cloud_tpu_init", "running_in_cloud_tpu_vm"))
    except RuntimeError:
        return False


def cluster_env() -> Any:
    """JAX's cluster detection (SLURM, Open MPI...: private ``clusters.ClusterEnv``), which
    `jax.distributed.initialize` runs without saying what it found."""
    return _private("clusters", "ClusterEnv")


def at_exit_before_threads(fn: Callable[[], None]) -> None:
    """Run ``fn`` at interpreter exit while worker threads still run (CPython's private
    ``threading._register_atexit``, what ``concurrent.futures`` uses); plain ``atexit`` where
    it is missing, which runs later but still runs."""
    getattr(threading, "_register_atexit", atexit.register)(fn)


def varying_axes(x: Any) -> frozenset[str]:
    """The manual mesh axes ``x`` varies over inside a ``shard_map`` (empty outside one): its type's
    ``vma`` in newer JAX, ``manual_axis_type.varying`` in 0.10.2."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        manual = getattr(aval, "manual_axis_type", None)
        vma = manual.varying if manual is not None else ()
    return frozenset(vma)
