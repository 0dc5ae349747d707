"""Issue 44 §1: a 2-process Hugging Face import reads each checkpoint byte once a job.

Under zero3 a matrix's shard is a column block of the checkpoint's row-major tensor, so a reader
of each device's shard pages in the whole checkpoint on every process. Two real processes (gloo
over localhost, `shardlib launch -n 2 -d 4`) import a Llama-shaped bf16 checkpoint written here;
each reports the bytes its reader read (`TensorFile.bytes_read`) and checks its shards against
the checkpoint read whole on the host (tests/hf_import_worker.py).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

from shardlib.hf import architectures as arch_lib
from shardlib.hf.load import _param_shapes
from shardlib.hf.safetensors_io import TensorWriter
from shardlib.models import GPTConfig

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "tests" / "hf_import_worker.py")
CONFIG = GPTConfig(vocab_size=100, d_model=64, n_layers=2, n_heads=4, d_ff=168, n_kv_heads=2, max_seq_len=32)


def _write(directory: Path) -> tuple[int, int]:
    """A bf16 checkpoint of CONFIG's shapes (rows not a multiple of 8: the split pads); returns
    (its tensor bytes, its largest tensor's bytes)."""
    shapes = _param_shapes(CONFIG)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    entries = []
    for t in arch_lib.tensors_for(CONFIG):
        layer_shape = shapes[t.path][1:] if t.per_layer else shapes[t.path]
        entries += [(name, bf16, t.placement.hf_shape(layer_shape)) for name in arch_lib.hf_names(t, CONFIG.n_layers)]
    rng = np.random.default_rng(0)
    directory.mkdir()
    with open(directory / "model.safetensors", "wb") as f:
        writer = TensorWriter(f, entries, metadata={"format": "pt"})
        for name, dtype, shape in entries:
            writer.add(name, rng.standard_normal(shape, np.float32).astype(dtype))
        writer.close()
    (directory / "config.json").write_text(json.dumps(arch_lib.from_gpt_config(CONFIG, dtype="bfloat16")))
    sizes = [math.prod(shape) * 2 for *_, shape in entries]
    return sum(sizes), max(sizes)


def test_each_of_two_processes_reads_half_the_checkpoint_and_places_its_shards(tmp_path):
    total, largest = _write(tmp_path / "ckpt")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDLIB_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, "-m", "shardlib.cli", "launch", "--processes", "2", "--devices-per-process", "4",
           "--grace", "120", "--", sys.executable, WORKER, str(tmp_path / "ckpt")]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = {int(m.group(1)): json.loads(m.group(2))
               for m in re.finditer(r"\[p(\d+)\] RESULT (.*)", out.stdout)}
    assert sorted(results) == [0, 1], out.stdout[-3000:]
    for r in results.values():
        assert r["devices"] == 8 and r["split"] > 0 and r["mismatched"] == [], r
        assert r["bytes_read"] <= 1.05 * total / 2 + largest, (r["bytes_read"], total)
    assert sum(r["bytes_read"] for r in results.values()) == total  # each byte once a job, none twice
