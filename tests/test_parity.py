"""Every strategy on every mesh it supports trains exactly like one device.

The one-device run is `tests.helpers.reference`: the NNX module trained by a plain
``jax.jit(jax.value_and_grad)`` + optax step, with no shardlib code in it, so a bug shared by
every path through shardlib's step (loss normalisation, the skip, the update) cannot hide.

Tolerances: per-step losses rtol 1e-5; parameters after 5 AdamW steps rtol 1e-5 / atol 1e-6.
The sharded runs sum gradients in a different order than one device (per-device partial sums,
then a collective), which changes float32 results in the last bits only.
"""

import jax
import numpy as np
import pytest

from shardlib.step import pmap as pmap_lib
from tests.helpers import batches, optimizer, reference, run, tiny_model

CASES = [
    ("dp", {"data": 8}), ("dp", {"data": 2, "fsdp": 4}), ("dp", {"data": 4, "fsdp": 2}),
    ("zero1", {"data": 8}), ("zero1", {"data": 2, "fsdp": 4}), ("zero1", {"data": 4, "fsdp": 2}),
    ("zero2", {"data": 8}), ("zero2", {"data": 2, "fsdp": 4}), ("zero2", {"data": 4, "fsdp": 2}),
    ("zero3", {"fsdp": 8}), ("zero3", {"data": 2, "fsdp": 4}), ("zero3", {"data": 4, "fsdp": 2}),
    ("tp", {"tensor": 8}), ("tp", {"data": 2, "tensor": 4}), ("tp", {"data": 4, "tensor": 2}),
    ("fsdp_tp", {"fsdp": 2, "tensor": 4}), ("fsdp_tp", {"fsdp": 4, "tensor": 2}),
    ("hsdp", {"data": 2, "fsdp": 4}), ("hsdp", {"data": 4, "fsdp": 2}),
]


@pytest.fixture(scope="module")
def single_device():
    return reference()


def _assert_same_training(losses, params, single_device):
    ref_losses, ref_params = single_device
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for path, ref in jax.tree_util.tree_leaves_with_path(ref_params):
        got = dict(jax.tree_util.tree_leaves_with_path(params))[path]
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("strategy,mesh", CASES, ids=[f"{s}-{'x'.join(f'{k}{v}' for k, v in m.items())}" for s, m in CASES])
def test_strategy_matches_single_device(strategy, mesh, single_device):
    losses, params, program, state = run(strategy, mesh)
    _assert_same_training(losses, params, single_device)
    assert losses[-1] < losses[0]
    # The parameters really live in the strategy's layout (not silently replicated).
    for leaf, array in zip(jax.tree.leaves(program.layout.params, is_leaf=lambda x: hasattr(x, "spec")),
                           jax.tree.leaves(state.params)):
        assert array.sharding.spec == leaf.spec, leaf.path


def test_pmap_data_parallel_matches_single_device(single_device):
    model = tiny_model()
    tx = optimizer()
    params = jax.jit(model.init)(jax.random.key(0))
    n = jax.local_device_count()
    step = pmap_lib.pmap_step(model, tx)
    params, opt_state = pmap_lib.replicate(params, n), pmap_lib.replicate(tx.init(params), n)
    losses = []
    for batch in batches():
        params, opt_state, metrics = step(params, opt_state, pmap_lib.split_batch(batch, n))
        losses.append(float(metrics["loss"][0]))
    _assert_same_training(np.array(losses), pmap_lib.unreplicate(params), single_device)
