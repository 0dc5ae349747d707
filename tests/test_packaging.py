"""The installed distribution claims no generic top-level name: the reference models are
`shardlib.models`, so a user's folder with its own `models.py` works beside shardlib."""

import subprocess
import sys
import textwrap

USER_MODELS = "MINE = True  # a user's own module, unrelated to shardlib\n"

SCRIPT = textwrap.dedent(
    """
    import json
    import models                                   # the user's models.py, not shardlib's
    assert models.MINE and not hasattr(models, "trainable"), models.__file__

    import shardlib
    from shardlib.models import flops_per_token, get_config, trainable
    from shardlib.cli import main

    assert flops_per_token(get_config("tiny"), 16) > 0
    assert main(["inspect", "--model", "tiny", "--strategy", "dp", "--devices", "1", "--json"]) == 0
    """
)


def test_a_users_models_py_does_not_shadow_shardlibs_models(tmp_path):
    (tmp_path / "models.py").write_text(USER_MODELS)
    (tmp_path / "user_script.py").write_text(SCRIPT)
    out = subprocess.run([sys.executable, "user_script.py"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


def test_the_distribution_declares_shardlib_as_its_only_top_level_package(tmp_path):
    code = "from importlib import metadata; print(metadata.distribution('shardlib').read_text('top_level.txt'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["shardlib"]


# ----------------------------------------------------------------------------------------------
# Dependencies: ranges for users' environments, exact pins for CI
# ----------------------------------------------------------------------------------------------

import tomllib  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from packaging.requirements import Requirement  # noqa: E402
from packaging.utils import canonicalize_name  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = ("jax", "flax", "optax", "orbax-checkpoint", "numpy")  # the ones users' environments bring


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def _requirements() -> list[Requirement]:
    """Every requirement of pyproject.toml, the extras' too, less the extras' own ``shardlib[...]``."""
    project = _project()
    lines = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    return [r for r in map(Requirement, lines) if canonicalize_name(r.name) != "shardlib"]


def _pins() -> dict[str, str]:
    """constraints.txt as {name: version}."""
    pins = {}
    for line in (ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep, f"constraints.txt: {line!r} is not an exact pin NAME==VERSION"
            pins[canonicalize_name(name)] = version.strip()
    return pins


@pytest.mark.parametrize("name", RUNTIME)
def test_runtime_dependencies_are_ranges_that_hold_the_ci_pin(name):
    declared = {canonicalize_name(r.name): r.specifier for r in map(Requirement, _project()["dependencies"])}
    spec = declared[name]
    operators = {s.operator for s in spec}
    assert not operators & {"==", "==="}, f"pyproject.toml pins {name}{spec}: declare a range (>=low,<next)"
    assert {">=", "<"} <= operators, f"pyproject.toml: {name}{spec} needs a floor and a ceiling"
    pin = _pins()[name]
    assert spec.contains(pin), f"constraints.txt has {name}=={pin}, outside pyproject.toml's {name}{spec}"


def test_constraints_pin_every_declared_requirement_inside_its_range():
    pins = _pins()
    for req in _requirements():
        name = canonicalize_name(req.name)
        assert name in pins, f"constraints.txt has no pin for {req.name}: pip freeze it from a working venv"
        assert req.specifier.contains(pins[name]), f"constraints.txt: {req.name}=={pins[name]} is outside {req}"


def test_dev_extra_includes_the_cli_extra():
    """CI installs .[dev]; the CLI's optional writers must be tested there."""
    assert "shardlib[cli]" in _project()["optional-dependencies"]["dev"]


# ----------------------------------------------------------------------------------------------
# Optional writers: TensorBoard through tensorboardX or tensorboard, matplotlib only for the plot
# ----------------------------------------------------------------------------------------------

RECORDS = [{"step": s, "loss": 3.0 / s, "tokens_per_s": 100.0 * s} for s in (1, 2, 3)]


def _read_scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    """One scalar series of ``run_dir``'s event files, read with TensorBoard's own reader:
    tensorboardX writes simple values, tensorboard's writer scalar tensors."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    if tag in acc.Tags()["scalars"]:
        return [(e.step, e.value) for e in acc.Scalars(tag)]
    return [(e.step, float(make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]


def _uninstall(monkeypatch, *packages: str) -> None:
    """Make ``packages`` (and their already-imported submodules) fail to import, as if absent."""
    for name in list(sys.modules):
        if name.split(".")[0] in packages:
            monkeypatch.setitem(sys.modules, name, None)
    for name in packages:
        monkeypatch.setitem(sys.modules, name, None)


def _log(run_dir: Path) -> None:
    from shardlib.run.metrics_io import MetricsLog

    log = MetricsLog(run_dir)
    for record in RECORDS:
        log.write(record)
    log.add_text("sample", "hello", 3)
    log.close()


def _expected() -> dict[str, list[tuple[int, float]]]:
    return {"loss/loss": [(r["step"], r["loss"]) for r in RECORDS],
            "speed/tokens_per_s": [(r["step"], r["tokens_per_s"]) for r in RECORDS]}


@pytest.mark.parametrize("writer", ["tensorboardX", "tensorboard"])
def test_tensorboard_scalars_are_written_by_whichever_package_is_installed(writer, tmp_path, monkeypatch):
    """tensorboard's own writer where it is installed (it imports no PyTorch), else tensorboardX's:
    the event files say which wrote them (simple values against scalar tensors)."""
    pytest.importorskip("tensorboard")  # the reader; in the dev extra
    if writer == "tensorboard":
        _uninstall(monkeypatch, "tensorboardX")  # as on an image with tensorboard alone
    else:  # as on an image with tensorboardX alone; tensorboard's reader stays importable
        monkeypatch.setitem(sys.modules, "tensorboard.summary.writer.event_file_writer", None)
    _log(tmp_path)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    written = EventAccumulator(str(tmp_path))
    written.Reload()
    assert set(_expected()) <= set(written.Tags()["scalars" if writer == "tensorboardX" else "tensors"])
    for tag, points in _expected().items():
        got = {tag: _read_scalars(tmp_path, tag)}
        assert [s for s, _ in got[tag]] == [s for s, _ in points], tag
        assert [v for _, v in got[tag]] == pytest.approx([v for _, v in points], rel=1e-6), tag  # float32 events


def test_events_are_written_without_importing_pytorch_where_tensorboard_is_installed(tmp_path):
    """tensorboardX's writer imports PyTorch when it is installed (seconds in every run); with
    tensorboard installed a run's metrics log never imports it. In a fresh process: the test
    process may have imported PyTorch for transformers' references."""
    pytest.importorskip("tensorboard")
    code = ("import sys; from pathlib import Path; from shardlib.run.metrics_io import MetricsLog; "
            f"log = MetricsLog(Path({str(tmp_path)!r})); log.write({{'step': 1, 'loss': 2.0}}); log.close(); "
            "assert 'torch' not in sys.modules, 'PyTorch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    assert list(tmp_path.glob("events.out.tfevents*"))


def test_without_tensorboard_the_run_notes_it_and_keeps_metrics_jsonl(tmp_path, monkeypatch, capsys):
    from shardlib.run.metrics_io import read_metrics

    _uninstall(monkeypatch, "tensorboardX", "tensorboard")
    _log(tmp_path)
    assert "TensorBoard events are off" in capsys.readouterr().err
    assert not list(tmp_path.glob("events.out.tfevents*"))
    assert read_metrics(tmp_path / "metrics.jsonl") == RECORDS


def test_without_matplotlib_there_is_no_loss_curve_and_a_note(tmp_path, monkeypatch, capsys):
    from shardlib.run.metrics_io import plot_loss_curve

    _uninstall(monkeypatch, "matplotlib")
    assert plot_loss_curve(RECORDS, tmp_path / "loss_curve.png") is None
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert not (tmp_path / "loss_curve.png").exists()
