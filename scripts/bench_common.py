"""What the step-time benchmarks share: the model-shape flags and the machine line they print."""

from __future__ import annotations

import argparse
import os
import platform


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """--model, --batch-size and --seq-len, with the defaults every step-time table uses."""
    parser.add_argument("--model", default="small", help="shardlib.models config name (default: small)")
    parser.add_argument("--batch-size", type=int, default=32, help="global sequences per step (default: 32)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default: the config's max_seq_len)")


def machine(*others: str) -> str:
    """CPU, cores, JAX's devices and versions (``others``: further 'name version' entries)."""
    import jax

    devices = jax.devices()
    return ", ".join([f"{platform.processor() or platform.machine()}", f"{os.cpu_count()} CPU cores",
                      f"{len(devices)} simulated {devices[0].platform.upper()} devices", f"jax {jax.__version__}",
                      *others, f"Python {platform.python_version()}", load()])


def load() -> str:
    """The 1/5/15-minute load averages: other jobs on the machine slow both sides of a ratio alike
    only while they stay steady, so the tables say how busy the machine was."""
    return "load average " + " / ".join(f"{x:.1f}" for x in os.getloadavg())
