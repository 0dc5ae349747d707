"""The accelerator program, compiled by the real TPU compiler on this CPU host.

Every other test runs XLA:CPU's program on simulated devices; users run the program XLA:TPU and
XLA:GPU build, which takes other paths (weights cast before the ZeRO-3 gather, autodiff's gather
pair, no barrier, no matmul-order transposes; `shardlib.backend`). Here each strategy's train step
is compiled for the 8 chips of a TPU v5e 2x4 slice (`jax.experimental.topologies`, libtpu from the
``tpu`` extra; nothing runs) and read: persistent bytes per chip against the README's formulas,
collective bytes by kind against the ZeRO paper's, the dtype each collective carries, no CPU-only
construct left, and the step fits the chip's 16 GB. Outside CI a missing libtpu skips with the
install command; under ``CI=true`` it fails.

The model's dims are multiples of 128 so that TPU's (8, 128) tiles hold them unpadded: memory
analysis then measures the bytes the formulas count.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from shardlib import build, make_layout, make_mesh
from shardlib.models import GPTConfig, trainable
from shardlib.runtime.checkpoint_digests import digest_all
from shardlib.step.precision import get_precision
from shardlib.tools.hardware import HARDWARE
from shardlib.tools.hlo import collective_stats
from shardlib.tools.hlo_parse import parse_hlo_module
from shardlib.tools.memory import memory_stats, peak_bytes
from tests.helpers import optimizer, tpu_chips

TOPOLOGY = "v5e:2x4"
N = 8
# As narrow as the assertions allow: XLA:TPU's compile time grows with each op's size (BENCHMARKS.md,
# "The TPU compile tests' model width"), and d_model 512, d_ff 1024 took twice this model's CPU time a
# compile. Four heads (tp splits them over 4) of 128 (the splash kernel's block), d_ff 512 (128 lanes
# a tp shard), vocabulary 256 (fsdp_tp's [vocab / 2, d_model / 4] embedding shard: 128 lanes), two
# layers (the loop's trip count is read), 128 tokens (the kernel's block): every shard whole tiles.
CONFIG = GPTConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=4, attention_head_dim=128, d_ff=512,
                   max_seq_len=128)
ROWS = 16
# name -> (strategy, mesh, build options); each compiled in f32 and in bf16 (below) unless named "@bf16"
STRATEGIES = {
    "dp": ("dp", {"data": N}, {}),
    "zero1": ("zero1", {"data": N}, {}),
    "zero2": ("zero2", {"data": N}, {}),
    "zero3": ("zero3", {"fsdp": N}, {}),
    "zero3_hpz": ("zero3_hpz", {"data": 2, "fsdp": 4}, {}),
    "tp": ("tp", {"data": 2, "tensor": 4}, {}),
    "fsdp_tp": ("fsdp_tp", {"fsdp": 4, "tensor": 2}, {}),
    "hsdp": ("hsdp", {"data": 2, "fsdp": 4}, {}),
}
OPTIONS = {  # bf16 only: the options users turn on at scale
    "dp_pipe": ("dp", {"pipe": 2, "data": 4}, {"microbatches": 4}),
    "zero3_pipe": ("zero3", {"pipe": 2, "fsdp": 4}, {"microbatches": 4}),
    "zero3_offload": ("zero3", {"fsdp": N}, {"offload": "opt_state"}),
    "zero3_qwz": ("zero3", {"fsdp": N}, {"weight_gather": "int8"}),
    "zero3_qgz": ("zero3", {"fsdp": N}, {"grad_compression": "int8"}),
    "dp_stale": ("dp", {"data": N}, {"staleness": 1}),
    "zero2_accum": ("zero2", {"data": N}, {"grad_accum": 2}),
    "zero3_reduce_bf16": ("zero3", {"fsdp": N}, {"reduce_dtype": "bf16"}),
}
CASES = [(name, precision) for name in STRATEGIES for precision in ("f32", "bf16")] + [(n, "bf16") for n in OPTIONS]


@pytest.fixture(scope="module")
def chips():
    return tpu_chips(TOPOLOGY)


@dataclasses.dataclass
class Program:
    compiled: object
    lowered_text: str
    psi: int
    stack: int  # parameters of the scanned layers

    @functools.cached_property
    def text(self) -> str:
        return self.compiled.as_text()

    @functools.cached_property
    def stats(self):
        return collective_stats(self.text)


_CACHE: dict[tuple[str, str], Program] = {}


def lower_case(chips, config: GPTConfig, name: str, precision: str):
    """Case ``name``'s model for ``config`` and its train step in ``precision``, lowered for ``chips``
    (scripts/benchmark_tpu_test_width.py times it at other widths)."""
    strategy, mesh, options = {**STRATEGIES, **OPTIONS}[name]
    options = dict(options)
    policy = get_precision(precision)
    if "reduce_dtype" in options:
        policy = dataclasses.replace(policy, reduce_dtype=options.pop("reduce_dtype"))
    config = dataclasses.replace(config, compute_dtype="bfloat16" if precision == "bf16" else "float32")
    model = trainable(config)
    layout = make_layout(model, strategy, make_mesh(mesh, devices=chips))
    prog = build(model, optimizer(), layout, precision=policy, **options)
    shape = ((ROWS, config.max_seq_len), jnp.int32)
    return model, prog.step.lower(prog.abstract_state(), prog.abstract_batch({"inputs": shape, "targets": shape}))


def program(chips, name: str, precision: str) -> Program:
    """The case's TPU program, compiled once for the whole module."""
    key = (name, precision)
    if key not in _CACHE:
        model, lowered = lower_case(chips, CONFIG, name, precision)
        psi = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(model.abstract()))
        stack = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(model.abstract()["blocks"]))
        _CACHE[key] = Program(lowered.compile(), lowered.as_text(), psi, stack)
    return _CACHE[key]


