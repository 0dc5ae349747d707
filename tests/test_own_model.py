"""`shardlib train --model package.module:factory`: a model the CLI imports from a test file
(`tests/own_model.py`) trains through the CLI's loop, against a plain jax.jit + optax reference."""

from __future__ import annotations

import warnings

import jax
import numpy as np
import optax
import pytest
import shardlib
from shardlib.cli import main
from shardlib.run.metrics_io import read_metrics
from shardlib.run.train import TrainConfig, train
from shardlib.runtime.data import ByteBatches, load_text, split_train_val
from tests import own_model, zoo

SPEC = "tests.own_model:make"
FLAGS = ["--batch-size", "16", "--seq-len", "32", "--no-progress", "--eval-every", "0", "--sample-tokens", "0"]


def reference_losses(steps: int, lr: float = 3e-3) -> list[float]:
    """The CLI's optimizer written out (clip 1.0, AdamW b2 0.95, decay on matrices, warmup 10% then
    cosine to 10%), stepped by `zoo.plain_steps` on the CLI loader's batches."""
    params, _, loss = zoo.nnx_functional(own_model.ByteLM, own_model.loss, seed=jax.random.key(0))
    schedule = optax.warmup_cosine_decay_schedule(lr * 0.1, lr, max(1, steps // 10), max(steps, 2), lr * 0.1)
    matrices = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=matrices))
    train_bytes, _ = split_train_val(load_text(None))
    source = ByteBatches(train_bytes, 16, 32, seed=0, process_index=0, process_count=1)
    _, losses = zoo.plain_steps(lambda p, b: loss(p, None, b)[0], params, tx, [source.batch(i) for i in range(steps)])
    return losses


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """Issue 36's Done-when: no --ckpt-every, and the run still ends with a checkpoint."""
    out = tmp_path_factory.mktemp("own") / "run"
    code = main(["train", "--model", SPEC, "--strategy", "zero3", "--steps", "5", "--out", str(out), *FLAGS])
    return code, out


def test_factory_model_trains_under_zero3_like_plain_optax(cli_run, capfd):
    code, out = cli_run
    assert code == 0
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    np.testing.assert_allclose([r["loss"] for r in records], reference_losses(5), rtol=1e-5)
    assert (out / "checkpoints" / "5").is_dir() and (out / "config.json").exists()


def test_header_names_the_factory_and_an_extended_rerun_keeps_its_lr_schedule(cli_run, capsys):
    code, out = cli_run
    assert code == 0
    capsys.readouterr()
    assert main(["train", "--model", SPEC, "--strategy", "zero3", "--steps", "8", "--ckpt-every", "5",
                 "--out", str(out), *FLAGS]) == 0
    printed = capsys.readouterr()
    assert printed.out.startswith(f"shardlib train: {SPEC} (0.02M params") and "resumed    step 5" in printed.out
    assert "the lr schedule stays the one this run started with, planned over 5 steps" in printed.err, printed.err
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6, 7, 8]
    # The 5-step schedule (warmup 1, cosine to 10% at step 5) evaluated at each update's count.
    planned = optax.warmup_cosine_decay_schedule(3e-4, 3e-3, 1, 5, 3e-4)
    np.testing.assert_allclose([r["lr"] for r in records], [float(planned(i)) for i in range(8)], rtol=1e-6)


def test_library_train_takes_the_same_model_object(tmp_path, capsys):
    config = TrainConfig(steps=2, batch_size=16, seq_len=32, out=str(tmp_path / "lib"), eval_every=0,
                         sample_tokens=0, progress=False, strategy="dp")
    result = train(config, model=own_model.make())
    np.testing.assert_allclose([r["loss"] for r in result.records], reference_losses(2), rtol=1e-5)
    assert capsys.readouterr().out.startswith("shardlib train: model passed to train() (0.02M params")


@pytest.mark.parametrize("spec, says", [
    ("tests.own_model:nope", "has no function 'nope'"),
    ("tests.own_model:not_a_model", "returned a ModuleMeta, not a shardlib Model"),
    ("tests.no_such_module:make", "cannot import 'tests.no_such_module'"),
    ("tinny", "did you mean --model tiny?"),
])
def test_a_bad_model_is_one_line_naming_the_flag(spec, says, capsys):
    assert main(["train", "--model", spec, *FLAGS]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("shardlib train: error: --model: ") and says in err, err


@pytest.mark.parametrize("flags, says", [
    (["--vocab-size", "300"], "--vocab-size: sets the vocabulary of a token file"),  # text is bytes: not ignored
    (["--data", "TOKENS"], "--vocab-size: with your own --model and a token file, give the tokenizer's"),
])
def test_the_vocabulary_of_your_own_model_comes_from_vocab_size(flags, says, tmp_path, capsys):
    tokens = tmp_path / "tokens.bin"
    np.arange(1000, dtype=np.uint16).tofile(tokens)
    flags = [str(tokens) if f == "TOKENS" else f for f in flags]
    assert main(["train", "--model", SPEC, *FLAGS, *flags, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err


def test_zero3_of_an_unrolled_stack_gathered_whole_warns_once_naming_it_and_the_fix():
    from shardlib import build, make_layout, make_mesh
    from shardlib.models import get_config, trainable
    from shardlib.step.compute import WholeGatherWarning

    # 3 blocks: more than the 2 the warning needs, and the first and last named apart from a pair; the
    # build traces each unrolled block (8 blocks traced 3x longer, issue 47).
    make = lambda rngs: zoo.NnxTransformer(rngs=rngs, n_layers=3)
    stack = shardlib.from_nnx(make, zoo.nnx_transformer_loss, blocks=())
    with pytest.warns(WholeGatherWarning, match=r"zero3 stores .* not one block's; most of them are 'blocks/0' to "
                                                r"'blocks/2' \(3 identical blocks of .*blocks='auto'"):
        build(stack, optax.adamw(1e-3), make_layout(stack, "zero3", make_mesh({"fsdp": 8})))
    rows = {k: np.zeros((16, zoo.SEQ), np.int32) for k in ("tokens", "positions", "targets")}
    linen = shardlib.from_linen(zoo.LinenTransformer(n_layers=3), zoo.linen_transformer_loss, rows,
                                inputs=lambda b, train: ((b["tokens"], b["positions"]), {"train": train}), blocks=())
    with pytest.warns(WholeGatherWarning, match=r"from_linen gathers each weight where it is read .* 'LinenBlock_0' "
                                                r"to 'LinenBlock_2' \(3 identical blocks .*blocks='auto'"):
        build(linen, optax.adamw(1e-3), make_layout(linen, "zero3", make_mesh({"fsdp": 8})))
    gpt = trainable(get_config("tiny"))  # gathers its own layers: nothing to say; nor with blocks gathered per
    auto = shardlib.from_nnx(make, zoo.nnx_transformer_loss)  # call (the default); nor under dp
    with warnings.catch_warnings():
        warnings.simplefilter("error", WholeGatherWarning)
        build(gpt, optax.adamw(1e-3), make_layout(gpt, "zero3", make_mesh({"fsdp": 8})))
        build(auto, optax.adamw(1e-3), make_layout(auto, "zero3", make_mesh({"fsdp": 8})))
        build(own_model.make(), optax.adamw(1e-3), make_layout(own_model.make(), "zero3", make_mesh({"fsdp": 8})))
        build(stack, optax.adamw(1e-3), make_layout(stack, "dp", make_mesh({"data": 8})))
