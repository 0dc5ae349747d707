"""Packed rows with document masks (issue 45 §2): each example keeps its own inputs, targets and loss
mask in its segment, the GPT's loss of a packed batch equals that of the padded batch of the same
examples (the reference: the same model on one padded example a row), and `shardlib train --pack`
records its padding per step."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from shardlib.cli import main
from shardlib.models import CONFIGS, gpt
from shardlib.runtime.packing import KEYS, PackedBatches, best_fit, pack
from shardlib.runtime.rows import pad_fraction
from shardlib.runtime.rows import RowBatches

SEQ = 32


def _examples(n: int = 10, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Padded instruction rows as `shardlib.hf.tokenizer.instruction_rows` makes them: tokens
    [n, SEQ + 1] (0 after each example), the mask over targets (its prompt's and padding's 0)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(4, SEQ + 2, size=n)
    lengths[0] = 1  # one token: no target, left out of the packed rows
    tokens = np.zeros((n, SEQ + 1), np.uint32)
    mask = np.zeros((n, SEQ), np.float32)
    for i, length in enumerate(lengths):
        tokens[i, :length] = rng.integers(1, 256, size=length)
        prompt = rng.integers(1, max(2, length - 1))
        mask[i, prompt - 1:length - 1] = 1.0  # targets prompt .. length - 1: the completion's tokens
    return tokens, mask, lengths


def test_each_example_keeps_its_targets_mask_and_positions_in_its_own_segment():
    tokens, mask, lengths = _examples(12)
    packed = pack(tokens, mask, lengths)
    assert all(a.shape == packed.inputs.shape and a.shape[1] == SEQ for a in packed)
    seen = []
    for row in range(len(packed.inputs)):
        ids = packed.segment_ids[row]
        used = int((ids > 0).sum())
        assert (ids[:used] > 0).all() and (ids[used:] == 0).all()  # documents first, padding at the end
        assert not packed.loss_mask[row, used:].any()
        for segment in range(1, ids.max() + 1):
            where = np.flatnonzero(ids == segment)
            n = len(where)
            example = next(i for i in range(len(tokens)) if lengths[i] - 1 == n and i not in seen
                           and (tokens[i, :n] == packed.inputs[row, where]).all())
            seen.append(example)
            np.testing.assert_array_equal(packed.targets[row, where], tokens[example, 1:n + 1])  # never the next document's
            np.testing.assert_array_equal(packed.loss_mask[row, where], mask[example, :n])
            np.testing.assert_array_equal(packed.positions[row, where], np.arange(n))
    assert sorted(seen) == [i for i in range(len(tokens)) if lengths[i] > 1]  # each once, the one-token example out
    assert len(packed.inputs) < len(tokens) - 1


def test_best_fit_fills_rows_and_pad_fraction_counts_the_padding():
    sizes = np.array([30, 2, 20, 12, 10, 8, 22, 28, 4])
    bins = best_fit(sizes, 32)
    assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
    assert all(sizes[b].sum() <= 32 for b in bins)
    assert len(bins) == -(-sizes.sum() // 32)  # 136 positions: 5 rows, the least any packing needs
    lengths = np.array([5, 33, 40, 1])  # 4, 32, 32 (cut at SEQ + 1) and 0 positions of 4 x 32
    assert pad_fraction(lengths, 32) == 1 - 68 / 128


def test_loaders_record_the_padding_of_each_global_batch():
    tokens, mask, lengths = _examples(16)
    rows = RowBatches(tokens, mask, 4, seed=3, process_index=0, process_count=1, lengths=lengths)
    picked = rows._picked(5)
    assert rows.pad_fraction(5) == pad_fraction(lengths[picked], SEQ)
    packed = PackedBatches(pack(tokens, mask, lengths), 2, seed=3, process_index=0, process_count=1)
    batch = packed.batch(1)
    assert set(batch) == set(KEYS)
    assert packed.pad_fraction(1) == float((batch["segment_ids"] == 0).mean())  # one process: its rows are the batch


@pytest.fixture(scope="module")
def tiny():
    return dataclasses.replace(CONFIGS["tiny"], max_seq_len=SEQ)


def _loss_fn(config):
    """``loss_and_grads(batch)``: the GPT's `next_token_loss` and its gradients, one jit for every batch."""
    graphdef, params = nnx.split(gpt.build(config, 0))
    run = jax.jit(lambda params, batch: jax.value_and_grad(
        lambda p: gpt.next_token_loss(nnx.merge(graphdef, p), batch)[0])(params))
    return lambda batch: run(params, {k: jnp.asarray(v) for k, v in batch.items()})


