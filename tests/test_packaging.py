"""The installed distribution claims no generic top-level name: the reference models are
`shardlib.models`, so a user's folder with its own `models.py` works beside shardlib."""

import subprocess
import sys
import textwrap

USER_MODELS = "MINE = True  # a user's own module, unrelated to shardlib\n"

SCRIPT = textwrap.dedent(
    """
    import json
    import models                                   # the user's models.py, not shardlib's
    assert models.MINE and not hasattr(models, "trainable"), models.__file__

    import shardlib
    from shardlib.models import flops_per_token, get_config, trainable
    from shardlib.cli import main

    assert flops_per_token(get_config("tiny"), 16) > 0
    assert main(["inspect", "--model", "tiny", "--strategy", "dp", "--devices", "1", "--json"]) == 0
    """
)


def test_a_users_models_py_does_not_shadow_shardlibs_models(tmp_path):
    (tmp_path / "models.py").write_text(USER_MODELS)
    (tmp_path / "user_script.py").write_text(SCRIPT)
    out = subprocess.run([sys.executable, "user_script.py"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


def test_the_distribution_declares_shardlib_as_its_only_top_level_package(tmp_path):
    code = "from importlib import metadata; print(metadata.distribution('shardlib').read_text('top_level.txt'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["shardlib"]
