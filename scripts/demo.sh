#!/usr/bin/env bash
# Sets up, then generates with the embedded default model (a tiny PhiMoE trained by tools/).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
.venv/bin/expertmesh generate \
  --prompt "Hello, my name is" \
  --prompt "1 2 3 4 5" \
  --prompt "Monday Tuesday Wednesday" \
  --max-tokens 24 "$@"
