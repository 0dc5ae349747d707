"""`import shardlib` chooses nothing: the environment and Flax's config are as the user left them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from shardlib.backend import NO_TPU_ENV

REPO = Path(__file__).resolve().parents[1]

# `import jax` itself sets TPU_SKIP_MDS_QUERY, TPU_LIBRARY_PATH and TF_CPP_MIN_LOG_LEVEL where libtpu is
# installed (jax/_src/cloud_tpu_init.py), so the snapshot is taken after JAX and Flax are imported.
SNAPSHOT_AROUND_IMPORT = """
import json, os
import jax, flax
def state():
    return {"env": dict(os.environ), "flax": {k: repr(v) for k, v in flax.config._values.items()}}
before = state()
import shardlib, shardlib.models
after = state()
print(json.dumps({"before": before, "after": after}))
"""


def _fresh_env() -> dict[str, str]:
    """This process's environment less what shardlib or Flax would set, as a new user's shell has it."""
    env = {k: v for k, v in os.environ.items() if k not in NO_TPU_ENV and k != "FLAX_ALWAYS_SHARD_VARIABLE"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).strip(os.pathsep)
    return env


def test_import_leaves_the_environment_and_flax_config_unchanged():
    proc = subprocess.run([sys.executable, "-c", SNAPSHOT_AROUND_IMPORT], env=_fresh_env(), capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-1500:]
    seen = json.loads(proc.stdout.splitlines()[-1])
    assert seen["after"]["env"] == seen["before"]["env"]
    assert seen["after"]["flax"] == seen["before"]["flax"]
    assert "flax_always_shard_variable" in seen["after"]["flax"]  # the flag the old import turned off


def test_the_mesh_answers_libtpu_only_before_the_backend_starts(monkeypatch):
    # Once JAX has started, libtpu has read its environment: a mesh built then leaves it alone.
    import jax

    import shardlib

    jax.devices()

    for name in NO_TPU_ENV:
        monkeypatch.delenv(name, raising=False)
    shardlib.make_mesh({"data": -1})
    assert not set(NO_TPU_ENV) & set(os.environ)