# Every path a GPT runs on CPU: the einsum, the blocked einsum, shardlib's flash and
# jax.nn.dot_product_attention's XLA route (the cuDNN route's documents mask); the splash kernel's
# segment ids: tests/test_splash.py
ATTENTIONS = ["einsum", "blocked", "flash", "xla"]


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_the_loss_of_a_packed_batch_is_the_padded_batch_s(tiny, attention):
    config = dataclasses.replace(tiny, attention=attention)
    tokens, mask, lengths = _examples(10, seed=1)
    keep = lengths > 1
    tokens, mask, lengths = tokens[keep], mask[keep], lengths[keep]
    padded = {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32), "loss_mask": mask}
    packed = pack(tokens, mask, lengths)
    assert len(packed.inputs) < len(tokens) and packed.loss_mask.sum() == mask.sum()  # the same tokens counted
    loss_and_grads = _loss_fn(config)
    want, want_grads = loss_and_grads(padded)
    got, got_grads = loss_and_grads(packed._asdict())
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), got_grads, want_grads)
    # What made them equal: attention kept within each document, and positions reaching the rope
    one_segment = {**packed._asdict(), "segment_ids": (packed.segment_ids > 0).astype(np.int32)}
    assert abs(loss_and_grads(one_segment)[0] - want) > 1e-3
    shuffled = {**packed._asdict(), "positions": np.random.default_rng(0).permutation(packed.positions, axis=1)}
    assert abs(loss_and_grads(shuffled)[0] - want) > 1e-3


# ---------------------------------------------------------------- the CLI


WORDS = ["[UNK]", "the", "a", "cat", "dog", "sat", "on", "mat", "."]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A word-level tokenizer of 9 ids and 200 prompt/completion rows of 6 to 30 tokens."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    root = tmp_path_factory.mktemp("packing")
    tok = tokenizers.Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(root / "tokenizer.json"))
    rng = np.random.default_rng(0)
    words = lambda n: " ".join(rng.choice(WORDS[1:], size=n))
    rows = [{"prompt": words(rng.integers(3, 15)), "completion": " " + words(rng.integers(3, 15))} for _ in range(200)]
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _train(workspace, out, *flags):
    return ["train", "--model", "tiny", "--tokenizer", str(workspace / "tokenizer.json"), "--data",
            str(workspace / "rows.jsonl"), "--steps", "3", "--seq-len", "64", "--batch-size", "8", "--no-progress",
            "--sample-tokens", "0", "--eval-every", "0", "--out", str(out), *flags]


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


def test_a_packed_run_records_little_padding_where_padded_rows_hold_much(workspace, tmp_path, capsys):
    assert main(_train(workspace, tmp_path / "padded")) == 0
    assert main(_train(workspace, tmp_path / "packed", "--pack")) == 0
    padded, packed = _records(tmp_path / "padded"), _records(tmp_path / "packed")
    assert [r["step"] for r in packed] == [1, 2, 3] and len(padded) == 3
    assert all(r["pad_fraction"] > 0.3 for r in padded), padded
    assert all(r["pad_fraction"] < 0.15 for r in packed), packed
    assert "--pack: 190 training examples in" in capsys.readouterr().err


@pytest.mark.parametrize("flags, says", [
    (("--data", "CORPUS"), "text and token files are read as full windows"),
    (("--model", "moe-tiny"), "the MoE decoder does not take segment ids"),
    (("--mesh", "data=2,context=4"), "split over the context axis (size 4)"),
    (("--mesh", "data=4,pipe=2", "--strategy", "dp"), "pipeline stages (pipe=2) see no segment ids"),
])
def test_what_cannot_pack_is_one_line_before_anything_compiles(workspace, tmp_path, capsys, monkeypatch, flags, says):
    import shardlib.run.setup as setup

    monkeypatch.setattr(setup, "build_program", lambda *a, **k: pytest.fail("built the step before refusing --pack"))
    (tmp_path / "corpus.txt").write_text("the cat sat on the mat . " * 100)
    flags = tuple(str(tmp_path / "corpus.txt") if f == "CORPUS" else f for f in flags)
    argv = _train(workspace, tmp_path / "run", "--pack", *flags)
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "--pack" in lines[0] and says in lines[0], err
