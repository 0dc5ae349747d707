"""Simulated CPU devices and the one XLA flag every multi-device CPU run needs.

XLA:CPU aborts a collective that some device thread joins more than 40 s late. Many simulated
devices on a few loaded cores reach that (seen with 8 devices on 2 cores), so every
multi-device CPU run raises the watchdog to 15 minutes. This module is the one place that
knows the flag; it imports JAX only inside `simulate_cpu_devices`, so launchers stay light.
"""

from __future__ import annotations

import math
import os

CPU_COLLECTIVE_TIMEOUT_FLAG = "--xla_cpu_collective_call_terminate_timeout_seconds=900"


from shardlib.backend import quiet_libtpu


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
        quiet_libtpu()  # a TPU-topology compile later loads libtpu all the same
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", n)
    have = len(jax.devices("cpu"))
    if have != n:
        raise RuntimeError(
            f"JAX already started with {have} CPU devices in this process, so {n} cannot be simulated: "
            f"call shardlib.simulate_cpu_devices({n}) before any JAX computation, or restart the process"
        )
    return have


class TopologyError(ValueError):
    """A TPU topology that cannot be compiled for here (shown as one line by the CLI)."""

    user_facing = True


# Cloud TPU's slice names count TensorCores on v4 and v5p (two a chip) and chips on v5e and v6e;
# JAX's topology names give the chips' torus (3-D on v4 / v5p, 2-D on v5e / v6e).
_SLICE_GENERATIONS = {"v4": ("v4", 2, 3), "v5p": ("v5p", 2, 3), "v5e": ("v5e", 1, 2), "v5litepod": ("v5e", 1, 2),
                      "v6e": ("v6e", 1, 2)}
_SLICE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def cloud_tpu_topology(name: str) -> tuple[str, str | None]:
    """(JAX's topology name, a note saying which shape it is) for a Cloud TPU slice name
    (``v5p-128`` -> ``v5p:4x4x4``, 64 chips); a JAX name is returned as it is, with no note. A
    slice name that does not exist is refused naming the nearest ones."""
    import difflib
    import re

    match = re.fullmatch(r"(v4|v5p|v5e|v5litepod|v6e)-(\d+)", name.strip().lower())
    if ":" in name or not re.fullmatch(r"[a-z0-9]+-\d+", name.strip().lower()):
        return name, None
    if match is None:
        known = [f"{g}-{n * cores}" for g, (_, cores, _) in _SLICE_GENERATIONS.items() for n in _SLICE_SIZES[2:8]]
        close = difflib.get_close_matches(name.lower(), known, n=3, cutoff=0.5)
        raise TopologyError(f"TPU slice {name!r} (--topology) is not a Cloud TPU name shardlib knows (v4-N, v5p-N, "
                            f"v5e-N, v6e-N, or JAX's GENERATION:SHAPE such as v5p:4x4x4)"
                            + (f"; did you mean {' or '.join(close)}?" if close else ""))
    generation, count = match.group(1), int(match.group(2))
    jax_generation, cores, dims = _SLICE_GENERATIONS[generation]
    chips, rest = divmod(count, cores)
    if rest or chips not in _SLICE_SIZES or (dims == 3 and chips < 4):
        sizes = [n * cores for n in _SLICE_SIZES if (dims == 2 or n >= 4)]
        nearest = sorted(sizes, key=lambda n: abs(n - count))[:2]
        raise TopologyError(f"TPU slice {name!r}: {generation} slices come in {', '.join(map(str, sizes[:8]))}, ... "
                            f"({'TensorCores' if cores == 2 else 'chips'}); did you mean "
                            f"{' or '.join(f'{generation}-{n}' for n in nearest)}?")
    shape = [1] * dims
    while math.prod(shape) < chips:  # double the last of the smallest dims: 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4
        smallest = min(shape)
        last = max(i for i, d in enumerate(shape) if d == smallest)
        shape[last] *= 2
    if dims == 3 and shape == [1, 2, 2]:
        shape = [2, 2, 1]
    jax_name = f"{jax_generation}:{'x'.join(map(str, shape))}"
    counted = f", {count} TensorCores" if cores == 2 else ""
    return jax_name, f"{name} is {jax_name} ({chips} chips{counted})"


def topology_devices(name: str, slices: int = 1) -> list:
    """The chips of a TPU topology (JAX's names: ``v5e:2x4``, ``v5p:4x4x4``, ``v6e:8x8``), for compiling
    a real TPU program on a host without TPUs (`jax.experimental.topologies`; nothing runs on them).

    ``slices`` > 1 gives a multi-slice topology: that many copies joined by DCN, slice-major.
    It needs the TPU compiler (libtpu, ``pip install "jax[tpu]==<the installed jax>"``). libtpu
    guards the chips of a TPU VM with a lockfile that one process holds; compiling for an
    abstract topology touches no chip, so this process does not take the lock (the test
    workers and a plan beside a training job would otherwise refuse each other).
    """
    import importlib.util

    import jax

    if slices < 1:
        raise TopologyError(f"--slices must be at least 1, got {slices}")
    if importlib.util.find_spec("libtpu") is None:
        raise TopologyError(f"compiling for the TPU topology {name!r} needs the TPU compiler (libtpu): "
                            f'pip install "jax[tpu]=={jax.__version__}"')
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    name = cloud_tpu_topology(name)[0]
    try:
        description = topologies.get_topology_desc(topology_name=name, platform="tpu", num_slices=slices)
    except Exception as err:  # libtpu's error for an unknown name is a bare RuntimeError / JaxRuntimeError
        raise TopologyError(f"TPU topology {name!r} (--topology) is not one libtpu knows: "
                            f"{' '.join(str(err).split())[:200]}; write GENERATION:SHAPE, e.g. v5e:2x4, "
                            "v5p:4x4x4, v6e:8x8") from None
    return list(description.devices)
