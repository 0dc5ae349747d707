"""Grain pipelines as training data (issue 28): process-sharded, their state inside the checkpoint, exactly once.

The end-to-end proof is a 2-process job (``shardlib launch --elastic``, tests/grain_worker.py)
whose process 1 is SIGKILLed mid-run: the launcher restarts it on 1 process from the last
checkpoint, and every step's examples, gathered from the per-process logs, are exactly the
uninterrupted stream's (none lost, none read twice), and the checkpointed counter is the sum of
that stream. In-process tests cover the shard arithmetic, both Grain kinds and the refusals.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

grain = pytest.importorskip("grain")

from shardlib.runtime.checkpoint_contents import pick_data_state  # noqa: E402
from shardlib.runtime.grain_data import GrainBatches, Shard, require_grain  # noqa: E402
from tests import grain_worker  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STEPS, KILL_AFTER, TIMEOUT_S = 12, 4, 300


def _ids(batch) -> list[int]:
    return batch["id"].tolist()


def _stream(steps: int, shards: int = 2) -> list[list[int]]:
    """The uninterrupted global batches: one process reading every shard."""
    whole = GrainBatches(grain_worker.pipeline, grain_worker.BATCH, shards=shards, process_index=0, process_count=1)
    return [_ids(next(whole)) for _ in range(steps)]


def test_two_processes_read_disjoint_rows_of_the_same_global_batches():
    reference = _stream(3)
    parts = [GrainBatches(grain_worker.pipeline, grain_worker.BATCH, process_index=p, process_count=2) for p in (0, 1)]
    for step in range(3):
        rows = [_ids(next(b)) for b in parts]
        assert rows[0] + rows[1] == reference[step]
    assert parts[1].rows == slice(4, 8) and parts[1].shards == [1]


def test_state_saved_on_two_processes_resumes_on_one_exactly():
    reference = _stream(6)
    parts = [GrainBatches(grain_worker.pipeline, grain_worker.BATCH, process_index=p, process_count=2) for p in (0, 1)]
    read = [sum((_ids(next(b)) for b in parts), []) for _ in range(3)]
    saved = {"process_count": 2, "states": json.loads(json.dumps([b.state() for b in parts]))}  # as the checkpoint holds it
    merged = pick_data_state(saved, "ckpt", 3)
    assert sorted(merged["shards"]) == ["0", "1"] and merged["step"] == 3
    alone = GrainBatches(grain_worker.pipeline, grain_worker.BATCH, process_index=0, process_count=1)
    alone.restore(merged)
    assert alone.shard_count == 2 and alone.step == 3
    read += [_ids(next(alone)) for _ in range(3)]
    assert read == reference
    flat = sum(read, [])
    assert len(set(flat)) == len(flat)


def test_a_data_loader_state_round_trips_through_json():
    def loader(shard: Shard):
        sampler = grain.samplers.IndexSampler(64, shard_options=grain.sharding.ShardOptions(shard.index, shard.count),
                                              shuffle=True, seed=3, num_epochs=1)
        return grain.DataLoader(data_source=np.arange(64, dtype=np.int32), sampler=sampler, worker_count=0)

    first = GrainBatches(loader, 4, shards=2, process_index=0, process_count=1)
    next(first)
    state = json.loads(json.dumps(first.state()))
    expected = [next(first).tolist() for _ in range(2)]
    again = GrainBatches(loader, 4, process_index=0, process_count=1)
    again.restore(state)
    assert [next(again).tolist() for _ in range(2)] == expected


def test_a_pipeline_given_as_one_object_resumes_only_on_the_same_process_count():
    dataset = grain_worker.pipeline(Shard(0, 1))
    batches = GrainBatches(dataset, 4, process_index=0, process_count=1)
    next(batches)
    state = batches.state()
    with pytest.raises(ValueError, match="pass a function Shard -> pipeline"):
        batches.restore({**state, "shard_count": 2})
    with pytest.raises(ValueError, match="not a Grain data state"):
        batches.restore({"step": 1, "seed": 0})


def test_the_pipeline_example_of_docs_data_md_runs():
    page = (ROOT / "docs" / "data.md").read_text(encoding="utf-8")
    example = re.findall(r"```python\n(.*?)```", page, flags=re.S)[0]
    namespace: dict = {}
    exec(compile(example, "docs/data.md", "exec"), namespace)
    batch = namespace["batch"]
    assert batch["inputs"].shape == batch["targets"].shape == (16, 8)  # one process: every row
    np.testing.assert_array_equal((batch["inputs"] + 1) % 256, batch["targets"])


def test_without_grain_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "grain", None)
    with pytest.raises(ImportError, match=re.escape("pip install shardlib[data]")):
        require_grain()


# ---------------------------------------------------------------- SIGKILL, elastic shrink, exactly once


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDLIB_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _steps_logged(path: Path) -> int:
    try:
        return max((json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")), default=0)
    except FileNotFoundError:
        return 0


@pytest.fixture(scope="module")
def killed_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("grain") / "run"
    command = [sys.executable, "-m", "shardlib.cli", "launch", "--elastic", "--min-processes", "1", "-n", "2",
               "-d", "1", "--grace", "2", "--", sys.executable, str(ROOT / "tests" / "grain_worker.py"),
               "--out", str(out), "--steps", str(STEPS), "--slow-process", "1:0.5"]
    job = subprocess.Popen(command, env=_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stderr: list[str] = []
    pump = threading.Thread(target=lambda: stderr.extend(iter(job.stderr.readline, "")), daemon=True)
    pump.start()
    deadline = time.monotonic() + TIMEOUT_S
    while _steps_logged(out / "examples.process1.jsonl") < KILL_AFTER:
        assert job.poll() is None and time.monotonic() < deadline, "".join(stderr)[-3000:]
        time.sleep(0.01)
    started = next(line for line in stderr if "started process 0" in line)
    os.kill(int(re.search(r"process 1 \(pid (\d+)\)", started).group(1)), signal.SIGKILL)
    stdout = job.stdout.read()
    job.wait(timeout=TIMEOUT_S)
    pump.join(timeout=10)
    return {"code": job.returncode, "stdout": stdout, "stderr": "".join(stderr), "out": out}


@pytest.mark.slow
def test_grain_sigkill_and_shrink_to_one_process_reads_every_example_once(killed_job):
    assert killed_job["code"] == 0, killed_job["stderr"][-4000:]
    resumed = re.search(r"restart 1: 1 process\(es\) x 1 device\(s\), from checkpoint step (\d+)", killed_job["stderr"])
    assert resumed and 2 <= int(resumed.group(1)) < STEPS, killed_job["stderr"][-3000:]  # mid-run, from a checkpoint
    out = killed_job["out"]
    read: dict[int, list[int]] = {}
    for name in ("examples.process0.jsonl", "examples.process1.jsonl", "examples.jsonl"):
        for line in (out / name).read_text().splitlines():
            record = json.loads(line)
            read.setdefault(record["step"], []).extend(record["ids"])
    reference = _stream(STEPS)
    assert sorted(read) == list(range(1, STEPS + 1))
    for step, ids in enumerate(reference, start=1):
        assert sorted(read[step]) == sorted(ids), f"step {step}: examples lost or repeated"
    # The restored counter went on from the checkpoint: it holds every example of the stream once.
    assert json.loads((out / "total.json").read_text())["total"] == sum(sum(ids) for ids in reference)
