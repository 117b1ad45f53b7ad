#!/usr/bin/env bash
# On a machine with one CUDA GPU: expertmesh's one-process CUDA tokens against transformers on
# CUDA (Mixtral, Qwen3-MoE), then tok/s of the small MoE at batch 1 and 32 (fp32, bf16).
# Needs a CUDA build of torch in .venv: TORCH_SPEC="torch==<version>" make setup.
# Not part of CI (CI is CPU-only); without CUDA it stops with exit code 2 and says why.
# Takes a few minutes; the output is what docs/benchmarks.md's GPU section records.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  echo "gpu_check: no .venv here; run: TORCH_SPEC=\"torch==<version>\" make setup" >&2
  exit 2
fi
if ! command -v nvidia-smi > /dev/null 2>&1; then
  echo "gpu_check: nvidia-smi not found: this check needs a machine with an NVIDIA GPU" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
HF_HUB_OFFLINE=1 exec .venv/bin/python benchmarks/gpu_check.py "$@"