_MATRIX_BARRIER_RE = re.compile(r"stablehlo.optimization_barrier %[\w#]+ : tensor<\d+x\d+x[a-z0-9]+>$", re.M)


def matmul_order_barriers(lowered_text: str) -> int:
    """XLA:CPU's matmul-order construct (`hooks.matmul_ordered`): a barrier around one transposed
    weight-gradient matrix. (Remat's barriers hold the many values of a layer.)"""
    return len(_MATRIX_BARRIER_RE.findall(lowered_text))


@pytest.mark.parametrize("name,precision", CASES)
def test_tpu_step_compiles_fits_and_has_no_cpu_construct(chips, name, precision):
    prog = program(chips, name, precision)
    assert peak_bytes(memory_stats(prog.compiled)) <= HARDWARE["tpu-v5e"].hbm_bytes
    assert matmul_order_barriers(prog.lowered_text) == 0


@pytest.mark.parametrize("name", ["zero3", "fsdp_tp"])
def test_tpu_bf16_attention_is_the_pallas_splash_kernel(chips, name):
    """The TPU policy's bf16 attention is a Pallas kernel inside the step's shard_map (its forward:
    a custom call the compiled program holds); in f32 it is XLA's. Under fsdp_tp the heads split
    over ``tensor``: each kernel call sees half of them."""
    text = program(chips, name, "bf16").text
    assert "tpu_custom_call" in text
    assert "tpu_custom_call" not in program(chips, name, "f32").text
    if name == "fsdp_tp":
        heads = CONFIG.n_heads // STRATEGIES[name][1]["tensor"]
        assert re.search(rf"bf16\[[0-9,]*{heads},{CONFIG.max_seq_len},{CONFIG.head_dim}\][^\n]*custom_call_target=\"tpu_custom_call\"", text)


