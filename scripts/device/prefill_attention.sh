#!/usr/bin/env bash
# On the GPU machine (device tool, nvidia-h200): the tensor-core attention kernels' softmax and
# prefill attention against FlashAttention-3.
#   prefill_attention.sh check   (dist-kk/kernels.xz: `cargo test --workspace --test kernels
#       --no-run`, stripped): the attention tests with KERNEL_TEST_DEVICE=cuda (prefill and
#       decode against the plain-Burn reference: odd lengths, chunks over prefixes, both head
#       sizes, FP8 caches, batch invariance), then the PTX of the prefill kernel (CubeCL's IR
#       dump) checked for `ex2.approx` and counted by instruction.
#   prefill_attention.sh fa3   (dist-fa3/ = a copy of ../shared/peers/fa3): FlashAttention-3 at
#       every shape of `benches prefill` (scripts/device/fa3_prefill.py) -> fa3.csv.
#   prefill_attention.sh ours   (dist-b/benches.xz): `benches decode prefill` with each softmax
#       form (default; BURN_NANOVLLM_SOFTMAX_EXP=exact; BURN_NANOVLLM_SOFTMAX_MASK=all; both,
#       the form before the fast exponential) -> attention-FORM.log/json (SUITES=prefill: prefill
#       only).
#   prefill_attention.sh profile   (dist-b/benches.xz): Nsight Compute's full set for the prefill
#       kernel at every shape of `benches prefill` (the third launch of each launch
#       configuration) -> ncu-prefill.csv, summarised.
#   prefill_attention.sh prefill   (dist-b/benches.xz): `benches prefill`, default kernels, three
#       times -> prefill-N.log/json.
#   prefill_attention.sh tiles H,R,K...   (dist-b/benches.xz): `benches prefill` with each
#       manual-MMA tile BURN_NANOVLLM_PREFILL_MMA=heads_per_cube,row_blocks,block_k (a model
#       whose group the first does not divide keeps its default) -> tile-H,R,K.log/json.
#   prefill_attention.sh e2e MODEL...   (dist-b/benches.xz): through the engine, random weights of
#       each model's config, the softmax before (exact: libdevice `expf`, every stage masked)
#       and after (fast), back to back: `benches throughput` 32 x (8,192 + 128) and
#       1,000 x (512 + 128), `benches latency` of one 8,192-token prompt and one output token
#       -> e2e-FORM-MODEL-*.log/json.
#   prefill_attention.sh serve MODEL...   (dist-b/benches.xz): `benches serve` in process, random
#       weights, 200 requests of 2,048 + 64 tokens at 16 a second (a fresh seed each run), the
#       softmax before (exact) and after (fast), back to back -> serve-FORM-MODEL.log/json.
#   prefill_attention.sh wgmma   (dist-hp/hopper-prefill.xz: experiments/hopper-prefill,
#       `cargo build --release`, stripped): the warp-group-MMA prototype at the shapes of the
#       ratio table without a prefix (several sequences are more heads: each head of each
#       sequence is one independent causal attention; Qwen2's 7 and Qwen3's 2 query heads a kv
#       head): tiles staged by the units or loaded by TMA, P from registers or shared memory,
#       libdevice's or the polynomial exponential -> wgmma.log.
# Logs go to $OUT.
set -uo pipefail
source "$(dirname "$0")/unpack.sh"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
mode_args=("$@")
# The knobs of a softmax form, into the array `env`: fast (the default), exact-exp, mask-all, exact
# (both: the kernel before the fast exponential).
form_env() {
  case "$1" in
    fast) env=() ;;
    exact-exp) env=(BURN_NANOVLLM_SOFTMAX_EXP=exact) ;;
    mask-all) env=(BURN_NANOVLLM_SOFTMAX_MASK=all) ;;
    exact) env=(BURN_NANOVLLM_SOFTMAX_EXP=exact BURN_NANOVLLM_SOFTMAX_MASK=all) ;;
  esac
}
for mode in "$@"; do
  case "$mode" in
    check)
      KERNEL_TEST_DEVICE=cuda timeout 400 /tmp/bin/kernels attention batch_invariance fp8_kv \
        --test-threads 1 2>&1 | tee "$OUT/kernels-cuda.log" | grep -E "^test |test result|panicked" | cut -c1-300
      rm -rf /tmp/ir && mkdir -p /tmp/ir
      CUBECL_DEBUG_PLIRON=/tmp/ir KERNEL_TEST_DEVICE=cuda timeout 200 /tmp/bin/kernels \
        prefill_matches_reference --test-threads 1 > /dev/null 2>&1
      for ptx in $(ls /tmp/ir/*prefill_mma*/nvptx.ptx 2>/dev/null | head -2); do
        echo "== $ptx"; cp "$ptx" "$OUT/$(basename "$(dirname "$ptx")").ptx"
        grep -cE "ex2\.approx" "$ptx" | sed 's/^/ex2.approx: /'
        grep -oE "^\s+(mma|ldmatrix|ex2|fma|max|selp|setp|add|mul|cvt|shfl|bar)[a-z0-9._]*" "$ptx" \
          | sed 's/^\s*//; s/\..*//' | sort | uniq -c | sort -rn | head -14
      done
      ls /tmp/ir | head -5
      ;;
    wgmma)
      for form in libdevice,registers,units libdevice,shared,units libdevice,registers,tma \
        libdevice,shared,tma poly,registers,tma; do
        for shape in "14 4096 64 7" "224 1024 64 7" "3584 512 64 7" "16 4096 128 2" \
          "256 1024 128 2" "4096 512 128 2"; do
          IFS=, read -r exp p load <<< "$form"
          echo "== exp, P, loads: $form; heads seq D group: $shape"
          HOPPER_PREFILL_EXP=$exp HOPPER_PREFILL_P=$p HOPPER_PREFILL_LOAD=$load timeout 120 \
            /tmp/bin/hopper-prefill $shape 2>&1 | tail -n 3
        done
      done | tee "$OUT/wgmma.log"
      ;;
    fa3)
      bash dist-fa3/setup.sh > /dev/null && PYTHONPATH=/tmp/fa3site timeout 300 \
        python3 scripts/device/fa3_prefill.py 2>&1 | tee "$OUT/fa3.csv" | grep -E "^fa3"
      ;;
    ours)
      for form in fast exact-exp mask-all exact; do
        form_env "$form"
        env "${env[@]}" timeout 240 /tmp/bin/benches ${SUITES:-decode prefill} --device cuda --ours-only \
          --out "$OUT/attention-$form.json" > "$OUT/attention-$form.log" 2>&1
        echo "== $form exit $?"; grep -E "^qwen" "$OUT/attention-$form.log" | cut -d, -f1-4,8-10
      done
      ;;
    prefill)
      for n in 1 2 3; do
        timeout 120 /tmp/bin/benches prefill --device cuda --ours-only --out "$OUT/prefill-$n.json" \
          > "$OUT/prefill-$n.log" 2>&1
        echo "== prefill $n exit $?"; grep -E "^qwen" "$OUT/prefill-$n.log" | cut -d, -f1-4,8-10
      done
      ;;
    tiles)
      for tile in "${mode_args[@]:1}"; do
        BURN_NANOVLLM_PREFILL_MMA=$tile timeout 120 /tmp/bin/benches prefill --device cuda \
          --ours-only --out "$OUT/tile-${tile//,/_}.json" > "$OUT/tile-${tile//,/_}.log" 2>&1
        echo "== tile $tile exit $?"; grep -E "^qwen" "$OUT/tile-${tile//,/_}.log" | cut -d, -f1-4,8-10
      done
      break
      ;;
    e2e)
      for model in "${mode_args[@]:1}"; do
        for form in exact fast; do
          form_env "$form"
          for run in "long:throughput --num-prompts 32 --input-len 8192 --output-len 128" \
                     "short:throughput --num-prompts 1000 --input-len 512 --output-len 128" \
                     "ttft:latency --batch-size 1 --input-len 8192 --output-len 1 --iters 5"; do
            name=${run%%:*}; args=${run#*:}
            env "${env[@]}" timeout 300 /tmp/bin/benches $args --device cuda --dummy "$model" \
              --out "$OUT/e2e-$form-$model-$name.json" > "$OUT/e2e-$form-$model-$name.log" 2>&1
            echo "== $form $model $name exit $?: $(grep -E "^qwen|tok/s|latency|ms" "$OUT/e2e-$form-$model-$name.log" | tail -2 | tr '\n' ' ' | cut -c1-300)"
          done
        done
      done
      break
      ;;
    serve)
      for model in "${mode_args[@]:1}"; do
        for form in exact fast; do
          form_env "$form"
          env "${env[@]}" timeout 200 /tmp/bin/benches serve --device cuda --dummy "$model" \
            --num-prompts 200 --input-len 2048 --output-len 64 --request-rate 16 \
            --seed $((RANDOM * 7 + 1)) --out "$OUT/serve-$form-$model.json" \
            > "$OUT/serve-$form-$model.log" 2>&1
          echo "== $form $model exit $?"; grep -E "^(target|in-process)" "$OUT/serve-$form-$model.log" | tail -2
        done
      done
      break
      ;;
    profile)
      timeout 500 ncu --kernel-name regex:prefill_mma --filter-mode per-launch-config \
        --launch-skip 2 --launch-count 1 --set full --import-source no \
        --csv --page details --print-units base \
        /tmp/bin/benches prefill --device cuda --ours-only > "$OUT/ncu-prefill.csv" 2> "$OUT/ncu-prefill.err"
      echo "ncu exit $?"
      python3 - "$OUT/ncu-prefill.csv" <<'PY'
import csv, sys, re
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
h = rows[0]; rows = rows[1:]
iid, ig, im, iv = h.index("ID"), h.index("Grid Size"), h.index("Metric Name"), h.index("Metric Value")
keep = re.compile(r"Registers Per Thread|Achieved Occupancy|Theoretical Occupancy|Duration|Executed Ipc Active|"
                  r"Issue Slots Busy|Warp Cycles Per Issued|Stall|Block Limit|Executed Instructions$|Compute \(SM\) Throughput|Memory Throughput")
seen = {}
for r in rows:
    if keep.search(r[im]):
        seen.setdefault((r[iid], r[ig]), []).append(f"{r[im]}={r[iv]}")
for (i, g), ms in seen.items():
    print(f"== launch {i} grid {g}"); print("  " + "; ".join(ms))
PY
      ;;
  esac
done
