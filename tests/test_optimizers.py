"""Users' own optax optimizers through every strategy: parity with a one-device ``jax.jit`` + optax
step, the optimizer state's shardings, injected hyperparameters, checkpoints onto another mesh,
and how the step's own non-finite skip, gradient norm and ``grad_accum`` compose with
``clip_by_global_norm``, ``MultiSteps`` and ``apply_if_finite``.

The model is `tests.zoo`'s plain pytree MLP (fast to compile); references are written here or in
`zoo.plain_steps`, with no shardlib code in them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jax.sharding import PartitionSpec as P

from shardlib import (Checkpointer, ReplicationWarning, build, from_functions, from_linen, make_layout, make_mesh,
                      sharding_report)
from tests import zoo
from tests.helpers import host_copy

STEPS, ROWS = 4, 16
FSDP8, DATA2_FSDP4, DATA8 = {"fsdp": 8}, {"data": 2, "fsdp": 4}, {"data": 8}
# Parameters drift by rounding between summation orders as in tests/test_user_models.py (Adam with
# eps 1e-5, lr <= 3e-3, 4 steps: 4 * 3e-3 * 1e-8 / 1e-5 = 1.2e-5); losses compare at rtol 1e-5.
PARAM_ATOL = 1.2e-5
SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 3e-3, warmup_steps=2, decay_steps=10, end_value=1e-4)


def _mlp_shapes():
    """The MLP's parameter shapes (all a mask or label tree needs), traced, never computed."""
    return jax.eval_shape(zoo.mlp_init, jax.random.key(0))


def decay_mask_fn(params):
    """Weight decay on matrices only, as the Flax examples write it."""
    return jax.tree.map(lambda p: p.ndim > 1, params)


def frozen_encoder(params):
    return {name: jax.tree.map(lambda _: "freeze" if name == "encoder" else "train", layer)
            for name, layer in params.items()}


def _masked_decay_ema():
    """adamw spelled out, its weight-decay mask a pytree of bools, a schedule counter and an EMA."""
    mask = decay_mask_fn(_mlp_shapes())
    return optax.chain(optax.scale_by_adam(eps=1e-5), optax.add_decayed_weights(0.1, mask=mask),
                       optax.scale_by_schedule(SCHEDULE), optax.scale(-1.0), optax.ema(0.9))


OPTIMIZERS = {
    "clip_adamw_mask_fn": lambda: optax.chain(optax.clip_by_global_norm(1.0),
                                              optax.adamw(SCHEDULE, eps=1e-5, weight_decay=0.1, mask=decay_mask_fn)),
    "masked_decay_ema": _masked_decay_ema,
    "frozen_lion": lambda: optax.multi_transform({"train": optax.lion(1e-4), "freeze": optax.set_to_zero()},
                                                 frozen_encoder(_mlp_shapes())),
    "adafactor": lambda: optax.adafactor(1e-2),
    "muon": lambda: optax.contrib.muon(1e-3),
}

CASES = [
    ("clip_adamw_mask_fn", "zero2", DATA2_FSDP4),
    ("masked_decay_ema", "dp", DATA8),
    ("frozen_lion", "zero3", FSDP8),
    ("adafactor", "zero3", FSDP8),
    ("muon", "hsdp", DATA2_FSDP4),
]


def _model():
    return from_functions(zoo.mlp_init, zoo.mlp_loss)


def _batches(n=STEPS):
    return [zoo.regression_batch(i, ROWS) for i in range(n)]



def _train(program, state, batches):
    losses, metrics = [], []
    for batch in batches:
        state, m = program.step(state, batch)
        losses.append(float(m["loss"]))
        metrics.append(m)
    return state, losses, metrics


# Attention's key bias adds q.b to every score of a query, which softmax ignores: its gradient is
# rounding noise alone, and Adafactor (eps 1e-30) scales noise up to whole steps either way, so
# both sides can only be checked to stay at noise level.
NOISE_ONLY = "['key']['bias']"


