#!/usr/bin/env bash
# On the GPU machine (device tool): kernel tests on CUDA (plane and tensor-core paths; the
# second pass with our tiled cmma kernel for large M), then parity with transformers on a random
# Qwen2-0.5B checkpoint. Needs dist/{kernels,burn-nanovllm}.xz (stripped, xz-compressed
# debug-profile builds). Logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
mkdir -p /tmp/bin
for f in dist/*.xz; do xz -dc "$f" > "/tmp/bin/$(basename "$f" .xz)" && chmod +x "/tmp/bin/$(basename "$f" .xz)"; done
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
echo "== kernel tests on CUDA"
KERNEL_TEST_DEVICE=cuda timeout 300 /tmp/bin/kernels 2>&1 | tee "$OUT/kernel_tests.log" | grep -E "^test |test result|panicked|error"
echo "== kernel tests on CUDA, tiled cmma kernel for large M"
BURN_NANOVLLM_TILED_CMMA=1 KERNEL_TEST_DEVICE=cuda timeout 300 /tmp/bin/kernels linear 2>&1 | tee "$OUT/kernel_tests_tiled.log" | grep -E "^test |test result|panicked|error"
echo "== transformers parity"
PYTHONUNBUFFERED=1 timeout 400 python3 scripts/hf_parity.py /tmp/bin/burn-nanovllm 2>&1 | tee "$OUT/hf_parity.log" | grep -vE "^(loaded|prompt [0-9])|Loading weights|Writing model"
