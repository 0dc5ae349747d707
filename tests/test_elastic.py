"""Issue 16, parts 1 and 2b: elastic restarts (`shardlib launch --elastic`) and straggler detection.

The end-to-end proof is one elastic job and its reference, run side by side (module fixture):

- elastic: ``launch --elastic --min-processes 1 -n 2 -d 4 -- train`` (zero3, tiny GPT, 16 steps,
  a checkpoint every 2, examples recorded, stragglers compared every 3 steps against a factor
  of 1.2, and process 1 made slow by tests/slow_loader_train.py, whose loader sleeps 0.8 s before
  each of process 1's batches; that also keeps the run slow enough to be killed mid-run). Once ``metrics.jsonl`` shows step 7 the test SIGKILLs
  process 1; the launcher must restart the job on 1 process x 4 devices from the last
  complete checkpoint and finish it.
- reference: the same train command as 1 process x 8 devices, uninterrupted and saving nothing
  (``--ckpt-every 0``), made in the test process (conftest's 8 devices and XLA flags, which the job
  gets too) while the job restarts.

Fast unit tests cover the launcher's restart decision and the straggler arithmetic without JAX
in subprocesses.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from shardlib.cli import main
from shardlib.run.config import TrainConfig, TrainConfigError, check_numbers
from shardlib.run.examples import read_examples
from shardlib.run.metrics_io import MetricsLog, read_metrics
from shardlib.run.stragglers import own_step_times, stragglers
from shardlib.runtime import elastic
from shardlib.runtime.launch import LaunchError, launch

ROOT = Path(__file__).resolve().parent.parent
STEPS = 16
KILL_AFTER = 7  # SIGKILL process 1 once metrics.jsonl records this step
SLOW_S = 0.8  # process 1's loader sleeps this long before each batch (tests/slow_loader_train.py)
TRAIN = ["--model", "tiny", "--strategy", "zero3", "--steps", str(STEPS), "--batch-size", "16", "--seq-len", "32",
         "--no-progress", "--no-tensorboard", "--sample-tokens", "0", "--eval-every", "0", "--ckpt-every", "2",
         "--record-examples", "--straggler-every", "3", "--straggler-factor", "1.2"]
TIMEOUT_S = 300


# --------------------------------------------------------------------------------------------
# The launcher's decision (no subprocesses)
# --------------------------------------------------------------------------------------------


def test_restart_on_the_processes_left():
    decision = elastic.decide(4, [2], exit_code=137, min_processes=2, max_restarts=3, restarts=0)
    assert (decision.restart, decision.processes) == (True, 3)
    assert "restart 1 of 3" in decision.reason


def test_no_restart_below_min_processes_or_after_max_restarts():
    below = elastic.decide(2, [0, 1], exit_code=137, min_processes=1, max_restarts=3, restarts=0)
    assert not below.restart and "0 process(es) left, fewer than --min-processes 1" in below.reason
    spent = elastic.decide(4, [1], exit_code=137, min_processes=1, max_restarts=2, restarts=2)
    assert not spent.restart and "--max-restarts 2 reached" in spent.reason


def test_no_restart_for_a_failure_that_would_repeat():
    usage = elastic.decide(2, [0], exit_code=2, min_processes=1, max_restarts=3, restarts=0)
    assert not usage.restart and "command-line or configuration error" in usage.reason


def test_a_survivor_stopped_by_the_heartbeat_is_not_the_dead_one():
    # Process 0 exits first (aborted by the heartbeat), naming process 2, which hung.
    tails = {0: ["E0 coordination: The following tasks are unhealthy (stopped sending heartbeats):\n", "2\n", "x\n"],
             1: ["step 3\n"], 2: []}
    assert elastic.dead_processes(0, tails) == [2]
    assert elastic.dead_processes(1, {0: ["ok\n"], 1: ["Traceback\n"]}) == [1]  # nobody names a peer: the first failure


def test_elastic_needs_a_run_directory_and_the_flags_need_elastic(tmp_path):
    assert elastic.run_directory(["shardlib", "train", "--out", "runs/a", "--ckpt-every", "5"]) == Path("runs/a")
    assert elastic.run_directory(["python", "-m", "shardlib.cli", "train", "--out=runs/b", "--ckpt-every=5"]) == Path("runs/b")
    assert elastic.run_directory(["python", "my_loop.py", "--out", "runs/c"]) == Path("runs/c")  # checkpoints itself
    with pytest.raises(LaunchError, match="--out DIR"):
        launch(["true"], 2, elastic=elastic.Elastic())
    for missing in ([], ["--ckpt-every", "0"]):  # a restart would retrain from step 0
        with pytest.raises(LaunchError, match="--ckpt-every N"):
            launch(["shardlib", "train", "--out", str(tmp_path), *missing], 2, elastic=elastic.Elastic())
    assert main(["launch", "-n", "2", "--max-restarts", "1", "--", "true"]) == 2  # refused, one line


def test_last_complete_checkpoint_and_examples_cut_back(tmp_path):
    ckpts = tmp_path / "checkpoints"
    for name in ("2", "4", "6.orbax-checkpoint-tmp-123"):
        (ckpts / name / "digests").mkdir(parents=True)
        (ckpts / name / "commit_success.txt").write_text("")
        (ckpts / name / "digests" / "metadata").write_text("{}")
    (ckpts / "8").mkdir()  # an empty step directory is not a checkpoint either
    assert elastic.latest_checkpoint(tmp_path) == 4  # the save in flight is not a checkpoint
    assert elastic.latest_checkpoint(tmp_path / "none") is None
    log = tmp_path / "examples.process1.jsonl"
    log.write_text("".join(json.dumps({"step": s, "starts": [s]}) + "\n" for s in range(1, 7)))
    elastic.trim_examples(tmp_path, 4)
    assert [r["step"] for r in read_examples(log)] == [1, 2, 3, 4]


def test_metrics_log_keeps_restart_events_up_to_the_resume_step(tmp_path):
    lines = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.9}, {"event": "restart", "step": 2, "dead": [1]},
             {"step": 3, "loss": 2.8}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    MetricsLog(tmp_path, tensorboard=False, resume_step=2).close()
    assert read_metrics(tmp_path / "metrics.jsonl") == lines[:3]
    assert elastic.last_logged_step(tmp_path) == 2


# --------------------------------------------------------------------------------------------
# Straggler arithmetic (no subprocesses)
# --------------------------------------------------------------------------------------------


def test_own_step_time_charges_the_wait_to_the_process_waited_for():
    # Both laps 0.30 s; process 0 waited 0.25 s for process 1, which waited 0.05 s.
    own = own_step_times([0.30, 0.30], [0.25, 0.05])
    np.testing.assert_allclose(own, [0.10, 0.30])
    assert stragglers(own, 1.5) == [(1, pytest.approx(0.30), pytest.approx(0.10))]
    assert stragglers(own_step_times([0.3] * 4, [0.1, 0.11, 0.1, 0.09]), 1.5) == []  # noise is not a straggler


def test_straggler_flags_are_checked_before_the_run_starts():
    with pytest.raises(TrainConfigError, match="--straggler-factor: must be above 1"):
        check_numbers(TrainConfig(straggler_factor=1.0))
    with pytest.raises(TrainConfigError, match="--straggler-every: must be non-negative"):
        check_numbers(TrainConfig(straggler_every=-1))


# --------------------------------------------------------------------------------------------
# End to end: 2 x 4 with process 1 killed mid-run, against 1 x 8 uninterrupted
# --------------------------------------------------------------------------------------------


def _env(**extra: str) -> dict[str, str]:
    """This process's XLA flags (conftest's, with ``--xla_backend_optimization_level=0``: halves
    compile time), so that the job computes as the reference made here does."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDLIB_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["JAX_PLATFORMS"] = "cpu"
    return {**env, **extra}


