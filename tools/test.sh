#!/usr/bin/env bash
# Sets up (tools/setup.sh) and runs the whole test suite: ruff, the import-circle check, then pytest in two
# phases: every test not marked serial on TEST_WORKERS xdist workers at once (default 3: most tests wait on
# the processes they start, so 3 keep 2 cores busy; tests/conftest.py's ONE_WORKER_FILES each stay on one
# worker), then the tests marked serial, one at a time, alone.
# Extra arguments go to both pytest runs, e.g. tools/test.sh tests/agent -x
#
# tools/test.sh --fast: the quick loop (docs/testing.md): ruff, the import-circle check, then only the unit
# and contract tiers (in-process, no agent or worker started) on 2 xdist workers, with the package's
# coverage by module.  Extra arguments go to its pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."
# torch's TCPStore looks up the name of every peer it connects or accepts (a reverse DNS query, on the store's
# own thread), and a resolver that drops a query stalls it for glibc's 5 s timeout: here, about once every 25
# connections to a store (docs/testing.md, "Reverse DNS").  Every test talks over loopback; 1 s is plenty.  A value already
# set is kept.
export RES_OPTIONS="${RES_OPTIONS:-timeout:1 attempts:1}"
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
# Exit code 5 is "no test selected": one phase that the arguments leave empty (e.g. tools/test.sh tests/cli)
# is fine; both empty is still an error.
codes=()
for args in "-n ${TEST_WORKERS:-3} --tests-phase=concurrent" "--tests-phase=serial"; do
    rc=0
    # shellcheck disable=SC2086  # $args: the phase's own options, split into words
    .venv/bin/python -m pytest -q --durations=15 $args "$@" || rc=$?
    codes+=("$rc")
done
case "${codes[0]} ${codes[1]}" in
    "0 0" | "0 5" | "5 0") exit 0 ;;
    "5 5") exit 5 ;;
    *) for rc in "${codes[@]}"; do if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then exit "$rc"; fi; done ;;
esac
