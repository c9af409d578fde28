#!/usr/bin/env bash
# On the GPU machine (device tool): the linear layers against cuBLAS in one command — kernel
# tests with cuBLASLt and without it, `benches linear` and `torch_linear.py` on the same shapes
# (joined by compare_linear.py), the skinny/cuBLASLt crossover, and the decode step against
# PyTorch + CUDA graph. Needs dist/{kernels,benches}.xz. Results go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
mkdir -p /tmp/bin
for f in dist/*.xz; do xz -dc "$f" > "/tmp/bin/$(basename "$f" .xz)" && chmod +x "/tmp/bin/$(basename "$f" .xz)"; done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
MS=${MS:-1,2,4,8,16,32,64,128,256,1024,4096}
DTYPES=${DTYPES:-bf16,f16}
if [ -x /tmp/bin/kernels ]; then
  echo "== kernel tests on CUDA (cuBLASLt)"
  KERNEL_TEST_DEVICE=cuda timeout 240 /tmp/bin/kernels 2>&1 | tee "$OUT/kernel_tests.log" | grep -E "^test |test result|panicked|route=Cublas" | head -40
  echo "== kernel tests on CUDA, linear, BURN_NANOVLLM_CUBLAS=0 (cubek)"
  BURN_NANOVLLM_CUBLAS=0 KERNEL_TEST_DEVICE=cuda timeout 120 /tmp/bin/kernels linear 2>&1 | tee "$OUT/kernel_tests_cubek.log" | grep -E "^test |test result|panicked"
  echo "== kernel tests on CUDA, prefill attention, BURN_NANOVLLM_PREFILL_CMMA=1 (portable cmma)"
  BURN_NANOVLLM_PREFILL_CMMA=1 KERNEL_TEST_DEVICE=cuda timeout 120 /tmp/bin/kernels prefill 2>&1 | tee "$OUT/kernel_tests_cmma.log" | grep -E "^test |test result|panicked"
fi
if [ -x /tmp/bin/benches ] && [ -z "${NO_LINEAR:-}" ]; then
  echo "== benches linear (ours)"
  timeout 300 /tmp/bin/benches linear --device cuda --ours-only --ms "$MS" --dtypes "$DTYPES" --out "$OUT/linear.json" > "$OUT/linear.log" 2>&1; tail -3 "$OUT/linear.log"
  echo "== torch_linear.py (cuBLAS)"
  PYTHONUNBUFFERED=1 timeout 300 python3 scripts/baselines/torch_linear.py --ms "$MS" --dtypes "$DTYPES" > "$OUT/torch_linear.csv" 2>&1; tail -2 "$OUT/torch_linear.csv"
  python3 scripts/baselines/compare_linear.py "$OUT/linear.json" "$OUT/torch_linear.csv" | tee "$OUT/linear_compare.md" | tail -20
  echo "== cuBLASLt at M = 1..8 instead of the skinny kernel (BURN_NANOVLLM_SKINNY_MAX_M=0)"
  BURN_NANOVLLM_SKINNY_MAX_M=0 timeout 60 /tmp/bin/benches linear --device cuda --ours-only --ms 1,2,4,8 --dtypes bf16 --out "$OUT/linear_small_cublas.json" > "$OUT/linear_small_cublas.log" 2>&1
  python3 scripts/baselines/compare_linear.py "$OUT/linear_small_cublas.json" "$OUT/torch_linear.csv" > "$OUT/linear_small_cublas_compare.md"; tail -5 "$OUT/linear_small_cublas_compare.md"
  echo "== decode step (ours, then PyTorch)"
  timeout 150 /tmp/bin/benches step --device cuda --ours-only --out "$OUT/step.json" 2>&1 | tee "$OUT/step.log" | grep -v "^\s*$" | tail -6
  PYTHONUNBUFFERED=1 timeout 60 python3 scripts/baselines/torch_decode_step.py 2>&1 | tee "$OUT/torch_decode_step.csv"
  if [ -n "${NANO:-}" ]; then
    echo "== bench.py workload (benches nano, Qwen2-0.5B dummy)"
    timeout 200 /tmp/bin/benches nano --device cuda --out "$OUT/nano.json" 2>&1 | tee "$OUT/nano.log" | grep -v "^\s*$" | tail -2
    echo "== bench.py workload (Qwen3-0.6B dummy)"
    timeout 200 /tmp/bin/benches nano --device cuda --dummy qwen3-0.6b --out "$OUT/nano-qwen3.json" 2>&1 | tee "$OUT/nano-qwen3.log" | grep -v "^\s*$" | tail -2
  fi
fi
tar -C "$OUT" -czf "$OUT/gemm-results.tgz" --exclude gemm-results.tgz . 2>/dev/null
