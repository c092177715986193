#!/usr/bin/env bash
# Sets up .venv (tools/setup.sh) and runs a real elastic training demo on the embedded rendezvous:
# a small CNN on generated images, two workers.  Halfway through, tools/demo_fault.py SIGKILLs
# rank 1 from outside; the job restores from node memory and finishes.  At the end: the failure,
# the recovery time, the committed steps lost (0), a check that every sample was used exactly once
# per epoch, the job's goodput (what share of the workers' time went into steps that were kept, and
# where the rest went) and the timeline of the run (a picture and an interactive page).  Checkpoints go to a temporary directory (removed);
# the event log, the per-step records and the picture stay in runs/demo-<time>/.
# Extra arguments go to elastrun, e.g. `bash tools/demo.sh --start-method spawn`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
samples=2048 epochs=2 kill_at=40   # 32 steps per epoch with 2 workers × 32: the kill lands in epoch 2
run="runs/demo-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$run"
ckpt="$(mktemp -d "${TMPDIR:-/tmp}/elastrun-demo-ckpt.XXXXXX")"
watcher=""
cleanup() {
    if [ -n "$watcher" ]; then kill "$watcher" 2>/dev/null || true; fi
    rm -rf "$ckpt"
}
trap cleanup EXIT
.venv/bin/python tools/demo_fault.py kill "$run/audit" --rank 1 --at-step "$kill_at" --timeout 300 &
watcher=$!
.venv/bin/elastrun --standalone --nproc-per-node=2 --max-restarts=3 --log-dir "$run/logs" "$@" \
    examples/train_imagenet_style.py --epochs "$epochs" --samples "$samples" --checkpoint-dir "$ckpt" \
    --audit-dir "$run/audit"
wait "$watcher"
watcher=""
echo
echo "== what happened =="
.venv/bin/python tools/demo_fault.py report "$run/audit" "$run/logs" --samples "$samples"
echo "goodput:    $(.venv/bin/elastrun goodput "$run/logs" | tail -n 1)"
echo "            (the breakdown: elastrun goodput $run/logs)"
if .venv/bin/python -c "import matplotlib" 2>/dev/null; then
    .venv/bin/elastrun timeline "$run/logs" -o "$run/timeline.png" --html "$run/timeline.html" >/dev/null
    echo "timeline:   $run/timeline.png, $run/timeline.html  (elastrun timeline $run/logs)"
else
    echo "timeline:   pip install 'elastrun[timeline]', then: elastrun timeline $run/logs -o timeline.png"
fi
