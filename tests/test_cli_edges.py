"""The command line's rough edges a new user met first (issue 28): each one a clear line or a working default.

Most tests only parse or validate (no compile); one in-process run of ``tiny`` with no ``--seq-len``,
on a .bin token file, then checks a re-run without ``--ckpt-every``, a resume with another
``--model``, and finally a resume that reads each token window once.
"""

from __future__ import annotations

import collections
import io
import json

import numpy as np
import pytest

from shardlib.cli import main
from shardlib.models import CONFIGS
from shardlib.run.config import DEFAULT_SEQ_LEN, TrainConfig
from shardlib.run.examples import read_examples
from shardlib.run.metrics_io import read_metrics
from shardlib.run.setup import _strategy, with_model_defaults
from shardlib.runtime.data import split_train_val, train_window_starts
from shardlib.runtime import launch
from shardlib.sharding.strategies import STRATEGIES
from tests.test_token_data import VOCAB, token_ids


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(("shardlib ", "shardlib:")) and "Traceback" not in err[0]
    return err[0]


def test_seq_len_defaults_to_the_shorter_of_128_and_the_model_max():
    for name, model in CONFIGS.items():
        assert with_model_defaults(TrainConfig(model=name)).seq_len == min(DEFAULT_SEQ_LEN, model.max_seq_len)
    assert CONFIGS["tiny"].max_seq_len < DEFAULT_SEQ_LEN  # the case that failed
    assert with_model_defaults(TrainConfig(model="tiny", seq_len=16)).seq_len == 16  # given: kept


def test_out_naming_a_file_is_one_line_before_anything_starts(tmp_path, capsys, monkeypatch):
    afile = tmp_path / "notes.txt"
    afile.write_text("keep me\n")
    monkeypatch.setattr("shardlib.run.train.setup_devices", lambda *_: pytest.fail("devices set up first"))
    for out in (afile, afile / "run"):
        assert main(["train", "--model", "tiny", "--out", str(out)]) == 2
        line = _one_error_line(capsys)
        assert "--out" in line and f"{afile} is a file" in line
    assert afile.read_text() == "keep me\n"


@pytest.mark.parametrize("argv, suggestion", [
    (["train", "--stratgy", "zero3"], "did you mean --strategy?"),
    (["train", "--strategy", "zero4"], "did you mean --strategy zero3?"),
    (["train", "--model", "tinny"], "did you mean --model tiny?"),
    (["plan", "--model", "tiny", "--devices", "8", "--precison", "bf16"], "did you mean --precision?"),
    (["train", "--strategy", "FSDP"], "did you mean --strategy fsdp?"),
    (["trian", "--steps", "3"], "did you mean 'shardlib train'?"),
])
def test_a_typo_gets_did_you_mean(argv, suggestion, capsys):
    assert main(argv) == 2
    assert suggestion in _one_error_line(capsys)


def test_an_unknown_name_in_the_library_suggests_the_close_one():
    from shardlib.sharding.strategies import get_strategy

    with pytest.raises(ValueError, match="did you mean 'zero3'"):
        get_strategy("zer03")


def test_mesh_accepts_the_spelling_the_header_prints():
    from shardlib.sharding.mesh import describe, make_mesh, parse_mesh

    printed = describe(make_mesh({"fsdp": 4, "tensor": 2}))
    assert " " in printed and parse_mesh(printed) == parse_mesh("fsdp=4,tensor=2") == {"fsdp": 4, "tensor": 2}


def test_hsdp_without_data_replicas_says_it_is_zero3(capsys):
    from shardlib.run.setup import _note_collapse
    from shardlib.sharding.mesh import make_mesh

    _note_collapse(STRATEGIES["hsdp"], make_mesh({"data": 2, "fsdp": 4}))
    assert capsys.readouterr().err == ""
    _note_collapse(STRATEGIES["hsdp"], make_mesh({"fsdp": 8}))
    assert "--strategy hsdp with data=1 is zero3" in capsys.readouterr().err


def test_strategy_fsdp_is_zero3_with_a_note(capsys):
    assert _strategy(TrainConfig(strategy="fsdp")) is STRATEGIES["zero3"]
    assert "--strategy fsdp is zero3" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["plan", "inspect"])
