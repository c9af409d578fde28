#!/usr/bin/env bash
# On the GPU machine (device tool): kernel tests on CUDA (plane and tensor-core paths), then
# parity with transformers on a random Qwen2-0.5B checkpoint. Needs dist/{kernels,burn-nanovllm}.xz
# (stripped, xz-compressed dev-profile builds; carry one at a time if both exceed the 64 MiB
# limit: the script skips what is absent). Logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
mkdir -p /tmp/bin
for f in dist/*.xz; do xz -dc "$f" > "/tmp/bin/$(basename "$f" .xz)" && chmod +x "/tmp/bin/$(basename "$f" .xz)"; done
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
echo "== kernel tests on CUDA"
[ -x /tmp/bin/kernels ] && KERNEL_TEST_DEVICE=cuda timeout 300 /tmp/bin/kernels 2>&1 | tee "$OUT/kernel_tests.log" | grep -E "^test |test result|panicked|error"
echo "== transformers parity"
[ -x /tmp/bin/burn-nanovllm ] && PYTHONUNBUFFERED=1 timeout 400 python3 scripts/hf_parity.py /tmp/bin/burn-nanovllm 2>&1 | tee "$OUT/hf_parity.log" | grep -vE "^(loaded|prompt [0-9])|Loading weights|Writing model"
