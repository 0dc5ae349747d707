"""Every choice that depends on the backend a step runs on, in one table, each with its reason.

The backend is read from the devices the program is built for (a mesh's, or a TPU topology's
from `jax.experimental.topologies`), never from ``jax.default_backend()``: a TPU program compiled
on a CPU host, as `shardlib plan --topology` and the TPU-compilation tests do, gets the TPU
policy. On GPU and TPU the step is plain JAX unless a measurement says otherwise; the XLA:CPU
entries exist to make simulated devices on a few cores fast and stable, and stay there.

`policy_for(devices)` answers; `forced(platform)` makes every step built inside it take that
backend's policy (tests use it to run the accelerator branches on CPU devices).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class BackendPolicy:
    """What the step does differently on one backend. The reasons and measurements are in
    docs/backends.md; the TPU-compilation tests (tests/test_tpu_compile.py) check the accelerator
    entries in the compiled TPU program, the CPU tests the CPU entries."""

    platform: str
    # XLA:CPU: a weight gradient is reduced in its matmul's order ([out, in]) behind an
    # optimization barrier, so XLA:CPU keeps the weight-gradient matmul fused (13 unfused dots a
    # step otherwise; tests/test_matmul_order.py). Other backends take transposed operands as
    # they are: no barrier, no copy.
    matmul_order: bool
    # XLA:CPU: the ZeRO-3 gather of a matrix's first dim is a custom_vjp whose backward
    # reduce-scatters the matmul-ordered cotangent; elsewhere autodiff's own all-gather /
    # reduce-scatter pair (which also keeps forward-mode differentiation).
    custom_vjp_gather: bool
    # Cast weight shards to the compute dtype before the ZeRO-3 gather (half the bytes on the
    # wire). Not on XLA:CPU: it aborts compiling some low-precision reduce-scatters
    # (ChangeOpDataType, jaxlib 0.10.2) and upcasts bf16 collectives to f32 anyway.
    cast_before_gather: bool
    # zero1/zero2: split the optimizer state on a kernel's last (output) dim, the major dim of the
    # weight-gradient matmul's result, so XLA:CPU's reduce-scatter reads it as it is. Elsewhere the
    # largest dim the axes divide, as for every other strategy.
    state_from_last: bool
    # Steps dispatched before the loop waits for one: XLA:CPU's simulated collectives deadlock
    # with many queued steps (seen after ~50 on jaxlib 0.10.2), so one; on an accelerator the
    # next step is queued while one runs and its batch is placed a step ahead.
    steps_in_flight: int
    # The attention a `shardlib train` model uses (models.GPTConfig.attention).
    attention: str
    # Pack reduce-scatters into buckets (`build(bucket_bytes=)`: one collective per bucket of
    # concatenated gradients). XLA:TPU rewrites a bucket's reduce-scatter as an all-reduce of the
    # whole bucket (twice the bytes; v5e:2x4, zero1, jaxlib 0.10.2), so there each tensor is
    # reduce-scattered on its own; all-reduce buckets (dp, hsdp's data axis) stay.
    bucket_scatters: bool = True
    # The memory kind `offload="opt_state"` keeps the optimizer state in.
    host_memory: str = "pinned_host"
    # XLA options a train step compiles with when it reduces gradients in a dtype narrower than
    # float32 (`Precision.reduce_dtype=bf16`). XLA:CPU: its AllReducePromotion pass, which widens
    # bf16 all-reduces and reduce-scatters to f32, aborts the process on a train step's bf16
    # reduce-scatter (`Invalid binary instruction opcode copy`, jaxlib 0.10.2; docs/design.md);
    # without the pass the step compiles, and the optimised program still reduces in f32.
    narrow_reduce_options: tuple[tuple[str, str], ...] = ()
    # The optimised program runs bf16 collectives in float32 (XLA:CPU's AllReducePromotion), so
    # `shardlib plan` counts bf16 collectives from the module right after SPMD partitioning.
    # XLA:TPU and XLA:GPU keep bf16 on the wire: their optimised program is read as it is.
    widens_bf16_collectives: bool = False
    # Metrics (loss, aux) are summed over devices in float32 on every backend: a bf16 psum of a
    # metric aborts XLA:CPU (AllReducePromotion) and loses digits everywhere.
    f32_metric_sums: bool = True
    # XLA options every train and eval step compiles with on this backend (docs/tpu.md says what
    # each changed in a program compiled here). A key the user sets in LIBTPU_INIT_ARGS is left to
    # that; `build(compiler_options=)` / `--xla-options` override both (`compiler_options`).
    compiler_options: tuple[tuple[str, str], ...] = ()
    # Dropless MoE sends each device exactly its tokens with `jax.lax.ragged_all_to_all`
    # (`shardlib.model.experts`); XLA:CPU has no such collective: there the groups travel padded.
    ragged_all_to_all: bool = True
    # A reduce-scatter over every device of the mesh goes in two partial stages where the compiler
    # would run it as an all-reduce, twice the bytes (`shardlib.sharding.staged`: XLA:TPU on
    # v5p, v5e:4x4, v6e; the compiler is asked once per device set).
    stage_whole_scatters: bool = False


# XLA:TPU decomposes a 1-D all-gather over a 3-D torus (v5p:4x4x4) into an all-reduce of a
# zero-filled buffer: 7 all-reduces and no all-gather in a 4-layer FSDP MLP over 64 chips. With
# these, the same program has 9 all-gathers and 3 all-reduces (jax 0.10.2, libtpu 0.0.42.1); on
# v5e:2x4 the gathers are real either way. The same group MaxText sets for FSDP on v5p
# (its CF_FOR_ALL_GATHER and DATA_PARALLEL_OVERLAP flag groups).
TPU_COLLECTIVE_OPTIONS: tuple[tuple[str, str], ...] = (
    ("xla_tpu_enable_async_collective_fusion", "true"),
    ("xla_tpu_enable_async_collective_fusion_fuse_all_gather", "true"),
    ("xla_tpu_enable_async_collective_fusion_multiple_steps", "true"),
    ("xla_tpu_overlap_compute_collective_tc", "true"),
    ("xla_enable_async_all_gather", "true"),
    ("xla_tpu_prefer_async_allgather_to_allreduce", "true"),
)


POLICIES: dict[str, BackendPolicy] = {
    "cpu": BackendPolicy("cpu", matmul_order=True, custom_vjp_gather=True, cast_before_gather=False,
                         state_from_last=True, steps_in_flight=1, attention="einsum", widens_bf16_collectives=True,
                         narrow_reduce_options=(("xla_disable_hlo_passes", "all-reduce-promotion"),),
                         ragged_all_to_all=False),
    "gpu": BackendPolicy("gpu", matmul_order=False, custom_vjp_gather=False, cast_before_gather=True,
                         state_from_last=False, steps_in_flight=2, attention="cudnn"),
    "tpu": BackendPolicy("tpu", matmul_order=False, custom_vjp_gather=False, cast_before_gather=True,
                         state_from_last=False, steps_in_flight=2, bucket_scatters=False, attention="splash",
                         compiler_options=TPU_COLLECTIVE_OPTIONS, stage_whole_scatters=True),
}
# JAX's platform names for the same backends.
_ALIASES = {"cuda": "gpu", "rocm": "gpu"}

_FORCED: contextvars.ContextVar[str | None] = contextvars.ContextVar("shardlib_backend", default=None)


def platform_of(devices: Any) -> str:
    """The platform of a mesh's devices, a list of devices, or one device ("cpu", "gpu", "tpu")."""
    if hasattr(devices, "devices"):  # a Mesh: its ndarray of devices
        devices = devices.devices
    if hasattr(devices, "flat"):
        devices = list(devices.flat)
    if not isinstance(devices, (list, tuple)):
        devices = [devices]
    if not devices:
        raise ValueError("platform_of: no devices")
    platforms = {_ALIASES.get(d.platform, d.platform) for d in devices}
    if len(platforms) != 1:
        raise ValueError(f"a mesh spans devices of several platforms {sorted(platforms)}; use one")
    return platforms.pop()


