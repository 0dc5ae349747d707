"""What a user sees: the documented journeys emit no warning, a wrong one exactly one clear message.

A warning that fires when the user did what the docs say teaches them to ignore warnings, so the
right paths are recorded with ``simplefilter("always")`` and must stay silent: a Gemma-style NNX
module with names of its own mapped by ``with_logical_rules``, synchronised BatchNorm, small
unannotated tensors the fallback keeps whole, ``init_from``, ``evaluate``, and a linen module with
dropout, ``inputs=`` and ``nn.with_logical_constraint``. Its training is compared with the
module's own one-device ``jax.jit`` + optax loop (`tests.zoo`).
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx

import shardlib
from shardlib import build, from_linen, from_nnx, get_strategy, make_layout, make_mesh
from tests import zoo
from tests.helpers import optimizer

P = jax.sharding.PartitionSpec
RULES = (("embed", "fsdp"), ("q_heads", "tensor"), ("head_dim", None), ("mlp", "tensor"),
         ("activation_batch", ("data", "fsdp")), ("activation_embed", None))
FSDP_TP = {"fsdp": 4, "tensor": 2}


class Attentionish(nnx.Module):
    """Gemma-style einsum projections named with the model's own axis names, a BatchNorm and an
    unannotated head (256 elements: the fallback keeps it whole)."""

    def __init__(self, rngs, bn_axis_name=None):
        init = nnx.initializers.lecun_normal()
        self.q = nnx.Param(init(rngs.params(), (16, 4, 4)), out_sharding=("embed", "q_heads", "head_dim"))
        self.o = nnx.Param(init(rngs.params(), (4, 4, 16)), out_sharding=("q_heads", "head_dim", "embed"))
        self.bn = nnx.BatchNorm(16, axis_name=bn_axis_name, rngs=rngs)
        self.head = nnx.Linear(16, 16, rngs=rngs)

    def __call__(self, x):
        h = jnp.einsum("bhk,hkd->bd", jnp.tanh(jnp.einsum("bd,dhk->bhk", x, self.q[...])), self.o[...])
        return self.head(self.bn(h))


def mse(module, batch):
    return jnp.mean((module(batch["x"]) - batch["y"]) ** 2)


class MaxTextMlp(nn.Module):
    """A linen block as MaxText writes it: logical names, an activation constraint, dropout."""

    @nn.compact
    def __call__(self, x, deterministic):
        x = nn.with_logical_constraint(x, ("activation_batch", "activation_embed"))
        named = lambda names: nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)
        h = nn.Dropout(0.1, deterministic=deterministic)(nn.gelu(nn.Dense(32, kernel_init=named(("embed", "mlp")))(x)))
        return nn.Dense(16, kernel_init=named(("mlp", "embed")))(h)


def _batches(n=3):
    rng = np.random.default_rng(0)
    return [{"x": rng.normal(size=(16, 16)).astype(np.float32), "y": rng.normal(size=(16, 16)).astype(np.float32)}
            for _ in range(n)]


def test_documented_journeys_are_silent_and_train_like_one_device():
    mesh, batches = make_mesh(FSDP_TP), _batches()
    params, stats, reference_loss = zoo.nnx_functional(Attentionish, mse)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model = from_nnx(lambda rngs: Attentionish(rngs, shardlib.batch_axis_names(mesh)), mse)
        layout = make_layout(model, get_strategy("fsdp_tp").with_logical_rules(RULES), mesh)
        program = build(model, optimizer(), layout)
        state, losses = zoo.program_steps(program, program.init_from(params, model_state=stats), batches)
        program.evaluate(state.params, batches[0], state.model_state)
        linen = from_linen(MaxTextMlp(), lambda out, b: jnp.mean((out - b["y"]) ** 2), batches[0],
                           inputs=lambda b, train: ((b["x"],), {"deterministic": not train}))
        linen_program = build(linen, optax.adam(1e-3),
                              make_layout(linen, get_strategy("zero3").with_logical_rules(RULES), make_mesh({"fsdp": 8})))
        linen_program.step(linen_program.init(jax.random.key(0)), batches[0])
    assert [f"{w.category.__name__}: {w.message}" for w in seen] == []
    assert layout.param_shardings()["q"].spec == P("fsdp", "tensor", None)  # the user's names were mapped
    _, _, expected = zoo.plain_steps_with_state(reference_loss, params, stats, optimizer(), batches)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)


def _only_warning(make) -> str:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        make()
    assert len(seen) == 1, [str(w.message) for w in seen]
    return str(seen[0].message)


def test_a_name_no_rule_maps_is_one_warning_naming_the_tensor_dim_and_fix():
    """Unmapped names are warned about once, where the rules are known, and the idle ``tensor``
    axis they cause is not warned about a second time."""
    model = from_nnx(Attentionish, mse)
    mesh = make_mesh(FSDP_TP)
    without_heads = get_strategy("fsdp_tp").with_logical_rules([r for r in RULES if r[0] != "q_heads"])
    assert re.search(r"your logical-axis rules .*no rule for: o dim 0 'q_heads'; q dim 1 'q_heads'; .*add a rule for "
                     r"each name", _only_warning(lambda: make_layout(model, without_heads, mesh)))
    assert re.search(r"no strategy has a rule .*: o \(4, 4, 16\) dim 0 'q_heads'; q \(16, 4, 4\) dim 1 'q_heads'; "
                     r".*with_logical_rules\(your_rules\)", _only_warning(lambda: make_layout(model, "fsdp_tp", mesh)))
    flax_guide = shardlib.from_functions(lambda key: {"w": jnp.zeros((64, 64))}, lambda p, b: 0.0,
                                         logical_axes={"w": (None, "model")})
    assert re.search(r"strategy 'tp' has no rule for any of the model's axis names \(model\); map them onto mesh axes, "
                     r"e\.g\. .*; no strategy has a rule .*: w \(64, 64\) dim 1 'model'$",
                     _only_warning(lambda: make_layout(flax_guide, "tp", make_mesh({"data": 2, "tensor": 4}))))
