#!/usr/bin/env bash
# Creates .venv with elastrun (editable) and its dev tools; installs etcd, iproute2, SLURM (slurm-wlm's
# slurmctld, slurmd and client commands, for tests/deploy/test_slurm_cluster.py) and Chromium with its
# WebDriver (for the timeline page's browser test, tests/observe/test_goodput_accuracy.py) when root.
# Idempotent: a second run only checks.  torch is pinned to the CPU build 2.13.0 for dev and CI.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
# The system packages install in the background, beside the Python ones below (each installer keeps one
# core busy; on a fresh machine they are the set-up's two longest steps).  A failure of etcd's or
# iproute2's install still stops this script, at the wait.
apt_pid=""
if [ "$(id -u)" = 0 ] && { ! command -v etcd >/dev/null || ! command -v ip >/dev/null \
        || ! command -v slurmctld >/dev/null || ! command -v chromedriver >/dev/null; }; then
    (
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq >/dev/null
        apt-get install -y -qq etcd-server iproute2 >/dev/null
        # The daemons are not started here: the test runs its own, configured in a temporary directory.
        apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client >/dev/null \
            || echo "setup.sh: SLURM could not be installed; its tests will be skipped" >&2
        apt-get install -y -qq chromium chromium-driver >/dev/null \
            || echo "setup.sh: Chromium could not be installed; the browser test will be skipped" >&2
    ) &
    apt_pid=$!
    # Whatever stops this script, it leaves no installer running behind it.
    trap 'wait "$apt_pid" 2>/dev/null || true' EXIT
fi
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
if [ ! -x .venv/bin/elastrun ] || ! .venv/bin/python -c "import torch, pytest, xdist, pytest_cov, etcd3gw, websocket, selenium" 2>/dev/null \
        || ! .venv/bin/python -c "import importlib.util as u, sys
sys.exit(any(u.find_spec(m) is None for m in ('accelerate', 'pytorch_lightning')))" \
        || [ "${FORCE_INSTALL:-0}" = 1 ]; then
    .venv/bin/pip install -q --upgrade pip
    # pip compiles every module it installs (the dev install: 59 s with, 26 s without, on 2 cores);
    # instead the modules that elastrun, its workers and the suite import are compiled once, by
    # importing them (about a third of torch's), in one process, before any test needs them.
    .venv/bin/pip install -q --no-compile "torch==2.13.0" -e ".[dev]"
    env -u PYTHONDONTWRITEBYTECODE .venv/bin/python -W ignore -c "import torch, torch._dynamo, torch.nn.parallel, \
torch.distributed, torch.distributed.fsdp, torch.distributed.checkpoint, torch.distributed.tensor, torch.optim, \
torch.distributed.optim, torch.distributed.algorithms.ddp_comm_hooks, torch.distributed.tensor.debug, \
torch.utils.data, elastrun.train, elastrun.agent.agent, pytest, xdist.dsession, pytest_cov, etcd3gw, websocket, \
selenium.webdriver, pytorch_lightning, accelerate" || echo "setup.sh: warming the byte-code cache failed; the first imports compile it" >&2
fi
if [ -n "$apt_pid" ]; then
    wait "$apt_pid"
    trap - EXIT
fi
