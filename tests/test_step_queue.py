"""A loop that never reads its metrics must not deadlock the simulated devices' collectives."""

import os
import pathlib
import subprocess
import sys

SCRIPT = """
import jax, optax
from shardlib import make_mesh, make_layout, build
from shardlib.runtime.data import ByteBatches, load_text
from tests.helpers import tiny_model
model = tiny_model()
program = build(model, optax.adamw(3e-3), make_layout(model, "dp", make_mesh({"data": 8})))
source = ByteBatches(load_text(None), 32, 64, seed=0, process_index=0, process_count=1)
state = program.init(jax.random.key(0))
for step in range(80):
    state, metrics = program.step(state, source.batch(step))   # metrics never read in the loop
print("finished", float(metrics["loss"]))
"""


def test_eighty_queued_dp_steps_finish():
    root = pathlib.Path(__file__).parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), JAX_PLATFORMS="cpu")
    # Before the step bounded its queue this hung after ~50 steps; the timeout turns a
    # regression into a failure instead of a stuck CI job.
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=root, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "finished" in done.stdout
