"""`shardlib plan`'s estimate (over 600 lines: one `Planner`, one model, device set and compile cache).

Will this model train on N devices, with which strategy, how fast? Before renting them. Its
compiles, measurements and advice share the planner's model, devices and cache, so they stay
one class.

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

Beside it: `plan_candidates` (configs, devices, meshes, the row), `plan_report` (the document and
the tables) and `plan_cli` (the command line).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

from shardlib.backend import platform_of, policy_for, step_compiler_options
from shardlib.text import format_bytes
from shardlib.tools import hardware as hw
from shardlib.tools.compiled_cache import compile_cached
from shardlib.tools.hlo import collective_stats
from shardlib.tools.memory import memory_stats, peak_bytes
from shardlib.tools.plan_candidates import (
    ALL_STRATEGIES,
    CONTEXT_SEQ_LEN,
    HPZ_STRATEGIES,
    PlanError,
    PlanRow,
    check_strategy,
    default_mesh,
    resolve_config,
    select_devices,
    select_topology,
    topology_profile,
)
from shardlib.tools.plan_report import compiler_versions, progress_line

_gib = format_bytes  # the short name the advice texts use

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
        from shardlib.backend import get_policy
        from shardlib.models import param_count, trainable
        from shardlib.models.gpt import attention_for
        from shardlib.runtime.devices import TopologyError, cloud_tpu_topology
        from shardlib.step.precision import get_precision
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
        self.batch_given = batch_size is not None
        self.batch_size = batch_size or self.n
        if self.seq_len < 1 or self.batch_size < 1:
            raise PlanError(f"--batch-size and --seq-len must be positive, got {self.batch_size} and {self.seq_len}")
        self.params = param_count(self.config)
        self.attention_note = self.stand_in = None
        if not topology and self.profile.backend == "gpu" and self.config.attention == "auto" and \
                attention_for(get_policy("gpu"), get_precision(precision).compute_dtype) == "cudnn":
            # The GPU policy's bf16 attention is cuDNN's fused kernel, which XLA:CPU cannot compile.
            # Its memory is linear in T: shardlib's flash stands in (XLA's dot_product_attention
            # would count T x T scores that no run holds). In float32 the GPU policy runs the
            # einsum, flash from FLASH_MIN_SEQ tokens: "auto" compiles that as it is.
            self.config = dataclasses.replace(self.config, attention="flash")
            self.stand_in = "cuDNN"
            self.attention_note = ("attention compiled as shardlib's flash, a stand-in for cuDNN's fused kernel (which "
                                   "a GPU run uses in bf16 and needs a GPU to compile): memory linear in T, as cuDNN's")
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
        with self._hardware_policy():  # the policy the step was built with ("auto" resolves under it)
            row.attention = plan_attention.kernel(text, self.config, dtype, self.seq_len, policy_for(self.devices))
        if self.stand_in:
            row.attention += f" (stand-in for {self.stand_in})"
        if self.dump_hlo:
            row.notes.append(f"compiled HLO: {plan_attention.dump(self.dump_hlo, row.strategy, sizes, text)}")

    def _new_row(self, strategy: str, sizes: Mapping[str, int]) -> PlanRow:
        """An empty row for one candidate, with its global batch and, when pipelined, its bubble."""
        from shardlib.step.pipeline import bubble_fraction

        stages = sizes.get("pipe", 1)
        batch_size = self.batch_size
        if stages > 1 and not self.batch_given:  # one row per data-parallel device per microbatch
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
            import jax

            # JAX's cache key leaves XLA's dump options out: a hit compiles nothing, so dumps nothing.
            cause = (" (JAX's persistent compilation cache returned the program without compiling it; "
                     "JAX_ENABLE_COMPILATION_CACHE=false counts them exactly)"
                     if jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir else "")
            row.notes.append(f"XLA's partitioned HLO was not found{cause}: bf16 collectives are counted as "
                             "XLA:CPU runs them (f32), an upper bound")
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
