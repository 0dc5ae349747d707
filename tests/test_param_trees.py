"""Parameter trees as users write them with `from_functions`: NamedTuple and `flax.struct`
containers, keys holding ``/`` or ``.``, unicode and integer keys, scalars, a ``(1,)`` bias and a
zero-size tensor, trained against a one-device `jax.jit` + optax loop, checkpointed onto another
mesh bit for bit, exported and loaded back."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import struct

from shardlib import build, from_functions, make_layout, make_mesh
from shardlib.runtime.checkpoint import Checkpointer, CheckpointError
from shardlib.tools.export import export_params, load_exported
from tests import zoo

VOCAB, D = 40, 16


class Dense(NamedTuple):
    w: jax.Array
    b: jax.Array


@struct.dataclass
class Head:
    w: jax.Array
    temperature: jax.Array


def _init(key):
    k = jax.random.split(key, 6)
    normal = lambda i, shape: jax.random.normal(k[i], shape) * 0.3
    return {
        "embed": normal(0, (VOCAB, D)),
        "layers": [Dense(normal(1, (D, 32)), jnp.zeros((32,))), Dense(normal(2, (32, D)), jnp.zeros((D,)))],
        "a/b": normal(3, (D, 8)),  # a key with a slash, beside the path a -> b of another shape
        "a": {"b": normal(4, (8, D)), "layer.0": jnp.ones((D,)), "κλίμα": {0: jnp.zeros((1,))}},
        "head": Head(normal(5, (D, VOCAB)), jnp.array(1.0)),
    }


_LOGICAL = {
    "embed": ("vocab", "embed"),
    "layers": [Dense(("embed", "mlp"), ("mlp",)), Dense(("mlp", "embed"), ("embd",))],  # a typo, warned by path
    "a/b": ("embed", None), "a": {"b": (None, "embed"), "layer.0": ("norm",), "κλίμα": {0: None}},
    "head": Head(("embed", "vocab"), None),
}


def _loss(params, batch):
    h = params["embed"][batch["tokens"]]
    for layer in params["layers"]:
        h = jnp.tanh(h @ layer.w + layer.b)
    h = jnp.tanh(h @ params["a/b"] @ params["a"]["b"]) * params["a"]["layer.0"] + params["a"]["κλίμα"][0]
    logits = h @ params["head"].w / params["head"].temperature
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def _batches(n):
    rng = np.random.default_rng(0)
    return [{"tokens": rng.integers(0, VOCAB, (16, 4)).astype(np.int32),
             "targets": rng.integers(0, VOCAB, (16, 4)).astype(np.int32)} for _ in range(n)]


def _equal(a, b):
    return all(jax.tree.leaves(jax.tree.map(lambda x, y: np.array_equal(np.asarray(x), np.asarray(y)), a, b)))


def test_containers_and_odd_keys_train_checkpoint_and_export_like_one_device(tmp_path):
    with pytest.warns(UserWarning, match=r"layers/1/b \(16,\) dim 0 'embd'"):
        model = from_functions(_init, _loss, logical_axes=_LOGICAL)
        layout = make_layout(model, "fsdp_tp", make_mesh({"fsdp": 4, "tensor": 2}))  # where the rules are known
    tx = optax.adamw(1e-2, eps=1e-5)
    program = build(model, tx, layout)
    specs = program.layout.param_shardings()
    assert specs["a/b"].spec == jax.sharding.PartitionSpec("fsdp", None)  # its own names, not a -> b's
    assert specs["a"]["b"].spec == jax.sharding.PartitionSpec(None, "fsdp")
    assert specs["layers"][0].b.spec == jax.sharding.PartitionSpec("tensor")
    batches = _batches(3)
    state, losses = zoo.program_steps(program, program.init(jax.random.key(0)), batches)
    expected, expected_losses = zoo.plain_steps(_loss, _init(jax.random.key(0)), tx, batches)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6),
                 state.params, expected)

    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(3, state, data_state={"step": 3}, config={})
    ckpt.close()
    other = build(model, tx, make_layout(model, "dp", make_mesh({"data": 8})))
    restored, _, _ = Checkpointer(tmp_path / "ckpt").restore(other.abstract_state())
    assert _equal(restored.params, state.params) and _equal(restored.opt_state, state.opt_state)

    export_params(tmp_path / "ckpt", tmp_path / "weights.safetensors")
    exported = load_exported(tmp_path / "weights.safetensors")
    np.testing.assert_array_equal(exported["a/b"], np.asarray(state.params["a/b"]))
    np.testing.assert_array_equal(exported["a"]["b"], np.asarray(state.params["a"]["b"]))
    assert _equal(program.init_from(exported).params, state.params)


def test_zero_size_parameter_trains_and_its_checkpoint_is_refused_by_name(tmp_path):
    init = lambda key: {"w": jax.random.normal(key, (D, D)), "registers": jnp.zeros((0, D))}  # num_registers=0
    loss = lambda p, batch: jnp.mean((batch["x"] @ p["w"] + p["registers"].sum(0)) ** 2)
    model = from_functions(init, loss)
    tx = optax.adam(1e-2)
    program = build(model, tx, make_layout(model, "zero3", make_mesh({"fsdp": 8})))
    batches = [{"x": np.random.default_rng(i).normal(size=(16, D)).astype(np.float32)} for i in range(2)]
    state, losses = zoo.program_steps(program, program.init(jax.random.key(0)), batches)
    expected, expected_losses = zoo.plain_steps(loss, init(jax.random.key(0)), tx, batches)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(state.params["w"]), expected["w"], rtol=1e-5, atol=1e-6)
    with Checkpointer(tmp_path / "ckpt") as ckpt, pytest.raises(CheckpointError, match=r"zero-size.*params/registers"):
        ckpt.save(2, state, data_state={"step": 2}, config={})
