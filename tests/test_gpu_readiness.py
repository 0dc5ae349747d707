"""GPU readiness on a CPU machine: the XLA_FLAGS string `set_gpu_overlap_flags` writes, and the MFU
benchmark's smoke run. The flags' effect on a GPU is measured by hand (docs/gpu.md)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from shardlib.runtime import xla_flags
from shardlib.runtime.xla_flags import GPU_OVERLAP_FLAGS, flag_names, set_gpu_overlap_flags, with_flags

from tests import compile_flags

ROOT = Path(__file__).resolve().parents[1]


def _subprocess_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return {**env, "PYTHONPATH": str(ROOT), "XLA_FLAGS": compile_flags.FAST, **extra}


def test_flags_string_for_an_empty_environment():
    expected = " ".join(f"--{name}={value}" for name, value in GPU_OVERLAP_FLAGS)
    assert with_flags("") == expected
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in expected.split()
    assert {"xla_gpu_all_reduce_combine_threshold_bytes", "xla_gpu_all_gather_combine_threshold_bytes",
            "xla_gpu_reduce_scatter_combine_threshold_bytes"} <= flag_names(expected)


def test_user_flags_win_and_are_kept_verbatim():
    user = ("--xla_gpu_enable_latency_hiding_scheduler=false  --xla_gpu_all_gather_combine_threshold_bytes=1 "
            "--xla_dump_to=/tmp/d")
    merged = with_flags(user)
    assert merged.startswith(user.strip())
    tokens = merged.split()
    for name in ("xla_gpu_enable_latency_hiding_scheduler", "xla_gpu_all_gather_combine_threshold_bytes"):
        assert sum(t.startswith(f"--{name}=") for t in tokens) == 1  # set once: the user's value
    assert "--xla_gpu_enable_latency_hiding_scheduler=false" in tokens
    assert "--xla_gpu_all_reduce_combine_threshold_bytes=134217728" in tokens
    assert with_flags(merged) == merged  # idempotent


def test_calling_after_the_backend_started_is_an_error():
    jax.devices()  # this test process's backend is up
    with pytest.raises(RuntimeError, match="already started.*before any JAX computation"):
        set_gpu_overlap_flags("gpu")


def test_gpu_sets_the_flags_and_cpu_tpu_leave_them(monkeypatch):
    """In this process the backend is up, so the start check is stubbed to test the platform branch."""
    monkeypatch.setattr("shardlib.compat.backends_initialized", lambda: False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_pipelined_all_gather=false")
    for platform in ("cpu", "tpu"):
        note = set_gpu_overlap_flags(platform)
        assert "not set" in note and "GPU-only" in note
        assert os.environ["XLA_FLAGS"] == "--xla_gpu_enable_pipelined_all_gather=false"
    note = set_gpu_overlap_flags("cuda")
    assert "kept your XLA_FLAGS value of xla_gpu_enable_pipelined_all_gather" in note
    assert os.environ["XLA_FLAGS"] == with_flags("--xla_gpu_enable_pipelined_all_gather=false")
    assert xla_flags._platform_before_start() == (False, f"JAX_PLATFORMS={os.environ['JAX_PLATFORMS']}")


def test_every_flag_is_known_to_this_jaxlib():
    """XLA aborts a process on an unknown XLA_FLAGS entry; a JAX release that drops one fails here."""
    env = _subprocess_env(JAX_PLATFORMS="cpu", XLA_FLAGS=with_flags(""))
    result = subprocess.run([sys.executable, "-c", "import jax; print(int(jax.numpy.ones(3).sum()))"],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "3", result.stderr[-2000:]


def test_benchmark_mfu_smoke_run_on_cpu():
    env = _subprocess_env(JAX_PLATFORMS="cpu")
    cmd = [sys.executable, str(ROOT / "scripts" / "benchmark_mfu.py"), "--steps", "2", "--warmup", "1",
           "--batch-size", "8", "--seq-len", "32", "--xla-gpu-overlap", "--vs-jit"]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "model       tiny" in out and "zero3, bf16, einsum attention, remat on" in out
    assert "devices     8 x cpu" in out
    assert "batch       8 x 32 tokens" in out
    tokens_per_s = re.search(r"^tokens/s +([\d,]+)$", out, re.MULTILINE)
    assert tokens_per_s and int(tokens_per_s[1].replace(",", "")) > 0
    assert "MFU         n/a (no peak figure for cpu)" in out
    assert "XLA GPU overlap flags not set (JAX_PLATFORMS=cpu)" in out
    assert re.search(r"^vs jit +\d+\.\d{3} \(plain jax\.jit step: [\d.]+ ms\)$", out, re.MULTILINE), out


def test_train_flag_after_the_backend_started_names_the_flag():
    from shardlib.run.config import TrainConfig, TrainConfigError
    from shardlib.run.train import train

    jax.devices()
    with pytest.raises(TrainConfigError, match="--xla-gpu-overlap: .*already started"):
        train(TrainConfig(model="tiny", xla_gpu_overlap=True))


def test_benchmark_mfu_figure_against_the_palm_formula(monkeypatch):
    """The MFU line on a device with a peak: 6 N + 12 L H Q T FLOPs per token, written here from the shapes."""
    import argparse
    import importlib.util

    from shardlib.models import get_config

    spec = importlib.util.spec_from_file_location("benchmark_mfu", ROOT / "scripts" / "benchmark_mfu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr("shardlib.tools.flops.peak_flops_for", lambda device: 2e12)
    c = get_config("tiny")
    args = argparse.Namespace(model="tiny", strategy="zero3", precision="bf16", batch_size=16, seq_len=32, steps=3,
                              attention="einsum", remat=True)
    lines = bench.report(args, c, step_s=1e-4, compile_s=1.0)
    layer = c.d_model * c.head_dim * (2 * c.n_heads + 2 * c.n_kv_heads) + 3 * c.d_model * c.d_ff + 2 * c.d_model
    matmul_params = c.vocab_size * c.d_model + c.n_layers * layer + c.d_model  # the output head, layers, final norm
    per_token = 6 * matmul_params + 12 * c.n_layers * c.n_heads * c.head_dim * 32
    expected = per_token * 16 * 32 / (1e-4 * len(jax.devices()) * 2e12)
    mfu_line = next(line for line in lines if line.startswith("MFU"))
    assert f"{expected:.1%} (of 2 TFLOP/s" in mfu_line
    assert any(line == f"tokens/s    {16 * 32 / 1e-4:,.0f}" for line in lines)


@pytest.mark.filterwarnings("ignore::shardlib.ReplicationWarning")  # the toy head is kept whole
def test_benchmark_user_models_runs_and_refuses_a_baseline_that_trains_differently(capsys):
    """A scanned linen ViT under zero3 at toy size: the table row comes out and the script's own
    check passes (shardlib's and the user's jit step end on the same loss); a jit step that trains
    something else is refused rather than timed."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("benchmark_user_models", ROOT / "scripts" / "benchmark_user_models.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--models", "vit_scan", "--strategies", "zero3", "--width", "16", "--depth", "1", "--heads",
                       "2", "--batch-size", "8", "--image-size", "16", "--repeats", "1", "--warmup", "0"]) == 0
    row = re.search(r"^vit_scan zero3 +fsdp=8 +([\d.]+) +([\d.]+) +([\d.]+) ", capsys.readouterr().out, re.MULTILINE)
    assert row and all(float(x) > 0 for x in row.groups())
    step = lambda loss: lambda state, batch: (state, {"loss": loss})  # noqa: E731
    with pytest.raises(SystemExit, match=r"shardlib's loss is 1 and the jit step's 1\.1: .*not compute the same step"):
        bench.check_same_training({"shardlib": step(1.0), "jit": step(1.1)}, {"shardlib": None, "jit": None}, None)
