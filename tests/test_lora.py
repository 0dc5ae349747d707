"""LoRA (`models.lora`): a zero3 LoRA step against the same LoRA written with plain ``jax.jit`` +
optax (gradients of the adapters only, AdamW over them alone), the frozen base stored in the
compute dtype and untouched, optimizer state for the adapters only, and the parameter count."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from shardlib import build, make_layout, make_mesh
from shardlib.models import get_config, param_count, trainable
from shardlib.models.configs import LoraConfig, lora_param_count
from shardlib.models.gpt import from_params, next_token_loss
from shardlib.models.lora import is_adapter
from shardlib.sharding.rules import path_str
from tests import zoo
from tests.helpers import batches, optimizer, tree_from_flat

CONFIG = dataclasses.replace(get_config("tiny"), lora=LoraConfig(rank=4, alpha=8, targets=("q", "v", "o", "down")))
STEPS = 3


def _split(params):
    """(adapters, base) as flat {path: array} dicts."""
    flat = {path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(params)}
    return ({k: v for k, v in flat.items() if is_adapter(k)}, {k: v for k, v in flat.items() if not is_adapter(k)})


@pytest.fixture(scope="module")
def zero3_run():
    model = trainable(CONFIG)
    program = build(model, optimizer(), make_layout(model, "zero3", make_mesh({"fsdp": 8})))
    state = program.init(jax.random.key(0))
    start = jax.tree.map(np.array, state.params)
    losses = []
    for rows in batches(STEPS):
        state, metrics = program.step(state, rows)
        losses.append(float(metrics["loss"]))
    return start, np.array(losses), state, program


def test_a_zero3_lora_step_equals_plain_jit_and_optax(zero3_run):
    """The same adapters after 3 AdamW steps as plain jax.jit over the adapters alone (the base a
    constant of the loss), the same losses, and the base bit for bit as it started."""
    start, losses, state, _ = zero3_run
    adapters, base = _split(start)
    tx = optimizer()

    def loss(a, b):
        return next_token_loss(from_params(CONFIG, tree_from_flat({**base, **a}, start)), b)[0]

    a, expected = zoo.plain_steps(loss, adapters, tx, batches(STEPS))
    np.testing.assert_allclose(losses, expected, rtol=1e-6)
    assert losses[-1] < losses[0]  # the adapters learned: B leaves zero after the first step
    got_adapters, got_base = _split(jax.tree.map(np.asarray, state.params))
    for name, want in a.items():
        np.testing.assert_allclose(got_adapters[name], np.asarray(want), rtol=1e-5, atol=1e-6, err_msg=name)
    assert any(np.abs(got_adapters[n]).max() > 0 for n in got_adapters if n.endswith("_lora_b"))
    for name, want in base.items():
        np.testing.assert_array_equal(got_base[name], want, err_msg=name)


def test_optimizer_state_holds_the_adapters_only_and_the_base_is_stored_in_bf16():
    """Under bf16 the frozen base is stored in bf16 (the compute dtype: never updated, so no
    float32 master copy), the adapters in float32, and AdamW's two moments exist for the adapters
    alone: 8 bytes per trained parameter."""
    model = trainable(CONFIG)
    program = build(model, optax.adamw(1e-3), make_layout(model, "zero3", make_mesh({"fsdp": 8})), precision="bf16")
    abstract = program.abstract_state()
    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract.params):
        want = jnp.float32 if is_adapter(path_str(path)) else jnp.bfloat16
        assert leaf.dtype == want, path_str(path)
    moments = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract.opt_state) if x.ndim > 0)
    assert moments == 8 * lora_param_count(CONFIG)
    total = sum(x.size for x in jax.tree.leaves(abstract.params))
    assert total == param_count(CONFIG)
    assert lora_param_count(CONFIG) == sum(x.size for p, x in jax.tree_util.tree_leaves_with_path(abstract.params)
                                           if is_adapter(path_str(p)))


def test_lora_settings_are_checked():
    with pytest.raises(ValueError, match="rank must be a positive integer"):
        LoraConfig(rank=0)
    with pytest.raises(ValueError, match="name each of q,k,v,o,gate,up,down"):
        LoraConfig(rank=2, targets=("q", "qkv"))
    assert LoraConfig(rank=8, targets=("down", "q")).targets == ("q", "down")
    assert LoraConfig(rank=8).scale == 1.0 and LoraConfig(rank=8, alpha=16).scale == 2.0


def test_zero3_reduces_the_adapters_gradients_only(zero3_run):
    """The frozen base is gathered for the forward and backward passes but never differentiated:
    the compiled zero3 step reduce-scatters exactly the adapters' float32 gradients, (N-1)/N of
    4 bytes per trained parameter (the ring convention, docs/design.md), nothing of the base."""
    from shardlib.tools.report import collective_stats

    program, state = zero3_run[3], zero3_run[2]
    compiled = program.step.lower(state, batches(1)[0]).compile()
    records = collective_stats(compiled).records
    scattered = sum(r.bytes_per_step for r in records if r.kind == "reduce-scatter")
    assert scattered == 7 / 8 * 4 * lora_param_count(CONFIG)


def test_plan_says_what_trains_and_the_command_keeps_the_lora_flags():
    """`shardlib plan --lora-rank`: the header line (counted from the model's shapes) and the
    LoRA flags of the train command it prints; alpha / targets without a rank are refused."""
    import argparse

    from shardlib.tools import plan_lora
    from shardlib.tools.plan_candidates import PlanError

    args = argparse.Namespace(lora_rank=4, lora_alpha=8.0, lora_targets="q,v,o,down", lora_base=None)
    lora = plan_lora.from_args(args, PlanError)
    assert lora == CONFIG.lora
    assert plan_lora.header(CONFIG, param_count(CONFIG)) == [
        f"trains: {lora_param_count(CONFIG):,} of {param_count(CONFIG):,} parameters (LoRA rank 4, alpha 8 on "
        "q,v,o,down); the base frozen in float32, optimizer state for the adapters only"]
    assert [w for w in plan_lora.train_flags(CONFIG) if w] == ["--lora-rank 4", "--lora-alpha 8",
                                                               "--lora-targets q,v,o,down"]
    with pytest.raises(PlanError, match="add --lora-rank R"):
        plan_lora.from_args(argparse.Namespace(lora_rank=None, lora_alpha=8.0, lora_targets=None, lora_base=None),
                            PlanError)
    # 2 layers x rank 4 x (q: 64+64, v: 64+64, o: 64+64, down: 128+64)
    assert lora_param_count(CONFIG) == 2 * 4 * (128 * 3 + 192)
