#!/usr/bin/env bash
# On the GPU machine (device tool, nvidia-h100-x1): batch-invariant inference on CUDA.
#   batch_invariance.sh test [MODEL...]   (dist-e/engine.xz: `cargo test --workspace --test engine
#       --no-run`, the binary stripped): the engine's batch-invariance test with
#       ENGINE_TEST_DEVICE=cuda (bf16: one request's tokens and log-probabilities alone, in a
#       batch of 64, preempted, after a prefix-cache hit), over random weights of each MODEL's
#       config (benches/configs/MODEL.json: the real tensor-core tiles; default qwen2-0.5b
#       qwen3-0.6b), or over the qwen2-tiny-tied fixture with MODEL `fixture`.
#   batch_invariance.sh cost MODEL...   (dist-b/benches.xz): bench.py, 1,000 x (528 + 136)
#       +-90 % and one request of 512 + 128, each with and without --batch-invariant, back to
#       back, random weights of each model's config.
#   batch_invariance.sh probe MODEL...   (dist-b/benches.xz, fixtures/qwen2-tokenizer): the
#       in-process server on random weights; one greedy request (with log-probabilities) alone,
#       then beside a flood of 300 random requests, 20 rounds; with and without
#       --batch-invariant: how many rounds give the alone text and log-probabilities.
# $TAG is added to the log names (e.g. TAG=split-k with BURN_NANOVLLM_INVARIANT_SPLIT_K=1, the
# invariant cuBLASLt plans allowed to split K). Logs go to $OUT.
set -uo pipefail
source "$(dirname "$0")/unpack.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mode=${1:-test}
shift || true
case "$mode" in
  test)
    models=("$@")
    [ ${#models[@]} -eq 0 ] && models=(qwen2-0.5b qwen3-0.6b)
    for m in "${models[@]}"; do
      config=(ENGINE_TEST_MODEL_CONFIG="benches/configs/$m.json")
      [ "$m" = fixture ] && config=()
      echo "== $m"
      env ENGINE_TEST_DEVICE=cuda "${config[@]}" timeout 300 /tmp/bin/engine \
        batch_invariance::a_requests --test-threads 1 2>&1 | tee "$OUT/tests-$m${TAG:+-$TAG}.log" \
        | grep -E "^test |test result|panicked|left|right" | cut -c1-400
    done
    ;;
  cost)
    for model in "$@"; do
      for flag in "" --batch-invariant; do
        tag="$model${flag:+-invariant}${TAG:+-$TAG}"
        for suite in nano "throughput --num-prompts 1000 --input-len 528 --output-len 136 --random-range-ratio 0.9" \
          "latency --input-len 512 --output-len 128 --batch-size 1 --iters 3"; do
          name="${suite%% *}-$tag"
          echo "== $name"
          # shellcheck disable=SC2086
          timeout 300 /tmp/bin/benches $suite --device cuda --dummy "$model" $flag \
            --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
          echo "exit $?"; grep -E "^$model" "$OUT/$name.log" | tail -n 1 | cut -d, -f1-8
        done
      done
    done
    ;;
  probe)
    for model in "$@"; do
      for flag in "" --batch-invariant; do
        name="probe-$model${flag:+-invariant}${TAG:+-$TAG}"
        echo "== $name"
        # shellcheck disable=SC2086
        timeout 280 /tmp/bin/benches invariance --device cuda --dummy "$model" $flag \
          --tokenizer fixtures/qwen2-tokenizer --num-prompts 300 --rounds 20 --input-len 256 \
          --output-len 64 --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
        echo "exit $?"; grep -E "^total" "$OUT/$name.log"
      done
    done
    ;;
esac
