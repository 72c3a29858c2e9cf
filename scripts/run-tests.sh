#!/usr/bin/env bash
# The README's test command: installs what is missing, then runs the whole suite
# (unit, integration against a real PostgreSQL and Redis that the tests start, e2e;
# tests/gpu skips without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
exec ${PYTHON:-python3} -m pytest -q "$@"
