#!/bin/bash
# shardlib on a Cloud TPU pod slice: the same command on every worker VM, started over gcloud ssh.
#
#   TPU_NAME=my-v4-32 ZONE=us-central2-b scripts/tpu_pod_train.sh
#   TPU_NAME=my-v5e-64 ZONE=us-west4-a scripts/tpu_pod_train.sh --model 1b --strategy fsdp_tp --mesh fsdp=-1,tensor=4
#
# Each worker runs one process that drives all of its local TPU chips (4 on v4/v5p hosts, 4 or
# 8 on v5e/v6e). shardlib.runtime.distributed.initialize() sees the Cloud TPU VM and calls
# jax.distributed.initialize() with no arguments: JAX reads the worker list and this worker's
# id from the TPU metadata server, and worker 0 becomes the coordinator. Nothing to set by hand.
#
# The code must be at the same path on every worker; the first step below copies the working
# tree there. Output of all workers is interleaved, prefixed by gcloud
# with the worker number. If one worker dies, the others abort within SHARDLIB_HEARTBEAT_TIMEOUT
# seconds (at once if it was worker 0). See docs/multihost.md.

set -euo pipefail

: "${TPU_NAME:?set TPU_NAME to the TPU VM (pod slice) name}"
: "${ZONE:?set ZONE to its zone, e.g. us-central2-b}"
PROJECT_ARGS=()
if [ -n "${PROJECT:-}" ]; then PROJECT_ARGS=(--project "$PROJECT"); fi
REMOTE_DIR=${REMOTE_DIR:-shardlib}
# Run directory: multi-host checkpoints need storage every worker reaches (shared filesystem).
OUT=${OUT:-runs/tpu-$(date +%Y%m%d-%H%M%S)}

MODEL_ARGS=("$@")
if [ ${#MODEL_ARGS[@]} -eq 0 ]; then
    MODEL_ARGS=(--model gpt2-small --strategy zero3 --mesh fsdp=-1 --steps 1000 --batch-size 128 --seq-len 1024)
fi
printf -v QUOTED_ARGS '%q ' "${MODEL_ARGS[@]}"

REPO_ROOT=$(cd "$(dirname "$0")/.." && pwd)

# 1. Same code on every worker (the working tree, without virtualenvs, runs and git history).
ARCHIVE=$(mktemp -t shardlib-XXXXXX.tgz)
tar -czf "$ARCHIVE" -C "$REPO_ROOT" --exclude=.venv --exclude=.git --exclude=runs .
gcloud compute tpus tpu-vm scp "${PROJECT_ARGS[@]}" --zone "$ZONE" --worker=all "$ARCHIVE" "$TPU_NAME:~/shardlib.tgz"
gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${PROJECT_ARGS[@]}" --zone "$ZONE" --worker=all --command \
    "mkdir -p ~/$REMOTE_DIR && tar -xzf ~/shardlib.tgz -C ~/$REMOTE_DIR"
rm -f "$ARCHIVE"

# 2. Same environment on every worker (skip if the image already has it).
gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${PROJECT_ARGS[@]}" --zone "$ZONE" --worker=all --command \
    "cd ~/$REMOTE_DIR && pip install -q -e . 'jax[tpu]==0.10.2'"

# 3. Same command on every worker, at the same time.
gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${PROJECT_ARGS[@]}" --zone "$ZONE" --worker=all --command \
    "cd ~/$REMOTE_DIR && SHARDLIB_HEARTBEAT_TIMEOUT=\${SHARDLIB_HEARTBEAT_TIMEOUT:-30} \
     python -m shardlib.cli train --out $(printf '%q' "$OUT") $QUOTED_ARGS"