def _assert_params_close(got, want):
    for (path, ref), value in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got)):
        name = jax.tree_util.keystr(path)
        if name.endswith(NOISE_ONLY):
            assert max(np.abs(np.asarray(value)).max(), np.abs(ref).max()) < 1e-4, name
            continue
        np.testing.assert_allclose(np.asarray(value), ref, rtol=1e-5, atol=PARAM_ATOL, err_msg=name)


def _assert_state_sharded(opt_state, mesh, strategy):
    """What the strategy promises, by formula: under zero1/2/3 every state leaf of >= 1024 elements
    with a dim the state axes divide is split over them (hsdp: over fsdp only); scalars stay whole."""
    ways = {"dp": 1, "hsdp": mesh.shape["fsdp"]}.get(strategy, mesh.shape["data"] * mesh.shape["fsdp"])
    for path, leaf in jax.tree_util.tree_leaves_with_path(opt_state):
        shard = leaf.addressable_shards[0].data
        if leaf.ndim == 0 or ways == 1:
            assert leaf.sharding.is_fully_replicated, jax.tree_util.keystr(path)
        elif leaf.size >= 1024 and any(d % ways == 0 for d in leaf.shape):  # fsdp_tp: and maybe over tensor
            assert (leaf.size // shard.size) % ways == 0, (jax.tree_util.keystr(path), leaf.shape, leaf.sharding.spec)


@pytest.mark.parametrize("name, strategy, sizes", CASES)
def test_matches_one_device_jit_and_optax(name, strategy, sizes):
    model, mesh = _model(), make_mesh(sizes)
    program = build(model, OPTIMIZERS[name](), make_layout(model, strategy, mesh))
    state = program.init(jax.random.key(0))
    params0 = host_copy(state.params)
    state, losses, metrics = _train(program, state, _batches())
    ref_params, ref_losses = zoo.plain_steps(zoo.mlp_loss, params0, OPTIMIZERS[name](), _batches())
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    _assert_params_close(state.params, ref_params)
    _assert_state_sharded(state.opt_state, mesh, strategy)
    if name == "frozen_lion":
        jax.tree.map(np.testing.assert_array_equal, host_copy(state.params["encoder"]), params0["encoder"])


def _token_inputs(batch, train):
    return (batch["tokens"], batch["positions"]), {"train": train}


def _frozen_embeddings_adafactor():
    """Flax-named parameters: the Embed tables frozen by a label function on their paths."""
    labels = lambda params: jax.tree_util.tree_map_with_path(
        lambda path, _: "freeze" if "Embed" in jax.tree_util.keystr(path) else "train", params)
    return optax.multi_transform({"train": optax.adafactor(1e-2, min_dim_size_to_factor=32, momentum=0.9),
                                  "freeze": optax.set_to_zero()}, labels)


def test_tensor_parallel_state_of_a_linen_model_with_factored_moments():
    """fsdp_tp: state shaped like its parameter (Adafactor's momentum) keeps its fsdp x tensor
    split; the factored second moments take their own layout."""
    module, batches = zoo.LinenTransformer(n_layers=1), [zoo.token_batch(i, ROWS) for i in range(3)]
    model = from_linen(module, zoo.linen_transformer_loss, batches[0], inputs=_token_inputs)
    layout = make_layout(model, "fsdp_tp", make_mesh({"fsdp": 4, "tensor": 2}))
    program = build(model, _frozen_embeddings_adafactor(), layout)
    state = program.init(jax.random.key(0))
    params0 = host_copy(state.params)
    state, losses, _ = _train(program, state, batches)
    apply = lambda p, b: module.apply({"params": p}, *_token_inputs(b, True)[0], train=True)
    loss = lambda p, b: zoo.linen_transformer_loss(apply(p, b), b)
    ref_params, ref_losses = zoo.plain_steps(loss, params0, _frozen_embeddings_adafactor(), batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    _assert_params_close(state.params, ref_params)
    _assert_state_sharded(state.opt_state, program.mesh, "fsdp_tp")
    moments = [leaf for leaf in jax.tree.leaves(state.opt_state) if leaf.shape == (zoo.D_MODEL, zoo.D_FF)]
    assert moments and all(l.sharding.spec == P("fsdp", "tensor") for l in moments)  # ("embed", "mlp")


def _jitted_reference(make):
    """One device, no shardlib: ``(params, opt_state, batch) -> (params, opt_state, loss, grad norm)``."""
    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(zoo.mlp_loss)(params, batch)
        updates, opt_state = make().update(grads, opt_state, params, value=loss)
        return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)

    return step


def _two_rates():
    """Per-layer optimizers by a label function, each with injected hyperparameters."""
    return optax.multi_transform({"train": optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3, eps=1e-5),
                                  "freeze": optax.inject_hyperparams(optax.sgd)(1e-2, momentum=0.9, nesterov=True)},
                                 frozen_encoder)


