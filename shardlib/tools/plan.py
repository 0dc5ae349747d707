"""`shardlib plan`: will this model train on N devices, with which strategy, how fast? Before renting them.

For every candidate (strategy, mesh) the REAL training step is built and compiled for N devices
from ShapeDtypeStructs (nothing is allocated; the command simulates N CPU devices), and read:

  persistent bytes   params + optimizer state per device, from the state's shardings (the layouts),
                     and XLA's argument bytes (the same plus the batch)
  peak bytes         XLA's buffer assignment: arguments + outputs - donated + temporaries. (XLA:CPU's
                     own ``peak_memory_in_bytes`` only repeats the argument bytes, so it is not used.)
  collective bytes   sent per device per step, by kind, ring volumes (docs/design.md), from the optimised
                     HLO. XLA:CPU upcasts bf16 collectives to f32 there; for ``--precision bf16`` the
                     bf16 collectives found right after SPMD partitioning are counted at 2 bytes.
  FLOPs              analytic: models.flops_per_token x tokens (XLA counts a scan body once); the
                     hardware also redoes the forward pass under remat (x 4/3)
  step time          roofline on a hardware profile (shardlib.tools.hardware): max(compute, communication);
                     under a pipeline (pipe > 1) the compute is stretched by the bubble,
                     / (1 - (S-1)/(M+S-1)), and collective-permute bytes are the stage traffic

The best candidate is the fastest estimated step that fits in HBM. When none fits, the plan says
what would: more devices, gradient accumulation, remat, or another strategy, with figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from shardlib.backend import parse_options, platform_of, policy_for, step_compiler_options
from shardlib.tools import hardware as hw
from shardlib.tools import plan_lora
from shardlib.tools.compiled_cache import compile_cached
from shardlib.tools.hlo import collective_stats
from shardlib.tools.memory import memory_stats, peak_bytes
from shardlib.text import format_bytes, format_table

_gib = format_bytes  # the short name the advice texts use

PRECISIONS: dict[str, str] = {"f32": "float32", "bf16": "bfloat16"}
ALL_STRATEGIES: tuple[str, ...] = ("dp", "zero1", "zero2", "zero3", "tp", "fsdp_tp", "hsdp")
HPZ_STRATEGIES: tuple[str, ...] = ("zero3_hpz",)  # planned by default only across link domains
REMAT_FLOPS = 4 / 3  # a rematerialised step runs the forward twice: (2 + 4 + 2) / (2 + 4)


def remat_flops_factor(config: Any, seq_len: int) -> float:
    """Executed over model FLOPs for ``config``'s remat policy (docs/tpu.md, "Remat policies"): the
    whole forward again under "full"; the MLP's input projections again under
    "save_dots_except_mlp_in" (2 matmuls of 2 d d_ff FLOPs a token a layer); nothing counted in the
    6N model FLOPs under "save_dots" / "offload_dots" (norms and attention scores are recomputed,
    which the estimate leaves out, as it does for attention's causal half)."""
    from shardlib.models import flops_per_token

    if not config.remat or config.remat_policy in ("save_dots", "offload_dots"):
        return 1.0
    if config.remat_policy == "full":
        return REMAT_FLOPS
    again = 2 * 2 * config.d_model * config.d_ff * config.n_layers
    return 1.0 + again / flops_per_token(config, seq_len)
# XLA pass before which the CPU pipeline starts changing dtypes; the module dumped there is the
# SPMD-partitioned program with its collectives still in their original element types.
_PARTITIONED_DUMP_PASS = "batched_gather_scatter_normalizer"
SCHEMA_VERSION = 1


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


def _is_hf_config(model: str) -> bool:
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
    if isinstance(model, str) and _is_hf_config(model):
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


def _shard_bytes(tree: Any) -> int:
    """Bytes per device of a tree of sharded ShapeDtypeStructs."""
    import jax

    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _fits_by_offload(row: PlanRow) -> bool:
    """The candidate fits only because its offloaded state is in host memory (peak + host > HBM)."""
    return bool(row.fits and row.host_bytes and row.peak_bytes + row.host_bytes > row.hbm_bytes)


def _in_host_memory(tree: Any) -> list[Any]:
    """The leaves of a tree of sharded ShapeDtypeStructs that live in host memory (offloaded)."""
    import jax

    from shardlib.step.offload import HOST_MEMORY

    return [x for x in jax.tree.leaves(tree) if x.sharding.memory_kind == HOST_MEMORY]


def _full_bytes(tree: Any) -> int:
    import jax

    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


# ----------------------------------------------------------------------------------------------
# The planner
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Compiled:
    program: Any
    compiled: Any
    partitioned_hlo: str | None  # bf16 only: the module right after SPMD partitioning


class Planner:
    """Compiles candidates for one model, device count, batch and hardware; see `plan`."""

    def __init__(self, model: Any, devices: int | None = None, *, batch_size: int | None = None,
                 seq_len: int | None = None, precision: str = "f32", hardware: str | hw.HardwareProfile | None = None,
                 hbm: str | int | None = None, remat: bool | None = None,
                 pipeline_stages: int = 1, microbatches: int | None = None, schedule: str = "1f1b",
                 offload: str = "none", stage_layers: Any = None, topology: str | None = None, slices: int = 1,
                 cache_dir: str | None = None, compiler_options: Mapping[str, Any] | None = None,
                 batch_per_device: int | None = None, lora: Any = None, dump_hlo: str | None = None):
        from shardlib.models import param_count, trainable
        from shardlib.runtime.devices import TopologyError, cloud_tpu_topology
        from shardlib.step.offload import get_offload
        from shardlib.step.pipeline import get_schedule

        try:
            self.offload = get_offload(offload).name
        except ValueError as err:
            raise PlanError(str(err)) from None

        self.precision = precision
        self.dump_hlo = dump_hlo  # a folder each candidate's compiled HLO text is written to
        self.config = dataclasses.replace(resolve_config(model, precision, remat), lora=lora)  # a LoraConfig: LoRA
        self.model_name = model if isinstance(model, str) else "custom"
        self.topology_note = None
        if topology is not None:
            try:
                topology, self.topology_note = cloud_tpu_topology(topology)  # v5p-128 -> v5p:4x4x4
            except TopologyError as err:
                raise PlanError(str(err)) from None
        self.topology, self.slices = topology, slices
        if topology is not None:
            self.devices = select_topology(topology, slices, devices)
            self.profile = topology_profile(topology, slices, len(self.devices), hardware)
        else:
            if devices is None:
                raise PlanError("give --devices N (simulated CPU devices) or --topology NAME (a TPU slice)")
            self.devices = select_devices(devices)
            self.profile = hw.get_hardware(hardware or "h100")
        self.hbm_bytes = hw.parse_bytes(hbm) if hbm is not None else self.profile.hbm_bytes
        self.n = len(self.devices)
        # Compiles are cached by the planner itself (`shardlib.tools.compiled_cache`), not by JAX's
        # persistent cache: that one cannot load a topology's executables, and turning it on is a
        # process-wide setting that would also serve (and skip the dumps of) every later compile.
        self.cache_dir = cache_dir
        # The compiler's identity for the cache: versions, the options every step compiles with (the
        # policy's, the user's) and the environment's, so other options never read a stale program.
        self.compiler_options = dict(compiler_options or {})
        self.progress: Any = None  # a callable that gets one line per compiled candidate (the CLI: stderr)
        self._compiler = json.dumps([topology, slices, compiler_versions(platform_of(self.devices)),
                                     step_compiler_options(self.devices, None, self.compiler_options),
                                     os.environ.get("XLA_FLAGS", ""), os.environ.get("LIBTPU_INIT_ARGS", "")])
        self.seq_len = seq_len or self.config.max_seq_len
        if pipeline_stages < 1 or self.n % pipeline_stages:
            raise PlanError(f"--pipeline-stages {pipeline_stages} must be positive and divide the {self.n} devices")
        self.pipeline_stages = pipeline_stages
        self.microbatches = microbatches or 2 * pipeline_stages
        self.schedule = get_schedule(schedule).name
        self.stage_layers = stage_layers  # None, "auto" or layers per stage
        if batch_per_device is not None:
            batch_size = batch_per_device * self.n
        self._batch_given = batch_size is not None
        self.batch_size = batch_size or self.n
        if self.seq_len < 1 or self.batch_size < 1:
            raise PlanError(f"--batch-size and --seq-len must be positive, got {self.batch_size} and {self.seq_len}")
        self.params = param_count(self.config)
        self.attention_note = None
        if not topology and self.profile.backend == "gpu" and self.config.attention == "auto":
            # the GPU policy's attention is cuDNN's fused kernel, which XLA:CPU cannot compile
            self.config = dataclasses.replace(self.config, attention="xla")
            self.attention_note = ("attention compiled as XLA's (cuDNN's fused kernel, which a GPU run uses in bf16, "
                                   "does not compile here): its T x T scores are counted, cuDNN keeps none")
        if not topology and self.profile.backend == "tpu" and self.config.attention == "auto" and precision == "bf16":
            # the TPU policy's bf16 attention is a Pallas kernel, which XLA:CPU cannot compile
            self.config = dataclasses.replace(self.config, attention="flash")
            self.attention_note = ("attention compiled as shardlib's flash (the Pallas splash kernel a TPU run uses in "
                                   "bf16 compiles with --topology only): memory linear in T, as the kernel's")
        self.model = trainable(self.config)
        self._layouts: dict[tuple[str, str], Any] = {}

    # -- one candidate ------------------------------------------------------------------------

    def mesh_for(self, strategy: str, mesh: str | Mapping[str, int] | None) -> dict[str, int]:
        from shardlib.sharding.mesh import parse_mesh, resolve_axis_sizes

        if mesh is None:
            domain = self.profile.domain_size
            if self.pipeline_stages == 1:
                return default_mesh(strategy, self.n, self.config, domain)
            return {"pipe": self.pipeline_stages,
                    **default_mesh(strategy, self.n // self.pipeline_stages, self.config, domain)}
        sizes = parse_mesh(mesh) if isinstance(mesh, str) else dict(mesh)
        full = resolve_axis_sizes(sizes, self.n)  # MeshError naming the mismatch with --devices
        return {k: v for k, v in full.items() if v > 1} or {"data": 1}

    def _compile(self, strategy: str, sizes: Mapping[str, int], batch_size: int) -> _Compiled:
        import jax.numpy as jnp
        import optax

        from shardlib.sharding.layout import make_layout
        from shardlib.sharding.mesh import make_mesh
        from shardlib.step.program import build

        mesh = make_mesh(dict(sizes), devices=self.devices)
        with self._hardware_policy():
            layout = make_layout(self.model, strategy, mesh)
            self._layouts[(strategy, json.dumps(dict(sizes), sort_keys=True))] = layout
            pipelined = layout.pipeline_stages > 1
            # The precision reaches the step as `shardlib train` passes it: weights cast where the step casts them.
            program = build(self.model, optax.adamw(1e-4), layout, precision=self.precision,
                            microbatches=self.microbatches if pipelined else None, schedule=self.schedule,
                            offload=self.offload, stage_layers=self.stage_layers if pipelined else None,
                            compiler_options=self.compiler_options or None)
        shape = ((batch_size, self.seq_len), jnp.int32)
        batch = program.abstract_batch({"inputs": shape, "targets": shape})
        lowered = program.step.lower(program.abstract_state(), batch)  # checks the batch divides
        if self.precision != "bf16" or not policy_for(self.devices).widens_bf16_collectives:
            return _Compiled(program, compile_cached(lowered, self.cache_dir, self._compiler), None)
        with tempfile.TemporaryDirectory(prefix="shardlib-plan-") as dump:
            compiled = lowered.compile(compiler_options={
                "xla_dump_to": dump, "xla_dump_hlo_pass_re": _PARTITIONED_DUMP_PASS})
            found = sorted(glob.glob(os.path.join(dump, f"*step_fn*before_{_PARTITIONED_DUMP_PASS}.txt")))
            text = open(found[0]).read() if found else None
        return _Compiled(program, compiled, text)

    def candidate(self, strategy: str, mesh: str | Mapping[str, int] | None = None) -> PlanRow:
        """Compile one candidate and read its figures (errors are recorded on the row)."""
        import jax

        sizes = self.mesh_for(strategy, mesh)
        row = self._new_row(strategy, sizes)
        start = time.perf_counter()
        try:
            built = self._compile(strategy, sizes, row.batch_size)
        except (ValueError, jax.errors.JaxRuntimeError) as err:
            text = " ".join(str(err).split())
            if "RESOURCE_EXHAUSTED" in text and "memory" in text:  # XLA:TPU refuses a program over HBM
                text = f"does not fit: the compiler ran out of device memory ({text})"
            row.error = text[:500]
            return row
        row.compile_s = time.perf_counter() - start
        self._read_attention(row, built, sizes)
        if self.attention_note:
            row.notes.append(self.attention_note)
        self._read_memory(row, built)
        links = self._read_collectives(row, built)
        self._estimate_time(row, links)
        row.fits = row.peak_bytes <= self.hbm_bytes
        row.fits_by_offload = _fits_by_offload(row)
        if row.host_bytes:
            row.notes.append(f"offload moves {_gib(2 * row.host_bytes)} per device per step between host and device "
                             "memory; the step time leaves that transfer out")
        replicated = self._replicated(strategy, sizes)
        if replicated:
            row.notes.append(f"{len(replicated)} tensor(s) replicated against the rules: {', '.join(replicated[:4])}"
                             + (" ..." if len(replicated) > 4 else "") + " (see `shardlib inspect`)")
        return row

    def _read_attention(self, row: PlanRow, built: _Compiled, sizes: Mapping[str, int]) -> None:
        """The attention kernel the program runs, on the row; its HLO text to ``dump_hlo``."""
        from shardlib.step.precision import get_precision
        from shardlib.tools import plan_attention

        text = built.compiled.as_text() or ""
        dtype = get_precision(self.precision).compute_dtype
        row.attention = plan_attention.kernel(text, self.config, dtype, self.seq_len, policy_for(self.devices))
        if self.dump_hlo:
            row.notes.append(f"compiled HLO: {plan_attention.dump(self.dump_hlo, row.strategy, sizes, text)}")

    def _new_row(self, strategy: str, sizes: Mapping[str, int]) -> PlanRow:
        """An empty row for one candidate, with its global batch and, when pipelined, its bubble."""
        from shardlib.step.pipeline import bubble_fraction

        stages = sizes.get("pipe", 1)
        batch_size = self.batch_size
        if stages > 1 and not self._batch_given:  # one row per data-parallel device per microbatch
            batch_size = self.n // stages // sizes.get("tensor", 1) * self.microbatches
        row = PlanRow(strategy=strategy, mesh=dict(sizes), devices=self.n, batch_size=batch_size,
                      seq_len=self.seq_len, precision=self.precision, hbm_bytes=self.hbm_bytes)
        if stages > 1:
            row.pipeline_stages, row.microbatches = stages, self.microbatches
            row.bubble = bubble_fraction(stages, self.microbatches)
            row.stage_costs = self._stage_costs(strategy, sizes, batch_size)
        return row

    def _stage_costs(self, strategy: str, sizes: Mapping[str, int], batch_size: int) -> dict[str, Any] | None:
        """Per-stage compiled cost of one microbatch under the even split and the chosen one."""
        import jax
        import jax.numpy as jnp

        from shardlib.sharding.strategies import get_strategy
        from shardlib.step.stage_balance import stage_table

        replicas = self.n // sizes["pipe"] // sizes.get("tensor", 1)
        rows = max(1, batch_size // replicas // self.microbatches)
        shape = jax.ShapeDtypeStruct((rows, self.seq_len), jnp.int32)
        everywhere = get_strategy(strategy).shards_params or sizes.get("tensor", 1) > 1  # ends hold collectives
        try:
            return stage_table(self.model.pipeline, self.model.abstract(), {"inputs": shape, "targets": shape},
                               sizes["pipe"], self.stage_layers, everywhere)
        except ValueError as err:
            raise PlanError(str(err)) from None

    def _read_memory(self, row: PlanRow, built: _Compiled) -> None:
        """Persistent bytes from the state's shardings; peak and temporaries from XLA's buffer assignment.
        Device figures leave out the state offloaded to host memory (``host_bytes``)."""
        state = built.program.abstract_state()
        row.params_bytes = _shard_bytes(state.params)
        row.opt_state_bytes = _shard_bytes(state.opt_state)
        row.persistent_bytes = (row.params_bytes + row.opt_state_bytes + _shard_bytes(state.step)
                                - _shard_bytes(_in_host_memory(state)))
        mem = memory_stats(built.compiled)
        row.offload, row.host_bytes = self.offload, mem.host_argument_bytes
        row.argument_bytes, row.temp_bytes = mem.device_bytes("argument"), mem.temp_bytes
        row.peak_bytes = peak_bytes(mem)
        row.transient_bytes = row.peak_bytes - row.persistent_bytes

    def _read_collectives(self, row: PlanRow, built: _Compiled) -> hw.LinkBytes:
        """Collective bytes per step by kind and by link, bf16 collectives counted at 2 bytes."""
        stats = collective_stats(built.compiled.as_text(), num_devices=self.n,
                                 num_slices=self.slices if self.topology else None)
        by_kind = dict(stats.bytes_by_kind())
        links_of = self._links_of(built)
        links = hw.link_bytes(stats.records, self.n, self.profile.domain_size, links_of=links_of)
        if built.partitioned_hlo is not None:  # count bf16 collectives at 2 bytes, not XLA:CPU's 4
            narrow = [r for r in collective_stats(built.partitioned_hlo, num_devices=self.n).records
                      if r.dtype == "bf16"]
            for r in narrow:
                by_kind[r.kind] = max(0, round(by_kind[r.kind] - r.bytes_per_step))
            upcast = hw.link_bytes(narrow, self.n, self.profile.domain_size)
            links = hw.LinkBytes(max(0.0, links.intra - upcast.intra), max(0.0, links.inter - upcast.inter),
                                 links.unknown_groups)  # (CPU devices: no torus, one link a collective)
            row.notes.append(f"{len(narrow)} bf16 collective(s) counted at 2 bytes/element "
                             "(XLA:CPU runs them in f32)")
        elif self.precision == "bf16" and policy_for(self.devices).widens_bf16_collectives:
            row.notes.append("XLA's partitioned HLO was not found: bf16 collectives are counted as XLA:CPU "
                             "runs them (f32), an upper bound")
        if links.intra_priced is not None and links.intra_priced < links.intra * 0.999:
            row.notes.append(f"comm time prices collectives over 2-D / 3-D blocks of the torus at one link per "
                             f"dimension they span ({_gib(links.intra)} on ICI timed as {_gib(links.intra_priced)} on "
                             "one link): an assumption, not a measurement; the pick between candidates depends on it")
        scattered = [r for r in stats.records if r.scattered]
        if scattered:
            row.notes.append(f"{len(scattered)} all-reduce(s) of {_gib(sum(r.bytes_per_step for r in scattered))} "
                             "per step are reduce-scatters the compiler runs as a full all-reduce, each device "
                             "keeping its slice (counted as the all-reduce they are)")
        gathered = [r for r in stats.records if r.gathered]
        if gathered:
            row.notes.append(f"{len(gathered)} all-reduce(s) of {_gib(sum(r.bytes_per_step for r in gathered))} "
                             "per step are all-gathers the compiler runs as an all-reduce of a zero-filled buffer "
                             "(counted as the all-reduce they are)")
        if links.unknown_groups:
            row.notes.append(f"{links.unknown_groups} collective(s) with replica groups not understood: "
                             "placed by group size")
        if stats.trip_count_unknown:
            row.notes.append("a loop trip count was unknown: its collectives are counted once")
        row.collective_bytes = by_kind
        row.collective_total_bytes = sum(by_kind.values())
        row.intra_domain_bytes, row.inter_domain_bytes = round(links.intra), round(links.inter)
        return links

    def _hardware_policy(self) -> Any:
        """On simulated CPU devices, build the step as the ``--hardware``'s backend builds it
        (`shardlib.backend.forced`: bf16 weights gathered in bf16 on GPU and TPU), so the plan
        counts that program's collectives; a topology's chips are the backend already."""
        import contextlib

        from shardlib.backend import forced

        if self.topology or platform_of(self.devices) != "cpu":
            return contextlib.nullcontext()
        return forced(self.profile.backend)

    def _links_of(self, built: _Compiled) -> Any:
        """`hardware.torus_links` of the candidate's mesh on a TPU topology (None elsewhere)."""
        devices = list(built.program.layout.mesh.devices.flat)
        if not self.topology or not all(hasattr(d, "coords") for d in devices):
            return None
        return hw.torus_links([tuple(d.coords) for d in devices])

    def _estimate_time(self, row: PlanRow, links: hw.LinkBytes) -> None:
        """Analytic FLOPs and the roofline step time on the profile (compute stretched by the bubble)."""
        from shardlib.models import flops_per_token

        tokens = row.batch_size * self.seq_len
        row.model_flops = flops_per_token(self.config, self.seq_len) * tokens
        row.flops_per_device = row.model_flops * remat_flops_factor(self.config, self.seq_len) / self.n
        # A stage is idle for the bubble: its share of the work takes 1 / (1 - bubble) as long.
        estimate = hw.step_time(self.profile, row.flops_per_device / (1 - row.bubble), links, self.precision)
        row.compute_s, row.comm_s = estimate.compute_s, estimate.comm_s
        row.step_s, row.step_serial_s = estimate.overlapped_s, estimate.serial_s
        if row.pipeline_stages > 1:
            row.notes.append(
                f"pipeline: {row.pipeline_stages} stages x {self.microbatches} microbatches ({self.schedule}), "
                f"bubble {row.bubble:.1%} = (S-1)/(M+S-1); collective-permute "
                f"{row.collective_bytes['collective-permute']:,} B/step between stages; persistent bytes are "
                "one stage's layers + the replicated embedding and head")
        row.tokens_per_s = tokens / row.step_s if row.step_s > 0 else None
        peak = self.profile.peak_flops[self.precision]
        row.mfu = row.model_flops / (row.step_s * self.n * peak) if row.step_s > 0 else None

    def _replicated(self, strategy: str, sizes: Mapping[str, int]) -> list[str]:
        from shardlib.sharding.rules import replicated_leaves

        layout = self._layouts.get((strategy, json.dumps(dict(sizes), sort_keys=True)))
        if layout is None:
            return []
        tree = layout.params if layout.strategy.param_rules else layout.state
        return [leaf.path for leaf in replicated_leaves(tree, layout.mesh)]

    # -- all candidates -----------------------------------------------------------------------

    def default_strategies(self) -> tuple[str, ...]:
        """ALL_STRATEGIES, and hpZ when the devices span more than one link domain (else it cannot apply)."""
        return ALL_STRATEGIES + (HPZ_STRATEGIES if self.n > self.profile.domain_size else ())

    def run(self, strategies: Sequence[str] | None = None, mesh: str | Mapping[str, int] | None = None) -> list[PlanRow]:
        """Compile every strategy (on ``mesh``, or on each strategy's default mesh) and mark the best."""
        names = [check_strategy(name) for name in strategies or self.default_strategies()]  # fail before compiling
        if mesh is not None:
            self.mesh_for(names[0], mesh)  # a mesh that does not match --devices: fail now
        tries = [(name, mesh) for name in names]
        if mesh is None and strategies is None:
            tries += self.context_candidates()
        rows = []
        for k, (name, sizes) in enumerate(tries, 1):
            try:
                rows.append(self.candidate(name, sizes))
            except PlanError as err:  # e.g. no tensor size divides the heads
                rows.append(PlanRow(strategy=name, mesh={}, devices=self.n, batch_size=self.batch_size,
                                    seq_len=self.seq_len, precision=self.precision, hbm_bytes=self.hbm_bytes,
                                    error=str(err)))
            if self.progress is not None:  # compiles take minutes at scale: say what each gave as it lands
                self.progress(progress_line(k, len(tries), rows[-1]))
        return self.decide(rows)

    def context_candidates(self) -> list[tuple[str, dict[str, int]]]:
        """For a long sequence (``seq_len >= CONTEXT_SEQ_LEN``): zero3 over the rest of the devices
        with the sequence split over C = 2, 4, 8 context devices (dp when C is all of them;
        docs/context-parallel.md), where C divides the devices and 2C the sequence (one early and
        one late chunk per device)."""
        if self.seq_len < CONTEXT_SEQ_LEN or self.topology:
            return []
        return [("zero3" if self.n > c else "dp", {"fsdp": self.n // c, "context": c}) for c in (2, 4, 8)
                if self.n % c == 0 and self.seq_len % (2 * c) == 0 and self.batch_size % (self.n // c) == 0]

    def decide(self, rows: Sequence[PlanRow], hbm: str | int | None = None) -> list[PlanRow]:
        """Set ``fits`` and ``best`` for an HBM limit (default: the planner's), without recompiling."""
        if hbm is not None:
            self.hbm_bytes = hw.parse_bytes(hbm)
        for r in rows:
            r.hbm_bytes = self.hbm_bytes
            r.fits = r.error is None and r.peak_bytes <= self.hbm_bytes
            r.fits_by_offload = _fits_by_offload(r)
        mark_best(rows)
        return list(rows)

    # -- what would fit -----------------------------------------------------------------------

    def advise(self, rows: Sequence[PlanRow]) -> list[dict[str, Any]]:
        """When no candidate fits: more devices, gradient accumulation, remat, or another strategy."""
        ok = [r for r in rows if r.error is None]
        if not ok or any(r.fits for r in ok):
            return []
        hbm = self.hbm_bytes
        state_total = self._state_total()
        tried = {r.strategy for r in ok}
        zero3 = next((r for r in ok if r.strategy == "zero3"), None)
        smallest = min(ok, key=lambda r: r.peak_bytes)
        transient = (zero3 or min(ok, key=lambda r: r.transient_bytes)).transient_bytes
        out: list[dict[str, Any]] = []

        # 1. More devices under ZeRO-3, same rows per device: 12 Psi / N' + transient <= HBM
        #    (when N' <= N, suggestion 4 says zero3 fits on the devices there are).
        need = math.ceil(state_total / (hbm - transient)) if transient < hbm else None
        if need is not None and need > self.n:
            devices = 1 << max(0, (need - 1).bit_length())
            per_device = self.batch_size / self.n
            out.append({
                "kind": "devices", "strategy": "zero3", "devices": devices, "min_devices": need,
                "persistent_bytes": state_total // devices, "transient_bytes": transient,
                "estimated_peak_bytes": state_total // devices + transient,
                "text": (f"zero3 on {devices} devices (at least {need}): persistent {_gib(state_total / devices)} "
                         f"+ transient {_gib(transient)} per device <= {_gib(hbm)}, keeping {per_device:g} "
                         f"sequence(s) per device (global batch {round(per_device * devices)})"),
            })
        elif need is None:
            out.append({"kind": "devices", "strategy": "zero3", "devices": None, "transient_bytes": transient,
                        "text": f"activations alone ({_gib(transient)} per device) exceed {_gib(hbm)}: more devices "
                                "do not help; use fewer sequences per device or a shorter --seq-len"})

        # 2. Gradient accumulation on the candidate with the smallest peak: measure transient at one row.
        accumulation = self._accumulation(smallest)
        if accumulation:
            out.append(accumulation)

        # 3. Remat, when the model does not rematerialise yet.
        if not self.config.remat:
            remat_row = Planner(dataclasses.replace(self.config, remat=True), self.n, batch_size=self.batch_size,
                                seq_len=self.seq_len, precision=self.precision, hardware=self.profile,
                                hbm=hbm, topology=self.topology, slices=self.slices,
                                ).candidate(smallest.strategy, smallest.mesh)
            if remat_row.error is None:
                out.append({"kind": "remat", "strategy": smallest.strategy, "peak_bytes": remat_row.peak_bytes,
                            "fits": remat_row.fits,
                            "text": f"remat (recompute each block in the backward pass): {smallest.strategy} peak "
                                    f"{_gib(smallest.peak_bytes)} -> {_gib(remat_row.peak_bytes)} per device "
                                    f"({'fits' if remat_row.fits else 'still over'} {_gib(hbm)}), ~33% more compute"})

        # 4. The optimizer state in host memory, measured on the candidate with the smallest peak.
        offloaded = self._offloaded(smallest)
        if offloaded:
            out.append(offloaded)

        # 5. A strategy that was not tried.
        if "zero3" not in tried:
            estimate = state_total // self.n + transient
            out.append({"kind": "strategy", "strategy": "zero3", "estimated_peak_bytes": estimate,
                        "fits": estimate <= hbm,
                        "text": f"zero3 shards parameters too: ~{_gib(state_total / self.n)} persistent + "
                                f"{_gib(transient)} transient = {_gib(estimate)} per device"})
        return out

    def _offloaded(self, row: PlanRow) -> dict[str, Any] | None:
        """``row``'s candidate compiled with ``--offload opt_state``: its device peak and host bytes.
        Only where moving the optimizer state out could make it fit (no compile otherwise)."""
        if self.offload != "none" or row.peak_bytes - row.opt_state_bytes > self.hbm_bytes:
            return None
        self.offload = "opt_state"
        try:
            moved = self.candidate(row.strategy, row.mesh)
        finally:
            self.offload = "none"
        if moved.error is not None:
            return None
        return {"kind": "offload", "strategy": row.strategy, "peak_bytes": moved.peak_bytes,
                "host_bytes": moved.host_bytes, "fits": moved.fits,
                "text": f"{row.strategy} with --offload opt_state (optimizer state in host memory): peak "
                        f"{_gib(row.peak_bytes)} -> {_gib(moved.peak_bytes)} per device "
                        f"({'fits' if moved.fits else 'still over'} {_gib(self.hbm_bytes)}), "
                        f"{_gib(moved.host_bytes)} per device in host memory, moved in and out every step"}

    def _state_total(self) -> int:
        """Unsharded bytes of params + optimizer state (12 Psi for fp32 Adam)."""
        import jax
        import optax

        params = self.model.abstract()
        return _full_bytes(params) + _full_bytes(jax.eval_shape(optax.adamw(1e-4).init, params))

    def _accumulation(self, row: PlanRow) -> dict[str, Any] | None:
        layout = self._layouts.get((row.strategy, json.dumps(dict(row.mesh), sort_keys=True)))
        if layout is None:
            return None
        rows_per_device = self.batch_size // layout.batch_size_multiple
        if rows_per_device <= 1:
            return {"kind": "grad_accumulation", "strategy": row.strategy, "microbatches": None,
                    "text": f"{row.strategy} already runs one sequence per data-parallel device: gradient "
                            "accumulation cannot shrink activations further; shorten --seq-len"}
        import jax

        try:
            small = self._compile(row.strategy, row.mesh, layout.batch_size_multiple)
        except (ValueError, jax.errors.JaxRuntimeError):  # advice is best effort; the plan itself succeeded
            return None

        mem = memory_stats(small.compiled)
        small_peak = peak_bytes(mem)
        per_row = (row.peak_bytes - small_peak) / (rows_per_device - 1)
        buffer = sum(leaf.bytes_per_device(layout.mesh) for leaf in _leaves(layout.state))
        for k in range(2, rows_per_device + 1):
            if rows_per_device % k:
                continue
            estimate = small_peak + per_row * (rows_per_device // k - 1) + buffer
            if estimate <= self.hbm_bytes:
                return {"kind": "grad_accumulation", "strategy": row.strategy, "microbatches": k,
                        "rows_per_microbatch": rows_per_device // k, "estimated_peak_bytes": round(estimate),
                        "activation_bytes_per_row": round(per_row), "grad_buffer_bytes": buffer,
                        "text": f"{row.strategy} with gradient accumulation over {k} microbatches of "
                                f"{rows_per_device // k} sequence(s) per device: ~{_gib(estimate)} per device "
                                f"({_gib(per_row)} of activations per sequence, {_gib(buffer)} gradient buffer)"}
        return {"kind": "grad_accumulation", "strategy": row.strategy, "microbatches": None,
                "estimated_peak_bytes": small_peak + buffer,
                "text": f"even one sequence per device needs ~{_gib(small_peak + buffer)} under {row.strategy}"}


def _leaves(tree: Any) -> list[Any]:
    import jax

    from shardlib.sharding.rules import is_layout

    return jax.tree.leaves(tree, is_leaf=is_layout)


def mark_best(rows: Sequence[PlanRow]) -> PlanRow | None:
    """Flag the fitting candidate with the shortest estimated step (ties: less traffic, less memory)."""
    fitting = [r for r in rows if r.error is None and r.fits]
    for r in rows:
        r.best = False
    if not fitting:
        return None
    # Times within 1% count as equal, so a few bytes of scalar all-reduce do not decide.
    fastest = min(r.step_s for r in fitting)
    fitting = [r for r in fitting if r.step_s <= fastest * 1.01]
    least_serial = min(r.step_serial_s for r in fitting)
    fitting = [r for r in fitting if r.step_serial_s <= least_serial * 1.01]
    best = min(fitting, key=lambda r: r.peak_bytes)
    best.best = True
    return best


def plan(model: Any, devices: int, strategies: Sequence[str] | None = None, *,
         mesh: str | Mapping[str, int] | None = None, batch_size: int | None = None, seq_len: int | None = None,
         precision: str = "f32", hbm: str | int | None = None, hardware: str = "h100",
         remat: bool | None = None, pipeline_stages: int = 1, microbatches: int | None = None,
         schedule: str = "1f1b", offload: str = "none") -> list[PlanRow]:
    """Compile the training step of ``model`` for each strategy on ``devices`` devices; one row each.

    ``model``: a config name (``"llama-7b"``) or a ``models.GPTConfig``. ``strategies``: default all
    seven. ``mesh``: one mesh for every strategy (default: each strategy's default mesh for N).
    ``batch_size``: global sequences per step (default N); ``seq_len`` default the config's.
    Needs ``devices`` JAX devices in this process (``jax_num_cpu_devices`` before JAX starts).
    ``offload="opt_state"``: every candidate keeps its optimizer state in host memory (ZeRO-Offload).
    """
    planner = Planner(model, devices, batch_size=batch_size, seq_len=seq_len, precision=precision,
                      hardware=hardware, hbm=hbm, remat=remat, pipeline_stages=pipeline_stages,
                      microbatches=microbatches, schedule=schedule, offload=offload)
    return planner.run(strategies, mesh)


def plan_document(planner: Planner, rows: Sequence[PlanRow], advice: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The one JSON document `shardlib plan --json` prints (stable keys, schema_version 1)."""
    best = next((r for r in rows if r.best), None)
    return {
        "schema_version": SCHEMA_VERSION,
        "model": planner.model_name,
        "config": {k: (str(v) if not isinstance(v, (int, float, bool, type(None))) else v)
                   for k, v in dataclasses.asdict(planner.config).items()},
        "params": planner.params,
        "devices": planner.n,
        "batch_size": planner.batch_size,
        "seq_len": planner.seq_len,
        "precision": planner.precision,
        "hbm_bytes": planner.hbm_bytes,
        "hardware": planner.profile.to_dict(),
        "topology": planner.topology,
        "slices": planner.slices,
        "compiler": compiler_versions(platform_of(planner.devices)),
        # which link each domain figure is: one slice's chips share ICI, slices talk over DCN
        "links": ({"intra_domain_bytes": "ICI", "inter_domain_bytes": "DCN"} if planner.topology else
                  {"intra_domain_bytes": "fast domain (NVLink node / ICI slice)", "inter_domain_bytes": "across domains"}),
        "candidates": [r.to_dict() for r in rows],
        "best": None if best is None else {"strategy": best.strategy, "mesh": best.mesh,
                                           "command": train_command(planner, best)},
        "suggestions": list(advice),
        "model_notes": MODEL_NOTES,
    }


def compiler_versions(platform: str) -> dict[str, str | None]:
    """The compiler that produced the plan's programs: the platform, jax and (for TPU) libtpu."""
    import importlib.metadata

    import jax

    try:
        libtpu = importlib.metadata.version("libtpu") if platform == "tpu" else None
    except importlib.metadata.PackageNotFoundError:
        libtpu = None
    return {"platform": platform, "jax": jax.__version__, "libtpu": libtpu}


MODEL_NOTES: dict[str, str] = {
    "persistent_bytes": "params + optimizer state per device in device memory, from the train state's shardings",
    "host_bytes": "state per device in host memory (--offload), from the compiled step's parameter layouts; "
                  "not counted in persistent, args or peak",
    "peak_bytes": "XLA buffer assignment of the compiled step: arguments + outputs - donated + temporaries "
                  "(with --topology: the TPU compiler's own, tiled layouts included; else XLA:CPU's, an estimate "
                  "for GPU/TPU)",
    "collective_bytes": "bytes one device sends per step, ring volumes (all-reduce 2(N-1)/N S, all-gather and "
                        "reduce-scatter (N-1)/N S), from the optimised HLO; bf16 collectives counted at 2 bytes",
    "flops": "model_flops = models.flops_per_token x tokens; flops_per_device adds remat's extra forward (x4/3) / N",
    "step_s": "roofline: max(flops_per_device / peak_flops, sum of collective bytes / link bandwidth); "
              "step_serial_s = their sum (no overlap)",
    "best": "fits in HBM, then shortest step_s, then shortest step_serial_s (each within 1%), then smallest peak",
}


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model config name (models.CONFIGS), e.g. llama-7b, or a Hugging "
                                                       "Face config.json or model directory (the shapes only)")
    parser.add_argument("--devices", type=int, help="number of devices to plan for (simulated CPU devices)")
    parser.add_argument("--topology", nargs="+", metavar="NAME",
                        help="plan with the real TPU compiler for a TPU slice, JAX's names: v5e:2x4, v5p:4x4x4, "
                             "v6e:8x8 (needs jax[tpu]); several names plan each (with --plot: against chip count)")
    parser.add_argument("--slices", type=int, default=1, help="--topology: that many slices joined by DCN")
    parser.add_argument("--plot", metavar="FILE.png", help="draw per-chip memory and estimated step time against "
                                                           "chip count (one point per --topology or --devices run)")
    parser.add_argument("--cache-dir", help="where compiled candidates are kept, so a rerun plan skips compiling "
                                            "(default $SHARDLIB_PLAN_CACHE or ~/.cache/shardlib/jax; 'none': off)")
    from shardlib.sharding.strategies import STRATEGIES

    parser.add_argument("--strategy", nargs="+", action="extend", metavar="S",
                        help=f"strategies to compare, any of {', '.join(STRATEGIES)} (default: "
                             f"{', '.join(ALL_STRATEGIES)}, and {', '.join(HPZ_STRATEGIES)} when the devices span "
                             "more than one link domain)")
    parser.add_argument("--all", action="store_true", help="every strategy on its default mesh for N devices")
    parser.add_argument("--mesh", help="one mesh for every strategy, e.g. data=2,fsdp=4 (default: per strategy)")
    parser.add_argument("--batch-size", type=int, help="global sequences per step (default: one per device)")
    parser.add_argument("--batch-per-device", type=int, metavar="B",
                        help="sequences per device per step (the global batch is B x devices), as published runs state it")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default: the config's max_seq_len)")
    parser.add_argument("--dump-hlo", metavar="DIR", help="write each candidate's compiled HLO text to DIR "
                        "(<strategy>_<mesh>.hlo.txt): a Pallas kernel shows as tpu_custom_call")
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default="f32", help="compute dtype")
    parser.add_argument("--pipeline-stages", type=int, default=1, metavar="S",
                        help="add a pipe=S axis to every candidate's default mesh (or give pipe in --mesh)")
    parser.add_argument("--microbatches", type=int, metavar="M", help="pipeline microbatches (default 2 x stages)")
    parser.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"], help="pipeline schedule")
    parser.add_argument("--stage-layers", metavar="auto|N,N",
                        help="layers per pipeline stage (auto: balance the compiled stage costs; default even)")
    parser.add_argument("--offload", default="none", choices=["none", "opt_state"],
                        help="keep the optimizer state in host memory (ZeRO-Offload, docs/offload.md)")
    parser.add_argument("--hbm", type=_hbm_flag, help="memory per device with its unit, e.g. 80GB or 16GiB "
                                                      "(default: the hardware's)")
    parser.add_argument("--hardware", help=f"profile for the time estimate: {', '.join(hw.HARDWARE)} (default: "
                                           "the --topology's generation, else h100)")
    parser.add_argument("--no-remat", action="store_true", help="plan without rematerialisation (--remat none)")
    parser.add_argument("--remat", choices=["none", "full", "save_dots_except_mlp_in", "save_dots", "offload_dots"],
                        help="what each block keeps for the backward pass (docs/tpu.md, \"Remat policies\"; default: "
                             "the model's, full)")
    parser.add_argument("--xla-options", metavar="NAME=VALUE,...",
                        help="XLA options every step compiles with, over the backend's own (on TPU the collective "
                             "options of docs/tpu.md) and over LIBTPU_INIT_ARGS")
    plan_lora.add_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of tables")


def _hbm_flag(text: str) -> int:
    """``--hbm`` in bytes, read before JAX starts; a size without a unit is a usage error."""
    try:
        return hw.parse_bytes(text)
    except hw.HardwareError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def setup_devices(n: int) -> None:
    """Simulate ``n`` CPU devices if JAX has not started yet; else keep the backend (it must have >= n).

    A started backend with more devices than the plan needs is fine (the plan takes the first n),
    which is why this does not call `simulate_cpu_devices` then: that asks for exactly n.
    """
    from shardlib.compat import backends_initialized
    from shardlib.runtime.devices import simulate_cpu_devices

    if not backends_initialized():
        simulate_cpu_devices(max(n, 1))


def run(args: argparse.Namespace) -> int:
    if args.all and args.strategy:
        raise PlanError("give --strategy or --all, not both")
    if args.devices is None and not args.topology:
        raise PlanError("give --devices N (simulated CPU devices) or --topology NAME (a TPU slice, e.g. v5e:2x4)")
    if args.hardware is not None:
        hw.get_hardware(args.hardware)  # unknown hardware: fail before JAX starts
    if args.batch_per_device is not None and args.batch_size is not None:
        raise PlanError("give --batch-size or --batch-per-device, not both")
    setup_devices(1 if args.topology else args.devices)
    cache_dir = plan_cache_dir(args.cache_dir)
    documents = []
    for topology in args.topology or [None]:
        planner = Planner(args.model, args.devices, batch_size=args.batch_size, seq_len=args.seq_len,
                          batch_per_device=args.batch_per_device,
                          precision=args.precision, hardware=args.hardware, hbm=args.hbm,
                          remat=False if args.no_remat else args.remat, pipeline_stages=args.pipeline_stages,
                          microbatches=args.microbatches, schedule=args.schedule, offload=args.offload,
                          stage_layers=_stage_layers_flag(args.stage_layers), topology=topology, slices=args.slices,
                          cache_dir=cache_dir, compiler_options=_options_flag(args.xla_options),
                          lora=plan_lora.from_args(args, PlanError), dump_hlo=args.dump_hlo)
        if planner.topology_note:
            print(f"shardlib plan: note: {planner.topology_note}", file=sys.stderr, flush=True)
        planner.progress = lambda line: print(f"shardlib plan: {line}", file=sys.stderr, flush=True)
        rows = planner.run(None if args.all else args.strategy, args.mesh)
        advice = planner.advise(rows)
        documents.append(plan_document(planner, rows, advice))
        if not args.json:
            print(render(planner, rows, advice))
    if args.json:
        json.dump(documents[0] if len(documents) == 1 else {"plans": documents}, sys.stdout, indent=1)
        print()
    if args.plot:
        from shardlib.tools.plan_plot import plot_plans

        print(f"plot: {plot_plans(documents, args.plot)}", file=sys.stderr if args.json else sys.stdout)
    ok = [c for d in documents for c in d["candidates"] if c["error"] is None]
    return 0 if ok else 1


def plan_cache_dir(cache_dir: str | None) -> str | None:
    """The folder that keeps the plan's compiles (minutes each for a large model on a large
    topology), so planning the same candidates again reads them back: ``--cache-dir``, else
    ``$SHARDLIB_PLAN_CACHE``, else ``~/.cache/shardlib/jax``; None when either says ``none``."""
    folder = cache_dir or os.environ.get("SHARDLIB_PLAN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "shardlib", "jax")
    return None if folder == "none" else folder


DEFAULT_TRAIN_BATCH = 32  # shardlib.run.config.DEFAULT_BATCH (run is a layer above; tests/test_tpu_scale.py checks they agree)


def progress_line(k: int, total: int, row: PlanRow) -> str:
    """``[2/7] zero3 fsdp=8: peak 21.03 GiB, 40.28 GiB/step, fits (96 s)``, or the candidate's error."""
    where = f"[{k}/{total}] {row.strategy} {row.mesh_text if row.mesh else ''}".rstrip()
    if row.error:
        return f"{where}: {row.error[:160]}"
    return (f"{where}: peak {format_bytes(row.peak_bytes)}, {format_bytes(row.collective_total_bytes)}/step, "
            f"attention {row.attention}, {'fits' if row.fits else 'does not fit'} ({row.compile_s:.0f} s)")


def train_command(planner: Planner, row: PlanRow) -> str:
    """The `shardlib train` command that runs ``row``'s candidate: its model, strategy, mesh, batch,
    sequence length, precision and remat (flags a default already gives are left out)."""
    c = planner.config
    model = planner.model_name
    source = ("" if model == "custom" else
              f"--init-from {Path(model).parent if Path(model).name == 'config.json' else model}" if _is_hf_config(model)
              else f"--model {model}")
    words = ["shardlib train", source,
             f"--strategy {row.strategy}", f"--mesh {','.join(f'{k}={v}' for k, v in row.mesh.items())}",
             f"--batch-size {row.batch_size}", f"--seq-len {row.seq_len}", f"--precision {row.precision}",
             "" if not c.remat else "" if c.remat_policy == "full" else f"--remat {c.remat_policy}",
             "--remat none" if not c.remat else "", f"--offload {planner.offload}" if planner.offload != "none" else ""]
    if row.pipeline_stages > 1:
        words.append(f"--pipeline-stages {row.pipeline_stages} --microbatches {row.microbatches}")
    words += plan_lora.train_flags(c)
    return " ".join(w for w in words if w)


def _options_flag(text: str | None) -> dict[str, str]:
    try:
        return parse_options(text)
    except ValueError as err:
        raise PlanError(f"--xla-options: {err}") from None


def _stage_layers_flag(text: str | None) -> Any:
    from shardlib.step.stage_balance import parse_stage_layers

    try:
        return parse_stage_layers(text)
    except ValueError as err:
        raise PlanError(str(err)) from None


def render(planner: Planner, rows: Sequence[PlanRow], advice: Sequence[Mapping[str, Any]]) -> str:
    """Human-readable plan: a header, one line per candidate, notes and suggestions."""
    from shardlib.step.stage_balance import format_stage_table

    c, p = planner.config, planner.profile
    lines = [
        f"plan: {planner.model_name} ({planner.params / 1e6:,.1f}M params, {c.n_layers} layers, d={c.d_model}) "
        f"on {planner.n} devices, batch {planner.batch_size} x {planner.seq_len} tokens, {planner.precision}, "
        f"remat {'on' if c.remat else 'off'}, offload {planner.offload}",
        *plan_lora.header(c, planner.params),
        f"hardware: {p.description}; HBM limit {format_bytes(planner.hbm_bytes)} per device",
        *([f"batch: one sequence a device by default, the smallest batch every strategy splits (shardlib train's "
           f"default is {DEFAULT_TRAIN_BATCH}); --batch-size plans another"] if not planner._batch_given else []),
        "",
    ]
    table = []
    for r in rows:
        if r.error:
            table.append({"": "", "strategy": r.strategy, "mesh": r.mesh_text if r.mesh else "-",
                          "persistent": "error: " + r.error[:100]})
            continue
        table.append({
            "": "*" if r.best else "", "strategy": r.strategy, "mesh": r.mesh_text,
            "persistent": format_bytes(r.persistent_bytes), "args": format_bytes(r.argument_bytes),
            "host": format_bytes(r.host_bytes),
            "peak": format_bytes(r.peak_bytes), "comm/step": format_bytes(r.collective_total_bytes),
            "compute ms": r.compute_s * 1e3, "comm ms": r.comm_s * 1e3,
            "step ms": r.step_s * 1e3, "MFU": f"{r.mfu:.0%}" if r.mfu is not None else "-",
            "attention": r.attention or "-", "fits": "yes" if r.fits else "NO",
        })
    lines.append(format_table(table, ["", "strategy", "mesh", "persistent", "args", "host", "peak", "comm/step",
                                      "compute ms", "comm ms", "step ms", "MFU", "attention", "fits"]))
    kinds = [(r.strategy, {k: v for k, v in (r.collective_bytes or {}).items() if v}) for r in rows if not r.error]
    lines += ["", "collective bytes per device per step, by kind:"]
    lines += [f"  {s}: " + (", ".join(f"{k} {format_bytes(v)}" for k, v in d.items()) or "none") for s, d in kinds]
    for r in rows:
        for note in r.notes:
            lines.append(f"  note ({r.strategy}): {note}")
        if r.fits_by_offload:
            lines.append(f"  note ({r.strategy}): fits because of --offload {r.offload}: {format_bytes(r.host_bytes)} "
                         f"per device in host memory; without it ~{format_bytes(r.peak_bytes + r.host_bytes)} > "
                         f"{format_bytes(r.hbm_bytes)}")
    for r in (r for r in rows if r.stage_costs):
        lines += [f"  stage costs ({r.strategy}, one microbatch forward + backward):", *format_stage_table(r.stage_costs)]
    best = next((r for r in rows if r.best), None)
    lines.append("")
    lines.append(f"best: {best.strategy} on {best.mesh_text} (* above)" if best else
                 f"nothing fits in {format_bytes(planner.hbm_bytes)} per device. What would:")
    if best is not None:
        lines.append(f"run it: {train_command(planner, best)}")
    lines += [f"  - {a['text']}" for a in advice]
    lines += ["", "model: " + MODEL_NOTES["step_s"] + "; peak = " + MODEL_NOTES["peak_bytes"]]
    return "\n".join(lines)
