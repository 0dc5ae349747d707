"""dp / zero1 / zero2 gradients reduced layer by layer inside the backward loop
(`shardlib.step.layerwise`, ``build(layerwise=)``): all-reduced (dp) or reduce-scattered.

The reference is the same step reducing after the backward pass (``layerwise=False``), itself
parity-tested against plain ``jax.jit`` + optax in tests/test_parity.py: the two must train alike
(to float32's summation noise, amplified as Adam amplifies it: see the first test), send the same
bytes, and differ in where the reduce-scatters run (in the layer loop, once per layer) and in the
compiled peak.
"""

import dataclasses
import types

import jax
import numpy as np
import pytest

from shardlib import build, make_layout, make_mesh
from shardlib.tools.hlo_parse import parse_hlo_module
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


def adam_noise(lr: float, eps: float) -> float:
    """How far apart one Adam step can move a parameter in two programs whose gradients differ by
    float32 summation noise, |dg| ~ 1e-9 here: the update m / (sqrt(v) + eps) moves by at most
    lr * |dg| / eps (`tests.helpers.optimizer`: 3e-7 at lr 3e-3, eps 1e-5)."""
    return lr * 1e-9 / eps


def test_layerwise_trains_like_the_reduction_after_the_loop(pair):
    """The two programs are different programs: the twins reduce the weight's cotangent where
    GSPMD reduces the weight-gradient matmul's result, so XLA:CPU computes that matmul in another
    layout, and which dot kernel (hence which accumulation order) it picks depends on the layout
    and on the CPU's instruction set. On one AVX-512 machine they trained bitwise alike; on an
    AVX2 machine a twelfth of dp's stacked weights came out up to 3.2e-8 apart after one step. What
    holds on every CPU is what is asserted: the same losses to float32 rounding, and parameters
    apart by at most the gradient's last-bit noise as AdamW amplifies it, per step."""
    (_, _, losses_after, params_after, *_), (_, _, losses_in, params_in, *_) = pair[False], pair[True]
    np.testing.assert_allclose(losses_in, losses_after, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=STEPS * adam_noise(3e-3, 1e-5)),
                 params_in, params_after)


def test_layerwise_trains_like_plain_jax(pair):
    """zero2 + grad_accum=2 + bf16 against plain ``jax.jit`` + optax on one device, the model
    computing in bf16 (`tests.helpers.reference`): each microbatch's bf16 gradient is rounded
    otherwise than the whole batch's, so the losses agree to bf16's precision, not float32's
    (measured within 2.3e-4; bound 1e-3, half of one bf16 rounding, 2**-9)."""
    if CASES[pair["case"]][1].get("precision") != "bf16":
        pytest.skip("float32: like layerwise=False (above), itself parity-tested in tests/test_parity.py")
    _, _, losses, _, *_ = pair[True]
    ref_losses, _ = reference(STEPS, config=dataclasses.replace(TINY, compute_dtype="bfloat16"))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-3)


@pytest.mark.xla_defaults
def test_reductions_run_inside_the_layer_loop_with_the_same_bytes(pair):
    (after, _, _, _, after_looped, _), (inside, _, _, _, looped, _) = pair[False], pair[True]
    microbatches = CASES[pair["case"]][1].get("grad_accum", 1)
    # One bucket per layer and microbatch (XLA unrolls grad_accum=2's one-trip microbatch scan).
    assert sum(r.multiplicity for r in looped) == TINY.n_layers * microbatches, inside.table()
    assert not after_looped, after.table()  # the reference reduces after the layer loop
    assert inside.bytes_by_kind() == pytest.approx(after.bytes_by_kind())


@pytest.mark.xla_defaults
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
    gradient after the loop), trains like the reduction after the loop (to Adam's amplified
    summation noise, as the first test) and like plain jit + optax on one device."""
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
    layout, tx = make_layout(model, "zero1", make_mesh({"data": 8})), optax.adam(1e-3, eps=1e-5)
    results = {}
    for layerwise in (None, False):
        program = build(model, tx, layout, layerwise=layerwise)
        state = program.init(jax.random.key(0))
        start = jax.tree.map(np.asarray, state.params)
        compiled = program.compile_step(state, rows[0])
        state, losses = zoo.program_steps(types.SimpleNamespace(step=compiled), state, rows)
        results[layerwise] = (compiled.memory_analysis().temp_size_in_bytes, losses, jax.tree.map(np.asarray, state.params))
    np.testing.assert_allclose(results[None][1], results[False][1], rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=STEPS * adam_noise(1e-3, 1e-5)),
                 results[None][2], results[False][2])
    stacked = sum(x.nbytes for name, tree in start.items() if name.startswith("Scan") for x in jax.tree.leaves(tree))
    assert results[None][0] + stacked / 2 < results[False][0]  # the whole stacked gradient is never live
    expected, expected_losses = zoo.plain_steps(lambda p, b: loss(Net().apply({"params": p}, b["inputs"]), b), start,
                                                tx, rows)
    np.testing.assert_allclose(results[None][1], expected_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), results[None][2],
                 jax.tree.map(np.asarray, expected))

