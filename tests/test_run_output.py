"""What a run prints where its output is not a terminal (a file, a pipe, CI's log): plain lines."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardlib.cli import main
from shardlib.run.metrics_io import read_metrics
from shardlib.backend import NO_TPU_ENV, tpu_attached
from tests import compile_flags

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, str, str]:
    """One in-process run, its output not a terminal, steps 2-3 profiled: (run directory, stdout, stderr).
    The plain-lines test and the profile test read it (they differ only in what they check).
    30 steps: tqdm's carriage-return refreshes would make one line of ~3,000 characters."""
    out, stdout, stderr = tmp_path_factory.mktemp("output") / "run", io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(["train", "--model", "tiny", "--batch-size", "16", "--seq-len", "32", "--steps", "30",
                     "--eval-every", "0", "--sample-tokens", "0", "--profile", "2:3", "--out", str(out)])
    assert code == 0, stderr.getvalue()[-3000:]
    return out, stdout.getvalue(), stderr.getvalue()


def test_output_to_a_file_is_plain_lines_with_lr_grad_norm_and_time_left(run):
    out, stdout, stderr = run
    printed = stdout + stderr
    assert "\r" not in printed and max(map(len, printed.splitlines())) < 2000
    lines = [line for line in stdout.splitlines() if re.match(r"step \d", line)]
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


def _without_tpu_answers() -> dict[str, str]:
    """The environment of a fresh process on this host, libtpu free to load (as on a machine where
    no other process holds its lockfile), none of `NO_TPU_ENV` set."""
    env = {k: v for k, v in os.environ.items() if k not in NO_TPU_ENV and k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    env["XLA_FLAGS"] = compile_flags.FAST  # compile speed only: the CLI picks its own devices
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).strip(os.pathsep)
    return env


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None or tpu_attached(), reason="libtpu on a host without TPUs")
@pytest.mark.parametrize("code", [
    "import shardlib; print(shardlib.make_mesh({'data': -1}).devices)",  # a user's script: the mesh picks the devices
    "from shardlib.cli import main; main(['train', '--model', 'tiny', '--steps', '1', '--batch-size', '8', '--seq-len', "
    "'16', '--sample-tokens', '0', '--eval-every', '0', '--no-tensorboard', '--out', OUT])",
])
def test_no_libtpu_noise_without_tpus(code, tmp_path):
    code = code.replace("OUT", repr(str(tmp_path / "run")))
    proc = subprocess.run([sys.executable, "-c", code], env=_without_tpu_answers(), capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 0 and proc.stdout, proc.stderr
    assert proc.stderr == "", proc.stderr


BUILD_ANNOTATED = """
import shardlib
from flax import nnx
init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
with nnx.use_eager_sharding(False):  # logical names, no mesh: shardlib places the parameters
    model = nnx.Linear(4, 8, kernel_init=init, rngs=nnx.Rngs(0))
params = shardlib.from_nnx(model, lambda m, b: m(b).mean()).init(None)
print(float(abs(params["kernel"] - model.kernel.value).max()))
"""

FACTORY = """
from flax import nnx
import shardlib

init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
MODEL = nnx.Linear(4, 8, kernel_init=init, rngs=nnx.Rngs(0))  # built on import: the CLI's context


def make():
    return shardlib.from_nnx(MODEL, lambda m, b: m(b).mean())
"""


@pytest.mark.parametrize("eager", [None, "true"])
def test_an_nnx_instance_with_logical_names_builds_without_a_mesh(eager, tmp_path):
    # Flax's eager sharding would ask for a mesh ("An auto mesh context or metadata is required").
    # `import shardlib` leaves Flax's default alone (tests/test_import_effects.py): a script builds
    # its annotated instance inside `nnx.use_eager_sharding(False)`, and the CLI loads a user's
    # model module inside it unless FLAX_ALWAYS_SHARD_VARIABLE is set.
    env = _without_tpu_answers()
    env.pop("FLAX_ALWAYS_SHARD_VARIABLE", None)
    if eager:
        env["FLAX_ALWAYS_SHARD_VARIABLE"] = eager
    proc = subprocess.run([sys.executable, "-c", BUILD_ANNOTATED], env=env, capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 0 and proc.stdout.strip() == "0.0", proc.stderr[-1500:]
    # The CLI loads a user's model file inside shardlib's placement, unless the environment says otherwise.
    (tmp_path / "annotated_model.py").write_text(FACTORY)
    load = "from shardlib.run.user_model import load; print(type(load('annotated_model:make')).__name__)"
    proc = subprocess.run([sys.executable, "-c", load], env=env, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    if eager:  # the user's choice wins: Flax's own error
        assert proc.returncode == 1 and "An auto mesh context or metadata is required" in proc.stderr
    else:
        assert proc.returncode == 0 and proc.stdout.strip() == "Model", proc.stderr[-1500:]


def test_a_read_only_checkpointer_opens_without_orbax_warning(tmp_path, caplog):
    from shardlib.runtime.checkpoint import Checkpointer

    (tmp_path / "checkpoints").mkdir()
    with caplog.at_level("WARNING"):
        Checkpointer(tmp_path / "checkpoints", create=False).close()
    assert not [r for r in caplog.records if "read only" in r.getMessage()], caplog.text


def test_profile_traces_the_steps_asked_and_metrics_carry_tokens_per_device(run):
    out, stdout, _ = run
    assert "profile    steps 2-3: " in stdout
    traces = list((out / "profile").rglob("*.xplane.pb"))
    assert len(traces) == 1 and list((out / "profile").rglob("*.trace.json.gz"))
    records = read_metrics(out / "metrics.jsonl")
    assert [r["tokens_per_s_per_device"] for r in records] == [r["tokens_per_s"] / 8 for r in records]
    assert not any("memory_peak_bytes" in r for r in records)  # XLA:CPU reports no device memory


def test_metrics_carry_device_memory_where_the_backend_reports_it(monkeypatch):
    import jax

    from shardlib.run.loop import device_memory

    class Device:
        def __init__(self, used, peak):
            self.stats = {"bytes_in_use": used, "peak_bytes_in_use": peak, "bytes_limit": 10**9}

        def memory_stats(self):
            return self.stats

    monkeypatch.setattr(jax, "local_devices", lambda: [Device(5, 9), Device(7, 8)])
    assert device_memory() == {"memory_in_use_bytes": 7, "memory_peak_bytes": 9}


@pytest.mark.parametrize("spec, says", [("5", "'5' is not START:STOP"), ("2:4", "2:4 ends past the run's last step (3)")])
def test_a_bad_profile_range_is_one_line(spec, says, capsys):
    assert main(["train", "--profile", spec, "--steps", "3"]) == 2
    assert f"--profile: {says}" in capsys.readouterr().err
