"""`shardlib plan`'s candidates: the model config, the devices or TPU topology, the strategies and
each one's default mesh, and the row (`PlanRow`) one candidate fills in.

Nothing here compiles: `shardlib inspect` and the benchmarks take the same meshes from here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from shardlib.backend import platform_of
from shardlib.tools import hardware as hw

PRECISIONS: dict[str, str] = {"f32": "float32", "bf16": "bfloat16"}
ALL_STRATEGIES: tuple[str, ...] = ("dp", "zero1", "zero2", "zero3", "tp", "fsdp_tp", "hsdp")
HPZ_STRATEGIES: tuple[str, ...] = ("zero3_hpz",)  # planned by default only across link domains

# From this many tokens per sequence `plan` also tries context parallelism (the sequence split
# over a `context` axis): attention's [T x T] scores then outgrow the rest of the activations.
CONTEXT_SEQ_LEN = 4096


class PlanError(ValueError):
    """A plan that cannot be made as asked (shown as one line by the CLI)."""

    user_facing = True


@dataclasses.dataclass
class PlanRow:
    """One candidate (strategy x mesh): per-device memory, communication, FLOPs and estimated time.

    Bytes are per device; collective bytes are sent per device per step. ``error`` is set (and the
    figures left None) when the candidate cannot be built or compiled.
    """

    strategy: str
    mesh: dict[str, int]
    devices: int
    batch_size: int
    seq_len: int
    precision: str
    persistent_bytes: int | None = None
    params_bytes: int | None = None
    opt_state_bytes: int | None = None
    host_bytes: int | None = None  # state in host memory (offload), per device, from the compiled program
    offload: str = "none"
    fits_by_offload: bool = False  # fits, and would not with the host bytes in device memory
    argument_bytes: int | None = None
    temp_bytes: int | None = None
    peak_bytes: int | None = None
    transient_bytes: int | None = None  # peak - persistent: activations, gathered weights, gradients
    collective_bytes: dict[str, int] | None = None
    collective_total_bytes: int | None = None
    intra_domain_bytes: int | None = None
    inter_domain_bytes: int | None = None
    model_flops: float | None = None  # whole step, all devices, without remat recomputation
    flops_per_device: float | None = None  # with remat recomputation
    compute_s: float | None = None
    comm_s: float | None = None
    step_s: float | None = None  # max(compute, comm)
    step_serial_s: float | None = None  # compute + comm
    tokens_per_s: float | None = None
    mfu: float | None = None
    hbm_bytes: int | None = None
    fits: bool = False
    best: bool = False
    compile_s: float | None = None
    attention: str | None = None  # the attention kernel the compiled step runs (`plan_attention.kernel`)
    pipeline_stages: int = 1
    microbatches: int = 1
    bubble: float = 0.0  # (S-1)/(M+S-1) of a pipelined candidate
    stage_costs: dict[str, Any] | None = None  # pipelined: per-stage FLOPs / bytes, even split and chosen
    error: str | None = None
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def mesh_text(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.mesh.items() if v > 1) or "single"

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["mesh_text"] = self.mesh_text
        return out


# ----------------------------------------------------------------------------------------------
# Inputs: model config, devices, meshes
# ----------------------------------------------------------------------------------------------


def is_hf_config(model: str) -> bool:
    """Whether ``model`` names a Hugging Face config: a config.json, a directory holding one, or a hub id."""
    from shardlib.hf.hub_cache import is_hub_id

    path = Path(model).expanduser()
    return path.name == "config.json" and path.is_file() or (path / "config.json").is_file() or is_hub_id(model)


def _hf_config(model: str) -> Any:
    """The `GPTConfig` of a Hugging Face config.json (or the model directory holding one, or an
    ``org/name`` snapshot in the local Hugging Face cache): a plan needs the shapes only, so no
    weights need be present."""
    from shardlib.hf.architectures import UnsupportedModel, to_gpt_config
    from shardlib.hf.hub_cache import resolve

    try:
        path = resolve(model)[0].expanduser()  # org/name: the cached snapshot; a path: itself
        path = path if path.name == "config.json" else path / "config.json"
        return to_gpt_config(json.loads(path.read_text(encoding="utf-8")), str(path))
    except (UnsupportedModel, ValueError) as err:
        raise PlanError(f"{err} (--model)") from None


def resolve_config(model: Any, precision: str = "f32", remat: bool | None = None) -> Any:
    """A GPTConfig from a name or a config, with the plan's compute dtype (and remat) applied."""
    from shardlib.models import GPTConfig, get_config

    if precision not in PRECISIONS:
        raise PlanError(f"unknown precision {precision!r} (--precision); choose one of {', '.join(PRECISIONS)}")
    if isinstance(model, str) and is_hf_config(model):
        config = _hf_config(model)
    elif isinstance(model, str):
        try:
            config = get_config(model)
        except ValueError as err:
            raise PlanError(f"{err} or a Hugging Face config.json / model directory (--model)") from None
    elif isinstance(model, GPTConfig):
        config = model
    else:
        raise PlanError(f"plan needs a model config name or a models.GPTConfig, got {type(model).__name__}")
    changes: dict[str, Any] = {"compute_dtype": PRECISIONS[precision]}
    changes.update(remat_fields(remat))
    return dataclasses.replace(config, **changes)


