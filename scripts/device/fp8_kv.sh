#!/usr/bin/env bash
# On the GPU machine (device tool, nvidia-h100-x1): FP8 KV caches and FP8 weights on CUDA.
#   fp8_kv.sh kernels   (dist-kk/kernels.xz: `cargo test --workspace --test kernels --no-run`,
#       stripped): the FP8 KV write against the host's rounding, FP8 attention against the
#       dequantised reference (decode and prefill, the tensor-core tiles), the FP8 weights'
#       quantisation and cuBLASLt FP8 product against their definition, then the attention
#       and KV-write tests, with KERNEL_TEST_DEVICE=cuda.
#   fp8_kv.sh engine   (dist-e/engine.xz, models/tiny-english): the engine's FP8 tests
#       (prompt scores against bf16, generation through chunking, prefix hits and preemption,
#       FP8 cache and FP8 weights) and the default model's, with ENGINE_TEST_DEVICE=cuda.
#   fp8_kv.sh accuracy TEXT   (dist-b/benches.xz, models/tiny-english): perplexity of TEXT (a
#       file the model did not train on), top-1 agreement with bf16 over up to 10,000
#       positions, greedy continuations: bf16, fp8_e4m3 and fp8_e5m2 caches, FP8 weights, both.
#       TAG names the logs (accuracy-TAG.log), as for `linear` (linear-fp8-TAG.log) and `bench`;
#       BURN_NANOVLLM_FP8_SCALES=row takes the FP8 weights' per-row scales.
#   fp8_kv.sh linear MODEL...   (dist-b/benches.xz): every product of each model at decode and
#       prefill sizes, bf16 and FP8 weights.
#   fp8_kv.sh attention   (dist-b/benches.xz): the decode and prefill attention suites over a
#       bf16 and an FP8 cache, both head shapes; KVS the cache forms (default "auto fp8
#       fp8-bits"), MODELS the head shapes (default "qwen2-0.5b,qwen3-0.6b").
#   fp8_kv.sh bench MODEL...   (dist-b/benches.xz): bench.py on random weights of each model's
#       config with the bf16 cache, then FP8 (E4M3), back to back; QUANT=fp8 with FP8 weights,
#       KVS="auto fp8" the cache forms.
#   fp8_kv.sh profile   (dist-b/benches.xz): Nsight Compute on one tensor-core decode launch
#       (256 x 16,384 keys), each cache form in KVS.
#   fp8_kv.sh peers MODEL...   (.peerkit, installed by carrying .pk0, .pk1, .pk2 in turn and
#       running their install.sh): vLLM 0.24's bench.py with kv_cache_dtype="fp8" on a folder of
#       each model's config (load_format="dummy"), $VLLM_KV (default fp8; "auto" for bf16),
#       VLLM_QUANT=fp8 for its FP8 weights (with scripts/device/vllm_stub/ on its path: the kit
#       lacks compressed_tensors, which vLLM imports for any quantization).
# A cache form is a --kv-cache-dtype name, or NAME-bits: that format with its codes decoded by
# bit placement instead of PTX's paired conversion (BURN_NANOVLLM_FP8_DECODE=bits; the FP8
# weights' one-row kernel too).
# Logs go to $OUT.
set -uo pipefail
source "$(dirname "$0")/unpack.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mode=${1:-kernels}
# Runs "$@" with the cache form $KV (see above) appended.
with_kv() {
  if [[ $KV == *-bits ]]; then
    BURN_NANOVLLM_FP8_DECODE=bits "$@" --kv-cache-dtype "${KV%-bits}"
  else
    "$@" --kv-cache-dtype "$KV"
  fi
}
shift || true
case "$mode" in
  kernels)
    KERNEL_TEST_DEVICE=cuda timeout 400 /tmp/bin/kernels fp8 attention store_kv batch_invariance inline_ptx \
      --test-threads 1 2>&1 | tee "$OUT/kernels-cuda.log" | grep -E "^test |test result|panicked" | cut -c1-300
    ;;
  engine)
    ENGINE_TEST_DEVICE=cuda timeout 500 /tmp/bin/engine fp8:: default_model --test-threads 1 \
      --nocapture 2>&1 | tee "$OUT/engine-cuda.log" \
      | grep -E "^test |test result|panicked|NLL|left|right" | cut -c1-300
    ;;
  accuracy)
    name="accuracy${TAG:+-$TAG}"
    timeout 500 /tmp/bin/benches kv-accuracy --device cuda --model models/tiny-english --text "$1" \
      --positions 10000 --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
    echo "exit $?"; grep -v "^graph\|^warm" "$OUT/$name.log" | tail -n 16 | cut -c1-400
    ;;
  linear)
    models=$(IFS=,; echo "$*")
    name="linear-fp8${TAG:+-$TAG}"
    timeout 400 /tmp/bin/benches linear --device cuda --linear-models "$models" --quantization fp8 \
      --ms 1,16,64,256,1024,4096 --ours-only --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
    echo "exit $?"; grep -E "^qwen" "$OUT/$name.log" | cut -d, -f1-8,14
    ;;
  attention)
    for kv in ${KVS:-auto fp8 fp8-bits}; do
      KV=$kv with_kv timeout 240 /tmp/bin/benches decode prefill --device cuda \
        --models "${MODELS:-qwen2-0.5b,qwen3-0.6b}" \
        --out "$OUT/attention-$kv.json" > "$OUT/attention-$kv.log" 2>&1
      echo "== $kv exit $?"; grep -E "^qwen" "$OUT/attention-$kv.log" | cut -d, -f1-3,7-8
    done
    ;;
  bench)
    quant=${QUANT:-none}
    for model in "$@"; do
      for kv in ${KVS:-auto fp8}; do
        name="nano-$model-$kv${QUANT:+-w$QUANT}${TAG:+-$TAG}"
        echo "== $name"
        KV=$kv with_kv timeout 300 /tmp/bin/benches nano --device cuda --dummy "$model" \
          --quantization "$quant" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
        echo "exit $?"; head -n 1 "$OUT/$name.log" | cut -c1-200
        grep -E "^$model" "$OUT/$name.log" | tail -n 1 | cut -d, -f1-8,12,14-15,24
      done
    done
    ;;
  profile)
    # Nsight Compute on one launch of the tensor-core decode kernel at Qwen2-0.5B's heads, 256
    # sequences of 16,384 keys, for each cache form in KVS (default "auto fp8"): duration,
    # issue, occupancy, DRAM activity and the warps' main stall reasons (stalled warps per issued
    # instruction, those of at least 0.5).
    for kv in ${KVS:-auto fp8}; do
      KV=$kv with_kv timeout 120 ncu --kernel-name regex:paged_decode_mma --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section WarpStateStats --section SchedulerStats --section InstructionStats \
        --csv --page raw --print-units base \
        /tmp/bin/benches decode --device cuda --models "${MODELS:-qwen2-0.5b}" \
        --batches 256 --contexts 16384 > "$OUT/ncu-decode-$kv.csv" 2> "$OUT/ncu-decode-$kv.err"
      echo "== $kv ncu exit $?"
      python3 - "$OUT/ncu-decode-$kv.csv" <<'PY'