def get_policy(platform: str) -> BackendPolicy:
    """The policy of a platform name ("cpu", "gpu", "tpu"; JAX's "cuda" / "rocm" are "gpu")."""
    name = _ALIASES.get(platform, platform)
    if name not in POLICIES:
        raise ValueError(f"no backend policy for platform {platform!r}; known: {', '.join(POLICIES)}")
    return POLICIES[name]


def policy_for(devices: Any) -> BackendPolicy:
    """The policy for a mesh's devices (or a device list); `forced` wins over the devices."""
    return get_policy(_FORCED.get() or platform_of(devices))


def step_compiler_options(devices: Any, reduce_dtype: Any = None,
                          given: Mapping[str, Any] | None = None) -> dict[str, str] | None:
    """The XLA options of a step on ``devices`` that reduces its gradients in ``reduce_dtype``
    (None: no options): the policy's own, less any key ``LIBTPU_INIT_ARGS`` sets, the narrow-
    reduction ones when the gradients are reduced below float32, then ``given`` (the user's) over
    all. Read from the devices' own policy, never a `forced` one: they are for the compiler that
    really compiles the step."""
    import numpy as np

    policy = get_policy(platform_of(devices))
    from_env = env_option_keys()
    options = {k: v for k, v in policy.compiler_options if k not in from_env}
    if reduce_dtype is not None and np.dtype(reduce_dtype).itemsize < 4:
        options.update(policy.narrow_reduce_options)
    options.update({k: _option_text(v) for k, v in (given or {}).items()})
    return options or None


