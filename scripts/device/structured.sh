#!/usr/bin/env bash
# On the GPU machine (device tool): structured outputs on CUDA, with whichever
# binaries dist*/ hold (carry one folder per call, back to back; /tmp/bin stays while the
# machine is warm):
#   kernels (dist-k/kernels.xz): every kernel test on CUDA, the token-mask kernel among them;
#   engine (dist/engine.xz, with models/ in the tree): the structured-output engine tests on
#     CUDA (bf16 default model, step graphs captured, overlapped steps);
#   bench (dist-bench/benches.xz, with fixtures/qwen2-tokenizer in the tree): bench.py
#     (`benches nano`, Qwen2-0.5B random weights with the Qwen2 tokenizer) with 0 %, 50 % and
#     100 % of the requests constrained to a JSON schema: output tok/s, per-step mask time; at
#     100 % once more with CUDA events (`--gpu-timeline`): the device's busy and idle time per step;
#     first the host's grammar work alone (`benches grammar`: masks and matcher advances per step
#     for 1–256 constrained rows, all cores and one thread). FRACTIONS (default "0 0.5 1") picks
#     the bench.py runs.
# Logs go to $OUT.
set -uo pipefail
source "$(dirname "$0")/unpack.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
export RUST_BACKTRACE=0
quiet() { grep -vE "^\s*$|^ +[0-9]+:|^ +at "; }
if [[ -x /tmp/bin/kernels && -e dist-k/kernels.xz ]]; then
  echo "== kernel tests on CUDA"
  KERNEL_TEST_DEVICE=cuda timeout 300 /tmp/bin/kernels --test-threads=1 2>&1 \
    | tee "$OUT/kernel_tests.log" | grep -E "^test |test result|panicked|rror" | tail -30
fi
if [[ -x /tmp/bin/engine && -e dist/engine.xz ]]; then
  echo "== structured-output engine tests on CUDA"
  ENGINE_TEST_DEVICE=cuda timeout 400 /tmp/bin/engine structured --test-threads=1 2>&1 \
    | tee "$OUT/engine_structured.log" | grep -E "^test |test result|panicked|rror|left|right" | tail -30
fi
if [[ -x /tmp/bin/benches && -e dist-bench/benches.xz ]]; then
  echo "== grammar masks and advances on the host ($(nproc) cores)"
  timeout 200 /tmp/bin/benches grammar --tokenizer fixtures/qwen2-tokenizer \
    --out "$OUT/grammar.json" 2>&1 | tee "$OUT/grammar.log" | quiet | tail -12
  for f in ${FRACTIONS:-0 0.5 1}; do
    echo "== bench.py (nano), Qwen2-0.5B, --json-fraction $f"
    timeout 240 /tmp/bin/benches nano --device cuda --tokenizer fixtures/qwen2-tokenizer \
      --json-fraction $f --out "$OUT/nano-json-$f.json" 2>&1 | tee "$OUT/nano-json-$f.log" | quiet | tail -4
  done
  echo "== bench.py (nano), Qwen2-0.5B, --json-fraction 1, CUDA events per step"
  timeout 240 /tmp/bin/benches nano --device cuda --tokenizer fixtures/qwen2-tokenizer \
    --json-fraction 1 --gpu-timeline 2>&1 | tee "$OUT/nano-json-1-timeline.log" | quiet | tail -24
fi
