#!/usr/bin/env bash
# Sets up, lints, then runs the test suite (pytest-timeout turns any hang into a failure).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check expertmesh tests tools benchmarks examples
.venv/bin/ruff format --check expertmesh tests tools benchmarks examples
HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@"
