"""A step larger than a device is refused before it runs (`shardlib.run.fits`), with the largest
batch and the --grad-accum that fit, each checked here by compiling it; --force starts it anyway."""

from __future__ import annotations

import re

import pytest

from shardlib.cli import main
from shardlib.run.setup import prepare
from shardlib.run.train import TrainConfig
from shardlib.tools import memory

BATCH = 64
FLAGS = ["--model", "tiny", "--seq-len", "32", "--steps", "1", "--no-progress", "--eval-every", "0",
         "--sample-tokens", "0"]


def _peak(tmp_path, **fields) -> memory.MemoryStats:
    config = TrainConfig(**{"model": "tiny", "seq_len": 32, "batch_size": BATCH, "force": True, **fields})
    return prepare(config, tmp_path / "probe").mem


@pytest.fixture(scope="module")
def limit(tmp_path_factory):
    """A device that holds the step at 64 rows less half its temporaries."""
    mem = _peak(tmp_path_factory.mktemp("fits"))
    return memory.peak_bytes(mem) - mem.temp_bytes // 2


def test_a_step_too_large_is_refused_in_one_line_with_what_fits(limit, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(memory, "device_capacity", lambda: (limit, "a test device"))
    assert main(["train", *FLAGS, "--batch-size", str(BATCH), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("shardlib train: error: --batch-size: 64 sequences need"), err
    largest = int(re.search(r"the largest batch that fits is (\d+) \(--batch-size \1\)", err).group(1))
    accum = int(re.search(r"keep 64 with --grad-accum (\d+); --force starts it anyway", err).group(1))
    assert 0 < largest < BATCH and largest % 8 == 0 and BATCH % (8 * accum) == 0
    # What it names fits, and the next batch size up does not: compiled here, judged by the same limit.
    assert memory.peak_bytes(_peak(tmp_path, batch_size=largest)) <= limit
    assert memory.peak_bytes(_peak(tmp_path, batch_size=largest + 8)) > limit
    assert memory.peak_bytes(_peak(tmp_path, grad_accum=accum)) <= limit
    # --force starts it.
    assert main(["train", *FLAGS, "--batch-size", str(BATCH), "--force", "--out", str(tmp_path / "forced")]) == 0


def test_what_the_compile_logs_is_held_back_only_when_the_step_is_refused(capfd):
    import os

    from shardlib.run.config import TrainConfigError
    from shardlib.run.fits import held_output

    with held_output():
        os.write(2, b"XLA: compiled\n")  # file descriptor 2, as XLA's C++ log writes
    assert capfd.readouterr().err == "XLA: compiled\n"
    with pytest.raises(TrainConfigError), held_output():
        os.write(2, b"XLA: constant folding is taking > 1s\n")
        raise TrainConfigError("batch_size", "does not fit")
    assert capfd.readouterr().err == ""
