"""What a run prints where its output is not a terminal (a file, a pipe, CI's log): plain lines."""

from __future__ import annotations

import re

from shardlib.cli import main
from shardlib.run.metrics_io import read_metrics


def test_output_to_a_file_is_plain_lines_with_lr_grad_norm_and_time_left(tmp_path, capsys):
    # 30 steps: tqdm's carriage-return refreshes would make one line of ~3,000 characters.
    out = tmp_path / "run"
    assert main(["train", "--model", "tiny", "--batch-size", "16", "--seq-len", "32", "--steps", "30",
                 "--eval-every", "0", "--sample-tokens", "0", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    printed = captured.out + captured.err
    assert "\r" not in printed and max(map(len, printed.splitlines())) < 2000
    lines = [line for line in captured.out.splitlines() if re.match(r"step \d", line)]
    assert [line.split(":")[0] for line in lines] == ["step 10/30", "step 20/30", "step 30/30"], lines
    records = {r["step"]: r for r in read_metrics(out / "metrics.jsonl")}
    for line in lines:
        step = int(line.split("/")[0].split()[1])
        found = re.fullmatch(r"step \d+/30: loss (\S+) lr (\S+) grad_norm (\S+) tok/s \d+ step \S+s(?: val \S+)? "
                             r"left \d+:\d\d", line)
        assert found, line
        assert [float(x) for x in found.groups()] == [float(f"{records[step][k]:{f}}") for k, f in
                                                      (("loss", ".3f"), ("lr", ".3g"), ("grad_norm", ".3g"))]
    assert lines[-1].endswith("left 0:00")