def test_injected_rates_are_replicated_reported_and_a_change_takes_effect():
    model = _model()
    program = build(model, _two_rates(), make_layout(model, "zero1", make_mesh(FSDP8)))
    state = program.init(jax.random.key(0))
    params, reference = host_copy(state.params), _jitted_reference(_two_rates)
    ref_state, losses, ref_losses, rates = _two_rates().init(params), [], [], []
    for i, batch in enumerate(_batches()):
        if i == 2:  # as a user's loop would: a new rate between two steps, on both sides
            for opt_state in (state.opt_state, ref_state):
                opt_state.inner_states["train"].inner_state.hyperparams["learning_rate"] = 3e-4
        state, metrics = program.step(state, batch)
        params, ref_state, ref_loss, _ = reference(params, ref_state, batch)
        losses.append(float(metrics["loss"]))
        ref_losses.append(float(ref_loss))
        rates.append((float(metrics["lr/train"]), float(metrics["lr/freeze"])))  # one metric per label
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    _assert_params_close(state.params, params)
    assert rates == [(np.float32(1e-3), np.float32(1e-2))] * 2 + [(np.float32(3e-4), np.float32(1e-2))] * 2
    _assert_state_sharded(state.opt_state, program.mesh, "zero1")  # hyperparameters: scalars, replicated


def test_multi_steps_and_grad_accum_compose_with_clipping():
    """grad_accum=2 (microbatches inside a step) under MultiSteps(k=2) (steps accumulated by the
    optimizer) with clip_by_global_norm inside: the same updates as plain MultiSteps on the whole
    batches; the grad_norm metric is each step's whole-batch gradient norm before clipping; and
    reduce_on_plateau receives the step's loss as ``value`` (atol 1: it never counts an
    improvement, so with patience 1 it halves the rate on the second update)."""
    plateau = lambda: optax.contrib.reduce_on_plateau(factor=0.5, patience=1, atol=1.0)
    make = lambda: optax.MultiSteps(
        optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-3, eps=1e-5), plateau()), 2)
    model = _model()
    program = build(model, make(), make_layout(model, "zero2", make_mesh(DATA2_FSDP4)), grad_accum=2)
    state = program.init(jax.random.key(0))
    params = host_copy(state.params)
    state, losses, metrics = _train(program, state, _batches())
    ref_state, reference = make().init(params), _jitted_reference(make)
    for batch, loss, m in zip(_batches(), losses, metrics):
        params, ref_state, ref_loss, norm = reference(params, ref_state, batch)
        np.testing.assert_allclose([loss, float(m["grad_norm"])], [ref_loss, norm], rtol=1e-5)
        assert float(norm) > 0.05  # the clip acted
    _assert_params_close(state.params, params)
    assert int(state.opt_state.gradient_step) == 2 and int(state.step) == STEPS
    _assert_state_sharded(state.opt_state, program.mesh, "zero2")  # the full-size accumulator included
    assert float(state.opt_state.inner_opt_state[2].scale) == float(ref_state.inner_opt_state[2].scale) == 0.5


def test_apply_if_finite_is_reported_inert_and_the_step_skips_instead():
    model = _model()
    with pytest.warns(UserWarning, match="optax.apply_if_finite: .*counters stay 0; drop it"):
        program = build(model, optax.apply_if_finite(optax.adam(1e-3), 3), make_layout(model, "dp", make_mesh(DATA8)))
    state = program.init(jax.random.key(0))
    before = host_copy(state.params)
    bad = _batches(1)[0]
    bad["x"][0, 0] = np.nan
    state, metrics = program.step(state, bad)
    assert int(metrics["skipped"]) == 1 and int(state.step) == 0
    assert int(state.opt_state.notfinite_count) == 0 and int(state.opt_state.total_notfinite) == 0
    jax.tree.map(np.testing.assert_array_equal, host_copy(state.params), before)


