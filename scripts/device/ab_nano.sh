#!/usr/bin/env bash
# On the GPU machine (device tool): the decode step (ours, then PyTorch + graph) and an A/B of
# the engine on nano-vLLM's bench.py workload between two builds in one command, interleaved:
# dist/benches.xz (this tree) and dist/benches_prev.xz (the build before the change).
# Usage: ab_nano.sh [ROUNDS] (default 2); results in $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
mkdir -p /tmp/bin
for f in dist/*.xz; do xz -dc "$f" > "/tmp/bin/$(basename "$f" .xz)" && chmod +x "/tmp/bin/$(basename "$f" .xz)"; done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
echo "== decode step (ours: fused ops and the model's deferred norms; errors against the f32 step)"
timeout 200 /tmp/bin/benches step --device cuda --ours-only --out "$OUT/step.json" 2>&1 | tee "$OUT/step.log" | grep -E "^model|^qwen"
PYTHONUNBUFFERED=1 timeout 60 python3 scripts/baselines/torch_decode_step.py 2>&1 | tee "$OUT/torch_decode_step.csv"
for round in $(seq 1 "${1:-2}"); do
  for build in benches benches_prev; do
    for model in qwen2-0.5b qwen3-0.6b; do
      echo "== round $round $build $model"
      timeout 200 /tmp/bin/$build nano --device cuda --dummy $model --out "$OUT/nano-$build-$model-$round.json" 2>&1 | tee "$OUT/nano-$build-$model-$round.log" | grep -E "^qwen"
    done
  done
done
