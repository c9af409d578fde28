#!/usr/bin/env bash
# On a GPU machine with 2 or 4 GPUs of one host (dist/burn-nanovllm.xz, fixtures/qwen2-tokenizer):
# the first token's top-5 log-probabilities of a random-weight checkpoint with Qwen2.5-7B's
# config (benches/configs/qwen2-7b.json; scripts/device/random_checkpoint.py writes it, the same
# model at every size) over 8 prompts, bf16 at TP 1, 2 (and 4) with the whole LM head and with
# --vocab-parallel at the largest size, and f32 at TP 1 as the measure of bf16's own noise; then each run against
# bf16 TP 1 and f32 TP 1 (scripts/device/compare_logprobs.py). Logs go to $OUT.
set -uo pipefail
source "$(dirname "$0")/unpack.sh"
export NCCL_NVLS_ENABLE=0
gpus=$(nvidia-smi --list-gpus | wc -l)
model=/tmp/models/qwen2-7b-random
[ -f "$model/model.safetensors" ] || python3 scripts/device/random_checkpoint.py \
  benches/configs/qwen2-7b.json fixtures/qwen2-tokenizer "$model" | tee "$OUT/checkpoint.log"
prompts=()
for p in "Once upon a time" "The capital of France is" "def fibonacci(n):" "In 1905, Einstein" \
  "The quick brown fox" "Water boils at" "Translate to German: good morning" "1, 2, 3, 5, 8,"; do
  prompts+=(--prompt "$p")
done
# Loading the 15 GB checkpoint takes 40-70 s a run: the bf16 sizes first, f32 last.
runs="bf16:1 bf16:2"
[ "$gpus" -ge 4 ] && runs="$runs bf16:4"
runs="$runs bf16:${gpus}v f32:1"
for run in $runs; do
  IFS=: read -r dtype tp <<< "$run"
  extra=()
  [ "${tp%v}" != "$tp" ] && extra=(--vocab-parallel)
  echo "== $dtype TP $tp"
  timeout 300 /tmp/bin/burn-nanovllm generate --model "$model" --device cuda --dtype "$dtype" \
    -tp "${tp%v}" "${extra[@]}" --max-model-len 4096 --temperature 0 --max-tokens 1 --logprobs 5 \
    --no-progress "${prompts[@]}" > "$OUT/logprobs-$dtype-tp$tp.txt" 2> "$OUT/logprobs-$dtype-tp$tp.log"
  echo "exit $?"; tail -n 1 "$OUT/logprobs-$dtype-tp$tp.log"
  python3 scripts/device/compare_logprobs.py "$OUT"/logprobs-*.txt > "$OUT/compare.txt"
done
cat "$OUT/compare.txt"
# The device returns a handful of files: the runs' outputs in one archive.
(cd "$OUT" && tar czf logprobs.tgz logprobs-* && rm logprobs-*)
