"""The model guides (docs/your-model.md and the pages its table links) run as written: each page's
python blocks in order, in one namespace of its own, so every page works when read alone."""

import pathlib
import re

import jax
import numpy as np
import pytest

DOCS = pathlib.Path(__file__).parents[1] / "docs"


def _same_on_every_device(tree):
    """BatchNorm statistics (and other model state): one value, held alike by every device."""
    for leaf in jax.tree.leaves(tree):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        assert all(np.array_equal(s, shards[0]) for s in shards)


def _nnx(ns):
    assert int(ns["state"].step) == 3
    assert np.isfinite(float(ns["evaluation"]["loss"]))
    _same_on_every_device(ns["state"].model_state)


def _dropout_and_batchnorm(ns):
    for name in ("sync_state", "patched_state"):
        _same_on_every_device(ns[name].model_state)




def _steps(**expected):
    def check(ns):
        assert {name: int(ns[name].step) for name in expected} == expected
    return check


# What each page must have left behind, beyond its own asserts.
CHECKS = {
    "your-model.md": lambda ns: None,  # its block asserts the annotated layout
    "nnx.md": _nnx,
    "linen.md": lambda ns: _same_on_every_device(ns["linen_state"].model_state),
    "pytrees-and-equinox.md": _steps(plain_state=1, custom_state=2, dropped_state=1, eqx_state=2),
    "dropout-and-batchnorm.md": _dropout_and_batchnorm,
    "train-eval-switch.md": _steps(flag_state=1, field_state=1, switched_state=1),
    "training-loop.md": _steps(opt_state=2, flax_state=1),
    "fine-tuning-and-evaluation.md": _steps(tuned=1),
    "porting.md": lambda ns: None,
}


def test_every_guide_the_index_links_is_run():
    index = (DOCS / "your-model.md").read_text()
    table = index[index.index("## Which page"):index.index("Checkpoints of your own loop")]
    assert set(re.findall(r"\]\(([\w-]+\.md)\)", table)) | {"your-model.md"} == set(CHECKS)


@pytest.mark.parametrize("page", sorted(CHECKS))
def test_guide_runs_as_written(page):
    namespace: dict = {}
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), flags=re.S)
    for i, code in enumerate(blocks):
        exec(compile(code, f"docs/{page} (block {i})", "exec"), namespace)
    CHECKS[page](namespace)
