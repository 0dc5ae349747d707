"""scripts/benchmark_torch.py: its PyTorch GPT has the parameters of shardlib's, and --help runs.

PyTorch is the optional `bench` extra, which CI does not install: then these tests are skipped,
with the reason, rather than passed.
"""

import dataclasses
import importlib.util
import pathlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="PyTorch (the optional `bench` extra) is not installed")

from shardlib.models import get_config, param_count  # noqa: E402

SCRIPT = pathlib.Path(__file__).parents[1] / "scripts" / "benchmark_torch.py"


def _script():
    spec = importlib.util.spec_from_file_location("benchmark_torch", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["small", "tiny"])
def test_torch_model_has_shardlibs_parameter_count(name):
    config = get_config(name)
    assert _script().torch_param_count(dataclasses.asdict(config)) == param_count(config)


def test_torch_model_tensor_shapes_match_shardlibs_per_layer():
    """Same count from the same tensors: per block 4 attention + 3 MLP matrices + 2 norm scales."""
    config = get_config("small")
    with torch.device("meta"):
        model = _script().TorchGPT(dataclasses.asdict(config), remat=False)
    shapes = sorted(tuple(p.shape) for p in model.blocks[0].parameters())
    d, f = config.d_model, config.d_ff
    assert shapes == sorted([(d, d)] * 4 + [(f, d), (f, d), (d, f), (d,), (d,)])
    assert len(model.blocks) == config.n_layers


def test_help_runs():
    result = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for flag in ("--steps", "--warmup", "--rounds", "--markdown"):
        assert flag in result.stdout
