"""Fault tolerance of `shardlib train` end to end: preemption, SIGKILL, exactly-once data,
resuming onto another layout, and stopping on non-finite steps.

Processes that must die (SIGTERM, SIGKILL) are real subprocesses of the CLI, given the same
XLA flags as this test process (conftest's), so their numbers are bit-comparable with runs
made here in-process. Everything else goes through `shardlib.cli.main` in-process, or through
the library for the restore matrix (one CLI-level case covers the flag path).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from shardlib import build, make_layout, make_mesh
from shardlib.runtime.checkpoint import Checkpointer
from shardlib.runtime.checkpoint_contents import is_finite_state
from shardlib.cli import main
from shardlib.runtime.data import VOCAB_SIZE, ByteBatches, load_text, split_train_val
from shardlib.run.examples import read_examples
from shardlib.run.metrics_io import read_metrics
from shardlib.exits import EXIT_DIVERGED
from tests.helpers import batches, host_copy, optimizer, tiny_model

REPO = Path(__file__).resolve().parents[1]
TINY = ["--model", "tiny", "--batch-size", "16", "--seq-len", "32", "--no-progress", "--no-tensorboard",
        "--eval-every", "0", "--sample-tokens", "0"]
# The run that the SIGKILL test interrupts, and its uninterrupted reference (zero3 on 8 devices).
# 20 steps (was 30): the kill still lands mid-run with 5 steps to the next save on either side,
# and the cross-layout resume below still takes 10 steps after checkpoint KILL_AFTER.
STEPS, CKPT_EVERY = 20, 5
KILLED_RUN = [*TINY, "--steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY), "--record-examples"]
KILL_AFTER = 10  # SIGKILL once metrics.jsonl shows this step: the restart resumes from 5 or 10


def _env() -> dict[str, str]:
    """This process's XLA flags (8 devices, collective timeout, optimisation level) for a child."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).strip(os.pathsep)
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _spawn(out: Path, *flags: str) -> subprocess.Popen:
    log = open(out.parent / f"{out.name}.log", "w")
    cmd = [sys.executable, "-m", "shardlib.cli", "train", *flags, "--out", str(out)]
    return subprocess.Popen(cmd, env=_env(), stdout=log, stderr=subprocess.STDOUT, text=True)


def _steps_written(out: Path) -> int:
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    complete = [json.loads(line) for line in lines if line.endswith("}")]
    return complete[-1]["step"] if complete else 0


