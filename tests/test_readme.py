"""The library examples of the README and of docs/pipeline.md run as written and train."""

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


def test_pipeline_doc_example_trains_two_stages(capsys):
    doc = (pathlib.Path(__file__).parents[1] / "docs" / "pipeline.md").read_text()
    code = re.findall(r"```python\n(.*?)```", doc, flags=re.S)[0]
    namespace: dict = {}
    exec(compile(code, "docs/pipeline.md", "exec"), namespace)
    state = namespace["state"]
    assert state.params["blocks"]["mlp"]["w_up"].sharding.spec[0] == "pipe"
    assert int(state.step) == 3
    assert "pipe" in capsys.readouterr().out
