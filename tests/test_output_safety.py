"""Nothing deleted that shardlib did not write, nothing written through a link (issue 42 §1, §2, §3, §5, §7).

Each refusal is checked in-process through the CLI's ``main`` with the work that would follow it
(the checkpoint restore, the run's setup) replaced by a function that fails the test: the refusal
must come first. "Unchanged" compares every path and byte below a directory before and after.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from shardlib.cli import main
from shardlib.hf.save import MARKER, ExportError, save_pretrained
from shardlib.models import CONFIGS, trainable
from shardlib.run.config import TrainConfig
from shardlib.run.metrics_io import plot_loss_curve
from shardlib.run.directory import claim_run_directory
from shardlib.runtime.files import LinkedOutputError, write_atomic
from shardlib.tools import export

TINY = CONFIGS["tiny"]


@pytest.fixture(scope="module")
def params():
    """The tiny decoder's parameters, as host arrays (no compile): what an export writes."""
    return jax.tree.map(lambda s: np.full(s.shape, 0.01, s.dtype), trainable(TINY).abstract())


def _tree(directory: Path) -> dict[str, bytes | str | None]:
    """Every path below ``directory`` with its bytes (a link: its target; a directory: None)."""
    def content(p: Path):
        return f"-> {os.readlink(p)}" if p.is_symlink() else None if p.is_dir() else p.read_bytes()

    return {str(p.relative_to(directory)): content(p) for p in sorted(directory.rglob("*"))}


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def no_restore(monkeypatch):
    """The checkpoint restore fails the test: a refusal must come before it."""
    def restore(*args, **kwargs):
        raise AssertionError("the checkpoint was restored before the refusal")

    monkeypatch.setattr(export, "_restore_parts", restore)


# ---------------------------------------------------------------- §1 an export replaces only an export


def _run_dir(d: Path) -> None:
    (d / "checkpoints" / "2").mkdir(parents=True)
    (d / "checkpoints" / "2" / "state").write_bytes(b"weights")
    (d / "config.json").write_text('{"model": "tiny"}')
    (d / "metrics.jsonl").write_text('{"step": 1}\n')


def _hub_model(d: Path) -> None:
    d.mkdir()
    for name in ("config.json", "generation_config.json", "chat_template.jinja", "tokenizer.model", "model.safetensors"):
        (d / name).write_text(name)


def _notes(d: Path) -> None:
    (d / "sub").mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "notes.txt").write_text("mine")
    (d / "sub" / "more.txt").write_text("mine too")


def _lock_only(d: Path) -> None:
    d.mkdir()
    (d / ".lock").write_text("")
    (d / "config.json").write_text("{}")


def _forged_marker(d: Path) -> None:  # a marker naming a path outside the directory is no marker
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / MARKER).write_text(json.dumps({"format": "shardlib.hf.save/1", "files": ["config.json", "../x"]}))


def _a_file(d: Path) -> None:
    d.write_text("a file")


