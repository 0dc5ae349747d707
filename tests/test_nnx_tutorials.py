"""A transformer written as the Flax NNX tutorials write one (``nnx.MultiHeadAttention`` with its
3-D kernels, ``nnx.Sequential`` MLP, blocks in an ``nnx.List``, ``nnx.Dropout(rate, rngs=rngs)``, a
custom ``nnx.Variable`` counter, Flax's logical names ``embed`` / ``heads`` / ``kv`` / ``mlp`` /
``vocab`` / ``norm``), trained through ``from_nnx`` and compared with the user's own loop:
``nnx.Optimizer(model, tx, wrt=nnx.Param)`` + ``nnx.value_and_grad`` under ``nnx.jit``, one device.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from shardlib import Checkpointer, build, from_nnx, make_layout, make_mesh
from shardlib.tools.export import export_params, load_exported
from tests.helpers import optimizer
from tests.test_user_models import _assert_close, _host, _train

VOCAB, D, HEADS, LAYERS, SEQ, ROWS, STEPS = 64, 32, 4, 1, 8, 16, 3


def named(names, init=nnx.initializers.lecun_normal()):
    return nnx.with_partitioning(init, names)


class Steps(nnx.Variable):
    """A counter as the NNX guides write one: a Variable kind of the user's own."""


class Block(nnx.Module):
    def __init__(self, *, attn_dropout: float, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(D, scale_init=named(("norm",), nnx.initializers.ones_init()), rngs=rngs)
        self.attn = nnx.MultiHeadAttention(  # deterministic=None: undecided until model.train()
            num_heads=HEADS, in_features=D, decode=False, dropout_rate=attn_dropout,
            kernel_init=named(("embed", "heads", "kv")), out_kernel_init=named(("heads", "kv", "embed")), rngs=rngs)
        self.ln2 = nnx.LayerNorm(D, scale_init=named(("norm",), nnx.initializers.ones_init()), rngs=rngs)
        self.mlp = nnx.Sequential(nnx.Linear(D, 4 * D, kernel_init=named(("embed", "mlp")), rngs=rngs), nnx.gelu,
                                  nnx.Linear(4 * D, D, kernel_init=named(("mlp", "embed")), rngs=rngs))

    def __call__(self, x, mask):
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.mlp(self.ln2(x))


class TutorialLM(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs, attn_dropout: float = 0.0):
        self.embed = nnx.Embed(VOCAB, D, embedding_init=named(("vocab", "embed"), nnx.initializers.normal(0.02)),
                               rngs=rngs)
        self.blocks = nnx.List([Block(attn_dropout=attn_dropout, rngs=rngs) for _ in range(LAYERS)])
        self.ln_f = nnx.LayerNorm(D, rngs=rngs)
        self.head = nnx.Linear(D, VOCAB, kernel_init=named(("embed", "vocab")), rngs=rngs)
        self.steps = Steps(jnp.array(0, jnp.int32))

    def __call__(self, tokens):
        self.steps[...] += 1
        x, mask = self.embed(tokens), nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))