def test_tpu_bf16_windowed_softcapped_attention_is_the_splash_kernel_per_window(chips):
    """A Gemma-2-shaped model (windows 64 and 0 alternating under the layers' scan, soft-capped
    scores) compiles with the splash kernel: one kernel per window value (``lax.switch``), so the
    program holds more kernel calls than the plain model's one."""
    def kernel_calls(text: str) -> int:
        return len(re.findall(r'custom_call_target="tpu_custom_call"', text))

    config = dataclasses.replace(CONFIG, compute_dtype="bfloat16", layer_windows=(64, 0), attn_softcap=50.0)
    model = trainable(config)
    prog = build(model, optimizer(), make_layout(model, "zero3", make_mesh({"fsdp": N}, devices=chips)),
                 precision=get_precision("bf16"))
    shape = ((ROWS, CONFIG.max_seq_len), jnp.int32)
    text = prog.step.lower(prog.abstract_state(), prog.abstract_batch({"inputs": shape, "targets": shape})) \
        .compile().as_text()
    assert kernel_calls(text) > kernel_calls(program(chips, "zero3", "bf16").text) > 0


@pytest.mark.slow  # 35-50 CPU s of XLA:TPU compile (the d_model 256 model it replaced: 86-99, BENCHMARKS.md)
def test_tpu_bf16_attention_at_8192_tokens_on_v5p_is_the_kernel_in_linear_memory():
    """A one-layer bf16 GPT at 8192 tokens, zero3 over the 8 chips of a v5p 2x2x2 slice (one row a
    chip): the program calls the splash kernel on each chip's [heads, 8192, head_dim] queries, and
    its temporaries are under one head's [T x T] scores in bf16 (128 MiB), where the einsum holds
    them in float32 (256 MiB a head and layer): attention's memory is linear in T.

    The model is as narrow as the kernel takes (one head of 128, TPU's lanes and the kernel's
    block; d_ff and vocabulary 128): XLA:TPU's compile time grows with each op's size (its
    low-level backend, not the attention: BENCHMARKS.md), so every other dim is at its minimum."""
    seq, heads, head_dim = 8192, 1, 128
    config = GPTConfig(vocab_size=128, d_model=heads * head_dim, n_layers=1, n_heads=heads, d_ff=128,
                       max_seq_len=seq, compute_dtype="bfloat16")
    chips = tpu_chips("v5p:2x2x2")
    model = trainable(config)
    prog = build(model, optimizer(), make_layout(model, "zero3", make_mesh({"fsdp": len(chips)}, devices=chips)),
                 precision=get_precision("bf16"))
    shape = ((len(chips), seq), jnp.int32)
    compiled = prog.step.lower(prog.abstract_state(), prog.abstract_batch({"inputs": shape, "targets": shape})).compile()
    text = compiled.as_text()
    assert re.search(rf"bf16\[[0-9,]*{heads},{seq},{head_dim}\][^\n]*custom_call_target=\"tpu_custom_call\"", text)
    assert memory_stats(compiled).temp_bytes < seq * seq * 2  # one head's scores, bf16


def test_tpu_checkpoint_digests_hash_each_shard_without_an_array_sized_temporary(chips):
    """A save's digests (`shardlib.runtime.checkpoint_digests`) over a 96 MiB-a-chip state on the
    8 chips: each lane's hash fuses into its reduction, so the temporaries stay under 1 MiB. (A
    one-pass form over both seeds, a trailing axis of 2, held 128 MiB a chip here.)"""
    mesh = make_mesh({"fsdp": N}, devices=chips)
    rows = NamedSharding(mesh, P("fsdp"))
    leaves = [jax.ShapeDtypeStruct((32768, 4096), dtype, sharding=rows) for dtype in (jnp.float32, jnp.bfloat16)]
    compiled = jax.jit(digest_all, out_shardings=NamedSharding(mesh, P())).lower(leaves).compile()
    assert memory_stats(compiled).argument_bytes == 96 * 2**20
    assert memory_stats(compiled).temp_bytes < 2**20


def test_the_cpu_construct_is_seen_where_the_cpu_policy_builds_it(chips):
    """The check above can fail: the same zero3 step built with XLA:CPU's policy has the barriers."""
    from shardlib.backend import forced

    model = trainable(CONFIG)
    with forced("cpu"):
        prog = build(model, optimizer(), make_layout(model, "zero3", make_mesh({"fsdp": N}, devices=chips)))
    shape = ((ROWS, CONFIG.max_seq_len), jnp.int32)
    lowered = prog.step.lower(prog.abstract_state(), prog.abstract_batch({"inputs": shape, "targets": shape}))
    assert matmul_order_barriers(lowered.as_text()) > 0


