#!/usr/bin/env bash
# Sets up .venv (tools/setup.sh) and runs a real elastic training demo on the embedded rendezvous:
# a small CNN on generated images, two workers, trained through et.run (in-process re-forms).
# Halfway through, tools/demo_fault.py SIGKILLs rank 1 from outside: only that worker is started
# anew, the survivor keeps its process (same PID) and rolls back to the last commit, and the job
# finishes.  At the end: the failure, the recovery time, who kept their process, the committed steps
# lost (0), a check that every sample was used exactly once per epoch, the job's goodput (what share
# of the workers' time went into steps that were kept) and the timeline of the run (a picture and an
# interactive page).  Checkpoints go to a temporary directory (removed); the event log, the per-step
# records and the picture stay in runs/demo-<time>/.
#
#   bash tools/demo.sh                          # et.run: the survivor keeps its process
#   bash tools/demo.sh --plain-loop             # the usual script, for comparison: every worker restarts
#   bash tools/demo.sh --start-method spawn     # other arguments go to elastrun
set -euo pipefail
cd "$(dirname "$0")/.."
mode=()
args=()
for arg in "$@"; do
    if [ "$arg" = --plain-loop ]; then mode=(--plain-loop); else args+=("$arg"); fi
done
bash tools/setup.sh
# 32 steps per epoch with 2 workers × 32: the kill lands in epoch 2, between two checkpoints (every 20
# steps; docs/first-minute.md says what a kill right after a checkpoint's commit adds)
samples=2048 epochs=2 kill_at=45
mkdir -p runs
run="runs/demo-$(date +%Y%m%d-%H%M%S)"
for n in $(seq 2 100); do  # another demo started in the same second: take the next free name
    if mkdir "$run" 2>/dev/null; then break; fi
    run="runs/demo-$(date +%Y%m%d-%H%M%S)-$n"
done
[ -d "$run" ] || { echo "demo: cannot make a run directory under runs/" >&2; exit 1; }
ckpt="$(mktemp -d "${TMPDIR:-/tmp}/elastrun-demo-ckpt.XXXXXX")"
watcher=""
cleanup() {
    if [ -n "$watcher" ]; then kill "$watcher" 2>/dev/null || true; fi
    rm -rf "$ckpt"
}
trap cleanup EXIT
if [ ${#mode[@]} -eq 0 ]; then
    echo "demo: 2 workers train through et.run; rank 1 will be SIGKILLed after step $kill_at (--plain-loop: the usual script)"
else
    echo "demo: 2 workers train with the usual loop; rank 1 will be SIGKILLed after step $kill_at"
fi
.venv/bin/python tools/demo_fault.py kill "$run/audit" --rank 1 --at-step "$kill_at" --timeout 300 &
watcher=$!
.venv/bin/elastrun --standalone --nproc-per-node=2 --max-restarts=3 --log-dir "$run/logs" ${args[@]+"${args[@]}"} \
    examples/train_imagenet_style.py --epochs "$epochs" --samples "$samples" --checkpoint-dir "$ckpt" \
    --audit-dir "$run/audit" ${mode[@]+"${mode[@]}"}
wait "$watcher"
watcher=""
echo
echo "== what happened =="
.venv/bin/python tools/demo_fault.py report "$run/audit" "$run/logs" --samples "$samples"
if .venv/bin/python -c "import matplotlib" 2>/dev/null; then
    .venv/bin/elastrun timeline "$run/logs" -o "$run/timeline.png" --html "$run/timeline.html" >/dev/null
    echo "timeline:   $run/timeline.png, $run/timeline.html  (elastrun timeline $run/logs)"
else
    echo "timeline:   pip install 'elastrun[timeline]', then: elastrun timeline $run/logs -o timeline.png"
fi
