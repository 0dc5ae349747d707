"""Models as users bring them, unedited: ZeRO shards them anyway, Flax's naming conventions hold,
and a model's own mesh-axis placement is kept (strategy ``as_annotated``).

References are independent of shardlib: a plain ``jax.jit(jax.value_and_grad)`` + optax step on
one device, written here.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import PartitionSpec as P

import shardlib
from shardlib import RuleError, build, from_functions, from_linen, from_nnx, make_layout, make_mesh
from shardlib.sharding.rules import LeafLayout
from shardlib.tools.report import memory_stats
from tests.helpers import optimizer

N = 8
D_IN, HIDDEN, ROWS, STEPS = 64, 512, 32, 5


def _mlp_init(key):
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (D_IN, HIDDEN)) / 8, "b1": jnp.zeros((HIDDEN,)),
            "w2": jax.random.normal(k2, (HIDDEN, D_IN)) / 16, "b2": jnp.zeros((D_IN,))}


def _mlp_loss(p, batch):
    h = jax.nn.gelu(batch["x"] @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] - batch["y"]) ** 2)


def _plain_mlp():
    """A plain pytree and a loss, no logical names and no path rules."""
    return from_functions(_mlp_init, _mlp_loss)


class _NNXMLP(nnx.Module):
    """nnx.Linear layers with no partitioning metadata at all."""

    def __init__(self, rngs):
        self.up = nnx.Linear(D_IN, HIDDEN, rngs=rngs)
        self.down = nnx.Linear(HIDDEN, D_IN, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


def _nnx_mlp():
    return from_nnx(_NNXMLP, lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2))


def _batches(n=STEPS):
    keys = jax.random.split(jax.random.key(1), n)
    xs = [np.asarray(jax.random.normal(k, (ROWS, D_IN))) for k in keys]
    return [{"x": x, "y": np.sin(x)} for x in xs]


def _nnx_functions(cls, loss_fn):
    """(init, loss) over a pure dict of the module's nnx.Params, written with nnx.split / nnx.merge."""
    def make(key):
        with nnx.use_eager_sharding(False):
            return cls(nnx.Rngs(key))

    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: make(jax.random.key(0))))

    def loss(params, batch):
        state = jax.tree.map(lambda x: x, abstract)
        nnx.replace_by_pure_dict(state, params)
        return loss_fn(nnx.merge(graphdef, state), batch)

    return lambda key: nnx.to_pure_dict(nnx.state(make(key), nnx.Param)), loss


def _reference(init, loss_fn, steps=STEPS):
    """One device, plain JAX: jit(value_and_grad) and the optax update, nothing from shardlib."""
    tx = optimizer()
    params = jax.jit(init)(jax.random.key(0))
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for batch in _batches(steps):
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    return np.array(losses), params


def _sharded(model, layout, steps=STEPS):
    program = build(model, optimizer(), layout)
    state = program.init(jax.random.key(0))
    losses = []
    for batch in _batches(steps):
        state, metrics = program.step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses), state, program


def _assert_parity(model, layout, reference):
    ref_losses, ref_params = reference
    losses, state, _ = _sharded(model, layout)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for path, ref in jax.tree_util.tree_leaves_with_path(ref_params):
        got = dict(jax.tree_util.tree_leaves_with_path(state.params))[path]
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(path))
    return state


def _leaves(tree):
    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, LeafLayout))


# ---------------------------------------------------------------- ZeRO for every model


@pytest.mark.parametrize("make", [_plain_mlp, _nnx_mlp], ids=["pytree", "nnx"])
def test_unannotated_model_gets_zero3_memory(make):
    model = make()
    layout = make_layout(model, "zero3", make_mesh({"fsdp": N}))
    for leaf in _leaves(layout.params):
        if leaf.bytes() >= 4096:  # every tensor above the fallback's minimum size is split 8 ways
            assert leaf.shards(layout.mesh) == N, (leaf.path, leaf.spec)
    assert _leaves(layout.state) == _leaves(layout.params)  # ZeRO-3: state where the parameters are

    psi_bytes = layout.param_bytes()  # fp32: 4 Psi; params + Adam's two moments: 12 Psi = 3 * psi_bytes
    replicated = 3 * layout.replicated_bytes()  # R: the whole tensors, with their two moments
    assert 0 < replicated <= 0.01 * 3 * psi_bytes
    assert "replicated against the strategy: 2 tensor(s)" in layout.replication_summary()

    program = build(model, optimizer(), layout)
    shapes = {"x": ((ROWS, D_IN), jnp.float32), "y": ((ROWS, D_IN), jnp.float32)}
    compiled = program.compile_step(program.abstract_state(), program.abstract_batch(shapes))
    persistent = memory_stats(compiled).argument_bytes - 2 * ROWS * D_IN * 4 // N
    expected = (3 * psi_bytes - replicated) / N + replicated
    assert persistent == pytest.approx(expected, rel=0.02)


def test_unannotated_model_trains_under_zero3_like_one_device():
    model = _plain_mlp()
    layout = make_layout(model, "zero3", make_mesh({"fsdp": N}))
    assert layout.params["w1"].spec == P(None, "fsdp") and layout.params["w2"].spec == P("fsdp", None)
    state = _assert_parity(model, layout, _reference(_mlp_init, _mlp_loss))
    assert state.params["w1"].sharding.spec == P(None, "fsdp")


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_unannotated_optimizer_state_is_sharded_under_zero1_and_zero2(strategy):
    model = _nnx_mlp()
    layout = make_layout(model, strategy, make_mesh({"data": N}))
    for leaf in _leaves(layout.params):
        assert leaf.shards(layout.mesh) == 1, leaf.path  # parameters stay whole
    state_specs = {l.path: l.spec for l in _leaves(layout.state)}
    # The last dim (a kernel's output: Strategy.state_from_last), not zero3's largest (test above)
    assert state_specs["up/kernel"] == P(None, "data") and state_specs["down/kernel"] == P(None, "data")
    program = build(model, optimizer(), layout)
    opt = program.abstract_state().opt_state
    mu = next(s for s in jax.tree.leaves(opt, is_leaf=lambda x: hasattr(x, "mu")) if hasattr(s, "mu")).mu
    assert mu["up"]["kernel"].sharding.spec == P(None, "data")