# ---------------------------------------------------------------- persistent bytes a chip

# In units of Psi (fp32 params + Adam's two moments = 12 bytes a parameter), the README's rows for
# N = 8, F = 4 (hpz, hsdp, fsdp_tp), T = 4 (tp) / 2 (fsdp_tp), S = 2 (pipe); R = the norm scales
# (no dim tp splits), E = embedding, final norm and head (replicated over pipe).
def persistent_bytes(name: str, prog: Program, norms: int) -> float:
    psi, stack = prog.psi, prog.stack
    edges = psi - stack
    return {
        "dp": 12 * psi, "zero1": (4 + 8 / N) * psi, "zero2": (4 + 8 / N) * psi, "zero3": 12 * psi / N,
        "zero3_hpz": 12 * psi / N, "hsdp": 12 * psi / 4,
        "tp": 12 * ((psi - norms) / 4 + norms), "fsdp_tp": 12 * ((psi - norms) / 8 + norms / 4),
        "dp_pipe": 12 * (stack / 2 + edges), "zero3_pipe": 12 * (stack / 2 + edges) / 4,
        "zero3_offload": 4 * psi / N,  # the moments are in host memory (below)
        "zero3_qwz": 12 * psi / N,
        "zero3_qgz": 12 * psi / N + 4 * psi,  # + each chip's error-feedback residual: its whole local gradient
        "dp_stale": 16 * psi,  # + the one gradient waiting to be reduced (staleness 1)
        "zero2_accum": (4 + 8 / N) * psi,  # the accumulation buffer is a temporary
        "zero3_reduce_bf16": 12 * psi / N,
    }[name]


def _norm_params() -> int:
    """Parameters in tensors tp leaves whole (the norm scales: one d_model vector each)."""
    return CONFIG.d_model * (2 * CONFIG.n_layers + 1)


@pytest.mark.parametrize("name,precision", CASES)
def test_tpu_persistent_bytes_match_the_readme(chips, name, precision):
    prog = program(chips, name, precision)
    mem = memory_stats(prog.compiled)
    batch = 2 * ROWS * CONFIG.max_seq_len * 4 // {"tp": 2, "fsdp_tp": 4, "dp_pipe": 4, "zero3_pipe": 4}.get(name, N)
    assert mem.device_bytes("argument") - batch == pytest.approx(persistent_bytes(name, prog, _norm_params()), rel=0.02)
    if name == "zero3_offload":
        assert mem.host_argument_bytes == pytest.approx(8 * prog.psi / N, rel=0.02)


# ---------------------------------------------------------------- collective bytes a chip per step


def ring(full_bytes: float, n: int = N) -> float:
    return full_bytes * (n - 1) / n


# Bytes one chip sends to gather or reduce the smallest weight matrix, the embedding, in bf16:
# a collective that moves fewer carries the norm scales (merged into one all-reduce) or the loss.
MATRIX_BYTES = ring(2 * CONFIG.vocab_size * CONFIG.d_model)


def expected_collectives(name: str, precision: str, psi: int, stack: int) -> dict[str, float]:
    """Bytes one chip sends per step by kind, from the ZeRO paper's volumes (docs/design.md).

    Gradients are reduced in float32 (`Precision.reduce_dtype`); ZeRO-3's weights are gathered
    in the compute dtype, each scanned layer twice (forward and the remat forward) and the
    embedding and head once. In an f32 step XLA:TPU gathers the layers' weights in bf16 too:
    they feed only matmuls, which JAX's default precision runs as one bf16 pass on TPU, so the
    compiler converts before the gather (the embedding, read by a lookup, stays f32).
    ZeRO-1/2 all-gather the updated f32 parameters.
    """
    edges = psi - stack
    gather = ring(2 * (psi + stack)) if precision == "bf16" else ring(4 * edges + 2 * 2 * stack)
    grads = ring(4 * psi)
    return {
        "dp": {"all-reduce": 2 * grads},
        "dp_stale": {"all-reduce": 2 * grads},
        "zero1": {"reduce-scatter": grads, "all-gather": grads},
        "zero2": {"reduce-scatter": grads, "all-gather": grads},
        # The layers' gradients are reduce-scattered once a microbatch (ZeRO-2's 1/N buffer); the
        # embedding's and head's, summed outside the layer loop, XLA:TPU moves out of the microbatch
        # loop (the sum of reduce-scatters is the reduce-scatter of the sum): once a step.
        "zero2_accum": {"reduce-scatter": ring(4 * (2 * stack + edges)), "all-gather": grads},
        "zero3": {"reduce-scatter": grads, "all-gather": gather},
        "zero3_offload": {"reduce-scatter": grads, "all-gather": gather},
        "zero3_reduce_bf16": {"reduce-scatter": grads / 2, "all-gather": gather},
        "hsdp": {"reduce-scatter": ring(4 * psi, 4), "all-gather": gather * (3 / 4) / (7 / 8),
                 "all-reduce": 2 * ring(4 * psi / 4, 2)},
    }.get(name, {})