def remat_fields(remat: bool | str | None) -> dict[str, Any]:
    """`GPTConfig` fields of a remat setting: None keeps the model's, False / "none" turns it off,
    True / a policy name (`models.configs.REMAT_POLICIES`) rematerialises with that policy."""
    from shardlib.models.configs import REMAT_POLICIES

    if remat is None:
        return {}
    if remat in (False, "none"):
        return {"remat": False}
    if remat is True:
        return {"remat": True}
    if remat not in REMAT_POLICIES:
        raise PlanError(f"unknown remat policy {remat!r} (--remat); choose none or one of {', '.join(REMAT_POLICIES)}")
    return {"remat": True, "remat_policy": remat}


def check_strategy(name: str) -> str:
    """The strategy's canonical name, or a PlanError naming the flag and the known strategies."""
    from shardlib.sharding.strategies import get_strategy

    try:
        return get_strategy(name).name
    except ValueError as err:
        raise PlanError(f"{err} (--strategy)") from None


def select_devices(n: int) -> list[Any]:
    """The first ``n`` devices of the current backend, or a clear error saying how to get more."""
    import jax

    if n < 1:
        raise PlanError(f"--devices must be at least 1, got {n}")
    available = jax.devices()
    if len(available) < n:
        raise PlanError(
            f"planning for {n} devices needs {n} JAX devices but the {platform_of(available)} backend has "
            f"{len(available)}; run `shardlib plan --devices {n}` (it simulates them on CPU), or call "
            f"jax.config.update('jax_num_cpu_devices', {n}) right after `import jax`, before any JAX operation"
        )
    return list(available[:n])


def select_topology(name: str, slices: int, devices: int | None) -> list[Any]:
    """The chips of a TPU topology (``--topology``, ``--slices``), checked against ``--devices`` if given."""
    from shardlib.runtime.devices import TopologyError, topology_devices

    try:
        chips = topology_devices(name, slices)
    except TopologyError as err:
        raise PlanError(str(err)) from None
    if devices is not None and devices != len(chips):
        raise PlanError(f"--devices {devices} does not match --topology {name} x {slices} slice(s), which has "
                        f"{len(chips)} chips; leave --devices out")
    return chips


