#!/usr/bin/env bash
# Sets up .venv (tools/setup.sh) and runs a real elastic training demo on the embedded rendezvous:
# a small CNN on generated images, two workers, progress and a final result on the console.
# Each run trains from scratch in its own checkpoint directory, removed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
ckpt="$(mktemp -d "${TMPDIR:-/tmp}/elastrun-demo-ckpt.XXXXXX")"
trap 'rm -rf "$ckpt"' EXIT
.venv/bin/elastrun --standalone --nproc-per-node=2 --max-restarts=3 \
    examples/train_imagenet_style.py --epochs 2 --checkpoint-dir "$ckpt" "$@"
