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
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardlib import build, make_layout, make_mesh
from shardlib.models import GPTConfig, trainable
from shardlib.step.precision import get_precision
from shardlib.tools.hardware import HARDWARE
from shardlib.tools.hlo import collective_stats, parse_hlo_module
from shardlib.tools.memory import memory_stats, peak_bytes
from tests.helpers import optimizer

TOPOLOGY = "v5e:2x4"
N = 8
CONFIG = GPTConfig(vocab_size=256, d_model=512, n_layers=2, n_heads=4, d_ff=1024, max_seq_len=128)
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
    from shardlib.runtime.devices import TopologyError, topology_devices

    try:
        return topology_devices(TOPOLOGY)
    except TopologyError as err:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must compile for TPU: {err}")
        pytest.skip(str(err))


@dataclasses.dataclass
class Program:
    compiled: object
    lowered_text: str
    psi: int
    stack: int  # parameters of the scanned layers

    @property
    def stats(self):
        return collective_stats(self.compiled.as_text())


_CACHE: dict[tuple[str, str], Program] = {}


def program(chips, name: str, precision: str) -> Program:
    """The case's TPU program, compiled once for the whole module."""
    key = (name, precision)
    if key not in _CACHE:
        strategy, mesh, options = {**STRATEGIES, **OPTIONS}[name]
        options = dict(options)
        policy = get_precision(precision)
        if "reduce_dtype" in options:
            policy = dataclasses.replace(policy, reduce_dtype=jnp.dtype(options.pop("reduce_dtype")))
        config = dataclasses.replace(CONFIG, compute_dtype="bfloat16" if precision == "bf16" else "float32")
        model = trainable(config)
        layout = make_layout(model, strategy, make_mesh(mesh, devices=chips))
        prog = build(model, optimizer(), layout, precision=policy, **options)
        shape = ((ROWS, CONFIG.max_seq_len), jnp.int32)
        lowered = prog.step.lower(prog.abstract_state(), prog.abstract_batch({"inputs": shape, "targets": shape}))
        params = jax.tree.leaves(model.abstract())
        psi = sum(int(np.prod(x.shape)) for x in params)
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


def test_the_cpu_construct_is_seen_where_the_cpu_policy_builds_it(chips):
    """The check above can fail: the same zero3 step built with XLA:CPU's policy has the barriers."""
    from shardlib.backend import forced

    model = trainable(CONFIG)
    with forced("cpu"):
        prog = build(model, optimizer(), make_layout(model, "zero3", make_mesh({"fsdp": N}, devices=chips)))
    shape = ((ROWS, CONFIG.max_seq_len), jnp.int32)
    lowered = prog.step.lower(prog.abstract_state(), prog.abstract_batch({"inputs": shape, "targets": shape}))
    assert matmul_order_barriers(lowered.as_text()) > 0