FORMULA_CASES = [(n, p) for n, p in CASES if expected_collectives(n, p, 1, 1)]


@pytest.mark.parametrize("name,precision", FORMULA_CASES)
def test_tpu_collective_bytes_match_the_zero_paper(chips, name, precision):
    prog = program(chips, name, precision)
    by_kind = prog.stats.bytes_by_kind()
    expected = expected_collectives(name, precision, prog.psi, prog.stack)
    total = sum(expected.values())
    for kind, nbytes in by_kind.items():  # each kind within 2%; kinds the formula has none of: scalars only
        assert nbytes == pytest.approx(expected.get(kind, 0), rel=0.02, abs=0.005 * total), (kind, by_kind)


@pytest.mark.parametrize("name", ["zero3", "zero3_hpz", "hsdp", "fsdp_tp", "zero3_offload", "zero3_pipe"])
def test_tpu_bf16_gathers_weights_in_bf16_and_reduces_gradients_in_f32(chips, name):
    stats = program(chips, name, "bf16").stats
    weights = [r for r in stats.of_kind("all-gather") if r.bytes_per_step >= MATRIX_BYTES]
    assert weights and {r.dtype for r in weights} == {"bf16"}
    assert {r.dtype for r in stats.of_kind("reduce-scatter")} == {"f32"}


def test_tpu_reduce_dtype_bf16_reduces_in_bf16(chips):
    stats = program(chips, "zero3_reduce_bf16", "bf16").stats
    reductions = [r for r in stats.records
                  if r.kind in ("reduce-scatter", "all-reduce") and r.bytes_per_step >= MATRIX_BYTES]
    assert reductions and {r.dtype for r in reductions} == {"bf16"}


def test_tpu_tp_reduces_activations_in_the_compute_dtype(chips):
    """Megatron's activation all-reduces carry bf16 under bf16 (the HLO reader once counted 0 bytes
    for them); the data-axis gradient all-reduce stays f32. No weight is gathered."""
    stats = program(chips, "tp", "bf16").stats
    by_dtype = {}
    for r in stats.of_kind("all-reduce"):
        by_dtype[r.dtype] = by_dtype.get(r.dtype, 0) + r.bytes_per_step
    assert by_dtype.get("bf16", 0) > 0 and by_dtype.get("f32", 0) > 0
    assert stats.bytes_by_kind()["all-gather"] < 0.01 * stats.total_bytes


# ---------------------------------------------------------------- the HLO reader on TPU programs


def test_hlo_reader_counts_each_async_chain_once(chips):
    """XLA:TPU splits a collective over a start fusion, continuation fusions and a done fusion,
    each holding a copy of the instruction: counted once, at its start."""
    prog = program(chips, "zero3", "bf16")
    text = prog.text
    copies = len(re.findall(r"= \S+ all-gather\(", text))
    records = prog.stats.of_kind("all-gather")
    assert len(records) < copies  # the program has chains, and their copies are not counted
    chains = [m.group(1) for r in records if (m := re.search(r'chain_id="(\d+)"', _line(text, r.name)))]
    assert chains and len(chains) == len(set(chains))


