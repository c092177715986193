#!/usr/bin/env bash
# Sets up (tools/setup.sh) and runs the whole test suite: ruff, the import-circle check, then pytest.
# Extra arguments go to pytest, e.g. tools/test.sh tests/agent -x
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
.venv/bin/ruff check .
.venv/bin/python tools/import_circles.py
exec .venv/bin/python -m pytest -q --durations=15 "$@"