def env_option_keys() -> set[str]:
    """The option names set in ``LIBTPU_INIT_ARGS`` (``--name=value`` words), which libtpu reads at start."""
    import os

    words = os.environ.get("LIBTPU_INIT_ARGS", "").split()
    return {w.lstrip("-").split("=", 1)[0] for w in words if w.startswith("--")}


def _option_text(value: Any) -> str:
    """An option value as XLA reads it: booleans lower case, everything else as written."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def parse_options(text: str | None) -> dict[str, str]:
    """``"key=value,key2=value2"`` (``--xla-options``) -> a dict; a word without ``=`` is refused."""
    options = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"XLA option {item!r} is not of the form name=value (e.g. "
                             "xla_tpu_enable_async_collective_fusion=true)")
        options[key.strip().lstrip("-")] = value.strip()
    return options


def check_options(options: Mapping[str, str]) -> None:
    """`ValueError` naming the first option this backend's compiler does not take (an unknown name,
    a value of the wrong kind), found by compiling a one-operation program with them (milliseconds):
    otherwise XLA names it only after the step's compile."""
    if not options:
        return
    import jax
    import numpy as np

    try:
        jax.jit(lambda x: x + 1).lower(np.float32(0)).compile(compiler_options=dict(options))
    except jax.errors.JaxRuntimeError as err:
        raise ValueError(f"{' '.join(str(err).split())} (the options given: "
                         f"{', '.join(f'{k}={v}' for k, v in options.items())})") from None


@contextlib.contextmanager
def forced(platform: str) -> Iterator[BackendPolicy]:
    """Make and build layouts and steps inside this block with ``platform``'s policy, whatever the
    devices are (`shardlib.make_layout` and `shardlib.build` resolve it; a step keeps the policy
    it was built with, wherever it is later traced or run)."""
    policy = get_policy(platform)
    token = _FORCED.set(policy.platform)
    try:
        yield policy
    finally:
        _FORCED.reset(token)


__all__ = ["POLICIES", "TPU_COLLECTIVE_OPTIONS", "BackendPolicy", "check_options", "env_option_keys", "forced",
           "get_policy", "parse_options", "platform_of", "policy_for", "step_compiler_options"]


# libtpu (the `tpu` extra, in `dev`) loads wherever it is installed: JAX probes it for chips and a
# TPU-topology compile uses it. On a host without TPUs it asks the cloud metadata server what it
# runs on and prints the failures ("Failed to find host bounds", "E0000 ... unexpected worker
# hostname"), which read like a crash; these answers leave it nothing to ask. Nothing else reads
# them there: a host with chips is left alone (`tpu_attached`). Only the places that choose
# devices set them (the CLI, `make_mesh`, `simulate_cpu_devices`), never `import shardlib`.
NO_TPU_ENV = {"TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": "v5p-8", "TPU_WORKER_HOSTNAMES": "localhost"}


def tpu_attached() -> bool:
    """Whether this host has TPU chips: their device files (``/dev/accel*``, ``/dev/vfio/N``), read without libtpu."""
    import glob

    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def quiet_libtpu() -> None:
    """On a host without TPUs, set `NO_TPU_ENV` (values already set win); callers do it before
    a JAX backend starts, as libtpu reads them when it loads."""
    import os

    if tpu_attached():
        return
    for name, value in NO_TPU_ENV.items():
        os.environ.setdefault(name, value)