def test_auto_shard_off_restores_the_rules_only_layout():
    model = _plain_mlp()
    mesh = make_mesh({"fsdp": N})
    with pytest.warns(shardlib.ReplicationWarning, match=r"w1 \(64, 512\) .*no logical axis names"):
        layout = make_layout(model, "zero3", mesh, auto_shard=False)
    assert all(l.spec == P(*(None,) * len(l.shape)) for l in _leaves(layout.params))
    assert layout.replicated_bytes() == layout.param_bytes()
    # An annotated model (the reference GPT) is laid out by its rules either way.
    from shardlib.models import get_config, trainable

    gpt = trainable(get_config("tiny"))
    on, off = (make_layout(gpt, "zero3", mesh, auto_shard=flag) for flag in (True, False))
    assert [l.spec for l in _leaves(on.params)] == [l.spec for l in _leaves(off.params)]


# ---------------------------------------------------------------- Flax naming conventions


class _Attention(nn.Module):
    """The common Flax pattern: one logically partitioned init for every DenseGeneral kernel
    (3-D, with two names), attention and an output projection."""

    @nn.compact
    def __call__(self, x):
        init = nn.with_logical_partitioning(nn.initializers.xavier_uniform(), ("embed", "kv"))
        y = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=64, kernel_init=init)(x)
        return nn.DenseGeneral((4, 16), kernel_init=init)(y).reshape(x.shape)


def test_linen_attention_with_two_names_on_three_dim_kernels():
    x = jnp.ones((8, 6, 64))
    model = from_linen(_Attention(), lambda out, b: jnp.mean(out ** 2), x)
    layout = make_layout(model, "zero3", make_mesh({"fsdp": N}))
    by_path = {l.path: l for l in _leaves(layout.params)}
    query = by_path["MultiHeadDotProductAttention_0/query/kernel"]
    assert query.shape == (64, 4, 16) and query.logical == ("embed", "kv", None) and query.spec == P("fsdp", None, None)
    out = by_path["MultiHeadDotProductAttention_0/out/kernel"]  # (4, 16, 64): "embed"=4 does not divide,
    assert out.spec == P(None, "fsdp", None)  # so the next named dim ("kv", Flax's head_dim) takes fsdp
    assert out.notes == ("dim 0 (embed=4) not divisible by fsdp=8",)
    program = build(model, optax.sgd(0.1), layout)
    state, metrics = program.step(program.init(jax.random.key(0)), {"inputs": x})
    assert np.isfinite(float(metrics["loss"]))


def test_more_names_than_dims_names_the_tensor():
    class Dense(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp", "heads"))
            return nn.Dense(32, kernel_init=init)(x)

    model = from_linen(Dense(), lambda out, b: jnp.mean(out), jnp.ones((8, 64)))
    with pytest.raises(RuleError, match=r"Dense_0/kernel: 3 logical axes \('embed', 'mlp', 'heads'\) for a tensor "
                                        r"of shape \(64, 32\)"):
        make_layout(model, "zero3", make_mesh({"fsdp": N}))


# ---------------------------------------------------------------- the model's own placement


class _Placed(nnx.Module):
    """Parameters placed over mesh axes in their metadata, as MaxText and Flax's Gemma example do."""

    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.w1 = nnx.Param(init(rngs.params(), (D_IN, HIDDEN)), out_sharding=P("fsdp", "tensor"))
        self.b1 = nnx.Param(jnp.zeros((HIDDEN,)), sharding=("tensor",))
        self.w2 = nnx.Param(init(rngs.params(), (HIDDEN, D_IN)), out_sharding=P(("tensor", "fsdp"), None))
        self.b2 = nnx.Param(jnp.zeros((D_IN,)), out_sharding=P(None))

    def __call__(self, x):
        return jax.nn.gelu(x @ self.w1[...] + self.b1[...]) @ self.w2[...] + self.b2[...]


def test_nnx_mesh_axis_annotations_are_laid_out_as_annotated():
    mse = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
    model = from_nnx(_Placed, mse)
    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    with warnings.catch_warnings():
        warnings.simplefilter("error", shardlib.ReplicationWarning)  # nothing replicated against the model's placement
        layout = make_layout(model, "as_annotated", mesh)
    expected = {"w1": P("fsdp", "tensor"), "b1": P("tensor"), "w2": P(("tensor", "fsdp"), None), "b2": P(None)}
    assert {l.path: l.spec for l in _leaves(layout.params)} == expected
    assert {l.path: l.spec for l in _leaves(layout.state)} == expected  # optimizer state follows the parameters
    state = _assert_parity(model, layout, _reference(*_nnx_functions(_Placed, mse)))
    assert state.params["w2"].sharding.spec == P(("tensor", "fsdp"), None)


def test_mesh_axis_annotations_under_a_rule_strategy_point_to_as_annotated():
    model = from_nnx(_Placed, lambda m, b: jnp.mean(m(b["x"])))
    with pytest.warns(shardlib.ReplicationWarning, match="strategy 'as_annotated' keeps the model's own placement"):
        layout = make_layout(model, "zero3", make_mesh({"fsdp": N}))
    assert layout.params["w1"].shards(layout.mesh) == N  # and the fallback still shards it
