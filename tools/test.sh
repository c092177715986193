#!/usr/bin/env bash
# Sets up (tools/setup.sh) and runs the whole test suite: ruff, the import-circle check, then pytest on
# TEST_WORKERS xdist workers at once (default 4: most tests wait on the processes they start, and since agents
# are forked from a warm interpreter (tests/warm.py) 3 left the 2 cores idle 17 % of the time; 4 cut that to
# 7 %: docs/testing.md; tests/conftest.py's ONE_WORKER_FILES each stay on one worker).
# Extra arguments go to pytest, e.g. tools/test.sh tests/agent -x
#
# tools/test.sh --fast: the quick loop (docs/testing.md): ruff, the import-circle check, then only the unit
# and contract tiers (in-process, no agent or worker started) on 2 xdist workers, with the package's
# coverage by module.  Extra arguments go to its pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."
# torch's TCPStore looks up the name of every peer it connects or accepts (a reverse DNS query, on the store's
# own thread), and a resolver that drops a query stalls it for glibc's 5 s timeout: here, about once every 25
# connections to a store (docs/testing.md, "Reverse DNS").  Every test talks over loopback; 1 s is plenty.
# A value already set is kept.
export RES_OPTIONS="${RES_OPTIONS:-timeout:1 attempts:1}"
# Byte-code is cached as on a user's machine, where nothing sets PYTHONDONTWRITEBYTECODE: with it set (as on this
# project's machines) each of the suite's ~700 processes compiles the elastrun modules it imports, and each
# pytest process rewrites every test module again.
unset PYTHONDONTWRITEBYTECODE
fast=0
if [ "${1:-}" = "--fast" ]; then
    fast=1
    shift
fi
bash tools/setup.sh
.venv/bin/ruff check .
.venv/bin/python tools/import_circles.py
if [ "$fast" = 1 ]; then
    exec .venv/bin/python -m pytest -q -n "${TEST_WORKERS:-2}" --tier=unit,contract \
        --cov=elastrun --cov-report=term --durations=5 "$@"
fi
exec .venv/bin/python -m pytest -q -n "${TEST_WORKERS:-4}" --durations=15 "$@"
