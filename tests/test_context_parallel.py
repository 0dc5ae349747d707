"""Context parallelism: the sequence split over a `context` mesh axis computes what one device does.

References are independent of shardlib: a causal softmax attention written here, and one step of
``jax.jit(jax.value_and_grad)`` on one device. Gradients are read exactly from the optimizer state
of a transformation that keeps them (`_keep_grads`). Tolerance rtol 1e-5 (atol 1e-7 for elements
near zero): the split sums the same terms in another order.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardlib import build, make_layout, make_mesh
from shardlib.model import attention as attention_lib
from shardlib.model import flash as flash_lib
from shardlib.model import from_nnx, hooks
from shardlib.models import GPT, get_config, next_token_loss, trainable
from shardlib.sharding import sequence
from tests import zoo
from tests.helpers import batches

TINY = get_config("tiny")
MESH = {"data": 2, "context": 4}


def causal_reference(q, k, v):
    """softmax(q k^T / sqrt(d)) v under a causal mask, float32, GQA by repeating kv heads."""
    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    s = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])
    t = q.shape[1]
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e30)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), v)


def _keep_grads() -> optax.GradientTransformation:
    """No update; the state is the last gradients, exactly as the step handed them over."""
    return optax.GradientTransformation(lambda params: jax.tree.map(jnp.zeros_like, params),
                                        lambda updates, state, params=None: (jax.tree.map(jnp.zeros_like, updates), updates))


def _one_step(model, mesh, batch, **layout_fields):
    layout = dataclasses.replace(make_layout(model, "dp", make_mesh(mesh)), **layout_fields)
    program = build(model, _keep_grads(), layout)
    state, metrics = program.step(program.init(jax.random.key(0)), batch)
    return float(metrics["loss"]), jax.tree.map(np.asarray, state.opt_state)


def _assert_close(got_loss, got_grads, ref_loss, ref_grads):
    np.testing.assert_allclose(got_loss, ref_loss, rtol=1e-5)
    got = dict(jax.tree_util.tree_leaves_with_path(got_grads))
    for path, ref in jax.tree_util.tree_leaves_with_path(ref_grads):
        match = [g for p, g in got.items() if jax.tree_util.keystr(p).endswith(jax.tree_util.keystr(path))]
        assert match, jax.tree_util.keystr(path)
        np.testing.assert_allclose(match[0], ref, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))


def _reference_step(make, loss_fn, batch):
    params, _, loss = zoo.nnx_functional(make, loss_fn, seed=jax.random.key(0))
    value, grads = jax.jit(jax.value_and_grad(lambda p: loss(p, None, batch)[0]))(params)
    return float(value), grads


# ---- the attention op itself, ring and all-gather, forward and backward


@pytest.mark.parametrize("mode,balanced", [("ring", False), ("allgather", True)])
def test_split_attention_matches_dense(mode, balanced):
    """q/k/v split over context=4 as the step splits them equal one-device attention, and so do
    their gradients (the ring's custom backward pass included). The balanced ring is
    `test_gpt_ring_matches_one_device`'s."""
    size, t = 4, 32
    keys = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(keys[0], (2, t, 4, 8))
    k, v = (jax.random.normal(key, (2, t, 2, 8)) for key in keys[1:3])
    w = jax.random.normal(keys[3], (2, t, 4, 8))
    order = sequence.order(t, size, balanced)
    mesh = make_mesh({"context": size}, devices=jax.devices()[:size])

    def split(q, k, v):
        def body(q, k, v):
            ctx = hooks.ComputeContext(lambda names, shape: P(), context_size=size, context_balance=balanced,
                                       context_attention=mode)
            with hooks.compute_context(ctx):
                return attention_lib.attention(q, k, v, causal=True)

        spec = P(None, "context")
        out = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(q[:, order], k[:, order], v[:, order])
        return out[:, np.argsort(order)]

    got, pull = jax.vjp(jax.jit(split), q, k, v)
    want, want_pull = jax.vjp(jax.jit(causal_reference), q, k, v)  # one program, not ~25 eager op compiles
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for g, r in zip(pull(w), want_pull(w)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def _blocks(monkeypatch, size: int) -> None:
    """Tiles of ``size`` queries x ``size`` keys."""
    monkeypatch.setattr(flash_lib, "QUERY_BLOCK", size)
    monkeypatch.setattr(flash_lib, "KEY_BLOCK", size)


def _count_tiles(monkeypatch) -> list[int]:
    """A list that grows by one each time a compiled program computes a tile's scores (forward or
    backward, on any device)."""
    computed: list[int] = []
    scores = flash_lib.scores

    def counting(*args):
        jax.debug.callback(lambda: computed.append(1))
        return scores(*args)

    monkeypatch.setattr(flash_lib, "scores", counting)
    return computed


def _triangle(tiles: int) -> int:
    """Tiles on or below the diagonal of a causal [tiles x tiles] grid."""
    return tiles * (tiles + 1) // 2


@pytest.mark.parametrize("mode,balanced", [("ring", True), ("ring", False), ("allgather", True)])
def test_attention_in_key_blocks_matches_dense(mode, balanced, monkeypatch):
    """With tiles of 2 queries x 2 keys (4 per half-chunk), forward and backward still equal
    one-device attention, and over all devices they compute the causal triangle's tiles only:
    16 x 17 / 2 of the 16 x 16 each way."""
    _blocks(monkeypatch, 2)
    computed = _count_tiles(monkeypatch)
    test_split_attention_matches_dense(mode, balanced)
    assert len(computed) == 2 * _triangle(16)


def _attention_temp_bytes(mode: str, t: int, size: int = 4) -> int:
    """Temporaries of one device's compiled forward + backward of split attention over t tokens,
    under remat (whose partial evaluation once saved every key block's causal mask)."""
    mesh = make_mesh({"context": size}, devices=jax.devices()[:size])

    def body(q, k, v, w):
        ctx = hooks.ComputeContext(lambda names, shape: P(), context_size=size, context_balance=True,
                                   context_attention=mode)
        with hooks.compute_context(ctx):
            attend = jax.checkpoint(lambda q, k, v: attention_lib.attention(q, k, v, causal=True))
            return jax.vjp(attend, q, k, v)[1](w)

    spec = P(None, "context")
    x = jax.ShapeDtypeStruct((1, t, 2, 8), jnp.float32)
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 3))
    return step.lower(x, x, x, x).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.xla_defaults
