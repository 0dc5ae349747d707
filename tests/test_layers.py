"""The layers of docs/design.md ("Layers") hold: `lint-imports` passes on shardlib, and fails on a
copy of it with one backward import added, naming that import (so the contract is not vacuous)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    """`lint-imports` with ``cwd``'s pyproject.toml against the ``shardlib`` found first on ``cwd``."""
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code, "--no-cache"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_layers_hold():
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize("module, line, broken", [
    # the bottom utilities importing the command line
    ("shardlib/text.py", "import shardlib.cli", "shardlib.text -> shardlib.cli"),
    # the sharding layer importing the model layer above it (what sharding/layout.py once did)
    ("shardlib/sharding/layout.py", "from shardlib.model import adapters", "shardlib.sharding.layout -> shardlib.model"),
    # a module reaching the facade, which imports every layer
    ("shardlib/step/grads.py", "from shardlib import build", "shardlib.step.grads -> shardlib (l."),
    # the reference models (`models/`, installed as shardlib.models) importing the run loop that uses them
    ("models/mlp.py", "import shardlib.run.train", "models.mlp -> shardlib.run.train"),
])
def test_a_backward_import_fails(tmp_path, module, line, broken):
    for package in ("shardlib", "models"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with open(tmp_path / module, "a") as f:
        f.write(f"\n{line}\n")
    result = _lint_imports(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert broken in result.stdout


def test_product_code_reads_no_test_hooks():
    """Tests reach behaviours through public seams (a corrupt batch, a slow loader patched in the
    test's own process: tests/test_fault_tolerance.py, tests/slow_loader_train.py), not through
    switches in shardlib: no SHARDLIB_TEST_* variable, no hidden flag."""
    hooks = [f"{path.relative_to(ROOT)}:{number}" for path in sorted((ROOT / "shardlib").rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if "SHARDLIB_TEST_" in line or re.search(r"help\W+argparse\.SUPPRESS|hidden=True", line)]
    assert hooks == []