def _line(text: str, name: str) -> str:
    return next(line for line in text.splitlines() if re.match(rf"\s*(ROOT )?%?{re.escape(name)} = ", line))


def test_hlo_reader_reads_tpu_loop_trip_counts(chips):
    """Each scanned layer's gradient reduce-scatter runs once a layer: the TPU while loop's trip
    count (read from its condition) multiplies it."""
    prog = program(chips, "zero3", "bf16")
    entry = parse_hlo_module(prog.text).entry
    per_layer = [r for r in prog.stats.of_kind("reduce-scatter") if r.computation != entry]
    assert per_layer and {r.multiplicity for r in per_layer} == {CONFIG.n_layers}


def test_hlo_reader_reads_memory_spaces(chips):
    """The offloaded optimizer state is in host memory (``S(5)`` layouts) in the TPU program."""
    from shardlib.tools.hlo_parse import HOST_MEMORY_SPACE, parameter_bytes_by_memory_space, parse_shape

    assert parse_shape("bf16[64,128]{1,0:T(8,128)(2,1)S(1)}").memory_space == 1
    prog = program(chips, "zero3_offload", "bf16")
    spaces = parameter_bytes_by_memory_space(prog.compiled)
    assert spaces[HOST_MEMORY_SPACE] == pytest.approx(8 * prog.psi / N, rel=0.01)


def test_hlo_reader_names_a_reduce_scatter_run_as_an_all_reduce(chips):
    """A reduce-scatter whose per-chip result is not whole (8, 128) tiles XLA:TPU runs as a full
    all-reduce and a slice: the reader counts the all-reduce it is, marked ``scattered``."""
    mesh = jax.sharding.Mesh(np.array(chips), ("d",))

    def stats_of(shape):
        scatter = jax.shard_map(lambda y: jax.lax.psum_scatter(y, "d", scatter_dimension=0, tiled=True), mesh=mesh,
                                in_specs=P(), out_specs=P("d"), check_vma=False)
        arg = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, P()))
        return collective_stats(jax.jit(scatter).lower(arg).compile())

    whole_tiles, thin = stats_of((64, 1024)), stats_of((8, 32768))
    assert [(r.kind, r.scattered) for r in whole_tiles.records] == [("reduce-scatter", False)]
    assert [(r.kind, r.scattered) for r in thin.records] == [("all-reduce", True)]
    assert thin.total_bytes == pytest.approx(2 * ring(8 * 32768 * 4))


def test_hlo_reader_names_an_all_gather_run_as_an_all_reduce(chips):
    """Over the 64 chips of a v5e 8x8 slice XLA:TPU runs an all-gather as an all-reduce of a
    zero-filled buffer each chip wrote its shard into (over 8 chips, as an all-gather): the reader
    counts the all-reduce, marked ``gathered``."""
    from shardlib.runtime.devices import topology_devices

    def stats_of(devices):
        mesh = jax.sharding.Mesh(np.array(devices), ("d",))
        gather = jax.shard_map(lambda y: jax.lax.all_gather(y, "d", axis=0, tiled=True) * 2, mesh=mesh,
                               in_specs=P("d"), out_specs=P(), check_vma=False)
        arg = jax.ShapeDtypeStruct((len(devices) * 64, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P("d")))
        return collective_stats(jax.jit(gather).lower(arg).compile())

    assert [(r.kind, r.gathered) for r in stats_of(chips).records] == [("all-gather", False)]
    large = stats_of(topology_devices("v5e:8x8"))
    assert [(r.kind, r.gathered) for r in large.records] == [("all-reduce", True)]
    assert large.total_bytes == pytest.approx(2 * ring(64 * 64 * 1024 * 2, 64))


# ---------------------------------------------------------------- shardlib plan --topology


