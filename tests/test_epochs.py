"""Instruction examples in shuffled epochs without replacement (`shardlib.runtime.epochs`), and
``--epochs N`` as the steps that read the data N times (`shardlib.run.epochs`)."""

from __future__ import annotations

import numpy as np
import pytest

from shardlib.run.config import TrainConfig, TrainConfigError
from shardlib.run.epochs import apply
from shardlib.runtime.epochs import epoch_rows
from shardlib.runtime.rows import RowBatches


def test_every_example_once_per_epoch_in_a_new_order_each_epoch():
    n, batch = 10, 4  # batches run across epoch boundaries (40 positions = 4 epochs in 10 steps)
    stream = np.concatenate([epoch_rows(7, step, batch, n) for step in range(10)])
    epochs = stream.reshape(4, n)
    for order in epochs:
        assert sorted(order.tolist()) == list(range(n))
    assert len({tuple(order) for order in epochs}) == 4
    np.testing.assert_array_equal(epoch_rows(7, 3, batch, n), stream[12:16])  # a pure function of the step
    assert not np.array_equal(epoch_rows(8, 0, n, n), epochs[0])  # the seed shuffles


def test_row_batches_read_each_example_once_per_epoch_split_over_processes():
    tokens = np.arange(12 * 5, dtype=np.uint16).reshape(12, 5)  # 12 distinct examples of 4 + 1 tokens
    mask = np.ones((12, 4), np.float32)
    seen = []
    for step in range(3):  # one epoch: 3 steps of 4
        parts = [RowBatches(tokens, mask, 4, seed=1, process_index=p, process_count=2).batch(step) for p in range(2)]
        seen += [row[0] // 5 for part in parts for row in part["inputs"]]
    assert sorted(seen) == list(range(12))


def test_epochs_set_the_steps_and_say_when_a_batch_exceeds_the_data(capsys):
    rows = (np.zeros((20, 9), np.uint16), np.ones((20, 8), np.float32))
    assert apply(TrainConfig(epochs=2, batch_size=8, seq_len=8), rows, main=True).steps == 5  # ceil(40 / 8)
    assert "--epochs 2 over 20 examples is 5 steps of 8" in capsys.readouterr().err
    text = np.zeros(1000, np.uint16)
    assert apply(TrainConfig(epochs=1.5, batch_size=4, seq_len=50), text, main=True).steps == 8  # ceil(1500 / 200)
    apply(TrainConfig(batch_size=32, seq_len=8), rows, main=True)
    assert "one batch of 32 rows is more than the 20 training examples" in capsys.readouterr().err
    with pytest.raises(TrainConfigError, match="--epochs: sets the number of steps from the data: drop --steps"):
        apply(TrainConfig(epochs=1, steps=7, batch_size=8, seq_len=8), rows, main=True)
    with pytest.raises(TrainConfigError, match="--epochs: must be positive"):
        apply(TrainConfig(epochs=0, batch_size=8, seq_len=8), rows, main=True)


def test_eval_data_validates_on_its_own_file_and_trains_on_all_of_data():
    """`--eval-data`: the loader's (train, held-out tail) split of --data joined back whole for
    training, the eval file whole for validation; a file of another kind is refused by flag."""
    from shardlib.run.eval_data import loaded

    files = {"train.txt": np.arange(100, dtype=np.uint8), "val.txt": np.arange(40, dtype=np.uint8) + 1,
             "rows.jsonl": (np.ones((4, 9), np.uint16), np.ones((4, 8), np.float32))}

    def load(config):  # as the run's loader splits: the last 5% held out
        data = files[config.data]
        if isinstance(data, tuple):
            return (data[0][:3], data[1][:3]), (data[0][3:], data[1][3:])
        return data[:95], data[95:]

    train, val = loaded(TrainConfig(data="train.txt", eval_data="val.txt"), load)
    np.testing.assert_array_equal(train, files["train.txt"])
    np.testing.assert_array_equal(val, files["val.txt"])
    assert loaded(TrainConfig(data="train.txt"), load)[1].tolist() == list(range(95, 100))
    with pytest.raises(TrainConfigError, match="--eval-data: rows.jsonl is instruction examples"):
        loaded(TrainConfig(data="train.txt", eval_data="rows.jsonl"), load)
