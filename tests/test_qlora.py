"""QLoRA (`models.lora`, ``LoraConfig.base``): the quantisation's error bound from its formula, a
zero3 QLoRA step against plain ``jax.jit`` + optax training the same adapters over the dequantised
base (codes x scales, computed here), the base's per-device bytes (1/4 of float32), only the
adapters' gradients reduced, and the plan's flags."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

pytest.importorskip("qwix")

from shardlib import build, make_layout, make_mesh  # noqa: E402
from shardlib.models import get_config, trainable  # noqa: E402
from shardlib.models.configs import LoraConfig, lora_param_count  # noqa: E402
from shardlib.models.gpt import from_params, next_token_loss  # noqa: E402
from shardlib.models.lora import SCALE, TARGETS, dequantise, is_adapter, quantise  # noqa: E402
from shardlib.sharding.rules import path_str  # noqa: E402
from tests import zoo  # noqa: E402
from tests.helpers import batches, tree_from_flat  # noqa: E402

LORA = LoraConfig(rank=4, alpha=8, targets=("q", "v", "o", "down"))
CONFIG = dataclasses.replace(get_config("tiny"), lora=dataclasses.replace(LORA, base="int8"))
PLAIN = dataclasses.replace(get_config("tiny"), lora=LORA)  # the reference: LoRA over a float base
STEPS = 3


def _sgd():
    """SGD with momentum, not Adam: a parameter moves by lr x its gradient, so the last-bit
    differences of two programs' sums (zero3 against plain jit) stay that size, where Adam's
    division by sqrt(v) + eps amplifies them for near-zero gradients (`tests.helpers.optimizer`)."""
    return optax.sgd(0.5, momentum=0.9)

N_IN = {weight: n for _, weight, n, _ in TARGETS.values()}
NF4 = np.array([-1.0, -0.6961928, -0.5250731, -0.3949175, -0.2844414, -0.1847734, -0.0910500, 0.0,
                0.0795803, 0.1609302, 0.2461123, 0.3379152, 0.4407098, 0.5626170, 0.7229568, 1.0])  # QLoRA paper, App. E


def _flat(tree):
    return {path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _flat_names(tree):
    leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: isinstance(x, tuple))
    return {path_str(p): tuple(x) for p, x in leaves}


def _dequantised_by_hand(flat):
    """The float base a QLoRA run computes with, from the formula: codes x per-output-channel scale."""
    out = {}
    for path, x in flat.items():
        if path.endswith(SCALE):
            continue
        scale = flat.get(path + SCALE)
        if scale is None:
            out[path] = np.asarray(x)
        else:  # [layers, in..., out...] codes, [layers, out...] scales
            n_in = N_IN[path.rsplit("/", 1)[-1]]
            s = np.asarray(scale).reshape(scale.shape[:1] + (1,) * n_in + scale.shape[1:])
            out[path] = np.asarray(x).astype(np.float32) * s
    return out


@pytest.fixture(scope="module")
def zero3_run():
    model = trainable(CONFIG)
    program = build(model, _sgd(), make_layout(model, "zero3", make_mesh({"fsdp": 8})))
    state = program.init(jax.random.key(0))
    start = jax.tree.map(np.array, state.params)
    losses = []
    for rows in batches(STEPS):
        state, metrics = program.step(state, rows)
        losses.append(float(metrics["loss"]))
    return start, np.array(losses), state, program


@pytest.mark.parametrize("base", ["int8", "nf4"])
def test_quantisation_error_is_within_half_a_step_of_each_channel(base):
    """Per output channel (and layer), absmax: int8 codes are round(w / s) with s = absmax / 127,
    so |w - codes s| <= s / 2 and the largest weight is exactly +-127 s; NF4's codes are the
    nearest of its 16 levels times s = absmax, so the error is at most half the widest gap between
    levels times s."""
    w = jax.random.normal(jax.random.key(1), (2, 64, 4, 16), jnp.float32) * 0.02  # [layers, in, heads, head_dim]
    codes, scale = quantise(w, 1, base, stacked=1)
    assert scale.shape == (2, 4, 16) and scale.dtype == jnp.float32
    back = np.asarray(dequantise(codes, scale, base, jnp.float32, stacked=1))
    absmax = np.abs(np.asarray(w)).max(axis=1)  # over the input dim
    step = np.asarray(scale)[:, None]
    if base == "int8":
        assert codes.dtype == jnp.int8 and int(np.abs(np.asarray(codes, np.int32)).max()) == 127
        np.testing.assert_allclose(np.asarray(scale), absmax / 127, rtol=1e-6)
        bound = step / 2
    else:
        assert codes.dtype == jnp.uint4 and int(np.asarray(codes, np.int32).max()) <= 15
        np.testing.assert_allclose(np.asarray(scale), absmax, rtol=1e-6)
        bound = step * np.diff(NF4).max() / 2
        np.testing.assert_allclose(back, NF4[np.asarray(codes, np.int32)] * step, rtol=1e-6)
    err = np.abs(np.asarray(w) - back)
    ulp = np.abs(np.asarray(w)) * 2.0 ** -23  # float32 rounding of w / s and codes x s
    assert (err <= bound + ulp).all(), float((err / bound).max())
    assert err.max() > 0.5 * bound.max()  # the bound is met, not vacuous


def test_a_zero3_qlora_step_equals_plain_jit_over_the_dequantised_base(zero3_run):
    """The codes and scales are stored (int8, sharded) and never change; the adapters after 3 SGD
    steps and the losses are those of plain jax.jit + optax training LoRA over the float base
    codes x scales computed in this test."""
    start, losses, state, _ = zero3_run
    flat = _flat(start)
    assert {flat[p].dtype for p in flat if p.endswith(("/wq", "/wo", "/w_down", "/w_gate"))} == {np.dtype(np.int8)}
    base = _dequantised_by_hand(flat)
    adapters = {p: x for p, x in base.items() if is_adapter(p)}
    frozen = {p: x for p, x in base.items() if not is_adapter(p)}
    like = jax.eval_shape(trainable(PLAIN).init, jax.random.key(0))
    tx = _sgd()

    def loss(a, b):
        return next_token_loss(from_params(PLAIN, tree_from_flat({**frozen, **a}, like)), b)[0]

    a, expected = zoo.plain_steps(loss, adapters, tx, batches(STEPS))
    np.testing.assert_allclose(losses, expected, rtol=1e-6)
    assert losses[-1] < losses[0]
    got = _flat(jax.tree.map(np.asarray, state.params))
    for name, want in a.items():
        np.testing.assert_allclose(got[name], np.asarray(want), rtol=1e-5, atol=1e-7, err_msg=name)
    for name, want in flat.items():
        if not is_adapter(name):  # codes, scales, norms, embeddings: bit for bit as they started
            np.testing.assert_array_equal(got[name], want, err_msg=name)


def test_the_base_is_sharded_like_its_weight_in_a_quarter_of_the_bytes(zero3_run):
    """Each device holds the codes of a projection in the float weight's shard shape (same rules),
    1 byte an element against 4; its scales carry the weight's layer and output names."""
    state = zero3_run[2]
    plain = trainable(PLAIN)
    plain_by_path, got = _flat(make_layout(plain, "zero3", make_mesh({"fsdp": 8})).param_shardings()), _flat(state.params)
    names = _flat_names(trainable(CONFIG).logical_axes)
    weights = [p for p in got if p + SCALE in got]
    assert len(weights) == 7  # every projection of the tiny model's blocks, adapted or not
    codes = floats = 0
    for path in weights:
        x, f32 = got[path], plain_by_path[path]
        shard = f32.shard_shape(x.shape)
        assert x.addressable_shards[0].data.shape == shard, path
        n_in = N_IN[path.rsplit("/", 1)[-1]]
        assert names[path + SCALE] == names[path][:1] + names[path][1 + n_in:], path
        codes += x.addressable_shards[0].data.nbytes
        floats += int(np.prod(shard)) * 4
    assert codes * 4 == floats