def lm_loss(model, batch):
    logits = model(batch["tokens"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()


def token_batches(n: int = STEPS):
    rng = np.random.default_rng(0)
    return [{"tokens": rng.integers(0, VOCAB, size=(ROWS, SEQ + 1)).astype(np.int32)} for _ in range(n)]


def build_lm(**kwargs) -> TutorialLM:
    """The user's instance; logical names need no mesh to create it without eager sharding."""
    with nnx.use_eager_sharding(False):
        return TutorialLM(rngs=nnx.Rngs(params=0, dropout=1), **kwargs)


def users_own_loop(model: TutorialLM, batches):
    """The tutorial's training loop, one device: model.train(), nnx.Optimizer, nnx.value_and_grad."""
    model.train()
    opt = nnx.Optimizer(model, optimizer(), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, opt, batch):
        loss, grads = nnx.value_and_grad(lm_loss)(model, batch)
        opt.update(model, grads)
        return loss

    return [float(train_step(model, opt, batch)) for batch in batches]


def test_tutorial_transformer_under_fsdp_tp_trains_like_its_own_nnx_optimizer_loop(tmp_path):
    """3-D attention kernels split over `tensor` on the heads dim and over `fsdp` on another, the
    counter carried, Flax's names known (no warning): the trajectory is the user's own loop's. The
    exported weights (list indices read back as strings) run through ``model.apply`` in eval mode."""
    held, batches = build_lm(), token_batches()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="no strategy has a rule")
        model = from_nnx(nnx.clone(held), lm_loss)
        layout = make_layout(model, "fsdp_tp", make_mesh({"fsdp": 4, "tensor": 2}))
    attn = layout.param_shardings()["blocks"][0]["attn"]
    assert attn["query"]["kernel"].spec == jax.sharding.PartitionSpec("fsdp", "tensor", None)
    assert attn["out"]["kernel"].spec[0] == "tensor"
    program = build(model, optimizer(), layout)
    state, losses = _train(program, program.init(jax.random.key(0)), batches)
    ref_losses = users_own_loop(held, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    _assert_close(_host(state.params), nnx.to_pure_dict(nnx.state(held, nnx.Param)))
    assert int(state.model_state["steps"]) == int(held.steps[...]) == STEPS
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.save(STEPS, state, data_state={}, config={}, force=True)
    export_params(tmp_path / "ckpt", tmp_path / "lm.npz")
    params, model_state = load_exported(tmp_path / "lm.npz", model_state=True)
    variables = nnx.state(held)  # the Flax way to load a pure dict read back without a target
    nnx.replace_by_pure_dict(variables, params)
    nnx.replace_by_pure_dict(variables, model_state)
    nnx.update(held, variables)
    held.eval()
    tokens = batches[0]["tokens"]
    np.testing.assert_allclose(model.apply(params, tokens, model_state=model_state), held(tokens), rtol=1e-6)


def test_attention_modes_undecided_dropout_trains_and_evaluates_and_decode_is_refused():
    """``nnx.MultiHeadAttention(dropout_rate=...)`` is built with ``deterministic=None`` and refuses
    to run until ``model.train()``; a constructor handed to from_nnx gets no such call from the
    user, so the step sets the undecided flags as ``train()`` would, and evaluate as ``eval()``.
    ``decode=True`` (a cache sized for one batch) is refused by path before any step."""
    with pytest.raises(ValueError, match="the module itself is built with decode=True.*train a decode=False module"):
        from_nnx(lambda rngs: nnx.MultiHeadAttention(HEADS, D, decode=True, rngs=rngs), lm_loss)
    make = lambda rngs: TutorialLM(rngs=rngs, attn_dropout=0.5)
    model = from_nnx(make, lm_loss)
    program = build(model, optimizer(), make_layout(model, "dp", make_mesh({"data": 8})))
    batch = token_batches(1)[0]
    state, metrics = program.step(program.init(jax.random.key(0)), batch)
    with nnx.use_eager_sharding(False):
        user = make(nnx.Rngs(jax.random.key(0)))  # the same initial weights
    user.eval()
    assert abs(float(metrics["loss"]) - float(lm_loss(user, batch))) > 1e-3  # the attention dropout drew
    assert int(state.model_state["steps"]) == 1
    evaluated = [float(program.evaluate(state.params, batch, state.model_state)["loss"]) for _ in range(2)]
    nnx.update(user, nnx.State(_host(state.params)))
    np.testing.assert_allclose(evaluated, [float(lm_loss(user, batch))] * 2, rtol=1e-6)


class JoinedAttention(nnx.Module):
    """lm1b / MaxText style: q, k and v fused into one 'joined_kv' (heads x head_dim) dim."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.norm = nnx.RMSNorm(D, scale_init=named(("norm",), nnx.initializers.ones_init()), rngs=rngs)
        self.qkv = nnx.Linear(D, 3 * D, kernel_init=named(("embed", "joined_kv")), use_bias=False, rngs=rngs)
        self.out = nnx.Linear(D, D, kernel_init=named(("joined_kv", "embed")), use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.out(self.qkv(self.norm(x))[..., :D])


def test_flax_names_are_known_joined_kv_splits_like_heads_and_path_rules_name_the_unannotated():
    loss = lambda m, batch: jnp.mean((m(batch["x"]) - batch["x"]) ** 2)
    mesh = make_mesh({"data": 2, "tensor": 4})
    P = jax.sharding.PartitionSpec
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no unknown-name nor replication warning
        specs = make_layout(from_nnx(JoinedAttention, loss), "tp", mesh).param_shardings()
        assert (specs["qkv"]["kernel"].spec, specs["out"]["kernel"].spec) == (P(None, "tensor"), P("tensor", None))
        assert specs["norm"]["scale"].spec == P(None)
        rules = [(r"(query|key|value)/kernel$", ("embed", "heads", "kv")),  # the tutorial's attention, unannotated
                 (r"(query|key|value)/bias$", ("heads", "kv")), (r"out/kernel$", ("heads", "kv", "embed"))]
        attention = from_nnx(lambda rngs: nnx.MultiHeadAttention(HEADS, D, decode=False, rngs=rngs), loss,
                             path_rules=rules)
        specs = make_layout(attention, "tp", mesh).param_shardings()
    assert specs["query"]["kernel"].spec == P(None, "tensor", None) and specs["out"]["kernel"].spec[0] == "tensor"