def topology_profile(name: str, slices: int, chips: int, hardware: Any) -> hw.HardwareProfile:
    """The generation's profile, its fast-link domain set to one slice: collectives within a slice
    use ICI, across slices DCN."""
    try:
        profile = hw.get_hardware(hardware) if hardware else hw.profile_for_topology(name)
    except hw.HardwareError as err:
        raise PlanError(str(err)) from None
    return dataclasses.replace(profile, domain_size=chips // slices)


def setup_devices(n: int) -> None:
    """Simulate ``n`` CPU devices if JAX has not started yet; else keep the backend (it must have >= n).

    A started backend with more devices than the plan needs is fine (the plan takes the first n),
    which is why this does not call `simulate_cpu_devices` then: that asks for exactly n.
    """
    from shardlib.compat import backends_initialized
    from shardlib.runtime.devices import simulate_cpu_devices

    if not backends_initialized():
        simulate_cpu_devices(max(n, 1))


def _largest_divisor(n: int, limit: int, *also: int) -> int:
    """Largest t <= limit dividing n and every number in ``also`` (1 if none larger)."""
    for t in range(max(1, limit), 0, -1):
        if n % t == 0 and all(x % t == 0 for x in also):
            return t
    return 1


def default_mesh(strategy: str, devices: int, config: Any, domain: int = 8) -> dict[str, int]:
    """The mesh a strategy gets for N devices in `--all` (its default mesh, made to divide).

    tp: tensor = the largest t <= min(8, N) dividing N and the (kv) head counts, data = the rest;
    fsdp_tp: tensor = 2 when the heads divide; hsdp: fsdp = up to 8 devices (one node), data = rest;
    zero3_hpz: fsdp = up to ``domain`` devices (one fast-link domain), data = the domains. An MoE
    model (``n_experts``) then splits its experts over ``expert`` (`_with_experts`).
    """
    from shardlib.sharding.strategies import get_strategy

    return _with_experts(_strategy_mesh(strategy, devices, config, domain), config, get_strategy(strategy))


def _with_experts(sizes: dict[str, int], config: Any, strat: Any) -> dict[str, int]:
    """``sizes`` with ``expert`` = the largest divisor of the expert count that the first
    data-parallel axis (data, then fsdp) divides into, taken from that axis; an axis the strategy
    shards over keeps at least 2 devices. Unchanged for a dense model."""
    experts = getattr(config, "n_experts", 1)
    axis = next((a for a in ("data", "fsdp") if sizes.get(a, 1) > 1), None)
    if experts < 2 or axis is None:
        return sizes
    keep = 2 if any(axis in group for group in strat.requires) else 1
    e = _largest_divisor(experts, sizes[axis] // keep, sizes[axis])
    if e == 1:
        return sizes
    out = {**sizes, axis: sizes[axis] // e, "expert": e}
    return {k: v for k, v in out.items() if v > 1}


def _strategy_mesh(strategy: str, devices: int, config: Any, domain: int = 8) -> dict[str, int]:
    from shardlib.sharding.mesh import resolve_axis_sizes
    from shardlib.sharding.strategies import get_strategy

    strat = get_strategy(strategy)
    heads = (config.n_heads, config.n_kv_heads)
    if strat.name == "tp":
        t = _largest_divisor(devices, min(8, devices), *heads)
        if t == 1 and devices > 1:
            raise PlanError(f"tp: no tensor-parallel size in 2..{min(8, devices)} divides {devices} devices and "
                            f"the {config.n_heads} heads / {config.n_kv_heads} kv heads; give --mesh")
        return {"data": devices // t, "tensor": t}
    if strat.name == "fsdp_tp":
        t = _largest_divisor(devices, 2, *heads)
        if t == 1 and devices > 1:
            raise PlanError(f"fsdp_tp: tensor=2 does not divide {devices} devices and the heads; give --mesh")
        return {"fsdp": devices // t, "tensor": t}
    if strat.name == "hsdp":
        f = _largest_divisor(devices, min(8, max(1, devices // 2)))
        return {"data": devices // f, "fsdp": f}
    if strat.secondary_axis:
        f = _largest_divisor(devices, min(domain, max(1, devices // 2)))
        return {strat.secondary_axis: devices // f, "fsdp": f}
    sizes = resolve_axis_sizes(strat.default_mesh, devices)
    return {k: v for k, v in sizes.items() if v > 1} or {"data": 1}