REFUSED = {
    "run directory": (_run_dir, "a training run's directory .*checkpoints, metrics.jsonl"),
    "live run's lock": (_lock_only, r"a training run's directory \(it holds .lock\)"),
    "Hub model": (_hub_model, "not a shardlib export .*generation_config.json.*no .shardlib-export.json"),
    "notes and sub/": (_notes, "not a shardlib export .*notes.txt, sub"),
    "forged marker": (_forged_marker, "not a shardlib export"),
    "a file": (_a_file, "is a file"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_an_hf_export_refuses_a_directory_it_did_not_write_and_leaves_it_whole(params, tmp_path, case):
    make, message = REFUSED[case]
    out = tmp_path / "out"
    make(out)
    before = _tree(tmp_path)
    with pytest.raises(ExportError, match=message) as err:
        save_pretrained(params, TINY, out)
    assert "\n" not in str(err.value) and str(out) in str(err.value)
    assert _tree(tmp_path) == before


def test_an_earlier_export_is_replaced_and_a_file_added_to_it_is_refused(params, tmp_path):
    out = tmp_path / "exp"
    save_pretrained(params, TINY, out, dtype="f32")
    assert json.loads((out / MARKER).read_text())["files"] == ["config.json", "model.safetensors"]
    first = (out / "model.safetensors").read_bytes()
    doubled = jax.tree.map(lambda x: x * 2, params)
    save_pretrained(doubled, TINY, out, dtype="f32")  # an earlier export: replaced
    assert (out / "model.safetensors").read_bytes() != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp"]  # nothing set aside is left
    (out / "generation_config.json").write_text("{}")  # the user's file beside it
    before = _tree(tmp_path)
    with pytest.raises(ExportError, match="holds generation_config.json, which no earlier export wrote"):
        save_pretrained(params, TINY, out)
    assert _tree(tmp_path) == before


CLI_REFUSALS = {  # (ckpt, out) below a run directory "run": the command, and the ckpt directory inside
    "out is the run": ("run", "run", "is, or holds, the checkpoint being exported"),
    "out holds the ckpt": ("run/checkpoints", "run", "holds, the checkpoint being exported"),
    "out is the ckpt": ("run/checkpoints", "run/checkpoints", "is, or holds, the checkpoint being exported"),
}


@pytest.mark.parametrize("kind", ["--hf", "--peft"])
@pytest.mark.parametrize("case", list(CLI_REFUSALS))
def test_export_hf_onto_a_run_is_refused_before_anything_is_restored(no_restore, tmp_path, capsys, case, kind):
    ckpt, out, message = CLI_REFUSALS[case]
    _run_dir(tmp_path / "run")
    before = _tree(tmp_path)
    assert main(["export", "--ckpt", str(tmp_path / ckpt), kind, "--out", str(tmp_path / out)]) == 2
    assert message in _one_error_line(capsys)
    assert _tree(tmp_path) == before


def test_a_peft_export_refuses_an_adapter_it_did_not_write(no_restore, tmp_path, capsys):
    """A downloaded adapter holds adapter_config.json too: without the export's marker it is not ours."""
    _run_dir(tmp_path / "run")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "README.md").write_text("the adapter's card")
    before = _tree(tmp_path)
    assert main(["export", "--ckpt", str(tmp_path / "run"), "--peft", "--out", str(adapter)]) == 2
    assert "not a shardlib export" in _one_error_line(capsys)
    assert _tree(tmp_path) == before


# ---------------------------------------------------------------- §2 no output through a link


@pytest.mark.parametrize("flags", [["--out", "link.npz"], ["--out", "link.safetensors"], ["--out", "linkdir", "--hf"]])
def test_export_to_a_link_is_refused_before_anything_is_restored(no_restore, tmp_path, capsys, flags):
    victim = tmp_path / "victim"
    if "--hf" in flags:
        victim.mkdir()
    else:
        victim.write_text("precious")
    (tmp_path / flags[1]).symlink_to(victim)
    before = _tree(tmp_path)
    out = [str(tmp_path / f) if i == 1 else f for i, f in enumerate(flags)]
    assert main(["export", "--ckpt", str(tmp_path / "run"), *out]) == 2
    assert f"{tmp_path / flags[1]} is a symbolic link (to {victim})" in _one_error_line(capsys)
    assert _tree(tmp_path) == before


def test_the_atomic_write_helper_never_writes_through_a_link(tmp_path):
    victim = tmp_path / "victim.png"
    victim.write_bytes(b"precious")
    (tmp_path / "loss_curve.png").symlink_to(victim)
    with pytest.raises(LinkedOutputError, match="loss_curve.png is a symbolic link"):
        plot_loss_curve([{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.0}], tmp_path / "loss_curve.png")
    with pytest.raises(LinkedOutputError):
        write_atomic(tmp_path / "loss_curve.png", b"x")
    assert victim.read_bytes() == b"precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loss_curve.png", "victim.png"]  # no partial left
    write_atomic(tmp_path / "new.txt", "whole")
    assert (tmp_path / "new.txt").read_text() == "whole"