def _train_with_slow_process_1(out: Path) -> list[str]:
    return [sys.executable, str(ROOT / "tests" / "slow_loader_train.py"), "1", str(SLOW_S), "train", *TRAIN,
            "--out", str(out)]


def _logged_step(out: Path) -> int:
    steps = [r.get("step", 0) for r in map(elastic._record, _lines(out / "metrics.jsonl")) if "loss" in r]
    return max(steps, default=0)


def _lines(path: Path) -> list[str]:
    try:
        return [line for line in path.read_text().splitlines() if line.endswith("}")]
    except FileNotFoundError:
        return []


def _kill_process_1(proc: subprocess.Popen, stderr: list[str], out: Path) -> None:
    """SIGKILL process 1 (its pid from the launcher's 'started' line) once step KILL_AFTER is logged."""
    deadline = time.monotonic() + TIMEOUT_S
    while _logged_step(out) < KILL_AFTER:
        assert proc.poll() is None and time.monotonic() < deadline, "".join(stderr)[-3000:]
        time.sleep(0.01)
    started = next(line for line in stderr if "started process 0" in line)
    os.kill(int(re.search(r"process 1 \(pid (\d+)\)", started).group(1)), signal.SIGKILL)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("elastic")
    command = [sys.executable, "-m", "shardlib.cli", "launch", "--elastic", "--min-processes", "1",
               "-n", "2", "-d", "4", "--grace", "2", "--", *_train_with_slow_process_1(base / "run")]
    job = subprocess.Popen(command, env=_env(), text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stderr: list[str] = []
    pump = threading.Thread(target=lambda: stderr.extend(iter(job.stderr.readline, "")), daemon=True)
    pump.start()
    _kill_process_1(job, stderr, base / "run")
    # The reference, while the job restarts: the same train command as 1 process x 8 devices,
    # uninterrupted, made in this process (8 devices, the same XLA flags; no start-up of its own),
    # and saving no checkpoint (--ckpt-every 0): the numbers of a run do not depend on its saves,
    # and if a save disturbed training the comparison with the job, which saves, would show it.
    assert main(["train", *TRAIN, "--ckpt-every", "0", "--out", str(base / "ref"), "--cpu-devices", "8"]) == 0
    stdout = job.stdout.read()
    job.wait(timeout=TIMEOUT_S)
    pump.join(timeout=10)
    return {"code": job.returncode, "stdout": stdout, "stderr": "".join(stderr),
            "run": base / "run", "ref": base / "ref"}


@pytest.mark.slow
def test_elastic_run_finishes_on_one_process_like_an_uninterrupted_run(runs):
    assert runs["code"] == 0, runs["stderr"][-4000:]
    records = read_metrics(runs["run"] / "metrics.jsonl")
    steps = [r for r in records if "loss" in r]
    reference = read_metrics(runs["ref"] / "metrics.jsonl")
    assert [r["step"] for r in steps] == [r["step"] for r in reference] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([r["loss"] for r in steps], [r["loss"] for r in reference], rtol=1e-5, atol=0)
    (restart,) = [r for r in records if r.get("event") == "restart"]
    assert restart["dead"] == [1] and restart["how"] == "killed by SIGKILL (signal 9)"
    assert (restart["processes"], restart["devices"], restart["mesh"]) == (1, 4, "fsdp=4")
    assert restart["step"] % 2 == 0 and KILL_AFTER - 2 <= restart["step"] <= restart["died_at_step"]
    assert "shardlib launch: process 1 killed by SIGKILL (signal 9) after step" in runs["stderr"]
    assert f"elastic restart 1: process 1 killed by SIGKILL (signal 9) at step {restart['died_at_step']}; resumed " \
           f"from step {restart['step']} on 1 process(es), 4 devices, mesh fsdp=4" in runs["stdout"]


@pytest.mark.slow
def test_elastic_run_reads_every_example_exactly_once(runs):
    """Across the shrink, the windows of each step (two process files before, one file after)
    are exactly the uninterrupted run's: none lost, none read twice."""
    run = runs["run"]
    read: dict[int, list[int]] = {}
    for name in ("examples.process0.jsonl", "examples.process1.jsonl", "examples.jsonl"):
        for record in read_examples(run / name):
            read.setdefault(record["step"], []).extend(record["starts"])
    reference = {r["step"]: r["starts"] for r in read_examples(runs["ref"] / "examples.jsonl")}
    assert sorted(read) == sorted(reference) == list(range(1, STEPS + 1))
    for step, starts in reference.items():
        assert sorted(read[step]) == sorted(starts), f"step {step}: windows lost or repeated"


@pytest.mark.slow
def test_straggler_warning_names_the_slow_process(runs):
    host = socket.gethostname()
    assert f"warning: straggler: process 1 (host {host}) took" in runs["stderr"]
    assert "straggler: process 0" not in runs["stderr"]
    # Process 1 is the slowest in every window; by how much depends on the machine's load (the
    # device's share of a step, on a shared CPU, is common to both processes and varies).
    for step in (3, 6):
        (window,) = [r for r in read_metrics(runs["run"] / "metrics.jsonl") if r.get("step") == step and "loss" in r]
        own = window["process_step_time_s"]
        assert len(own) == 2 and own[1] > own[0], own