def test_zero3_reduces_the_adapters_gradients_only(zero3_run):
    """The frozen int8 codes are not differentiated: the compiled step reduce-scatters exactly the
    adapters' float32 gradients, (N-1)/N of 4 bytes per trained parameter, and no integer tensor."""
    from shardlib.tools.report import collective_stats

    program, state = zero3_run[3], zero3_run[2]
    compiled = program.step.lower(state, batches(1)[0]).compile()
    scattered = sum(r.bytes_per_step for r in collective_stats(compiled).records if r.kind == "reduce-scatter")
    assert scattered == 7 / 8 * 4 * lora_param_count(CONFIG)
    assert not [line for line in compiled.as_text().splitlines()
                if ("reduce-scatter(" in line or "all-reduce(" in line) and " s8[" in line]


def test_zero2_layerwise_step_carries_the_frozen_base(zero3_run):
    """zero2 keeps parameters whole and reduces gradients layer by layer inside the backward loop
    (`shardlib.step.layerwise`: each weight travels with a twin); the frozen int8 base rides along:
    the same losses as zero3 (two programs: rtol 1e-6) and the codes unchanged."""
    start, losses, _, _ = zero3_run
    model = trainable(CONFIG)
    program = build(model, _sgd(), make_layout(model, "zero2", make_mesh({"fsdp": 8})))
    state = program.init(jax.random.key(0))
    got = []
    for rows in batches(STEPS):
        state, metrics = program.step(state, rows)
        got.append(float(metrics["loss"]))
    np.testing.assert_allclose(got, losses, rtol=1e-6)
    after = _flat(state.params)
    for path in [p for p in after if p + SCALE in after]:
        np.testing.assert_array_equal(np.asarray(after[path]), _flat(start)[path], err_msg=path)


