#!/usr/bin/env bash
# Creates .venv with torch pinned to the CPU build (override: TORCH_SPEC="torch==X" for a GPU build)
# and installs expertmesh editable with its test extras. Re-running is cheap: a stamp file
# records what was installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
stamp=.venv/.expertmesh-setup
want="$(cat pyproject.toml | sha256sum | cut -c1-16) $TORCH_SPEC"
if [ -x .venv/bin/python ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check "$TORCH_SPEC"
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
echo "$want" > "$stamp"
