"""dp / zero1 / zero2 gradients reduced layer by layer inside the backward loop
(`shardlib.step.layerwise`, ``build(layerwise=)``): all-reduced (dp) or reduce-scattered.

The reference is the same step reducing after the backward pass (``layerwise=False``), itself
parity-tested against plain ``jax.jit`` + optax in tests/test_parity.py: the two must train
bitwise alike, send the same bytes, and differ in where the reduce-scatters run (in the layer
loop, once per layer) and in the compiled peak.
"""

import dataclasses
import os
import types

import jax
import numpy as np
import pytest

from shardlib import build, make_layout, make_mesh
from shardlib.tools.hlo import parse_hlo_module
from shardlib.tools.report import collective_stats
from tests.helpers import TINY, batches, optimizer, reference, tiny_model

STEPS = 2


def _program(strategy: str, layerwise, **options):
    model = tiny_model()
    return build(model, optimizer(), make_layout(model, strategy, make_mesh({"data": 8})), layerwise=layerwise, **options)


def _run(strategy: str, layerwise, **options):
    """(collective stats, compiled peak bytes, losses, params, the gradient reductions outside the
    entry computation: in loops) after ``STEPS`` steps."""
    program = _program(strategy, layerwise, **options)
    state, rows = program.init(jax.random.key(0)), batches(STEPS)
    compiled = program.compile_step(state, rows[0])  # one compile serves the steps and the figures
    losses = []
    for batch in rows:
        state, metrics = compiled(state, batch)
        losses.append(float(metrics["loss"]))
    memory = compiled.memory_analysis()
    peak = memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes + memory.temp_size_in_bytes
    stats = collective_stats(compiled)
    kind = REDUCTION[strategy]
    looped = [r for r in stats.of_kind(kind) if r.computation != parse_hlo_module(compiled.as_text()).entry]
    cost = compiled.cost_analysis()
    accessed = (cost[0] if isinstance(cost, list) else cost)["bytes accessed"]
    return stats, peak, np.array(losses), jax.tree.map(np.asarray, state.params), looped, accessed


REDUCTION = {"dp": "all-reduce", "zero1": "reduce-scatter", "zero2": "reduce-scatter"}
# dp's all-reduces and the reduce-scatters, the latter once per microbatch and in bf16. zero1
# reduces as zero2 does when grad_accum=1 (the same twins); its own case is the linen stack below.
CASES = {"dp": ("dp", {}), "zero2-accum-bf16": ("zero2", {"grad_accum": 2, "precision": "bf16"})}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request):
    strategy, options = CASES[request.param]
    return {"case": request.param, **{layerwise: _run(strategy, layerwise, **options) for layerwise in (False, True)}}


_DEFAULT_EMITTERS = """
import os, pickle, sys
os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
                           "--xla_cpu_collective_call_terminate_timeout_seconds=900")
os.environ["JAX_PLATFORMS"] = "cpu"
from tests import test_layerwise as t
strategy, options = t.CASES[sys.argv[2]]
with open(sys.argv[1], "wb") as f:
    pickle.dump({layerwise: t._run(strategy, layerwise, **options)[2:4] for layerwise in (False, True)}, f)
"""


def test_layerwise_trains_bitwise_like_the_reduction_after_the_loop(pair, tmp_path):
    """In a process with XLA:CPU's default (fusion) emitters: the elemental emitters the other
    tests compile with (`tests/compile_flags.py`) fuse dp's update otherwise in the two programs
    and round a twelfth of the stacked weights one ulp apart."""
    import pickle
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, "-c", _DEFAULT_EMITTERS, str(tmp_path / "out.pkl"), pair["case"]],
                   env=env, check=True, cwd=root, timeout=600)
    with open(tmp_path / "out.pkl", "rb") as f:
        (losses_after, params_after), (losses_in, params_in) = pickle.load(f).values()
    np.testing.assert_array_equal(losses_in, losses_after)
    jax.tree.map(np.testing.assert_array_equal, params_in, params_after)


def test_layerwise_trains_like_plain_jax(pair):
    """zero2 + grad_accum=2 + bf16 against plain ``jax.jit`` + optax on one device, the model
    computing in bf16 (`tests.helpers.reference`): each microbatch's bf16 gradient is rounded
    otherwise than the whole batch's, so the losses agree to bf16's precision, not float32's
    (measured within 2.3e-4; bound 1e-3, half of one bf16 rounding, 2**-9)."""
    if CASES[pair["case"]][1].get("precision") != "bf16":
        pytest.skip("float32: bitwise like layerwise=False (above), itself parity-tested in tests/test_parity.py")
    _, _, losses, _, *_ = pair[True]
    ref_losses, _ = reference(STEPS, config=dataclasses.replace(TINY, compute_dtype="bfloat16"))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-3)