def _wait_for_step(proc: subprocess.Popen, out: Path, step: int, timeout: float = 240.0) -> int:
    """Poll metrics.jsonl until it records ``step``; the child must still be running then."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = _steps_written(out)
        if seen >= step:
            return seen
        if proc.poll() is not None:
            break
        time.sleep(0.005)
    proc.kill()
    log = (out.parent / f"{out.name}.log").read_text()[-3000:]
    pytest.fail(f"run never reached step {step} (exit {proc.poll()}), output:\n{log}")


def _resumed_from(printed: str) -> int:
    lines = [line for line in printed.splitlines() if line.startswith("resumed    step ")]
    assert len(lines) == 1, printed[-2000:]
    return int(lines[0].split()[2])


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> tuple[Path, list]:
    """The uninterrupted run (in-process), and (step, steps in examples.jsonl) at each of its saves."""
    from shardlib.run.checkpointing import SaveCheckpoint

    out, seen = tmp_path_factory.mktemp("reference") / "run", []
    save = SaveCheckpoint.save

    def spy(self, step, state, metrics):
        seen.append((step, [r["step"] for r in read_examples(out / "examples.jsonl")]))
        save(self, step, state, metrics)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SaveCheckpoint, "save", spy)
        assert main(["train", *KILLED_RUN, "--out", str(out)]) == 0
    return out, seen


@pytest.fixture(scope="module")
def reference(reference_run) -> Path:
    return reference_run[0]


# ---------------------------------------------------------------- preemption (SIGTERM) and Ctrl-C (SIGINT)


STOP_RUN = [*TINY, "--steps", "1000", "--ckpt-every", "1000"]


def _stop(proc: subprocess.Popen, out: Path, sig: signal.Signals, after: int, heading: str) -> tuple[str, int]:
    """Send ``sig`` once metrics.jsonl shows step ``after``; the run must finish that step, save it
    (off the --ckpt-every schedule) and exit 0 with one line, no end-of-run report. (its output, the step)"""
    _wait_for_step(proc, out, after)
    proc.send_signal(sig)
    assert proc.wait(timeout=120) == 0
    printed = (out.parent / f"{out.name}.log").read_text()
    reached = _steps_written(out)
    stop = [line for line in printed.splitlines() if line.startswith(heading)]
    assert len(stop) == 1 and f"stopped after step {reached};" in stop[0] and f"checkpoint step {reached} " in stop[0]
    assert stop[0].endswith("; run the same command again to resume"), stop[0]
    assert "summary" not in printed  # one line, no end-of-run report
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(1, reached + 1))
    return printed, reached


def test_sigterm_and_ctrl_c_finish_the_step_save_and_exit_0_and_the_same_command_resumes(tmp_path) -> None:
    """A scheduler's SIGTERM, then Ctrl-C (SIGINT) in the run that the same command restarts.

    One chain instead of a run per signal plus an in-process restart (one compile of the run
    fewer): the restart is the second signal's run, so each signal still stops a run of its own
    process, and the resume is checked as before (from the step the first stop saved)."""
    out = tmp_path / "run"
    _, first = _stop(_spawn(out, *STOP_RUN), out, signal.SIGTERM, 3, "preempted  SIGTERM received")
    with Checkpointer(out / "checkpoints") as ckpt:
        assert ckpt.all_steps() == [first]  # off the --ckpt-every schedule: saved because of the signal
    # The same command again continues from it (no --resume-from needed), for 2 steps or more.
    restarted = _spawn(out, *STOP_RUN)  # Ctrl-C in a terminal: the same stop as a scheduler's SIGTERM
    printed, second = _stop(restarted, out, signal.SIGINT, first + 2, "stopped    Ctrl-C (SIGINT) received")
    assert _resumed_from(printed) == first
    with Checkpointer(out / "checkpoints") as ckpt:
        assert ckpt.all_steps() == [first, second]  # the second signal's step saved beside the first's


# ---------------------------------------------------------------- SIGKILL: bitwise resume, exactly-once data


def test_a_step_is_saved_only_after_its_windows_are_written(reference_run) -> None:
    """A multi-process save of step k commits once every process reaches it. Each process must
    have written step k's windows by then: otherwise a process killed just after its peers'
    commit resumes from k without them (what tests/test_elastic.py once caught, now and then).
    Seen at each save of the reference run (a spy on `SaveCheckpoint.save` there)."""
    _, seen = reference_run
    assert seen == [(k, list(range(1, k + 1))) for k in range(CKPT_EVERY, STEPS + 1, CKPT_EVERY)]


def test_sigkill_restart_matches_the_uninterrupted_run_bitwise(reference, tmp_path, capsys) -> None:
    out = tmp_path / "run"
    proc = _spawn(out, *KILLED_RUN)
    _wait_for_step(proc, out, KILL_AFTER)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL  # it died, it did not finish
    before = read_examples(out / "examples.jsonl")

    capsys.readouterr()
    assert main(["train", *KILLED_RUN, "--out", str(out)]) == 0  # the same command again
    resumed = _resumed_from(capsys.readouterr().out)
    assert resumed in (KILL_AFTER - CKPT_EVERY, KILL_AFTER), resumed  # the latest *complete* checkpoint

    expected, got = read_metrics(reference / "metrics.jsonl"), read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))  # each step once: redone steps replaced
    # float32, same mesh, same compiled program: equal bit for bit, before and after the restart.
    assert [r["loss"] for r in got] == [r["loss"] for r in expected]
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in expected]

    # Exactly once: the restarted run read the same windows, in the same order, for every step.
    reference_examples = read_examples(reference / "examples.jsonl")
    assert read_examples(out / "examples.jsonl") == reference_examples
    # ...and the steps the killed process read (some redone after the restart) were those too.
    assert len(before) >= KILL_AFTER
    assert before == reference_examples[: len(before)]
    # The recorded offsets are the windows the batches hold (rows of step 1, 0-based batch 0).
    train_bytes, _ = split_train_val(load_text(None))
    first = ByteBatches(train_bytes, 16, 32, seed=0, process_index=0, process_count=1).batch(0)["inputs"]
    starts = reference_examples[0]["starts"]
    assert len(starts) == 16
    np.testing.assert_array_equal(first, np.stack([train_bytes[s: s + 32] for s in starts]))


# ---------------------------------------------------------------- resume onto another layout


LAYOUTS = [(strategy, n) for strategy in ("dp", "zero1", "zero3", "fsdp_tp") for n in (8, 4, 1)]
SOURCE = ("zero3", 8)


def _layout_program(model, strategy: str, n: int):
    sizes = {"dp": {"data": -1}, "zero1": {"data": -1}, "zero3": {"fsdp": -1}, "fsdp_tp": {"fsdp": -1, "tensor": 2}}
    mesh = make_mesh(sizes[strategy] if n > 1 else {}, devices=jax.devices()[:n])
    return build(model, optimizer(), make_layout(model, strategy, mesh))



@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """zero3 on 8 devices: 2 steps, checkpoint, then the uninterrupted 3rd step's loss."""
    model = tiny_model()
    program = _layout_program(model, *SOURCE)
    data = batches(3)
    state = program.init(jax.random.key(0))
    for batch in data[:2]:
        state, _ = program.step(state, batch)
    directory = tmp_path_factory.mktemp("matrix") / "checkpoints"
    with Checkpointer(directory) as ckpt:
        assert ckpt.save(2, state, data_state={"step": 2, "seed": 0}, config={"model": "tiny"}, force=True)
        ckpt.wait()
    host = host_copy(state)
    _, metrics = program.step(state, data[2])  # its loss is computed before the update
    return model, directory, host, float(metrics["loss"]), data[2]


