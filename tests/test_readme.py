"""The library examples of the README and of docs/pipeline.md run as written and train."""

import os
import pathlib
import re
import subprocess
import sys

import jax


def test_readme_example_shows_zero3_shards_as_a_plain_script(tmp_path):
    """Run as `python example.py` would: a fresh process with none of conftest's device set-up."""
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    code = next(b for b in blocks if "shardlib.build" in b)
    (tmp_path / "example.py").write_text(code)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES")}
    out = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    loss, spec = out.stdout.strip().splitlines()[-1].split(" ", 1)
    assert float(loss) < 0.05
    assert spec == "P('fsdp', None)"  # what the README's comment promises


def test_pipeline_doc_example_trains_two_stages(capsys):
    doc = (pathlib.Path(__file__).parents[1] / "docs" / "pipeline.md").read_text()
    code = re.findall(r"```python\n(.*?)```", doc, flags=re.S)[0]
    namespace: dict = {}
    exec(compile(code, "docs/pipeline.md", "exec"), namespace)
    state = namespace["state"]
    assert state.params["blocks"]["mlp"]["w_up"].sharding.spec[0] == "pipe"
    assert int(state.step) == 3
    assert "pipe" in capsys.readouterr().out