def test_reductions_run_inside_the_layer_loop_with_the_same_bytes(pair):
    (after, _, _, _, after_looped, _), (inside, _, _, _, looped, _) = pair[False], pair[True]
    microbatches = CASES[pair["case"]][1].get("grad_accum", 1)
    # One bucket per layer and microbatch (XLA unrolls grad_accum=2's one-trip microbatch scan).
    assert sum(r.multiplicity for r in looped) == TINY.n_layers * microbatches, inside.table()
    assert not after_looped, after.table()  # the reference reduces after the layer loop
    assert inside.bytes_by_kind() == pytest.approx(after.bytes_by_kind())


def test_layerwise_lowers_the_compiled_peak_and_memory_traffic(pair):
    after, inside = pair[False], pair[True]
    assert inside[5] < after[5]  # bytes accessed: no whole stacked gradient written, then read to reduce
    if pair["case"] != "dp":  # zero1/zero2's loop carries state shards, not the whole stacked gradient
        assert inside[1] < after[1]


@pytest.mark.parametrize("strategy, options, reason", [
    ("zero1", {"grad_compression": "int8"}, "grad_compression='int8'"),
    ("zero1", {"grad_accum": 2}, "zero1 adds whole gradients over grad_accum=2"),
    ("zero3", {}, "zero3 reduces no gradient of a parameter kept whole"),
])
def test_layerwise_true_names_why_it_cannot_apply(strategy, options, reason):
    with pytest.raises(ValueError, match=f"layerwise=True .*{reason}"):
        _program(strategy, True, **options)


def test_layerwise_true_refuses_a_model_that_does_not_gather_its_own_parameters():
    model = dataclasses.replace(tiny_model(), gathers_params=False)  # gathered up front, whole gradients
    with pytest.raises(ValueError, match="layerwise=True .*gathers_params=False"):
        build(model, optimizer(), make_layout(model, "zero1", make_mesh({"data": 8})), layerwise=True)


def test_a_scanned_linen_stack_is_reduced_per_layer_too():
    """from_linen gathers on read: under zero1 its whole parameters go through gather_layer as
    well, so a user's nn.scan stack gets the per-layer reduce-scatters (not the whole stacked
    gradient after the loop), trains bitwise like the reduction after the loop, and like plain
    jit + optax on one device."""
    import optax
    from flax import linen as nn

    from shardlib import from_linen
    from tests import zoo

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return x + nn.Dense(64)(nn.relu(nn.Dense(256)(x))), None

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x, _ = nn.scan(nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True}, length=6)()(
                nn.Dense(64)(x), None)
            return nn.Dense(10)(x)

    rng = np.random.default_rng(0)
    rows = [{"inputs": rng.normal(size=(64, 32)).astype(np.float32), "label": rng.integers(0, 10, 64).astype(np.int32)}
            for _ in range(STEPS)]
    loss = lambda logits, b: optax.softmax_cross_entropy_with_integer_labels(logits, b["label"]).mean()
    model = from_linen(Net(), loss, rows[0]["inputs"], rng_streams=())
    layout, tx = make_layout(model, "zero1", make_mesh({"data": 8})), optax.adam(1e-3)
    results = {}
    for layerwise in (None, False):
        program = build(model, tx, layout, layerwise=layerwise)
        state = program.init(jax.random.key(0))
        start = jax.tree.map(np.asarray, state.params)
        compiled = program.compile_step(state, rows[0])
        state, losses = zoo.program_steps(types.SimpleNamespace(step=compiled), state, rows)
        results[layerwise] = (compiled.memory_analysis().temp_size_in_bytes, losses, jax.tree.map(np.asarray, state.params))
    jax.tree.map(np.testing.assert_array_equal, results[None][2], results[False][2])
    stacked = sum(x.nbytes for name, tree in start.items() if name.startswith("Scan") for x in jax.tree.leaves(tree))
    assert results[None][0] + stacked / 2 < results[False][0]  # the whole stacked gradient is never live
    expected, expected_losses = zoo.plain_steps(lambda p, b: loss(Net().apply({"params": p}, b["inputs"]), b), start,
                                                tx, rows)
    np.testing.assert_allclose(results[None][1], expected_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), results[None][2],
                 jax.tree.map(np.asarray, expected))

