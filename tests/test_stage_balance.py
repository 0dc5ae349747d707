"""Uneven pipeline stages (`shardlib.step.stage_balance`, ``build(stage_layers=...)``).

The large-vocabulary GPT makes the head cost more than a layer, so the even split leaves the
last stage the slowest; ``auto`` moves a layer to the first stage. Parity uses the tolerances
of tests/test_pipeline.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardlib import build, make_layout, make_mesh
from shardlib.models import trainable
from shardlib.runtime.checkpoint import Checkpointer
from shardlib.sharding.rules import path_str
from shardlib.step import pipeline as pipeline_lib
from shardlib.step import stage_balance
from tests.helpers import TINY, assert_bitwise, optimizer, reference, train

BIG_HEAD = dataclasses.replace(TINY, n_layers=4, vocab_size=4096)
ROWS, MICROBATCHES, SEQ = 16, 4, 32  # the step's microbatch: 4 rows of 32 tokens


def _brute_force(costs, stages, first, last):
    n, best = len(costs), None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        loads = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        loads[0] += first
        loads[-1] += last
        best = max(loads) if best is None else min(best, max(loads))
    return best


def _slowest(split, costs, first, last):
    starts = np.cumsum((0, *split))
    loads = [sum(costs[a:b]) for a, b in zip(starts, starts[1:])]
    loads[0] += first
    loads[-1] += last
    return max(loads)


def test_balance_finds_the_brute_force_optimum():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        stages = rng.randint(1, n)
        costs = [rng.randint(1, 20) for _ in range(n)]
        first, last = rng.randint(0, 40), rng.randint(0, 40)
        split = stage_balance.balance(costs, stages, first, last)
        assert len(split) == stages and sum(split) == n and min(split) >= 1
        assert _slowest(split, costs, first, last) == _brute_force(costs, stages, first, last)


def test_balance_keeps_the_even_split_when_it_is_optimal():
    assert stage_balance.balance([1.0] * 8, 4) == (2, 2, 2, 2)
    assert stage_balance.balance([1.0] * 4, 2, first=0.0, last=2.0) == (3, 1)


@pytest.fixture(scope="module")
def model():
    return trainable(BIG_HEAD)


@pytest.fixture(scope="module")
def micro_rows():
    shape = jax.ShapeDtypeStruct((ROWS // MICROBATCHES, SEQ), jnp.int32)
    return {"inputs": shape, "targets": shape}


def _layout(model, strategy="dp", sizes=None):
    sizes = sizes or {"pipe": 2}
    return make_layout(model, strategy, make_mesh(sizes, devices=jax.devices()[:int(np.prod(list(sizes.values())))]))


def test_auto_lowers_the_slowest_stages_compiled_cost(model, micro_rows):
    pieces = stage_balance.measure_pieces(model.pipeline, model.abstract(), micro_rows)
    assert pieces.head.roofline > pieces.layer.roofline > pieces.embed.roofline
    split = pieces.auto(4, 2)
    assert split == (3, 1)
    # Each stage compiled as one program of its own (not the sum of the pieces auto used).
    even, auto = (stage_balance.compiled_stage_costs(model.pipeline, model.abstract(), micro_rows, s)
                  for s in ((2, 2), split))
    assert max(c.roofline for c in auto) < max(c.roofline for c in even)
    assert max(c.flops for c in auto) < max(c.flops for c in even)
    assert max(c.bytes for c in auto) < max(c.bytes for c in even)


@pytest.fixture(scope="module")
def uneven_run(model):
    """The built program's run, and the layers per stage its step was traced with."""
    program = build(model, optimizer(), _layout(model), microbatches=MICROBATCHES, stage_layers="auto")
    traced, pipelined = [], pipeline_lib.value_and_grad

    def spy(stages, params, batch, rows, **kwargs):
        traced.append(rows.stage_layers)
        return pipelined(stages, params, batch, rows, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline_lib, "value_and_grad", spy)
        run = train(program, 3, ROWS)
    return program, run, traced


def _by_path(tree):
    return {path_str(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def test_auto_builds_the_three_one_split(uneven_run):
    traced = uneven_run[2]
    assert traced and set(traced) == {(3, 1)}  # the split auto measured is the one the step runs


def test_uneven_stages_train_like_one_device(uneven_run):
    _, (losses, params, _), _ = uneven_run
    ref_losses, ref_params = reference(3, config=BIG_HEAD)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    got, ref = _by_path(params), _by_path(ref_params)
    assert got.keys() == ref.keys()
    for path in got:
        np.testing.assert_allclose(got[path], ref[path], rtol=1e-5, atol=1e-6, err_msg=path)


def test_uneven_checkpoint_restores_onto_the_even_split(model, uneven_run, tmp_path):
    _, (_, _, state), _ = uneven_run
    even = build(model, optimizer(), _layout(model), microbatches=MICROBATCHES)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(int(state.step), state, data_state={}, config={}, force=True)
        ckpt.wait()
        restored, _, _ = ckpt.restore(even.abstract_state())
    assert_bitwise(state, restored)  # pairs the leaves by path
    shardings = {path_str(p): leaf.sharding for p, leaf in jax.tree_util.tree_leaves_with_path(state)}
    for path, leaf in jax.tree_util.tree_leaves_with_path(restored):
        assert leaf.sharding == shardings[path_str(path)], path_str(path)


@pytest.mark.parametrize("layers,expected", [((3, 2), "sum 4"), ((1, 1, 2), "length 2"), ((4, 0), "at least one")])
def test_bad_stage_lists_name_the_expected_length_and_sum(model, layers, expected):
    with pytest.raises(ValueError, match=expected):
        build(model, optimizer(), _layout(model), microbatches=MICROBATCHES, stage_layers=layers)


def test_uneven_stages_that_cannot_help_say_so(model):
    with pytest.warns(UserWarning, match="cannot make the slowest stage faster"):
        build(model, optimizer(), _layout(model, "zero3", {"pipe": 2, "fsdp": 2}), microbatches=MICROBATCHES,
              stage_layers=(3, 1))
