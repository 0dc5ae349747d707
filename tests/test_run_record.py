"""A rerun into a run directory takes the flags the run recorded (config.json) as defaults, and
lists in one line the given flags that differ from the record (issue 45 §5)."""

from __future__ import annotations

import argparse
import json

import pytest

from shardlib.cli import main
from shardlib.run.config import TrainConfig, add_arguments, from_args, given_fields
from shardlib.run.record import RECORDED, with_recorded

COMMON = ["--model", "tiny", "--no-progress", "--no-tensorboard", "--sample-tokens", "0", "--eval-every", "0"]


def _parsed(argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv)
    return from_args(args), given_fields(args)


def test_given_fields_are_the_flags_on_the_command_line_even_at_their_default():
    config, given = _parsed(["--lr", "3e-3", "--no-progress", "--seq-len", "64"])
    assert given == {"lr", "progress", "seq_len"}
    assert (config.lr, config.progress, config.seq_len, config.batch_size) == (3e-3, False, 64, 32)


def test_the_record_fills_unset_flags_and_a_differing_flag_is_one_line(tmp_path):
    record = {**TrainConfig().__dict__, "init_from": "/models/llama", "tokenizer": "/models/llama", "data": "sft.jsonl",
              "lr": 1e-4, "warmup_steps": None, "schedule_steps": 500, "seq_len": 1024, "batch_size": 16}
    (tmp_path / "config.json").write_text(json.dumps(record))
    config, given = _parsed(["--out", str(tmp_path), "--seq-len", "512", "--lr", "1e-4", "--warmup-steps", "10"])
    config, lines = with_recorded(config, given)
    assert {name: getattr(config, name) for name in RECORDED} == {
        "init_from": "/models/llama", "tokenizer": "/models/llama", "data": "sft.jsonl", "lr": 1e-4,
        "warmup_steps": 10, "schedule_steps": 500, "seq_len": 512, "batch_size": 16}
    path = tmp_path / "config.json"
    assert lines == [f"shardlib: from {path} (the run's record): --init-from /models/llama, --tokenizer /models/llama, "
                     "--data sft.jsonl, --schedule-steps 500, --batch-size 16",
                     f"shardlib: note: given flags differ from {path}: --warmup-steps 10 (recorded unset), "
                     "--seq-len 512 (recorded 1024)"]


@pytest.mark.parametrize("content", ["{not json", json.dumps({"lr": 1.0}), json.dumps([1, 2])])
def test_a_directory_without_a_shardlib_record_changes_nothing(tmp_path, content):
    (tmp_path / "config.json").write_text(content)  # an export, a Hub model, a broken file: not a run's record
    config, given = _parsed(["--out", str(tmp_path)])
    assert with_recorded(config, given) == (config, [])
    assert with_recorded(*_parsed([])) == (_parsed([])[0], [])  # a new runs/<timestamp>: no record


def test_a_rerun_without_lr_keeps_the_recorded_schedule_and_batch(tmp_path, capsys):
    """In-process CLI: 2 steps at --lr 1e-3 --seq-len 32 --batch-size 8, then a rerun to step 3 giving none of
    them (and a --warmup-steps the record lacks): it resumes at the recorded schedule, whose rate after its
    2 planned steps is lr x min_lr_ratio = 1e-4 (the default --lr would give 3e-4)."""
    out = tmp_path / "R"
    assert main(["train", *COMMON, "--steps", "2", "--lr", "1e-3", "--seq-len", "32", "--batch-size", "8",
                 "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["train", *COMMON, "--steps", "3", "--warmup-steps", "1", "--out", str(out)]) == 0
    err = capsys.readouterr().err.splitlines()
    path = out / "config.json"
    assert f"shardlib: from {path} (the run's record): --lr 0.001, --seq-len 32, --batch-size 8" in err
    assert f"shardlib: note: given flags differ from {path}: --warmup-steps 1 (recorded unset)" in err
    saved = json.loads(path.read_text())
    assert (saved["lr"], saved["seq_len"], saved["batch_size"], saved["schedule_steps"]) == (1e-3, 32, 8, 2)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    third = next(r for r in records if r.get("step") == 3 and "loss" in r)
    assert third["lr"] == pytest.approx(1e-4, rel=1e-6)
