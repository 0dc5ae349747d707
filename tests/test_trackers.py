"""`--log-to wandb,mlflow`: each tracker, offline, holds the scalars metrics.jsonl has at their step
and the run's config (read back from wandb's run file and mlflow's store, not from shardlib)."""

from __future__ import annotations

import json

import pytest

from shardlib.cli import main
from shardlib.run.metrics_io import read_metrics

wandb = pytest.importorskip("wandb")
mlflow = pytest.importorskip("mlflow")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("trackers") / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("WANDB_SILENT", "true")
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)
        assert main(["train", "--model", "tiny", "--batch-size", "16", "--seq-len", "32", "--steps", "3",
                     "--eval-every", "0", "--sample-tokens", "0", "--no-progress", "--log-to", "wandb,mlflow",
                     "--out", str(out)]) == 0
    return out, {r["step"]: r for r in read_metrics(out / "metrics.jsonl")}


def _wandb_records(path):
    """The protobuf records of a wandb run file: a LevelDB-style log of 32 KiB blocks, each record
    chunk behind a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, chunks, records = path.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if not length and not kind:
            break
        chunks, pos = chunks + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(chunks)
            records.append(record)
            chunks = b""
    return records


def test_wandb_offline_holds_each_steps_scalars_and_the_config(run):
    out, records = run
    (path,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    logged = {}
    for record in _wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            logged[record.history.step.num] = items
        if record.WhichOneof("record_type") == "run":
            config = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                      for item in record.run.config.update}
    assert sorted(logged) == [1, 2, 3]
    for step, items in logged.items():
        assert items["loss"] == records[step]["loss"] and items["grad_norm"] == records[step]["grad_norm"]
    assert config["strategy"] == "zero3" and config["steps"] == 3


def test_mlflow_holds_each_steps_scalars_and_the_config(run):
    out, records = run
    client = mlflow.tracking.MlflowClient((out / "mlruns").absolute().as_uri())
    (found,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    history = {m.step: m.value for m in client.get_metric_history(found.info.run_id, "loss")}
    assert history == {step: record["loss"] for step, record in records.items()}
    assert found.data.params["strategy"] == "zero3" and found.data.params["model"] == "tiny"


def test_an_unknown_tracker_is_one_line(capsys):
    assert main(["train", "--log-to", "tensorboard", "--steps", "1"]) == 2
    assert "--log-to: 'tensorboard': choose among wandb, mlflow" in capsys.readouterr().err