def test_nested_optimizer_state_restores_bitwise_onto_another_mesh(tmp_path):
    """MultiSteps of a multi_transform (frozen encoder) of Adafactor: masked nodes, factored
    moments, the accumulator and counters, zero3 on 8 devices -> zero2 on 4."""
    make = lambda: optax.MultiSteps(optax.multi_transform(
        {"train": optax.adafactor(1e-2), "freeze": optax.set_to_zero()},
        frozen_encoder), every_k_schedule=2)
    model = _model()
    source = build(model, make(), make_layout(model, "zero3", make_mesh(FSDP8)))
    state, _, _ = _train(source, source.init(jax.random.key(0)), _batches(3))
    target = build(model, make(), make_layout(model, "zero2", make_mesh({"data": 2, "fsdp": 2},
                                                                         devices=jax.devices()[:4])))
    saved = host_copy(state)
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.save(3, state, data_state={}, config={}, force=True)
        ckpt.wait()
        restored, _, _ = ckpt.restore(target.abstract_state())
    assert jax.tree.structure(restored.opt_state) == jax.tree.structure(saved.opt_state)
    for (path, want), got in zip(jax.tree_util.tree_leaves_with_path(saved), jax.tree.leaves(restored)):
        assert got.dtype == want.dtype and np.array_equal(np.asarray(got), want), jax.tree_util.keystr(path)
        assert len(got.sharding.device_set) == 4
    # the restored state trains on (step 4 applies MultiSteps' second accumulation) as the source does
    _, on_target, _ = _train(target, restored, _batches(4)[3:])
    _, on_source, _ = _train(source, state, _batches(4)[3:])
    np.testing.assert_allclose(on_target, on_source, rtol=1e-5)


def flat_buffer(extra: int = 0):
    """A user's transformation keeping one flat vector of every parameter (as fused optimizers
    do), plus ``extra`` slots: state shaped like no parameter."""
    init = lambda params: jnp.zeros(sum(p.size for p in jax.tree.leaves(params)) + extra)
    return optax.GradientTransformation(init, lambda updates, state, params=None: (updates, state))


def test_report_names_state_that_cannot_follow_its_parameter():
    """Adafactor factors the 256x256 kernel into two 256-vectors (under 1024 elements: kept whole)
    and a user's flat buffer of all parameters follows none: both are listed with where they went."""
    layout = make_layout(_model(), "zero3", make_mesh(FSDP8))
    text = sharding_report(layout, optimizer=optax.chain(optax.adafactor(), flat_buffer()))
    lines = text.split("optimizer state not shaped like its parameter:")[1].splitlines()
    factored = [l for l in lines if "v_row/hidden/kernel" in l or "v_col/hidden/kernel" in l]
    assert len(factored) == 2 and all("its parameter hidden/kernel is (256, 256)" in l for l in factored)
    assert all("kept whole" in l for l in factored)
    flat = [l for l in lines if "follows no parameter" in l]
    n = sum(s for s in (32 * 256, 256, 256 * 256, 256, 256 * 8, 8))
    assert len(flat) == 1 and f"auto-sharded dim 0 ({n}) over fsdp=8" in flat[0]
    assert "v_row/encoder/kernel" not in text  # shaped like its parameter: not listed


def test_large_state_a_sharding_strategy_must_keep_whole_is_a_warning():
    """A flat buffer one slot longer than the parameters: no dimension the 8 devices divide."""
    model = _model()
    n = sum(p.size for p in jax.tree.leaves(_mlp_shapes())) + 1
    with pytest.warns(ReplicationWarning, match=rf"zero3 keeps 1 optimizer-state tensor\(s\) whole .*\n  1 \({n},\): "
                                                rf"own layout: it follows no parameter; auto-shard: no free dimension"):
        build(model, optax.chain(optax.adam(1e-3), flat_buffer(extra=1)), make_layout(model, "zero3", make_mesh(FSDP8)))
