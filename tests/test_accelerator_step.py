"""The GPU and TPU policies' train step, run (not only compiled) on CPU devices with the policy
forced (`shardlib.backend.forced`): autodiff's gather pair instead of the CPU custom_vjp, weights
cast before the ZeRO-3 gather, no matmul-order transposes. Compared with plain ``jax.jit`` + optax
on one device (`tests.helpers.reference`) at the parity tests' tolerances in f32, and within one
bf16 rounding of it in bf16 (tests/test_precision_accum.py's bound). XLA:CPU cannot run cuDNN's
fused attention, so the GPU policy's model here uses einsum attention (docs/backends.md)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from shardlib import backend, build, make_layout, make_mesh
from shardlib.models import trainable
from tests.helpers import TINY, optimizer, reference, train
from tests.test_precision_accum import BF16_RTOL

CASES = [("gpu", "zero3", {"fsdp": 8}), ("tpu", "zero3", {"fsdp": 8}), ("tpu", "fsdp_tp", {"fsdp": 4, "tensor": 2}),
         ("gpu", "hsdp", {"data": 2, "fsdp": 4})]


@pytest.fixture(scope="module")
def single_device():
    return reference()


def _run(platform: str, strategy: str, mesh: dict, precision: str):
    model = trainable(dataclasses.replace(TINY, attention="einsum"))
    with backend.forced(platform):
        program = build(model, optimizer(), make_layout(model, strategy, make_mesh(mesh)), precision=precision)
    assert program.layout.backend == backend.get_policy(platform)  # the step was built on the accelerator's path
    assert not program.layout.backend.custom_vjp_gather and not program.layout.backend.matmul_order
    losses, params, _ = train(program)
    return losses, params


@pytest.mark.parametrize("platform,strategy,mesh", CASES, ids=[f"{p}-{s}" for p, s, _ in CASES])
def test_the_accelerator_step_trains_like_one_device_in_f32(platform, strategy, mesh, single_device):
    losses, params = _run(platform, strategy, mesh, "f32")
    ref_losses, ref_params = single_device
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for path, ref in jax.tree_util.tree_leaves_with_path(ref_params):
        got = dict(jax.tree_util.tree_leaves_with_path(params))[path]
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_the_accelerator_step_in_bf16_stays_within_a_rounding_of_f32(platform, single_device):
    losses, _ = _run(platform, "zero3", {"fsdp": 8}, "bf16")
    np.testing.assert_allclose(losses, single_device[0], rtol=BF16_RTOL)
    assert np.abs(losses / single_device[0] - 1).max() > 1e-6  # it computed in bf16