@pytest.mark.parametrize("mode", ["ring", "allgather"])
def test_attention_memory_is_linear_in_the_sequence(mode, monkeypatch):
    """Twice the tokens at most 2.3x the temporaries (scores of [T/C x KEY_BLOCK], never
    [T/C x T/C] or [T/C x T]); dense scores would take 4x. The ring runs on C=2 devices: its
    compile is a third of C=4's (~5 s CPU against ~13, whatever T), and a [T/C x T/C] or
    [T/C x T] buffer would still grow 4x (measured 1.93x at C=2, 1.81x at C=4); the ring's
    hops over 4 devices are the other tests' (values, gradients, tiles)."""
    _blocks(monkeypatch, 64)
    size = 2 if mode == "ring" else 4
    assert _attention_temp_bytes(mode, 4096, size) <= 2.3 * _attention_temp_bytes(mode, 2048, size)


def test_whole_sequence_flash_computes_only_visible_tiles_and_matches_dense(monkeypatch):
    """One device, 32 tokens in tiles of 4 x 4: the forward and the backward each compute the
    8 x 9 / 2 tiles on or below the diagonal, of 8 x 8 (all 64 with every key visible), and values
    and gradients equal the written-out scores, GQA included."""
    _blocks(monkeypatch, 4)
    computed = _count_tiles(monkeypatch)
    q, w = (jax.random.normal(key, (2, 32, 4, 8)) for key in jax.random.split(jax.random.key(0), 2))
    k, v = (jax.random.normal(key, (2, 32, 2, 8)) for key in jax.random.split(jax.random.key(1), 2))
    got, pull = jax.vjp(jax.jit(lambda q, k, v: attention_lib.causal_flash(q, k, v)), q, k, v)
    grads = pull(w)
    assert len(computed) == 2 * _triangle(8)
    want, want_pull = jax.vjp(jax.jit(causal_reference), q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, want_pull(w)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
    computed.clear()
    pos = jnp.arange(32)
    jax.block_until_ready(jax.vjp(jax.jit(lambda q, k, v: attention_lib.flash(q, k, v, pos, pos, False)), q, k, v)[1](w))
    assert len(computed) == 2 * 8 * 8


def test_auto_attention_is_flash_from_the_measured_length():
    from shardlib.models.gpt import resolve_attention

    assert resolve_attention("auto", jnp.float32, attention_lib.FLASH_MIN_SEQ) == "flash"
    assert resolve_attention("auto", jnp.float32, attention_lib.FLASH_MIN_SEQ - 1) == "einsum"
    assert resolve_attention("einsum", jnp.float32, 10**6) == "einsum"  # asked for by name: kept


def test_splash_where_it_cannot_run_is_flash_said_once(capsys):
    """attention="splash" outside a TPU step (the Pallas kernel compiles for TPU only) runs
    shardlib's own attention, equal to the reference, and says so once per shape."""
    from shardlib.model import splash
    from shardlib.models.gpt import _local_attention

    splash._SAID.clear()
    q = jax.random.normal(jax.random.key(0), (1, 128, 4, 8))
    k, v = (jax.random.normal(key, (1, 128, 2, 8)) for key in jax.random.split(jax.random.key(1), 2))
    want = jax.jit(causal_reference)(q, k, v)
    for _ in range(2):
        np.testing.assert_allclose(_local_attention("splash", q, k, v), want, rtol=1e-5, atol=1e-6)
    assert capsys.readouterr().err.count("the Pallas splash kernel does not take q (1, 128, 4, 8) (not inside a "
                                        "shardlib step on TPU)") == 1


# ---- the balance of the ring's schedule, and the sequence layout


def test_balanced_schedule_evens_causal_work():
    """Per device attention FLOPs of the blocks the ring computes: balanced, every device the same;
    contiguous at C=8, the last device ~2x the mean (it attends to the whole sequence)."""
    for size in (2, 4, 8):
        flops = attention_lib.block_flops(size, balanced=True)
        assert max(flops) / np.mean(flops) == pytest.approx(1.0)
        # the same total as the causal triangle needs: C^2/2 blocks plus the diagonal's half
        assert sum(flops) == pytest.approx(size * size / 2 + size / 2)
    flops = attention_lib.block_flops(8, balanced=False)
    assert max(flops) / np.mean(flops) == pytest.approx(8 / 4.5)  # 1.78: 8 blocks against 4.5


def test_order_and_positions_agree():
    """Device i's part of the reordered sequence holds exactly the positions `positions` names."""
    t, size = 48, 3
    order = sequence.order(t, size, True)
    assert sorted(order) == list(range(t))
    parts = np.split(order, size)
    for d in range(size):
        np.testing.assert_array_equal(parts[d], sequence.positions(d, t // size, size, True))
        np.testing.assert_array_equal(np.split(np.arange(t), size)[d], sequence.positions(d, t // size, size, False))


# ---- whole models: the built-in GPT and a user's model that calls the helper


@pytest.fixture(scope="module")
def token_batch():
    return batches(1, batch=4, seq=32)[0]


def test_gpt_ring_matches_one_device(token_batch):
    """The built-in GPT, data=2 x context=4, ring attention, balanced: loss and every gradient."""
    ref = _reference_step(lambda rngs: GPT(TINY, rngs=rngs), lambda m, b: next_token_loss(m, b)[0], token_batch)
    got = _one_step(trainable(TINY), MESH, token_batch, context_attention="ring")
    _assert_close(*got, *ref)


class UserDecoder(nnx.Module):
    """A user's one-layer decoder with learned positions; ``attend`` is its attention."""

    def __init__(self, attend, *, rngs: nnx.Rngs):
        self.attend = attend
        self.embed = nnx.Embed(256, 32, rngs=rngs)
        self.pos = nnx.Embed(64, 32, rngs=rngs)
        self.qkv = nnx.Linear(32, 3 * 32, rngs=rngs)
        self.out = nnx.Linear(32, 256, rngs=rngs)

    def __call__(self, tokens):
        b, t = tokens.shape
        x = self.embed(tokens) + self.pos(attention_lib.positions(t))
        q, k, v = (y.reshape(b, t, 4, 8) for y in jnp.split(self.qkv(x), 3, axis=-1))
        return self.out(x + self.attend(q, k, v).reshape(b, t, 32))


def user_loss(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["inputs"]), batch["targets"]).mean()


def test_user_model_with_helper_matches_one_device(token_batch):
    """A user's model calling shardlib's helper (all-gather, auto's pick at 8 tokens a device),
    against the same model with the test's own attention on one device."""
    ref = _reference_step(lambda rngs: UserDecoder(causal_reference, rngs=rngs), user_loss, token_batch)
    model = from_nnx(lambda rngs: UserDecoder(attention_lib.attention, rngs=rngs), user_loss)
    _assert_close(*_one_step(model, MESH, token_batch), *ref)


def test_own_attention_under_context_is_refused(token_batch):
    model = from_nnx(lambda rngs: UserDecoder(causal_reference, rngs=rngs), user_loss)
    program = build(model, optax.sgd(0.1), make_layout(model, "dp", make_mesh(MESH)))
    with pytest.raises(ValueError, match=r"shardlib\.model\.attention\.attention\(q, k, v, causal=True\)"):
        program.step(program.init(jax.random.key(0)), token_batch)


def test_sequence_not_divisible_is_refused():
    """The step's batch check (`Layout.check_batch`) names the sequence and the multiple it needs."""
    layout = make_layout(trainable(TINY), "dp", make_mesh(MESH))
    rows = batches(1, batch=4, seq=36)[0]
    with pytest.raises(ValueError, match="sequence length 36.*multiple of 8"):
        layout.check_batch(rows)
    contiguous = dataclasses.replace(layout, context_balance=False)
    contiguous.check_batch(rows)  # 36 tokens: 4 chunks of 9
    with pytest.raises(ValueError, match="sequence length 34.*multiple of 4"):
        contiguous.check_batch(batches(1, batch=4, seq=34)[0])


def test_cli_trains_with_a_context_axis(tmp_path):
    """The command of issue 29's done-when, in-process: data=2 x context=4 on 8 devices, 3 steps."""
    from shardlib.cli import main
    from shardlib.run.metrics_io import read_metrics

    out = tmp_path / "run"
    assert main(["train", "--model", "tiny", "--mesh", "data=2,context=4", "--seq-len", "64", "--steps", "3",
                 "--out", str(out), "--sample-tokens", "0"]) == 0
    losses = [row["loss"] for row in read_metrics(out / "metrics.jsonl") if "loss" in row]
    assert len(losses) == 3 and all(np.isfinite(losses))


def test_plan_offers_context_candidates_for_long_sequences():
    """`shardlib plan` adds zero3 x context=C rows (dp when C is every device) from CONTEXT_SEQ_LEN tokens on."""
    from shardlib.tools.plan import Planner
    from shardlib.tools.plan_candidates import CONTEXT_SEQ_LEN

    long = Planner("tiny", 8, batch_size=8, seq_len=CONTEXT_SEQ_LEN)
    assert long.context_candidates() == [("zero3", {"fsdp": 4, "context": 2}), ("zero3", {"fsdp": 2, "context": 4}),
                                         ("dp", {"fsdp": 1, "context": 8})]
    assert Planner("tiny", 8, batch_size=8, seq_len=CONTEXT_SEQ_LEN // 2).context_candidates() == []