def test_plan_with_the_tpu_compiler(chips, capsys, tmp_path, monkeypatch):
    """`shardlib plan --topology` compiles with the TPU compiler and reads its program: gathers and
    reduce-scatters, and persistent bytes of 12 Psi / 8 for zero3 in bf16 on a v5e 2x4 slice. The
    row names its attention (64 tokens: the splash kernel does not take them, said on stderr) and
    ``--dump-hlo`` writes the compiled program. Planned again, the row is read back from the plan's
    cache without a compile, every figure the same: the TPU compiler's own peak included, which the
    read-back program must know is a TPU program's to keep."""
    import json

    import jax

    from shardlib.cli import main

    argv = ["plan", "--model", "tiny", "--topology", TOPOLOGY, "--strategy", "zero3", "--precision", "bf16",
            "--json", "--cache-dir", str(tmp_path / "cache")]
    assert main([*argv, "--dump-hlo", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    row = doc["candidates"][0]
    assert row["collective_bytes"]["all-gather"] > 0 and row["collective_bytes"]["reduce-scatter"] > 0
    assert row["persistent_bytes"] == pytest.approx(12 * doc["params"] / 8, rel=0.02)
    assert doc["compiler"]["platform"] == "tpu" and doc["hardware"]["name"] == "tpu-v5e" and row["fits"]
    assert row["inter_domain_bytes"] == 0  # one slice: everything on ICI
    assert row["attention"] == "einsum (splash did not fit)"
    assert "sequence 64 is not a multiple of 128" in captured.err or splash_said(64)
    dumped = (tmp_path / "zero3_fsdp8.hlo.txt").read_text()
    assert "all-gather" in dumped and "tpu_custom_call" not in dumped

    compile_program = jax.stages.Lowered.compile

    def refuse_the_step(self, *args, **kwargs):  # small probes (no matmul) may still compile
        assert "dot_general" not in self.as_text(), "the step was compiled again"
        return compile_program(self, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", refuse_the_step)
    assert main(argv) == 0
    again = json.loads(capsys.readouterr().out)["candidates"][0]
    row["notes"] = [n for n in row["notes"] if not n.startswith("compiled HLO:")]  # --dump-hlo's, not asked again
    assert {k: v for k, v in again.items() if k != "compile_s"} == {k: v for k, v in row.items() if k != "compile_s"}


def splash_said(seq_len: int) -> bool:
    """The fallback for ``seq_len`` tokens was already said in this process (it is said once)."""
    from shardlib.model import splash

    return any(q[1] == seq_len for q, _ in splash._SAID)


def test_plan_reads_zero3_traffic_as_gathers_and_reduce_scatters(chips):
    """On the test model (tiles filled), the plan's all-reduce bytes are under a tenth of the gathers
    and reduce-scatters. (The tiny model's 32 KB gradients XLA:TPU merges into the norm scales'
    all-reduce, a latency trade the reader reports as the all-reduce it is.)"""
    from shardlib.tools.plan import Planner

    row = Planner(CONFIG, topology=TOPOLOGY, precision="bf16", batch_size=ROWS).candidate("zero3")
    by_kind = row.collective_bytes
    assert by_kind["all-reduce"] < 0.1 * (by_kind["all-gather"] + by_kind["reduce-scatter"]), by_kind
    assert by_kind["reduce-scatter"] == pytest.approx(ring(4 * _psi()), rel=0.02)  # every gradient once, in f32


def _psi() -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(trainable(CONFIG).abstract()))


def test_plan_puts_hsdp_replica_all_reduce_on_dcn(chips):
    """Two v5e 2x2 slices: hsdp's fsdp axis stays in a slice (ICI); its data axis crosses slices,
    where XLA:TPU hands the all-reduce of the shards to the Megascale runtime (send/recv over DCN).
    The reader counts that transfer as the all-reduce it is, on the inter-slice link: 2 (K-1)/K of
    one chip's f32 gradient shard (4 Psi / F bytes), K = 2 slices."""
    from shardlib.tools.plan import Planner

    planner = Planner(CONFIG, topology="v5e:2x2", slices=2, precision="bf16", batch_size=ROWS)
    row = planner.candidate("hsdp", {"data": 2, "fsdp": 4})
    assert row.inter_domain_bytes == pytest.approx(2 * ring(4 * _psi() / 4, 2), rel=0.01)
    assert row.intra_domain_bytes > 0