def test_a_trained_integer_leaf_is_still_refused():
    """Only a frozen integer leaf is carried: one that would train is named and refused."""
    from flax import nnx

    from shardlib.model import from_nnx

    class Counter(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(jnp.ones((8, 8)))
            self.table = nnx.Param(jnp.zeros((8,), jnp.int32))

        def __call__(self, x):
            return x @ self.w[...] + self.table[...]

    model = from_nnx(lambda rngs: Counter(rngs), lambda m, b: (jnp.mean(m(b["x"]) ** 2), {}))
    with pytest.raises(TypeError, match=r"table \(int32\[8\]\)"):
        build(model, optax.sgd(0.1), make_layout(model, "dp", make_mesh({"data": 8})))


def test_plan_and_settings_name_the_base():
    import argparse

    from shardlib.models.configs import param_count
    from shardlib.tools import plan_lora
    from shardlib.tools.plan import PlanError

    args = argparse.Namespace(lora_rank=4, lora_alpha=8.0, lora_targets="q,v,o,down", lora_base="int8")
    assert plan_lora.from_args(args, PlanError) == CONFIG.lora
    assert plan_lora.header(CONFIG, param_count(CONFIG)) == [
        f"trains: {lora_param_count(CONFIG):,} of {param_count(CONFIG):,} parameters (QLoRA rank 4, alpha 8 on "
        "q,v,o,down over an int8 base); the base frozen in float32, its projections as int8 codes with "
        "per-channel scales, optimizer state for the adapters only"]
    assert "--lora-base int8" in plan_lora.train_flags(CONFIG)
    with pytest.raises(PlanError, match="add --lora-rank R"):
        plan_lora.from_args(argparse.Namespace(lora_rank=None, lora_alpha=None, lora_targets=None, lora_base="nf4"),
                            PlanError)
    with pytest.raises(PlanError, match="--lora-base: LoRA base 'nf4' is not supported yet: its uint4 codes"):
        plan_lora.from_args(argparse.Namespace(lora_rank=4, lora_alpha=None, lora_targets=None, lora_base="nf4"),
                            PlanError)
    with pytest.raises(ValueError, match="LoRA base 'int4': use one of int8"):
        LoraConfig(rank=2, base="int4")

