#!/usr/bin/env bash
# On the GPU machine (device tool), after the peer kit is installed (/tmp/site): vLLM 0.24's
# OpenAI server beside ours, both at the checkpoint's default max_model_len (Qwen2-0.5B's Hub
# config: 131,072), measured by vLLM's own client (`serve_client.py`, a fresh seed per run):
# 1,000 requests of 528 + 136 ±90 % with 256 in flight (ours also at --max-model-len 4096),
# and long contexts: one request of 100,000 prompt tokens + 512, and 64 requests of
# 16,384 + 256 (all at once). Needs dist/burn-nanovllm.xz and the kit's copy carried as
# .peerkit (with serve-wheels/). Logs and JSON go to $OUT.
set -uo pipefail
source "$(dirname "$0")/unpack.sh"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
model=/tmp/models/qwen2-0.5b
[ -d $model ] || python3 .peerkit/make_models.py --models qwen2-0.5b --tokenizer-dir /tmp/peerkit-tokenizer > /dev/null
python3 -m pip install -q --no-index --no-deps --target /tmp/site .peerkit/serve-wheels/*.whl 2>&1 | tail -2
seed=$(( $(date +%s) % 100000 + 500 ))
client() {  # PORT TAG INPUT OUTPUT PROMPTS CONCURRENCY [RANGE]
  seed=$((seed + 1))
  PYTHONPATH=/tmp/site timeout 400 python3 .peerkit/serve_client.py --backend vllm \
    --base-url "http://127.0.0.1:$1" --model qwen2 --tokenizer $model --dataset-name random \
    --random-input-len "$3" --random-output-len "$4" --random-range-ratio "${7:-0}" \
    --num-prompts "$5" --ignore-eos --max-concurrency "$6" --seed $seed --save-result \
    --result-dir "$OUT" --result-filename "$2.json" > "$OUT/$2.log" 2>&1
  grep -E "Output token throughput|Median TTFT|Median TPOT|Successful" "$OUT/$2.log" | sed "s/^/  $2: /"
}
wait_up() {  # PORT PID LOG
  local start=$(date +%s)
  until curl -sf "localhost:$1/health" > /dev/null; do
    sleep 2
    if ! kill -0 "$2" 2>/dev/null || [ $(( $(date +%s) - start )) -gt 300 ]; then
      echo "server on $1 did not come up"; tail -5 "$3"; return 1
    fi
  done
  echo "  up in $(( $(date +%s) - start )) s"
}
echo "== vLLM 0.24 server, default max_model_len"
PYTHONPATH=/tmp/site python3 -m vllm.entrypoints.openai.api_server --model $model \
  --load-format dummy --dtype bfloat16 --served-model-name qwen2 --port 8001 \
  > "$OUT/vllm-server.log" 2>&1 &
vllm=$!
if wait_up 8001 $vllm "$OUT/vllm-server.log"; then
  grep -m1 -o "max_model_len=[0-9]*\|max_seq_len=[0-9]*" "$OUT/vllm-server.log"
  client 8001 vllm-range 528 136 1000 256 0.9
  client 8001 vllm-long-100k 100000 512 1 1
  client 8001 vllm-long-64x16k 16384 256 64 64
fi
kill -INT $vllm; wait $vllm
for len in default 4096; do
  echo "== ours, max_model_len $len"
  flag=""; [ $len != default ] && flag="--max-model-len $len"
  /tmp/bin/burn-nanovllm serve --model $model --served-model-name qwen2 --device cuda --port 8000 \
    $flag > "$OUT/ours-server-$len.log" 2>&1 &
  ours=$!
  if wait_up 8000 $ours "$OUT/ours-server-$len.log"; then
    grep -m1 -o "max_model_len [0-9]*" "$OUT/ours-server-$len.log"
    client 8000 ours-range-$len 528 136 1000 256 0.9
    if [ $len = default ]; then
      client 8000 ours-long-100k 100000 512 1 1
      client 8000 ours-long-64x16k 16384 256 64 64
    fi
  fi
  kill -INT $ours; wait $ours
done
exit 0
