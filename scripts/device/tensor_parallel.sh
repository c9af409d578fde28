#!/usr/bin/env bash
# On a GPU machine with several GPUs of one host (device tool, nvidia-h100-x2 or x4):
# tensor parallelism. One binary travels per call (each is ~40 MB of the 64 MiB tree):
#   tensor_parallel.sh check   (dist/burn-nanovllm.xz, models/tiny-english): greedy outputs of
#       the default model at TP 1, 2 (and 4 where 4 GPUs are seen; each with the whole LM head
#       and with --vocab-parallel), f32 and bf16 ($DTYPES picks), through `generate`, compared
#       with TP 1's.
#   tensor_parallel.sh bench MODEL...   (dist-b/benches.xz): bench.py (`nano`) and one request
#       of 512 + 128 tokens (`latency`) on random weights of each model's config at TP 1, 2
#       (and 4), both engines in one process (which must then exit).
#   tensor_parallel.sh nano MODEL:TP[:vocab|:gather]...   (dist-b/benches.xz): bench.py alone
#       in its process per spec, in order (`:vocab`: --vocab-parallel; `:gather`: that and
#       BURN_NANOVLLM_TP_LOGITS=gather, every step's logits gathered instead of the shards'
#       draws exchanged).
#   tensor_parallel.sh latency MODEL:TP[:vocab]...   (dist-b/benches.xz): one request of
#       512 + 128 tokens, 3 iterations, alone in its process per spec.
#   (nano and latency pass $BENCH_ARGS on to benches, e.g. BENCH_ARGS=--gpu-timeline for rank
#   0's GPU busy and idle time per step, and add $BENCH_TAG to the log names.)
#   tensor_parallel.sh step MODEL:TP...   (dist-b/benches.xz): one rank's share of a decode
#       step (its heads and intermediate columns, attention over 1,024 keys a row, the LM head;
#       no sums over the ranks) on one GPU, replayed as a CUDA graph, at $MS rows (default
#       64,256): what the engine's step at that size spends beyond it is the sums, the sampler
#       and the host.
#   tensor_parallel.sh peers MODEL:TP...   (the peer kit installed in /tmp/site, its copy
#       carried as .peerkit): vLLM 0.24's bench.py run (bench_peers.py --workload bench) at each
#       spec, random weights of benches/configs/MODEL.json (load_format dummy) with the Qwen2
#       tokenizer install.sh leaves in /tmp/peerkit-tokenizer; run `nano` with the same specs
#       in the same call for ours beside it.
#   tensor_parallel.sh kill MODEL   (dist-b/benches.xz): bench.py at TP 2, a worker killed with
#       SIGKILL mid-run; how long rank 0 takes to end, and with what error.
#   tensor_parallel.sh early-exit   (dist/burn-nanovllm.xz, models/tiny-english): rank 1 given a
#       GPU that does not exist (CUDA_VISIBLE_DEVICES=0,99) exits before the group forms; rank 0
#       must end with an error naming it, not wait.
# Logs go to $OUT. NCCL_NVLS_ENABLE=0 (NVLink multicast off) in every process.
set -uo pipefail
source "$(dirname "$0")/unpack.sh"
export NCCL_NVLS_ENABLE=0
gpus=$(nvidia-smi --list-gpus | wc -l)
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
sizes="1 2"
[ "$gpus" -ge 4 ] && sizes="1 2 4"
mode=${1:-check}
shift || true
case "$mode" in
  check)
    # TP 1, then each larger size with the whole LM head and with --vocab-parallel ("v").
    prompts=(--prompt "Once upon a time" --prompt "The little dog" --prompt "She opened the door and")
    runs="1"
    for tp in $sizes; do [ "$tp" != 1 ] && runs="$runs $tp ${tp}v"; done
    for dtype in ${DTYPES:-f32 bf16}; do
      for run in $runs; do
        tp=${run%v}
        extra=()
        [ "$run" != "$tp" ] && extra=(--vocab-parallel)
        echo "== generate, default model, $dtype, TP $run"
        timeout 300 /tmp/bin/burn-nanovllm generate --device cuda --dtype "$dtype" -tp "$tp" \
          "${extra[@]}" --temperature 0 --max-tokens 48 --no-progress "${prompts[@]}" \
          > "$OUT/generate-$dtype-tp$run.txt" 2> "$OUT/generate-$dtype-tp$run.log"
        echo "exit $?"; tail -n 2 "$OUT/generate-$dtype-tp$run.log"
      done
      for run in $runs; do
        [ "$run" = 1 ] && continue
        if cmp -s "$OUT/generate-$dtype-tp1.txt" "$OUT/generate-$dtype-tp$run.txt"; then
          echo "$dtype TP $run: identical to TP 1"
        else
          echo "$dtype TP $run: differs from TP 1"
          diff "$OUT/generate-$dtype-tp1.txt" "$OUT/generate-$dtype-tp$run.txt" | head -20
        fi
      done
    done
    ;;
  bench)
    for model in "$@"; do
      for tp in $sizes; do
        echo "== $model TP $tp"
        start=$(date +%s)
        timeout 300 /tmp/bin/benches nano latency --device cuda --dummy "$model" -tp "$tp" \
          --input-len 512 --output-len 128 --batch-size 1 --out "$OUT/bench-$model-tp$tp.json" \
          2>&1 | tee "$OUT/bench-$model-tp$tp.log" | grep -E "^$model" | tail -n 2
        echo "exit ${PIPESTATUS[0]} after $(( $(date +%s) - start )) s"
      done
    done
    ;;
  nano|latency)
    for spec in "$@"; do
      IFS=: read -r model tp how <<< "$spec"
      env=()
      vocab=()
      [ -n "${how:-}" ] && vocab=(--vocab-parallel)
      [ "${how:-}" = gather ] && env=(BURN_NANOVLLM_TP_LOGITS=gather)
      name="$mode-$model-tp$tp${how:+-$how}${BENCH_TAG:+-$BENCH_TAG}"
      args=(nano)
      [ "$mode" = latency ] && args=(latency --input-len 512 --output-len 128 --batch-size 1 --iters 3)
      echo "== $name"
      start=$(date +%s)
      env "${env[@]}" timeout 300 /tmp/bin/benches "${args[@]}" --device cuda --dummy "$model" \
        -tp "$tp" "${vocab[@]}" ${BENCH_ARGS:-} --out "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log" | grep -E "^$model|blocks" | tail -n 3
      echo "exit ${PIPESTATUS[0]} after $(( $(date +%s) - start )) s"
    done
    ;;
  step)
    for spec in "$@"; do
      IFS=: read -r model tp _ <<< "$spec"
      echo "== step $model TP $tp share"
      timeout 300 /tmp/bin/benches step --device cuda --dummy "$model" -tp "$tp" --ours-only \
        --ms "${MS:-64,256}" --out "$OUT/step-$model-tp$tp.json" > "$OUT/step-$model-tp$tp.log" 2>&1
      echo "exit $?"; tail -n 3 "$OUT/step-$model-tp$tp.log"
    done
    ;;
  peers)
    export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
    for spec in "$@"; do
      IFS=: read -r model tp _ <<< "$spec"
      dir=/tmp/models/$model-config
      mkdir -p "$dir"
      cp benches/configs/"$model".json "$dir/config.json"
      # The Qwen2 tokenizer the kit's install.sh leaves there.
      cp /tmp/peerkit-tokenizer/{tokenizer.json,tokenizer_config.json} "$dir/"
      echo "== vLLM $model TP $tp"
      start=$(date +%s)
      timeout 400 python3 .peerkit/bench_peers.py --engine vllm --model "$dir" --workload bench \
        --tensor-parallel-size "$tp" --out "$OUT/vllm-$model-tp$tp.json" > "$OUT/vllm-$model-tp$tp.log" 2>&1
      echo "exit $? after $(( $(date +%s) - start )) s"
      tail -n 3 "$OUT/vllm-$model-tp$tp.log"
    done
    ;;
  early-exit)
    t0=$(date +%s%N)
    CUDA_VISIBLE_DEVICES=0,99 timeout 120 /tmp/bin/burn-nanovllm generate --device cuda -tp 2 \
      --max-tokens 4 --no-progress --prompt "Once upon a time" > "$OUT/early-exit.log" 2>&1
    echo "exit $? after $(( ($(date +%s%N) - t0) / 1000000 )) ms"; tail -n 3 "$OUT/early-exit.log"
    ;;
  kill)
    model=${1:-qwen2-7b}
    /tmp/bin/benches nano --device cuda --dummy "$model" -tp 2 > "$OUT/kill.log" 2>&1 &
    rank0=$!
    # The step graphs are captured once every rank has started; the timed run follows.
    for _ in $(seq 1 240); do grep -q "graph 8192 tokens" "$OUT/kill.log" && break; sleep 0.5; done
    sleep 4
    worker=$(pgrep -P "$rank0" | head -1)
    echo "rank 0 $rank0, worker ${worker:-none}"
    t0=$(date +%s%N); kill -9 "$worker"
    for _ in $(seq 1 600); do kill -0 "$rank0" 2>/dev/null || break; sleep 0.1; done
    t1=$(date +%s%N)
    if kill -0 "$rank0" 2>/dev/null; then echo "rank 0 still running 60 s after the kill"; kill -9 "$rank0"; fi
    wait "$rank0"; echo "rank 0 exit $? after $(( (t1 - t0) / 1000000 )) ms"
    grep -v "^graph" "$OUT/kill.log" | grep -iE "error|exited" | head -4
    ;;
esac
