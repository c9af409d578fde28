#!/usr/bin/env bash
# On the GPU machine (device tool): the OpenAI server over random weights of Qwen2-0.5B's Hub
# config (max_position_embeddings 131,072, so serve's default max_model_len is 131,072), at
# that default and at --max-model-len 4096, 1,000 requests of 528 + 136 tokens ±90 %, 256 in
# flight, measured by our client (`benches serve --url`) and, where the peer kit is installed
# (/tmp/site holds vLLM), by vLLM's (`serve_client.py`). Every client run has its own seed
# (a reused seed against a prefix-caching server measures cache hits).
#
# Binaries: dist/*.xz (this build) and, if present, dist-old/*.xz (a baseline build, its
# binaries renamed *-old, run at the default length only), unpacked by unpack.sh. Logs and
# JSON go to $OUT.
# Usage: serve_lengths.sh [LENGTHS...]   (default: "default 4096"; a length of "default"
# passes no --max-model-len)
set -uo pipefail
source "$(dirname "$0")/unpack.sh"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
model=/tmp/models/qwen2-0.5b
[ -d $model ] || python3 .peerkit/make_models.py --models qwen2-0.5b --tokenizer-dir fixtures/qwen2-tokenizer > /dev/null
lengths=("$@")
[ ${#lengths[@]} -eq 0 ] && lengths=(default 4096)
seed=$(( $(date +%s) % 100000 ))
vllm_client() {  # PORT NAME TAG
  [ -d /tmp/site/vllm ] || return 0
  seed=$((seed + 1))
  PYTHONPATH=/tmp/site timeout 300 python3 .peerkit/serve_client.py --backend vllm \
    --base-url "http://127.0.0.1:$1" --model "$2" --tokenizer $model --dataset-name random \
    --random-input-len 528 --random-output-len 136 --random-range-ratio 0.9 --num-prompts 1000 \
    --ignore-eos --max-concurrency 256 --seed $seed --save-result --result-dir "$OUT" \
    --result-filename "vllm-client-$3.json" > "$OUT/vllm-client-$3.log" 2>&1
  grep -E "Output token throughput|Median TTFT|Median TPOT" "$OUT/vllm-client-$3.log" | sed "s/^/  vLLM client $3: /"
}
ours_client() {  # PORT TAG
  seed=$((seed + 1))
  timeout 300 /tmp/bin/benches serve --device cpu --url "http://127.0.0.1:$1" --num-prompts 1000 \
    --input-len 528 --output-len 136 --random-range-ratio 0.9 --max-concurrency 256 --seed $seed \
    --out "$OUT/ours-client-$2.json" > "$OUT/ours-client-$2.log" 2>&1
  grep -E "out tok/s|output_tok_s|TTFT|TPOT" "$OUT/ours-client-$2.log" | tail -3 | sed "s/^/  our client $2: /"
}
serve_ours() {  # BINARY TAG LEN
  local flag=""
  [ "$3" != default ] && flag="--max-model-len $3"
  local start=$(date +%s)
  $1 serve --model $model --served-model-name qwen2 --device cuda $flag --port 8000 \
    > "$OUT/server-$2.log" 2>&1 &
  local pid=$!
  until curl -sf localhost:8000/health > /dev/null; do
    sleep 1
    if ! kill -0 $pid 2>/dev/null || [ $(( $(date +%s) - start )) -gt 240 ]; then
      echo "server $2 did not come up"; tail -5 "$OUT/server-$2.log"; kill $pid 2>/dev/null; return
    fi
  done
  echo "== $2: up in $(( $(date +%s) - start )) s; $(grep -m1 -o 'max_model_len [0-9]*' "$OUT/server-$2.log")"
  ours_client 8000 "$2"
  vllm_client 8000 qwen2 "$2"
  kill -INT $pid; wait $pid
}
# The baseline build at the default length only (the "before" of the default).
[ -x /tmp/bin/burn-nanovllm-old ] && serve_ours /tmp/bin/burn-nanovllm-old old-default default
for len in "${lengths[@]}"; do
  serve_ours /tmp/bin/burn-nanovllm "new-$len" "$len"
done
exit 0