@pytest.fixture
def no_setup(monkeypatch):
    """The run's setup (model, data, compile) fails the test: a refusal must come before it."""
    import shardlib.run.setup as setup

    def prepare(*args, **kwargs):
        raise AssertionError("the run was set up (and would compile) before the refusal")

    monkeypatch.setattr(setup, "prepare", prepare)


TRAIN = ["train", "--model", "tiny", "--steps", "2", "--no-progress", "--sample-tokens", "0"]


@pytest.mark.parametrize("name", ["loss_curve.png", "checkpoints", "config.json", "sample.txt", "examples.jsonl"])
def test_train_refuses_a_link_planted_where_an_output_goes(no_setup, tmp_path, capsys, name):
    out, victim = tmp_path / "run", tmp_path / "victim"
    out.mkdir()
    if name == "checkpoints":
        victim.mkdir()
        (victim / "7").mkdir()
    else:
        victim.write_text("precious")
    (out / name).symlink_to(victim)
    before = _tree(tmp_path)
    assert main([*TRAIN, "--out", str(out)]) == 2
    assert f"{out / name} is a symbolic link (to {victim})" in _one_error_line(capsys)
    assert _tree(tmp_path) == {**before, "run/.lock": b""}  # the lock, taken first and released empty


def test_train_out_that_is_a_link_is_refused_and_its_target_untouched(no_setup, tmp_path, capsys):
    victim = tmp_path / "elsewhere"
    victim.mkdir()
    (tmp_path / "run").symlink_to(victim)
    assert main([*TRAIN, "--out", str(tmp_path / "run")]) == 2
    assert f"{tmp_path / 'run'} is a symbolic link (to {victim})" in _one_error_line(capsys)
    assert list(victim.iterdir()) == []


# ---------------------------------------------------------------- §3 --out over the model it starts from


@pytest.mark.parametrize("where", ["the model", "above the model", "the tokenizer's"])
def test_train_out_over_its_init_from_or_tokenizer_is_refused(tmp_path, capsys, where):
    model = tmp_path / "models" / "llama"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (model / "tokenizer.json").write_text("{}")
    before = _tree(tmp_path)
    out = {"the model": model, "above the model": model.parent, "the tokenizer's": model}[where]
    flag = ["--tokenizer", str(model / "tokenizer.json")] if where == "the tokenizer's" else ["--init-from", str(model)]
    assert main(["train", *flag, "--data", str(tmp_path / "c.txt"), "--out", str(out)]) == 2
    line = _one_error_line(capsys)
    assert f"--out: {out} is, or holds, the {flag[0]} directory {model}" in line, line
    assert _tree(tmp_path) == before


# ---------------------------------------------------------------- §5 a killed export's staging directory


def test_a_killed_hf_exports_staging_directory_is_removed_by_the_next_export(params, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".exp.{dead.pid}.0badc0de.partial"  # what SIGKILL during an export leaves
    running = tmp_path / f".exp.{os.getppid()}.0badc0de.partial"  # an export still going
    foreign = tmp_path / f".exp.{dead.pid}.feedf00d.partial"  # named like one, holding what no export writes
    for staging in (stale, running, foreign):
        staging.mkdir()
        (staging / "model-00001-of-00002.safetensors").write_bytes(b"half")
    (foreign / "notes.txt").write_text("mine")
    save_pretrained(params, TINY, tmp_path / "exp")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["exp", running.name, foreign.name])


# ---------------------------------------------------------------- §7 the lock before anything reads --out


def test_a_second_run_on_a_live_out_is_told_the_run_is_live(no_setup, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')  # the live run's history, no checkpoint yet
    with claim_run_directory(TrainConfig(out=str(out)), out, main=True):
        assert main([*TRAIN, "--out", str(out)]) == 2
    line = _one_error_line(capsys)
    assert f"is in use by another run (pid {os.getpid()} on host" in line and "--fresh" not in line, line
