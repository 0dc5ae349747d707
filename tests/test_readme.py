"""The README's library example runs as written and trains."""

import pathlib
import re

import jax


def test_readme_example_trains_with_zero3(capsys):
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    code = next(b for b in blocks if "shardlib.build" in b)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    state, metrics = namespace["state"], namespace["metrics"]
    assert float(metrics["loss"]) < 0.05
    assert state.params["w1"].sharding.spec == jax.sharding.PartitionSpec("fsdp", None)
    assert "fsdp" in capsys.readouterr().out
