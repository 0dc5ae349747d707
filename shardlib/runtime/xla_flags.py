"""XLA's GPU flags for overlapping communication with compute, set before JAX starts.

Under ZeRO-3 every layer's weights are all-gathered and its gradients reduce-scattered; on a GPU
those collectives only hide behind the matmuls if XLA schedules them to. XLA does not by default,
so `set_gpu_overlap_flags` adds the flags below to ``XLA_FLAGS``. XLA reads ``XLA_FLAGS`` once,
when the backend starts, so this must run before any JAX computation (an error says so after).
A flag already in ``XLA_FLAGS`` is left as the user wrote it. Every flag is ``xla_gpu_*``, so on
CPU and TPU nothing is set and a note says why.

| flag (all ``--xla_gpu_...``)               | value   | why                                           | source        |
|--------------------------------------------|---------|-----------------------------------------------|---------------|
| ``enable_latency_hiding_scheduler``        | true    | starts async collectives early, under compute | JAX, TBX      |
| ``enable_highest_priority_async_stream``   | true    | collectives on a high-priority stream         | TBX, MT       |
| ``all_reduce_combine_threshold_bytes``     | 128 MiB | merges small all-reduces                      | JAX; MT value |
| ``all_gather_combine_threshold_bytes``     | 128 MiB | merges a layer's weight all-gathers           | JAX; MT value |
| ``reduce_scatter_combine_threshold_bytes`` | 64 MiB  | merges a layer's gradient reduce-scatters     | JAX; MT value |
| ``enable_all_gather_combine_by_dim``       | false   | combines across gather dimensions too         | TBX, MT       |
| ``enable_reduce_scatter_combine_by_dim``   | false   | the same for reduce-scatters                  | TBX, MT       |
| ``enable_pipelined_all_gather``            | true    | gathers layer i+1 while layer i computes      | TBX, MT       |
| ``enable_pipelined_reduce_scatter``        | true    | reduce-scatters grads during the next layer   | TBX, MT       |
| ``enable_pipelined_all_reduce``            | true    | the same for all-reduces (dp, hsdp)           | TBX, MT       |
| ``enable_while_loop_double_buffering``     | true    | double-buffers the layer scan for the above   | TBX, MT       |

JAX: "GPU performance tips" (its "Flags" list), https://docs.jax.dev/en/latest/gpu_performance_tips.html
TBX: NVIDIA JAX-Toolbox "GPU performance" (rosetta/docs/GPU_performance.md; the latency-hiding
     scheduler is also baked into NVIDIA's JAX image),
     https://docs.nvidia.com/jax-toolbox/performance-profiling/gpu-performance
MT:  MaxText's A3 (H100) Llama2-7B recipe, end_to_end/gpu/a3/test_llama2_7b.sh in
     https://github.com/AI-Hypercomputer/maxtext

Every flag is known to the jaxlib shardlib is tested with (0.10.2); XLA aborts on an unknown
flag, so `tests/test_gpu_readiness.py` starts a process with all of them to catch one a JAX
release removes. Measured effect: docs/gpu.md.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence

GPU_OVERLAP_FLAGS: tuple[tuple[str, str], ...] = (
    ("xla_gpu_enable_latency_hiding_scheduler", "true"),
    ("xla_gpu_enable_highest_priority_async_stream", "true"),
    ("xla_gpu_all_reduce_combine_threshold_bytes", str(128 * 2**20)),
    ("xla_gpu_all_gather_combine_threshold_bytes", str(128 * 2**20)),
    ("xla_gpu_reduce_scatter_combine_threshold_bytes", str(64 * 2**20)),
    ("xla_gpu_enable_all_gather_combine_by_dim", "false"),
    ("xla_gpu_enable_reduce_scatter_combine_by_dim", "false"),
    ("xla_gpu_enable_pipelined_all_gather", "true"),
    ("xla_gpu_enable_pipelined_reduce_scatter", "true"),
    ("xla_gpu_enable_pipelined_all_reduce", "true"),
    ("xla_gpu_enable_while_loop_double_buffering", "true"),
)

_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def flag_names(xla_flags: str) -> set[str]:
    """The names set in an ``XLA_FLAGS`` value (``--name=value`` or a bare ``--name``)."""
    return {token.lstrip("-").split("=", 1)[0] for token in shlex.split(xla_flags) if token.startswith("-")}


def with_flags(xla_flags: str, flags: Sequence[tuple[str, str]] = GPU_OVERLAP_FLAGS) -> str:
    """``xla_flags`` with each of ``flags`` appended unless it names it already (the user's value wins)."""
    present = flag_names(xla_flags)
    added = [f"--{name}={value}" for name, value in flags if name not in present]
    return " ".join([xla_flags.strip(), *added]).strip()


def _platform_before_start() -> tuple[bool, str]:
    """(GPU expected?, what decided it), read without starting the backend.

    ``JAX_PLATFORMS`` (or ``jax.config.jax_platforms``) decides when set; else a GPU is expected
    exactly when a JAX CUDA/ROCm plugin is installed (that is how JAX finds GPUs).
    """
    import importlib.util
    import pkgutil

    import jax

    platforms = jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        first = platforms.split(",")[0].strip().lower()
        return first in _GPU_PLATFORMS, f"JAX_PLATFORMS={platforms}"
    spec = importlib.util.find_spec("jax_plugins")
    plugins = [m.name for m in pkgutil.iter_modules(spec.submodule_search_locations)] if spec else []
    gpu = [name for name in plugins if "cuda" in name or "rocm" in name]
    return bool(gpu), f"JAX GPU plugin {gpu[0]}" if gpu else "no JAX CUDA/ROCm plugin installed"


def set_gpu_overlap_flags(platform: str | None = None) -> str:
    """Add `GPU_OVERLAP_FLAGS` to ``os.environ["XLA_FLAGS"]`` before JAX starts; returns a one-line note.

    ``platform`` ("gpu", "cuda", "rocm", "cpu", "tpu") overrides the guess made before the
    backend starts (``JAX_PLATFORMS``, else whether a JAX GPU plugin is installed). Off GPU the
    flags are not set: the note says so. Flags the user already set keep the user's value.
    """
    from shardlib.compat import backends_initialized

    if backends_initialized():
        raise RuntimeError(
            "set_gpu_overlap_flags: the JAX backend has already started in this process, and XLA reads "
            "XLA_FLAGS only at startup; call it before any JAX computation (first thing in the script), "
            "or set XLA_FLAGS in the shell (docs/gpu.md lists the flags)")
    if platform is not None:
        gpu, reason = platform.lower() in _GPU_PLATFORMS, f"platform={platform}"
    else:
        gpu, reason = _platform_before_start()
    if not gpu:
        return f"XLA GPU overlap flags not set ({reason}): they are GPU-only"
    before = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = with_flags(before)
    kept = sorted(flag_names(before) & {name for name, _ in GPU_OVERLAP_FLAGS})
    return (f"XLA GPU overlap flags set ({reason})"
            + (f"; kept your XLA_FLAGS value of {', '.join(kept)}" if kept else ""))


__all__ = ["GPU_OVERLAP_FLAGS", "flag_names", "set_gpu_overlap_flags", "with_flags"]
