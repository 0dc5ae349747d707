"""docs/your-model.md runs as written: its python blocks in order, in one namespace."""

import pathlib
import re

import jax
import numpy as np


def test_your_model_doc_runs_and_trains():
    doc = (pathlib.Path(__file__).parents[1] / "docs" / "your-model.md").read_text()
    namespace: dict = {}
    for i, code in enumerate(re.findall(r"```python\n(.*?)```", doc, flags=re.S)):
        exec(compile(code, f"docs/your-model.md (block {i})", "exec"), namespace)
    assert int(namespace["state"].step) == 3
    assert np.isfinite(float(namespace["evaluation"]["loss"]))
    for name in ("state", "sync_state", "linen_state"):  # BatchNorm statistics, the same on every device
        for leaf in jax.tree.leaves(namespace[name].model_state):
            shards = [np.asarray(s.data) for s in leaf.addressable_shards]
            assert all(np.array_equal(s, shards[0]) for s in shards)
    assert int(namespace["plain_state"].step) == 1
