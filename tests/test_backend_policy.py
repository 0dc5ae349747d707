"""One backend policy (`shardlib.backend`), read from the devices a program is built for.

`policy_for` answers from a mesh's (or a device list's) platform, never from JAX's default
backend: TPU topology devices get the TPU policy on this CPU host. `forced(platform)` makes a
step built inside it take that platform's policy on CPU devices, which is how the accelerator
branches of the step are tested here: a zero3 step built under ``forced("tpu")`` has none of
XLA:CPU's matmul-order barriers and none of its custom_vjp gathers; the CPU step has both.
"""

from __future__ import annotations

import contextlib
import os
import re

import jax
import jax.numpy as jnp
import pytest

from shardlib import backend, build, make_layout, make_mesh
from tests.helpers import optimizer, tiny_model, tpu_chips

TPU_TOPOLOGY = "v5e:2x4"


def tpu_devices():
    return tpu_chips(TPU_TOPOLOGY)


def test_cpu_devices_get_the_cpu_policy():
    mesh = make_mesh({"fsdp": 8})
    assert backend.policy_for(mesh) is backend.POLICIES["cpu"]
    assert backend.policy_for(jax.devices()) is backend.POLICIES["cpu"]
    assert backend.policy_for(jax.devices()[0]).matmul_order
    model = tiny_model()
    assert make_layout(model, "zero3", mesh).backend is backend.POLICIES["cpu"]


def test_tpu_topology_devices_get_the_tpu_policy_on_a_cpu_host():
    devices = tpu_devices()
    policy = backend.policy_for(devices)
    assert policy is backend.POLICIES["tpu"] and jax.default_backend() == "cpu"
    assert not policy.matmul_order and not policy.custom_vjp_gather and policy.cast_before_gather
    model = tiny_model()
    layout = make_layout(model, "zero1", make_mesh({"data": 8}, devices=devices))
    assert layout.backend is policy and not layout.state_from_last


def test_forced_wins_inside_its_block_only_and_names_are_checked():
    mesh = make_mesh({"fsdp": 8})
    with backend.forced("cuda") as policy:  # JAX's platform name for a GPU
        assert policy is backend.POLICIES["gpu"] and backend.policy_for(mesh) is policy
    assert backend.policy_for(mesh) is backend.POLICIES["cpu"]
    with pytest.raises(ValueError, match="no backend policy for platform 'metal'"):
        with backend.forced("metal"):
            pass


def _zero3(forced: str | None):
    with backend.forced(forced) if forced else contextlib.nullcontext():
        model = tiny_model()
        program = build(model, optimizer(), make_layout(model, "zero3", make_mesh({"fsdp": 8})))
    state = program.abstract_state()
    batch = program.abstract_batch({k: ((16, 32), jnp.int32) for k in ("inputs", "targets")})
    hlo = program.step.lower(state, batch).compiler_ir("hlo").as_hlo_text()
    # custom_vjp calls stay named in the traced step's jaxpr (the lowered program inlines them)
    jaxpr = str(program.step._jitted.trace(state, batch).jaxpr)
    return program, hlo, jaxpr


def _barriers(hlo: str) -> list[str]:
    """The optimization barriers of a lowered program but remat's own (jax.checkpoint's, named remat*)."""
    return [name for name in re.findall(r"(\S+) = \S+ opt-barrier\(", hlo) if not name.startswith("remat")]


@pytest.fixture(scope="module")
def steps():
    return {"cpu": _zero3(None), "tpu": _zero3("tpu")}


def test_a_step_built_under_forced_tpu_takes_the_tpu_policy_on_cpu_devices(steps):
    program, hlo, jaxpr = steps["tpu"]
    assert program.layout.backend is backend.POLICIES["tpu"]
    assert program.layout.mesh.devices.flat[0].platform == "cpu"
    assert _barriers(hlo) == []  # no matmul-order barrier
    assert "custom_vjp" not in jaxpr  # autodiff's own all-gather / reduce-scatter pair


def test_the_cpu_step_keeps_its_matmul_order_and_custom_gathers(steps):
    program, hlo, jaxpr = steps["cpu"]
    assert program.layout.backend is backend.POLICIES["cpu"]
    assert _barriers(hlo)  # the weight gradients' matmul-ordered copies
    assert "custom_vjp" in jaxpr  # the first-dim gathers whose backward reduce-scatters that copy


# Where a module may ask which backend it is on: the policy itself and device set-up. Anywhere
# else a backend-dependent choice belongs in `shardlib.backend` (an f-string naming the platform
# in a message is display, not a choice).
_DEVICE_SETUP = {"shardlib/backend.py", "shardlib/runtime/devices.py", "shardlib/runtime/distributed.py",
                 "shardlib/run/console.py", "shardlib/run/train.py"}


def test_no_module_outside_the_policy_asks_for_the_backend():
    root = os.path.join(os.path.dirname(__file__), "..")
    found = []
    for folder in ("shardlib", "models"):
        for dirpath, _, files in os.walk(os.path.join(root, folder)):
            for name in files:
                path = os.path.relpath(os.path.join(dirpath, name), root)
                if not name.endswith(".py") or path in _DEVICE_SETUP:
                    continue
                for number, line in enumerate(open(os.path.join(root, path)), 1):
                    code = re.sub(r"\{[^{}]*\}", "", line.split("#")[0])  # f-string fields: messages
                    if "default_backend" in code or re.search(r"\.platform\b", code):
                        found.append(f"{path}:{number}: {line.strip()}")
    assert not found, "\n".join(found)
