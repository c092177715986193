#!/usr/bin/env bash
# Sets up (tools/setup.sh) and runs the whole test suite: ruff, then pytest.
# Extra arguments go to pytest, e.g. tools/test.sh tests/agent -x
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q "$@"