import csv, sys, re
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if len(rows) < 3:
    sys.exit("no profiled launch")
h = rows[0]
want = re.compile(r"gpu__time_duration\.sum|launch__grid_size|launch__registers_per_thread|"
                  r"sm__warps_active\.avg\.pct_of_peak|smsp__issue_active\.avg\.pct|"
                  r"dram__cycles_active\.avg\.pct_of_peak_sustained_elapsed|smsp__inst_executed\.sum$|"
                  r"smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio")
out = []
for name, v in zip(h, rows[2]):
    if want.search(name):
        try:
            x = float(v.replace(",", ""))
        except ValueError:
            continue
        if "stalled" in name and x < 0.5:
            continue
        name = re.sub(r"smsp__average_warps_issue_stalled_(.*)_per_issue_active\.ratio", r"stall:\1", name)
        out.append(f"{name}={v}")
print("  " + "; ".join(out))
PY
    done
    ;;
  peers)
    export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
    kv=${VLLM_KV:-fp8}
    for model in "$@"; do
      dir=/tmp/models/$model-config
      mkdir -p "$dir"
      cp benches/configs/"$model".json "$dir/config.json"
      cp /tmp/peerkit-tokenizer/{tokenizer.json,tokenizer_config.json} "$dir/"
      flag=()
      [ "$kv" != auto ] && flag=(--kv-cache-dtype "$kv")
      # vLLM's quantization registry imports compressed_tensors, which the kit lacks: a stub.
      [ -n "${VLLM_QUANT:-}" ] && flag+=(--quantization "$VLLM_QUANT") \
        && cp scripts/device/vllm_stub/{ct_stub,sitecustomize}.py /tmp/site/
      name="vllm-$model-$kv${VLLM_QUANT:+-w$VLLM_QUANT}"
      echo "== $name"
      timeout 400 python3 .peerkit/bench_peers.py --engine vllm --model "$dir" --workload bench \
        "${flag[@]}" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
      echo "exit $?"; grep -E "KV cache size|output_tok" "$OUT/$name.log" | cut -c1-200
      tail -n 2 "$OUT/$name.log" | cut -c1-300
    done
    ;;
esac
