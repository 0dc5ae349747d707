"""The quickstart notebook runs top to bottom in a fresh kernel that sees 8 simulated CPU devices."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tests import compile_flags

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "quickstart.ipynb"


def test_stored_notebook_has_no_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)


@pytest.mark.slow
def test_quickstart_notebook_executes(tmp_path, monkeypatch):
    # The kernel inherits this environment: 8 CPU devices, the collective timeout, the repo, and
    # (as in conftest) the fast-compile flags: compiling dominates, and the checks are not numbers.
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                       "--xla_cpu_collective_call_terminate_timeout_seconds=900 " + compile_flags.FAST)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(nb, kernel_name="python3", timeout=300,
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError (with the cell's traceback) if any cell fails

    text = "\n".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code"
                     for out in cell.outputs if out.get("output_type") == "stream")
    assert "8 devices: cpu" in text
    for strategy in ("dp", "zero1", "zero2", "zero3"):
        assert f"\n{strategy} " in text
    assert "final validation loss:" in text
    assert "restored identical: True" in text
    assert "logits after the round trip: max difference" in text  # shardlib.hf.from_pretrained's section