def test_help_lists_every_strategy_of_the_table(command, capsys):
    assert main([command, "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    missing = [name for name in STRATEGIES if name not in text]
    assert not missing, missing


def test_ctrl_c_while_the_command_imports_is_one_line_and_exit_130(capsys, monkeypatch):
    def interrupted(name):
        raise KeyboardInterrupt  # Ctrl-C lands in the seconds JAX takes to import

    monkeypatch.setattr("shardlib.cli.importlib.import_module", interrupted)
    assert main(["train", "--model", "tiny"]) == 130
    assert _one_error_line(capsys) == "shardlib train: interrupted"


def test_launch_hides_gloo_lines_unless_verbose():
    lines = b"[Gloo] Rank 0 is connected to 1 peer ranks.\nstep 1 loss 5.5\n[Gloo] Rank 1 is connected\n"
    for verbose, shown in ((False, [b"[p0] step 1 loss 5.5"]), (True, [b"[p0] " + x for x in lines.splitlines()])):
        out, tail = io.BytesIO(), collections.deque()
        launch._pump(io.BytesIO(lines), b"[p0] ", out, launch._OUTPUT_LOCK, tail, verbose)
        assert out.getvalue().splitlines() == shown
        assert len(tail) == 3  # kept for the elastic restart's diagnosis either way


def test_launch_has_a_verbose_flag():
    import argparse

    parser = argparse.ArgumentParser()
    launch.add_arguments(parser)
    assert parser.parse_args(["-n", "2", "--verbose", "--", "true"]).verbose
    assert not parser.parse_args(["-n", "2", "--", "true"]).verbose


# One run shared by the tests below (its compile is the cost): `tiny` with no --seq-len, on a .bin
# token file of ids up to 299 (test_token_data's), checkpointing, recording the windows it reads.
TOKEN_RUN = ["--model", "tiny", "--vocab-size", str(VOCAB), "--eval-every", "0", "--sample-tokens", "0",
             "--batch-size", "16", "--seed", "5", "--no-progress", "--no-tensorboard", "--ckpt-every", "2",
             "--record-examples"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """``shardlib train --model tiny --data tokens.bin --vocab-size 300 --steps 2`` (default --seq-len)."""
    base = tmp_path_factory.mktemp("edges")
    data = base / "tokens.bin"
    data.write_bytes(token_ids().astype(np.uint16).tobytes())
    out = base / "run"
    code = main(["train", *TOKEN_RUN, "--data", str(data), "--steps", "2", "--out", str(out)])
    return code, out, data


def test_tiny_trains_on_a_bin_token_file_with_the_default_seq_len(tiny_run):
    code, out, _ = tiny_run
    assert code == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["seq_len"], config["vocab_size"]) == (CONFIGS["tiny"].max_seq_len, VOCAB)
    first = read_metrics(out / "metrics.jsonl")[0]["loss"]
    assert first == pytest.approx(np.log(VOCAB), rel=0.1)  # a fresh model spreads over all 300 ids, not 256 bytes


def test_rerun_that_does_not_checkpoint_refuses_and_loses_nothing(tiny_run, capsys):
    _, out, _ = tiny_run
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    metrics = (out / "metrics.jsonl").read_text()
    assert main(["train", "--model", "tiny", "--steps", "2", "--ckpt-every", "0", "--out", str(out)]) == 2
    line = _one_error_line(capsys)
    assert "checkpointed at step 2" in line and "drop --ckpt-every 0" in line and "another --out" in line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before
    assert (out / "metrics.jsonl").read_text() == metrics


def test_resume_with_another_model_leads_with_the_mismatch(tiny_run, capsys):
    _, out, data = tiny_run
    code = main(["train", "--model", "moe-tiny", "--data", str(data), "--vocab-size", str(VOCAB), "--steps", "3",
                 "--batch-size", "16", "--seq-len", "32", "--no-progress", "--ckpt-every", "2", "--out", str(out)])
    assert code == 2
    line = _one_error_line(capsys)
    lead = "shardlib train: error: --model: checkpoint is model 'tiny', this run is 'moe-tiny': pass --model tiny"
    assert line.startswith(lead) and "or a new --out" in line, line
    assert "tensors differ" in line and "more" in line and len(line) < 800, line  # the diff follows, shortened


def test_the_token_run_resumes_reading_each_window_once(tiny_run):
    """Runs after the refusals above (same module, in order): they must have left the run as it was."""
    _, out, data = tiny_run
    assert main(["train", *TOKEN_RUN, "--data", str(data), "--steps", "3", "--out", str(out)]) == 0
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]
    train, _ = split_train_val(token_ids())
    seq = CONFIGS["tiny"].max_seq_len
    read = read_examples(out / "examples.jsonl")
    assert [r["step"] for r in read] == [1, 2, 3]
    for record in read:  # the windows the stateless formula gives for each step, none twice
        assert record["starts"] == train_window_starts(5, record["step"] - 1, 16, len(train) - seq).tolist()
