#!/usr/bin/env bash
# Does shardlib work with the Python and JAX already here (Colab, a TPU VM, a GPU image)?
# Installs shardlib with --no-deps into the current `python` (nothing else is installed or
# upgraded), prints the versions it runs with, then runs two parity tests, 20 steps of
# `shardlib train --model tiny` and `shardlib plan` on tiny. docs/install.md records results.
#
#   bash scripts/smoke_env.sh            # from the repository root, in the environment to check
set -euo pipefail
cd "$(dirname "$0")/.."
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

step() { printf '\n== %s\n' "$*"; }

step "install shardlib --no-deps into $(command -v python)"
# Without build isolation when setuptools is here, so a machine with no network can install.
if python -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 68)" 2>/dev/null; then
  python -m pip install --quiet --no-deps --no-build-isolation -e .
else
  python -m pip install --quiet --no-deps -e .
fi

step "versions"
python - <<'EOF'
import platform
from importlib import metadata

import jax

print(f"python            {platform.python_version()} ({platform.platform()})")
for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy"):
    print(f"{name:<17} {metadata.version(name)}")
for name in ("tensorboardX", "tensorboard", "matplotlib", "tqdm"):
    try:
        print(f"{name:<17} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        print(f"{name:<17} (not installed)")
print(f"backend           {jax.default_backend()}: {jax.device_count()} x {jax.devices()[0].device_kind}")
EOF

# An accelerator runs the job as it is; a CPU-only machine simulates 8 devices. One device
# cannot shard, so it trains dp; more train zero3 (the default).
read -r backend count < <(python -c "import jax; print(jax.default_backend(), jax.device_count())")
if [ "$backend" = cpu ]; then
  devices=(--cpu-devices 8); strategy=zero3
else
  devices=(); strategy=$([ "$count" -gt 1 ] && echo zero3 || echo dp)
fi

step "parity tests (8 simulated CPU devices, tests/conftest.py)"
python -m pytest -q -p no:cacheprovider tests/test_parity.py -k "zero3-fsdp8 or dp-data8"

step "shardlib train --model tiny --strategy $strategy (20 steps, on $backend)"
shardlib train --model tiny --strategy "$strategy" "${devices[@]}" --steps 20 --batch-size 16 --seq-len 32 \
  --eval-every 10 --sample-tokens 16 --no-progress --out "$out/run"
test -s "$out/run/metrics.jsonl"

step "shardlib plan --model tiny --devices 8"
shardlib plan --model tiny --devices 8 --all

step "smoke test passed"
