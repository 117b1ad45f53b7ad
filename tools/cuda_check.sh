#!/usr/bin/env bash
# The CUDA path on a machine with one GPU: the single-process tests run there unchanged (a process
# that sees a GPU takes cuda:0 by default), against the same CPU references (transformers, gguf).
# Multi-process tests need a GPU a rank and are expected to stop with the "needs its own CUDA
# device" error on one GPU. Each failure is appended to OUT_DIR/failures.txt as it happens (a run
# cut short by its time limit still says what failed). Usage: bash tools/cuda_check.sh [OUT_DIR] [pytest args...]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-/tmp/cuda_check}; shift || true
mkdir -p "$out"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 EXPERTMESH_FAILURE_LOG="$out/failures.txt" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}
nvidia-smi -L
$py -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))"
files=(tests/test_models_vs_hf.py tests/test_families_2026.py tests/test_deepseek.py tests/test_real_families.py
  tests/test_hybrid_families.py tests/test_chunked_prefill.py tests/test_prefix_caching.py tests/test_spec_decode.py
  tests/test_spec_mtp.py tests/test_sampling.py tests/test_sampling_surface.py tests/test_sampler_distribution.py
  tests/test_scheduling.py tests/test_request_failures.py tests/test_default_model.py tests/test_quantization.py
  tests/test_quantization_held.py tests/test_compressed_tensors.py tests/test_structured_outputs.py
  tests/test_server.py tests/test_server_tools.py tests/test_attention_variants.py tests/test_routing.py
  tests/test_gguf.py tests/test_warmup.py tests/test_errors.py tests/test_strict_loading.py tests/test_verify.py)
# Build the CPU kernels once before the workers start (each would otherwise compile them at once).
$py -c "from expertmesh.cpu import cpu_kernels; print('cpu kernels:', cpu_kernels.load() is not None)"
timeout -s INT -k 20 "${CUDA_CHECK_TIMEOUT:-420}" $py -m pytest -q -p no:cacheprovider -rfE --tb=short --timeout 150 \
  -n "${CUDA_CHECK_WORKERS:-8}" --dist loadfile --junitxml="$out/junit.xml" \
  "${files[@]}" "$@" 2>&1 | tee "$out/pytest.log" | tail -150
