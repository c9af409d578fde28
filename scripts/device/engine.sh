#!/usr/bin/env bash
# On the GPU machine (device tool): the kernel and engine tests on CUDA, then the engine on
# nano-vLLM's bench.py workload (graphs on, then off), whichever binaries dist/ holds
# (kernels.xz, engine.xz: test binaries; benches.xz). Logs and JSON go to $OUT.
# Usage: engine.sh [BENCH ARGS...] (extra arguments for `benches nano`, e.g. --dummy qwen3-0.6b)
set -uo pipefail
cd "$(dirname "$0")/../.."
mkdir -p /tmp/bin
for f in dist/*.xz; do
  [ -e "$f" ] && xz -dc "$f" > "/tmp/bin/$(basename "$f" .xz)" && chmod +x "/tmp/bin/$(basename "$f" .xz)"
done
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
export RUST_BACKTRACE=0
if [ -x /tmp/bin/kernels ]; then
  echo "== kernel tests on CUDA"
  KERNEL_TEST_DEVICE=cuda timeout 240 /tmp/bin/kernels --test-threads=1 2>&1 | tee "$OUT/kernel_tests.log" | grep -E "^test |test result|panicked|rror"
fi
if [ -x /tmp/bin/engine ]; then
  echo "== engine tests on CUDA (f32 fixtures, decode graphs)"
  ENGINE_TEST_DEVICE=cuda timeout 400 /tmp/bin/engine --test-threads=1 --skip cubecl_cpu 2>&1 | tee "$OUT/engine_tests.log" | grep -E "^test |test result|panicked|rror|left|right"
fi
if [ -x /tmp/bin/benches ]; then
  for mode in graphs eager; do
    echo "== bench nano ($mode) $*"
    flag=""; [ "$mode" = eager ] && flag="--enforce-eager"
    timeout 250 /tmp/bin/benches nano --device cuda $flag "$@" --out "$OUT/nano-$mode.json" 2>&1 | tee "$OUT/nano-$mode.log" | grep -vE "^ +[0-9]+:|^ +at "
  done
fi
