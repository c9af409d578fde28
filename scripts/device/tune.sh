#!/usr/bin/env bash
# On the GPU machine (device tool): kernel tests on CUDA, then every benchmark of `benches`
# (CUDA-graph timings), plus the linear suite with the alternative large-M and skinny paths
# (BURN_NANOVLLM_TILED_CMMA, BURN_NANOVLLM_SKINNY_MAX_M) to choose the crossovers.
# Needs dist-bench/{benches,kernels}.xz. Results (JSON and logs) go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
mkdir -p /tmp/bin
for f in dist-bench/*.xz; do xz -dc "$f" > "/tmp/bin/$(basename "$f" .xz)" && chmod +x "/tmp/bin/$(basename "$f" .xz)"; done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
KERNEL_TEST_DEVICE=cuda timeout 300 /tmp/bin/kernels 2>&1 | grep -E "^test |test result|panicked at|error" | tee "$OUT/kernel_tests.log"
BURN_NANOVLLM_TILED_CMMA=1 KERNEL_TEST_DEVICE=cuda timeout 120 /tmp/bin/kernels linear 2>&1 | grep -E "test result|panicked at" | tee -a "$OUT/kernel_tests.log"
b=/tmp/bin/benches
timeout 330 $b linear decode step --device cuda --out "$OUT/main.json" > "$OUT/main.log" 2>&1; echo "main rc=$?"
BURN_NANOVLLM_TILED_CMMA=1 timeout 100 $b linear --ours-only --ms 64,256,1024,4096 --device cuda --out "$OUT/tiled_cmma.json" > "$OUT/tiled_cmma.log" 2>&1; echo "tiled rc=$?"
BURN_NANOVLLM_SKINNY_MAX_M=32 timeout 60 $b linear --ours-only --ms 16,32 --device cuda --out "$OUT/skinny32.json" > "$OUT/skinny32.log" 2>&1; echo "skinny32 rc=$?"
grep -hvE "panicked|backtrace|BACKTRACE|Option::unwrap" "$OUT"/main.log "$OUT"/tiled_cmma.log "$OUT"/skinny32.log | cut -c1-110
