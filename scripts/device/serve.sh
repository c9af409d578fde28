#!/usr/bin/env bash
# On the GPU machine (device tool): the OpenAI-compatible server over random weights of the
# Qwen2-0.5B config, loaded by `benches serve` (vLLM's `bench serve` semantics) at several
# request rates. Needs dist/{burn-nanovllm,benches}.xz and torch + transformers (to write the
# random checkpoint). Logs and JSON go to $OUT.
# Usage: [MAX_MODEL_LEN=N] serve.sh [BENCH ARGS...] (e.g. --request-rate 8,32,inf --num-prompts 200);
# the server runs at the checkpoint's own max_model_len (32,768 here) unless MAX_MODEL_LEN is set.
set -uo pipefail
cd "$(dirname "$0")/../.."
mkdir -p /tmp/bin
for f in dist/*.xz; do xz -dc "$f" > "/tmp/bin/$(basename "$f" .xz)" && chmod +x "/tmp/bin/$(basename "$f" .xz)"; done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 - <<'PY'
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
    rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False, hidden_act="silu",
    bos_token_id=151643, eos_token_id=151643)
torch.manual_seed(0)
Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained("/tmp/qwen2-0.5b-dummy")
PY
start=$(date +%s)
/tmp/bin/burn-nanovllm serve --model /tmp/qwen2-0.5b-dummy --served-model-name qwen2-0.5b-dummy \
  --device cuda ${MAX_MODEL_LEN:+--max-model-len $MAX_MODEL_LEN} --port 8000 > "$OUT/server.log" 2>&1 &
server=$!
until curl -sf localhost:8000/health > /dev/null; do
  sleep 1
  if ! kill -0 $server 2>/dev/null || [ $(( $(date +%s) - start )) -gt 300 ]; then
    echo "server did not come up"; tail -20 "$OUT/server.log"; exit 1
  fi
done
echo "server up in $(( $(date +%s) - start )) s"
timeout 400 /tmp/bin/benches serve --device cpu --url http://127.0.0.1:8000 --out "$OUT/serve.json" "$@"
curl -s localhost:8000/metrics > "$OUT/metrics.txt"
grep -E "^burn_nanovllm_(requests_finished|generation_tokens|prompt_tokens|prefix_cache)" "$OUT/metrics.txt"
kill -INT $server; wait $server; echo "server exit $?"
tail -3 "$OUT/server.log"
