"""The ZeRO contract (docs/design.md): persistent bytes per device and collective bytes per step,
read from the compiled program itself (memory_analysis and the optimised HLO)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardlib.models import GPTConfig, trainable
from shardlib import build, make_layout, make_mesh
from shardlib.tools.report import collective_stats, memory_stats
from tests.helpers import BATCH, SEQ, optimizer, tiny_model

N = 8
# Persistent bytes per device, in units of Psi (fp32 params + two fp32 Adam moments).
MEMORY_CONTRACT = {"dp": 12, "zero1": 4 + 8 / N, "zero2": 4 + 8 / N, "zero3": 12 / N}
MESHES = {"dp": {"data": N}, "zero1": {"data": N}, "zero2": {"data": N}, "zero3": {"fsdp": N}}


def _compiled(model, strategy, batch=BATCH, seq=SEQ):
    program = build(model, optimizer(), make_layout(model, strategy, make_mesh(MESHES[strategy])))
    shapes = {"inputs": ((batch, seq), jnp.int32), "targets": ((batch, seq), jnp.int32)}
    batch_bytes = 2 * batch * seq * 4 // N
    return program.compile_step(program.abstract_state(), program.abstract_batch(shapes)), batch_bytes


def _psi(model) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(model.abstract()))


@pytest.fixture(scope="module")
def tiny_compiled():
    model = tiny_model()
    return model, {s: _compiled(model, s) for s in MESHES}


@pytest.mark.parametrize("strategy", list(MESHES))
def test_persistent_bytes_tiny(strategy, tiny_compiled):
    model, compiled = tiny_compiled
    program, batch_bytes = compiled[strategy]
    persistent = memory_stats(program).argument_bytes - batch_bytes
    expected = MEMORY_CONTRACT[strategy] * _psi(model)  # the table is in bytes: 12 Psi = 4 + 4 + 4 bytes per parameter
    assert persistent == pytest.approx(expected, rel=0.02)


def test_persistent_bytes_100m_model_compiled_abstractly():
    config = GPTConfig(vocab_size=32000, d_model=768, n_layers=12, n_heads=12, d_ff=2048, max_seq_len=256)
    model = trainable(config)
    psi = _psi(model)
    assert psi > 100e6
    for strategy in ("dp", "zero1", "zero3"):  # zero2 has zero1's persistent state (checked on tiny)
        compiled, batch_bytes = _compiled(model, strategy, batch=N, seq=128)
        persistent = memory_stats(compiled).argument_bytes - batch_bytes
        assert persistent == pytest.approx(MEMORY_CONTRACT[strategy] * psi, rel=0.02), strategy


def _ring(bytes_full: float) -> float:
    return bytes_full * (N - 1) / N


@pytest.mark.parametrize("strategy,psi_factor", [("dp", 2), ("zero1", 2), ("zero2", 2), ("zero3", 3)])
def test_collective_bytes_match_the_zero_paper(strategy, psi_factor, tiny_compiled):
    model, compiled = tiny_compiled
    stats = collective_stats(compiled[strategy][0])
    psi_bytes = _psi(model) * 4
    assert stats.total_bytes == pytest.approx(_ring(psi_factor * psi_bytes), rel=0.10)
    by_kind = stats.bytes_by_kind()
    if strategy == "dp":
        assert by_kind["all-reduce"] == pytest.approx(_ring(2 * psi_bytes), rel=0.01)
        assert by_kind["reduce-scatter"] == by_kind["all-gather"] == 0
    elif strategy in ("zero1", "zero2"):  # reduce-scatter the gradients, all-gather the new params
        assert by_kind["reduce-scatter"] == pytest.approx(_ring(psi_bytes), rel=0.01)
        assert by_kind["all-gather"] == pytest.approx(_ring(psi_bytes), rel=0.01)
    else:
        # Exact accounting: every scanned layer is gathered in the forward and again in the
        # backward pass (remat); the embedding lookup's backward needs no weights, and XLA keeps
        # the output head's gathered weights from the end of the forward to the start of the
        # backward (freeing and re-gathering them there would save no memory). All gradients
        # are reduce-scattered once.
        layers = sum(int(np.prod(l.shape)) for l in _leaves(model) if l.logical[0] == "layers") * 4
        assert by_kind["reduce-scatter"] == pytest.approx(_ring(psi_bytes), rel=0.01)
        assert by_kind["all-gather"] == pytest.approx(_ring(psi_bytes + layers), rel=0.01)


def _leaves(model):
    program = make_layout(model, "zero3", make_mesh(MESHES["zero3"]))
    return jax.tree.leaves(program.params, is_leaf=lambda x: hasattr(x, "spec"))


def test_fsdp_gathers_weights_never_activations(tiny_compiled):
    model, compiled = tiny_compiled
    weight_shapes = set()
    for leaf in _leaves(model):
        weight_shapes.add(leaf.shape)
        if leaf.logical[0] == "layers":
            weight_shapes.add(leaf.shape[1:])
    gathers = collective_stats(compiled["zero3"][0]).of_kind("all-gather")
    assert gathers
    for record in gathers:
        shape = tuple(int(d) for d in record.shape.split("[")[1].rstrip("]").split(",") if d)
        assert shape in weight_shapes, f"{record.name} gathers {record.shape}, which is not a weight"