@pytest.mark.parametrize("target", [t for t in LAYOUTS if t != SOURCE], ids=lambda t: f"{t[0]}x{t[1]}")
def test_restore_matrix(saved, target) -> None:
    model, directory, host, next_loss, next_batch = saved
    program = _layout_program(model, *target)
    with Checkpointer(directory) as ckpt:
        state, data_state, _ = ckpt.restore(program.abstract_state())
    assert data_state == {"step": 2, "seed": 0}
    restored = host_copy(state)
    for (path, want), got in zip(jax.tree_util.tree_flatten_with_path(host)[0], jax.tree.leaves(restored)):
        assert np.array_equal(want, got), jax.tree_util.keystr(path)  # params, Adam mu/nu/count, step
    for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(program.state_sharding)):
        assert leaf.sharding == sharding
    # The loss the next step would report (evaluation compiles only the forward pass, which
    # keeps 11 layouts affordable; the CLI case below takes real steps after a cross-layout
    # restore). Another layout sums in another order: equal up to float32 reduction noise.
    loss = float(program.evaluate(state.params, next_batch)["loss"])
    assert abs(loss - next_loss) < 1e-5, (loss, next_loss)


def test_cli_resume_from_under_another_strategy_and_mesh(reference, tmp_path, capsys) -> None:
    source = tmp_path / "source"
    shutil.copytree(reference / "checkpoints" / str(KILL_AFTER), source / "checkpoints" / str(KILL_AFTER))
    out = tmp_path / "run"
    capsys.readouterr()
    flags = [*KILLED_RUN, "--strategy", "fsdp_tp", "--mesh", "fsdp=4,tensor=2"]
    assert main(["train", *flags, "--resume-from", str(source), "--out", str(out)]) == 0
    assert _resumed_from(capsys.readouterr().out) == KILL_AFTER
    expected = {r["step"]: r["loss"] for r in read_metrics(reference / "metrics.jsonl")}
    got = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(KILL_AFTER + 1, STEPS + 1))
    assert abs(got[0]["loss"] - expected[KILL_AFTER + 1]) < 1e-5, (got[0], expected[KILL_AFTER + 1])
    assert read_examples(out / "examples.jsonl") == read_examples(reference / "examples.jsonl")[KILL_AFTER:]


# ---------------------------------------------------------------- non-finite steps


def _unreadable_batches_at(monkeypatch, steps: set[int]) -> None:
    """The loader's batches for the 1-based ``steps`` hold a token outside the byte vocabulary, as
    corrupt data would: the model's embedding lookup (``jnp.take``, fill mode) reads NaN there, so
    the step's loss and gradients are NaN. Patched in this process; the run is `main` in-process."""
    batch = ByteBatches.batch

    def corrupt(self, index: int):
        rows = batch(self, index)
        return {**rows, "inputs": np.full_like(rows["inputs"], VOCAB_SIZE)} if index + 1 in steps else rows

    monkeypatch.setattr(ByteBatches, "batch", corrupt)


def test_consecutive_non_finite_steps_stop_the_run_and_keep_the_good_checkpoint(tmp_path, capsys, monkeypatch) -> None:
    out = tmp_path / "run"
    _unreadable_batches_at(monkeypatch, {2, 5, 6, 7})
    code = main(["train", *TINY, "--steps", "10", "--ckpt-every", "2", "--max-skips", "3", "--out", str(out)])
    assert code == EXIT_DIVERGED
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "stopped after step 7" in err[0] and "--max-skips 3" in err[0] and "last good checkpoint is step 4" in err[0]
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 8))
    assert [r["skipped"] for r in records] == [0, 1, 0, 0, 1, 1, 1]  # one isolated skip does not stop it
    assert records[1]["loss"] is None and records[2]["loss"] is not None  # NaN is written as null
    with Checkpointer(out / "checkpoints") as ckpt:
        assert ckpt.all_steps() == [4]  # steps 2 and 6 were skipped, so never saved; 8 never ran
        abstract = _layout_program(tiny_model(), "zero3", 8).abstract_state()
        saved = ckpt.restore_subtree({"params": abstract.params, "step": abstract.step})
    assert is_finite_state(saved["params"]) and int(saved["step"]) == 3  # 4 loop steps, 1 skipped update
