"""`train(config, data=<Grain pipeline>)` (issue 28): stopped at a checkpoint and resumed, the two runs read
exactly the uninterrupted stream's examples, none lost or read twice.

Each example carries its id; the pipeline logs every id it hands out, so the log is what the runs read.
"""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest

pytest.importorskip("grain")

from shardlib.run.config import TrainConfig, TrainConfigError  # noqa: E402
from shardlib.run.train import train  # noqa: E402
from shardlib.runtime.grain_data import GrainBatches  # noqa: E402

BATCH, SEQ, RECORDS = 8, 16, 512


def _pipeline(log: list[int] | None):
    def example(i):
        inputs = (np.arange(SEQ) * 3 + int(i)) % 256
        return {"id": np.int32(i), "inputs": inputs.astype(np.int32), "targets": ((inputs + 1) % 256).astype(np.int32)}

    def pipeline(shard):
        import grain

        return (grain.MapDataset.range(RECORDS).shuffle(seed=3)[shard.index::shard.count].map(example)
                .to_iter_dataset().map(read))  # after to_iter_dataset: its read-ahead threads would log early

    def read(e):
        if log is not None:
            log.append(int(e["id"]))
        return e

    return pipeline


def _config(out, steps: int, **kw) -> TrainConfig:
    return TrainConfig(model="tiny", strategy="zero3", steps=steps, batch_size=BATCH, seq_len=SEQ, lr=1e-2,
                       eval_every=0, ckpt_every=3, sample_tokens=0, out=str(out), progress=False, verbose=False, **kw)


def test_train_on_a_grain_pipeline_stops_and_resumes_exactly_once(tmp_path):
    first, second = [], []
    stopped = train(_config(tmp_path / "run", 5), data=_pipeline(first))  # saves steps 3 and 5
    # Lose the last checkpoint, as a crash after step 3's save would: the resume starts from step 3,
    # saved while batch 4 (0-based 3) was already read, the case a live-iterator state gets wrong.
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "5")
    resumed = train(_config(tmp_path / "run", 6), data=_pipeline(second))
    whole = GrainBatches(_pipeline(None), BATCH, process_index=0, process_count=1)
    stream = [int(i) for _ in range(6) for i in next(whole)["id"]]
    assert first == stream[:5 * BATCH]
    assert second == stream[3 * BATCH:]  # batches 4..6 again after step 3: none lost, none read twice
    assert [r["step"] for r in stopped.records] == [1, 2, 3, 4, 5]
    assert math.isnan(resumed.final_val_loss)  # a pipeline brings no validation split


def test_record_examples_is_refused_with_a_grain_pipeline(tmp_path):
    with pytest.raises(TrainConfigError, match="record-examples"):
        train(_config(tmp_path / "run", 2, record_examples=True), data=_pipeline(None))
