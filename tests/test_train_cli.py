"""`shardlib train` end to end: every strategy, the files a run writes, resuming, and bad flags.

Runs go through `shardlib.cli.main` in-process (they share the 8-device CPU backend that
conftest starts, which is much faster than a subprocess per run); two subprocess tests check
that a fresh process sets up its own simulated devices and that a bad flag there gives one
line and no traceback.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import pytest

from shardlib.sharding.strategies import STRATEGIES
from shardlib.cli import main
from shardlib.run.actions import Evaluate, Every, StepClock
from shardlib.run.checkpointing import resume_hint
from shardlib.run.console import checkpoint_setting
from shardlib.run.config import DEFAULT_CPU_DEVICES, add_arguments, from_args
from shardlib.run.loop import Recorder, run_steps
from shardlib.run.metrics_io import read_metrics
from shardlib.run.train import TrainConfig, sample_text, train

from tests import compile_flags

REPO = Path(__file__).resolve().parents[1]
TINY = ["--model", "tiny", "--batch-size", "16", "--seq-len", "32", "--no-progress"]
STEP_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"}


def _run(tmp_path: Path, *flags: str) -> tuple[int, Path]:
    out = tmp_path / "run"
    code = main(["train", *TINY, "--out", str(out), *flags])
    return code, out


# Some strategies also run the precision / accumulation / compression flags, so that those paths
# are covered from the CLI without another compile.
EXTRA = {"zero2": ["--precision", "bf16"], "zero1": ["--precision", "fp16"],
         "dp": ["--grad-accum", "2", "--grad-compression", "int8"]}
# zero3, the default, is driven through the CLI by the resume test and through `train` below.
CLI_STRATEGIES = sorted(set(STRATEGIES) - {"zero3"})


@pytest.mark.parametrize("strategy", CLI_STRATEGIES)
def test_every_strategy_trains_and_writes_its_files(strategy, tmp_path, capsys):
    extra = EXTRA.get(strategy, [])
    code, out = _run(tmp_path, "--strategy", strategy, "--steps", "3", "--eval-every", "2",
                     "--sample-tokens", "0", *extra)
    assert code == 0
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert STEP_KEYS <= r.keys()
        assert math.isfinite(r["loss"]) and r["loss"] > 0 and r["step_time_s"] > 0
    assert [("val_loss" in r) for r in records] == [False, True, True]  # every 2 steps and at the end
    config = json.loads((out / "config.json").read_text())
    assert config["strategy"] == strategy and config["steps"] == 3
    assert config["precision"] == {"zero2": "bf16", "zero1": "fp16"}.get(strategy, "f32")
    assert (config["grad_accum"], config["grad_compression"]) == ((2, "int8") if strategy == "dp" else (1, "none"))
    if strategy == "zero1":
        assert all("loss_scale" in r for r in records)  # fp16: the dynamic loss scale is logged
    assert (out / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert list(out.glob("events.out.tfevents.*"))
    printed = capsys.readouterr().out
    assert f"strategy   {strategy}" in printed and "collective bytes / step / device" in printed


def test_training_lowers_the_loss_and_samples_text(tmp_path):
    config = TrainConfig(model="tiny", strategy="zero3", steps=24, batch_size=16, seq_len=32, lr=1e-2,
                         eval_every=8, sample_tokens=40, prompt="The ", out=str(tmp_path / "run"),
                         progress=False, verbose=False)
    result = train(config)
    losses = [r["loss"] for r in result.records]
    vals = [r["val_loss"] for r in result.records if "val_loss" in r]
    assert len(losses) == 24 and len(vals) == 3
    # Byte-level loss starts near ln(256) = 5.5 and falls by well over a nat in 24 steps.
    assert sum(losses[-4:]) / 4 < losses[0] - 1.0
    assert vals[-1] < vals[0] and result.final_val_loss == vals[-1]
    assert result.sample.startswith("The ") and len(result.sample) > len("The ")
    assert (tmp_path / "run" / "sample.txt").read_text().startswith("The ")
    assert result.state_bytes_per_device > 0 and result.collective_bytes_per_step > 0
    assert result.metrics_path == tmp_path / "run" / "metrics.jsonl"


def test_sampling_slides_its_window_past_the_context():
    # A "model" that always predicts the byte after the last one it sees, with certainty.
    def apply(params, tokens):
        return 1e4 * jax.nn.one_hot((tokens + 1) % 256, 256)

    text = sample_text(SimpleNamespace(apply=apply), {}, "ab", 10, context=4, seed=0)
    assert text == "abcdefghijkl"  # read at the last real byte while filling, then shifted by one


def test_flags_are_the_config_fields():
    import argparse
    import dataclasses

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert from_args(parser.parse_args([])) == TrainConfig(cpu_devices=DEFAULT_CPU_DEVICES)
    shown = parser.format_help()
    for field in dataclasses.fields(TrainConfig):
        flag = field.metadata.get("flag")
        if flag is not None:  # every flag is documented: no hidden (test-only) flags
            assert (flag.name or "--" + ("no-" if flag.negate else "") + field.name.replace("_", "-")) in shown
    assert "==SUPPRESS==" not in repr([a.help for a in parser._actions])
    config = from_args(parser.parse_args(["--no-progress", "--no-tensorboard", "--schedule", "gpipe", "--lr", "0.5",
                                          "--warmup-steps", "4"]))
    assert (config.progress, config.tensorboard, config.pipeline_schedule) == (False, False, "gpipe")
    assert (config.lr, config.warmup_steps) == (0.5, 4)


def test_loop_records_each_step_once_one_step_behind_and_validates_at_once():
    """Fake steps whose state counts updates: a record runs one step late, so the state it
    sees is one ahead, except at a validation (every 3 steps and the last); saves see every
    dispatched step; a stop records the step still held before the stop action saves."""
    seen, saved = [], []

    def step(k, state, batch):
        assert batch == k - 1  # step k's batch (0-based index) was loaded before it ran
        return SimpleNamespace(params=state.params + 1), {"loss": 1.0 / k, "grad_norm": 1.0, "skipped": 0.0}

    def note(k, state, record):
        seen.append((k, state.params, record.get("val_loss")))

    class Stop:
        def should_stop(self, k):
            return k == 5

        def __call__(self, k, state, metrics):
            seen.append(("stop", k, state.params))

    clock = StepClock()
    validation = Evaluate(lambda state: float(state.params), Every(3, last=6), clock)
    record = Recorder([validation, note], clock, tokens_per_step=1, at_once=validation.due)
    final = run_steps(SimpleNamespace(params=0), 0, 6, step, lambda i: i, record=record,
                      after_step=[lambda k, state, metrics: saved.append((k, state.params))], preemption=Stop())
    assert final.params == 5 and saved == [(k, k) for k in range(1, 6)]
    assert seen == [(1, 2, None), (2, 3, None), (3, 3, 3.0), (4, 5, None), (5, 5, None), ("stop", 5, 5)]


# One zero3 run, a checkpoint every 2 of its 4 steps: the resume test and the banner test read it
# (they differ only in what they check, so they share its compile).
ZERO3_RUN = ["--strategy", "zero3", "--steps", "4", "--eval-every", "0", "--sample-tokens", "0", "--seed", "3",
             "--ckpt-every", "2"]


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory) -> tuple[int, Path, str, list[dict]]:
    """(exit code, run directory, what it printed, its metrics as first written)."""
    out = tmp_path_factory.mktemp("zero3") / "run"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["train", *TINY, *ZERO3_RUN, "--out", str(out)])
    return code, out, printed.getvalue(), read_metrics(out / "metrics.jsonl")


def test_resume_replaces_the_lost_steps_and_continues_within_rounding(zero3_run):
    code, out, _, first = zero3_run
    assert code == 0
    assert [r["step"] for r in first] == [1, 2, 3, 4] and STEP_KEYS <= first[-1].keys() and "val_loss" in first[-1]
    assert (out / "config.json").exists() and (out / "loss_curve.png").exists() and list(out.glob("events.out.*"))
    shutil.rmtree(out / "checkpoints" / "4")  # as if the run had died between steps 2 and 4
    assert main(["train", *TINY, *ZERO3_RUN, "--resume-from", str(out)]) == 0  # same run dir
    resumed = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]  # steps 3-4 replaced, not duplicated
    assert resumed[:2] == first[:2]
    for a, b in zip(first[2:], resumed[2:]):
        # Same state, same batches: the same numbers up to reduction order across two compiles.
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a, b)
    assert (out / "checkpoints" / "4").is_dir()  # and it went on checkpointing there


BAD_FLAGS = [
    (["--strategy", "zero9"], "--strategy"),
    (["--mesh", "data=3"], "--mesh"),
    (["--mesh", "fsdp=4,tensor=4"], "--mesh"),
    (["--data", "/nonexistent/corpus.txt"], "--data"),
    (["--batch-size", "12"], "--batch-size"),  # zero3 over 8 devices needs a multiple of 8
    (["--seq-len", "65"], "--seq-len"),  # tiny's max_seq_len is 64
    (["--steps", "0"], "--steps"),
    (["--bogus"], "--bogus"),
    (["--cpu-devices", "4"], "--cpu-devices"),  # this process already runs 8 devices
    (["--strategy", "dp", "--weight-gather", "int8"], "--weight-gather"),  # dp gathers no weights
    (["--pipeline-stages", "3"], "--mesh"),  # 3 stages leave 8/3 devices
    (["--pipeline-stages", "2", "--grad-accum", "2"], "--grad-accum"),  # the refused option names its flag
    (["--schedule", "gpipe"], "--schedule"),  # no pipeline: the schedule would be ignored
    (["--microbatches", "4"], "--microbatches"),
    (["--strategy", "dp", "--grad-accum", "3"], "--batch-size"),  # 2 rows per device cannot make 3 microbatches
]


@pytest.mark.parametrize("flags, named", BAD_FLAGS, ids=[f[1] + ":" + " ".join(f[0]) for f in BAD_FLAGS])
def test_bad_flags_give_one_line(flags, named, tmp_path, capsys):
    code = main(["train", *TINY, "--steps", "2", "--out", str(tmp_path / "run"), *flags])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("shardlib train: error: ") and named in err[0], err[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_banner_names_data_and_checkpoints_and_a_finished_rerun_prints_no_nan(zero3_run, tmp_path, capsys):
    code, run, printed, _ = zero3_run
    assert code == 0
    assert "compute f32) for 4 steps\n" in printed
    assert "data       built-in pydoc corpus" in printed and " validation bytes (" in printed
    assert f"checkpoint {run.absolute() / 'checkpoints'}, every 2 steps and at the end, keep 3" in printed
    out = tmp_path / "run"  # a copy of the finished run (the resume test changes the shared one)
    shutil.copytree(run, out)
    capsys.readouterr()
    assert main(["train", *TINY, *ZERO3_RUN, "--out", str(out)]) == 0  # the same command again: nothing left to run
    printed = capsys.readouterr().out
    assert "nan" not in printed, printed
    assert "n/a (no steps run: resumed at step 4 of 4; raise --steps to train on)" in printed
    assert "final train loss                   n/a (no steps run)" in printed


def test_checkpoint_setting_and_resume_hint_follow_the_flags():
    out = Path("runs/20250101-000000")
    assert checkpoint_setting(TrainConfig(), out) == \
        f"{out.absolute() / 'checkpoints'}, at the end (--ckpt-every N: also every N steps), keep 3"
    assert checkpoint_setting(TrainConfig(ckpt_every=0), out).startswith("off (--ckpt-every 0; without it a run saves")
    assert checkpoint_setting(TrainConfig(ckpt_every=50, keep=2), out) == \
        f"{out.absolute() / 'checkpoints'}, every 50 steps and at the end, keep 2"
    assert resume_hint(TrainConfig(), out) == f"to resume, run the same command with --out {out}"
    assert resume_hint(TrainConfig(out=str(out)), out) == "run the same command again to resume"


def test_missing_data_path_is_worded_for_the_flag(tmp_path, capsys):
    assert main(["train", *TINY, "--data", str(tmp_path / "corpus.txt")]) == 2
    err = capsys.readouterr().err
    assert "give --data PATH a text file" in err and "leave --data out for the built-in corpus" in err, err
    assert "or None" not in err


def test_ctrl_c_without_checkpoints_says_nothing_was_saved(monkeypatch, capsys):
    def interrupted(config, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("shardlib.run.train.train", interrupted)
    assert main(["train", *TINY, "--ckpt-every", "0"]) == 130
    err = capsys.readouterr().err
    assert "interrupted; nothing saved (checkpointing is off, --ckpt-every 0: without it" in err, err


def _subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).strip(os.pathsep)
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = compile_flags.FAST  # the CLI must set up its own devices and collective timeout
    return env


def _fresh_cli(*flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "shardlib.cli", "train", *flags]
    return subprocess.run(cmd, env=_subprocess_env(), capture_output=True, text=True, timeout=300)


def test_fresh_process_simulates_the_requested_devices():
    # dp over 4 simulated devices: a batch of 6 rows cannot be split, and the one-line error
    # says how many devices the new process has (no compile needed to find out).
    proc = _fresh_cli("--cpu-devices", "4", "--strategy", "dp", "--model", "tiny",
                      "--batch-size", "6", "--seq-len", "32")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--batch-size" in lines[0] and "4 data-parallel devices" in lines[0], proc.stderr


def test_fresh_process_bad_data_path_has_no_traceback(tmp_path):
    proc = _fresh_cli("--data", str(tmp_path / "missing.txt"))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--data" in lines[0] and "Traceback" not in proc.stderr, proc.stderr
