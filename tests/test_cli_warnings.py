"""The `shardlib` command prints a Python warning as one ``shardlib: note:`` line."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# The installed command's path (main() reading sys.argv) with a command that only warns: no JAX work.
WARNING_COMMAND = """
import sys, types, warnings
from shardlib import cli
from shardlib.sharding.layout import ReplicationWarning

command = types.ModuleType("warning_command")
command.add_arguments = lambda parser: None
def run(args):
    warnings.warn("kept whole:\\n  kernel (8, 16)", ReplicationWarning)
    warnings.warn("an old spelling", DeprecationWarning)
    print("ran")
    return 0
command.run = run
sys.modules["warning_command"] = command
cli.COMMANDS["warn"] = ("warning_command", "warns")
sys.argv = ["shardlib", "warn"]
sys.exit(cli.main())
"""


def test_the_command_prints_warnings_as_one_note_line():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).strip(os.pathsep),
           "PYTHONWARNINGS": "always"}
    proc = subprocess.run([sys.executable, "-c", WARNING_COMMAND], env=env, capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert proc.returncode == 0 and proc.stdout == "ran\n", proc.stderr
    assert proc.stderr.splitlines() == ["shardlib: note: kept whole: kernel (8, 16)",
                                        "shardlib: note: an old spelling (DeprecationWarning)"]


def test_main_called_with_arguments_leaves_warnings_to_the_caller(monkeypatch):
    # A caller of main([...]) (a test, a notebook) records or shows warnings as it chose.
    import types

    from shardlib import cli

    command = types.ModuleType("warning_command")
    command.add_arguments = lambda parser: None
    command.run = lambda args: warnings.warn("kept whole", UserWarning) or 0
    monkeypatch.setitem(sys.modules, "warning_command", command)
    monkeypatch.setitem(cli.COMMANDS, "warn", ("warning_command", "warns"))
    with pytest.warns(UserWarning, match="kept whole"):
        assert cli.main(["warn"]) == 0
