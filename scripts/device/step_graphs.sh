#!/usr/bin/env bash
# On the GPU machine (device tool): the step graphs' checks and figures in one command, with whichever
# binaries dist*/ hold (engine.xz, kernels.xz: test binaries; benches.xz: built with
# `--features benches/host-profile`, unstripped for the host profile). The three exceed the
# travelling tree's 64 MiB together: carry one folder per call, back to back (/tmp/bin stays
# while the machine is warm).
#   1. engine tests on CUDA: step graphs (decode and mixed steps captured) against transformers'
#      goldens and eager steps, padding, prefix hits, preemption; kernel tests on CUDA;
#   2. `benches throughput` 1,000 × (528 + 136), equal lengths and ±90 %; bench.py (`nano`); one
#      request 512 + 128 (`latency`);
#   3. the eager step's host profile (`--enforce-eager --host-profile`, ±90 %, 300 requests), and
#      eager steps with CUDA's stream-ordered allocator (`alloc`);
#   4. the shape sweep under compute-sanitizer (`sanitize`);
#   5. the same requests offline and through the server, in process and over HTTP (`serve`);
#   6. where a replayed decode step's host time goes: bench.py with `--host-profile` (`replay`);
#   7. overlapped against synchronous steps, same binary, back to back (`overlap`): the four
#      figures of 2. and bench.py on Qwen3-0.6B, each with and without `--sync-steps`, into
#      two logs (overlap.log, sync.log);
#   8. the device's busy and idle time per step from CUDA events (`timeline`, `--gpu-timeline`):
#      bench.py and 1,000 × (528 + 136) ±90 %, overlapped and synchronous (timeline.log).
#   9. admission batching (`admission`): ±90 % and equal lengths at several
#      `--admission-tokens` (0 = admit at once), bench.py and one request at 0 and the default
#      (admission.log);
#  10. balanced decode splits (`split`): `benches decode` with the default split and with
#      BURN_NANOVLLM_DECODE_SPLIT_KEYS=0 (a full batch never splits: the kernels before), then
#      the engine figures with both, at admission 0 / default / 8192 (split-*.log); FA3's
#      decode and prefill beside them when dist-fa3/ travels (fa3.csv);
#  11. admission sweep (`sweep`): ±90 % at --admission-tokens / --admission-wait-steps pairs
#      and with decode pieces of 512 / 2048 keys, then equal lengths at the best (sweep.log);
#  12. attention against FlashAttention-3 in one command (`fa3`, needs dist-fa3/ = a copy of
#      ../shared/peers/fa3): FA3's decode and prefill script, then `benches decode prefill`
#      (fa3.csv, attention.log);
#  13. the sampler's width (`sample`): the engine figures and bench.py with every request
#      JSON-constrained, for each count of units per row in UNITS (default "256 1024");
#  14. each kernel's device time in decode steps (`kprofile`): Nsight Compute (clocks and L2
#      left alone) over a window of launches per KPROFILE entry (see the section) into
#      kprofile-*.log, with a per-kernel total table printed;
#  15. batch limits (`limits`): the engine figures of 2. for each max_num_seqs,max_num_batched_tokens
#      pair in LIMITS.
#  16. larger models (`large`): bench.py and ±90 % on the random weights of each DUMMIES entry
#      (default qwen2-7b) at each LIMITS pair (default 256,8192; `default`: the engine's own
#      limits): the KV pool sized around the step graphs' measured memory (large-*.log).
#  17. the prefill kernel under Nsight Compute (`prefill-ncu`): the full section set and the
#      per-instruction SASS (stall samples, executed instructions) of one launch of the
#      manual-MMA prefill at each NCU_MODELS entry's 1 × 4096 shape (default qwen3-0.6b):
#      prefill-ncu-<model>.txt (details), prefill-sass-<model>.csv.xz.
#  18. an A/B of one binary under several environments (`ab`): the engine figures of 2. with
#      none, then with each NAME=value of AB_ENV (e.g. "BURN_NANOVLLM_CUBLAS_TUNE=off"), ROUNDS
#      times in turn (ab-<round>-base-*, ab-<round>-env<i>-* logs).
# SECTIONS (default "tests bench profile") picks which to run. Logs go to $OUT.
set -uo pipefail
source "$(dirname "$0")/unpack.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
export RUST_BACKTRACE=0
SECTIONS="${SECTIONS:-tests kernels bench profile}"
B=/tmp/bin/benches
quiet() { grep -vE "^\s*$|^ +[0-9]+:|^ +at "; }
if [[ " $SECTIONS " == *" tests "* && -x /tmp/bin/engine ]]; then
  echo "== engine tests on CUDA (f32 fixtures, step graphs captured)"
  ENGINE_TEST_DEVICE=cuda timeout 420 /tmp/bin/engine --test-threads=1 --skip cubecl_cpu --skip cpu_targets 2>&1 \
    | tee "$OUT/engine_tests.log" | grep -E "^test |test result|panicked|rror|left|right" | tail -40
fi
if [[ " $SECTIONS " == *" sanitize "* && -x /tmp/bin/engine ]]; then
  echo "== shape sweep under compute-sanitizer (memcheck)"
  ENGINE_TEST_DEVICE=cuda timeout 500 compute-sanitizer --tool memcheck --print-limit 20 --show-backtrace no \
    /tmp/bin/engine --exact engine::shape_sweep::every_config_shape_matches_the_reference --test-threads=1 --nocapture 2>&1 \
    | tee "$OUT/sanitize.log" | grep -E "shape [0-9]|=========|test result|panicked" | tail -40
fi
if [[ " $SECTIONS " == *" kernels "* && -x /tmp/bin/kernels ]]; then
  echo "== kernel tests on CUDA"
  KERNEL_TEST_DEVICE=cuda timeout 300 /tmp/bin/kernels --test-threads=1 2>&1 \
    | tee "$OUT/kernel_tests.log" | grep -E "^test |test result|panicked|rror" | tail -30
fi
# The engine figures of one binary: equal lengths, ±90 %, bench.py (Qwen2, Qwen3), one request.
bench() {
  local bin=$1 tag=$2
  local T="throughput --device cuda --num-prompts 1000 --input-len 528 --output-len 136"
  echo "== [$tag] throughput, equal lengths"
  timeout 200 $bin $T ${EXTRA:-} --out "$OUT/$tag-tp-equal.json" 2>&1 | tee "$OUT/$tag-tp-equal.log" | quiet | tail -3
  echo "== [$tag] throughput, ±90 %"
  timeout 200 $bin $T --random-range-ratio 0.9 ${EXTRA:-} --out "$OUT/$tag-tp-range.json" 2>&1 | tee "$OUT/$tag-tp-range.log" | quiet | tail -3
  echo "== [$tag] bench.py (nano)"
  timeout 200 $bin nano --device cuda ${EXTRA:-} --out "$OUT/$tag-nano.json" 2>&1 | tee "$OUT/$tag-nano.log" | quiet | tail -3
  echo "== [$tag] bench.py (nano), Qwen3-0.6B"
  timeout 200 $bin nano --device cuda --dummy qwen3-0.6b ${EXTRA:-} --out "$OUT/$tag-nano-qwen3.json" 2>&1 \
    | tee "$OUT/$tag-nano-qwen3.log" | quiet | tail -3
  echo "== [$tag] one request, 512 + 128"
  timeout 150 $bin latency --device cuda --batch-size 1 --input-len 512 --output-len 128 --iters 5 ${EXTRA:-} \
    --out "$OUT/$tag-latency.json" 2>&1 | tee "$OUT/$tag-latency.log" | quiet | tail -3
}
if [[ " $SECTIONS " == *" bench "* && -x $B ]]; then
  bench $B new
fi
if [[ " $SECTIONS " == *" ab "* && -x $B ]]; then
  for round in ${ROUNDS:-1}; do
    bench $B "ab-$round-base"
    i=0
    for e in ${AB_ENV:?}; do
      i=$((i + 1))
      export "$e"
      bench $B "ab-$round-env$i"
      unset "${e%%=*}"
    done
  done
fi
# Batch limits (`limits`): the engine figures for each `max_num_seqs,max_num_batched_tokens`
# pair in LIMITS (default: ours, nano-vLLM's 512/16,384, 1,024/16,384), one binary, back to
# back (lim-S-T-* logs); an entry `S,T:G` also sets the graph sizes G (`--graph-sizes`,
# lim-S-T-g* logs).
if [[ " $SECTIONS " == *" limits "* && -x $B ]]; then
  for e in ${LIMITS:-256,8192 512,16384 1024,16384}; do
    st=${e%%:*}; g=""; tag="lim-${st%,*}-${st#*,}"
    [[ $e == *:* ]] && g="--graph-sizes ${e#*:}" && tag="$tag-g$(tr -cd , <<< "${e#*:}" | wc -c)"
    EXTRA="--max-num-seqs ${st%,*} --max-num-batched-tokens ${st#*,} $g" bench $B "$tag"
  done
fi
if [[ " $SECTIONS " == *" large "* && -x $B ]]; then
  for m in ${DUMMIES:-qwen2-7b}; do
    for e in ${LIMITS:-256,8192}; do
      tag="large-$m-${e%,*}-${e#*,}"
      X="--dummy $m --max-num-seqs ${e%,*} --max-num-batched-tokens ${e#*,}"
      [[ $e == default ]] && tag="large-$m-default" && X="--dummy $m"
      echo "== [$tag] bench.py (nano)"
      timeout 300 $B nano --device cuda $X --out "$OUT/$tag-nano.json" 2>&1 | tee "$OUT/$tag-nano.log" | quiet | tail -3
      echo "== [$tag] throughput, ±90 %"
      timeout 300 $B throughput --device cuda --num-prompts 1000 --input-len 528 --output-len 136 \
        --random-range-ratio 0.9 $X --out "$OUT/$tag-tp-range.json" 2>&1 | tee "$OUT/$tag-tp-range.log" | quiet | tail -3
    done
  done
fi
if [[ " $SECTIONS " == *" prefill-ncu "* && -x $B ]]; then
  for m in ${NCU_MODELS:-qwen3-0.6b}; do
    echo "== [$m] prefill kernel under ncu (1 x 4096, causal)"
    timeout 400 ncu --set full --import-source no --kernel-name regex:paged_prefill_mma \
      --launch-skip 3 --launch-count 1 -f -o "/tmp/prefill-$m" \
      $B prefill --device cuda --models "$m" > "/tmp/prefill-ncu-$m.log" 2>&1
    tail -3 "/tmp/prefill-ncu-$m.log"
    ncu -i "/tmp/prefill-$m.ncu-rep" --page details > "$OUT/prefill-ncu-$m.txt" 2>&1
    ncu -i "/tmp/prefill-$m.ncu-rep" --page source --csv --print-source sass 2>&1 | xz -6 > "$OUT/prefill-sass-$m.csv.xz"
    grep -E "Registers Per|Achieved Occupancy|Theoretical Occupancy|Duration|Local|Spill|Issue Slots Busy|Tensor|Warp Cycles Per Issued|No Eligible|Block Limit" "$OUT/prefill-ncu-$m.txt" | head -40
  done
fi
# The sampler's units per row (`BURN_NANOVLLM_SAMPLE_UNITS`, UNITS="256 1024" by default):
# the engine figures and bench.py with every request JSON-constrained, for each.
if [[ " $SECTIONS " == *" sample "* && -x $B ]]; then
  for u in ${UNITS:-256 1024}; do
    BURN_NANOVLLM_SAMPLE_UNITS=$u bench $B units-$u
    if [ -d fixtures/qwen2-tokenizer ]; then
      echo "== [units-$u] bench.py (nano), every request JSON-constrained"
      BURN_NANOVLLM_SAMPLE_UNITS=$u timeout 200 $B nano --device cuda --tokenizer fixtures/qwen2-tokenizer \
        --json-fraction 1 --out "$OUT/units-$u-nano-json.json" 2>&1 | tee "$OUT/units-$u-nano-json.log" | quiet | tail -2
    fi
  done
fi
# The build before the step graphs (dist-old/benches-old.xz), same commands.
if [[ " $SECTIONS " == *" old "* && -x /tmp/bin/benches-old ]]; then
  bench /tmp/bin/benches-old old
fi
if [[ " $SECTIONS " == *" serve "* && -x $B ]]; then
  # The same 1,000 requests offline and through the server (IN_FLIGHT in flight, default 256):
  # in process (the server's engine thread) and over HTTP on loopback; varied lengths (±90 %),
  # then equal.
  for r in 0.9 0; do
    W="--device cuda --num-prompts 1000 --input-len 528 --output-len 136 --random-range-ratio $r"
    echo "== offline, range $r"
    timeout 120 $B throughput $W --out "$OUT/offline-$r.json" 2>&1 | tee "$OUT/offline-$r.log" | quiet | tail -1
    for n in ${IN_FLIGHT:-256}; do
      for how in in-process http; do
        flag=""; [ $how = http ] && flag="--http"
        echo "== serve $how, range $r, $n in flight"
        timeout 150 $B serve $W --max-concurrency $n $flag --out "$OUT/serve-$how-$r-$n.json" 2>&1 \
          | tee "$OUT/serve-$how-$r-$n.log" | quiet | tail -1
      done
    done
  done
fi
if [[ " $SECTIONS " == *" alloc "* && -x $B ]]; then
  # Eager steps with CUDA's stream-ordered allocator: whether pool growth and release (cuMemFree
  # synchronises the device) is where an eager step waits.
  mkdir -p /tmp/alloc && printf '[memory.cuda]\nallocator = "async"\n' > /tmp/alloc/cubecl.toml
  for mode in sync async; do
    echo "== eager steps, allocator $mode (±90 %, 300 requests)"
    dir=/tmp; [ $mode = async ] && dir=/tmp/alloc
    (cd $dir && timeout 150 $B throughput --device cuda --num-prompts 300 --input-len 528 --output-len 136 \
      --random-range-ratio 0.9 --enforce-eager --out "$OUT/tp-eager-$mode.json" 2>&1 | tee "$OUT/tp-eager-$mode.log" | quiet | tail -9)
  done
fi
if [[ " $SECTIONS " == *" profile "* && -x $B ]]; then
  echo "== eager steps, host profile (±90 %, 300 requests)"
  timeout 200 $B throughput --device cuda --num-prompts 300 --input-len 528 --output-len 136 \
    --random-range-ratio 0.9 --enforce-eager --host-profile --out "$OUT/tp-eager-profile.json" 2>&1 \
    | tee "$OUT/tp-eager-profile.log" | quiet | tail -150
fi
if [[ " $SECTIONS " == *" overlap "* && -x $B ]]; then
  for mode in overlap sync; do
    flag=""; [ $mode = sync ] && flag="--sync-steps"
    T="--device cuda $flag"
    {
      echo "== [$mode] throughput, equal lengths"
      timeout 200 $B throughput $T --num-prompts 1000 --input-len 528 --output-len 136 2>&1 | quiet | tail -14
      echo "== [$mode] throughput, ±90 %"
      timeout 200 $B throughput $T --num-prompts 1000 --input-len 528 --output-len 136 --random-range-ratio 0.9 2>&1 | quiet | tail -14
      echo "== [$mode] bench.py (nano), Qwen2-0.5B"
      timeout 200 $B nano $T 2>&1 | quiet | tail -12
      echo "== [$mode] bench.py (nano), Qwen3-0.6B"
      timeout 200 $B nano $T --dummy qwen3-0.6b 2>&1 | quiet | tail -12
      echo "== [$mode] one request, 512 + 128"
      timeout 150 $B latency $T --batch-size 1 --input-len 512 --output-len 128 --iters 5 2>&1 | quiet | tail -4
    } 2>&1 | tee "$OUT/$mode.log" | grep -E "^==|^qwen|^[0-9]|decode|mixed"
  done
fi
if [[ " $SECTIONS " == *" timeline "* && -x $B ]]; then
  for mode in overlap sync; do
    flag=""; [ $mode = sync ] && flag="--sync-steps"
    echo "== [$mode] bench.py (nano), Qwen2-0.5B, CUDA events"
    timeout 200 $B nano --device cuda --gpu-timeline $flag 2>&1 | quiet | tail -20
    echo "== [$mode] throughput ±90 %, CUDA events"
    timeout 200 $B throughput --device cuda --gpu-timeline $flag --num-prompts 1000 --input-len 528 \
      --output-len 136 --random-range-ratio 0.9 2>&1 | quiet | tail -20
  done 2>&1 | tee "$OUT/timeline.log" | grep -vE "^first mixed"
fi
if [[ " $SECTIONS " == *" admission "* && -x $B ]]; then
  T="--device cuda --num-prompts 1000 --input-len 528 --output-len 136"
  for a in ${ADMISSION:-0 2048 4096 8192}; do
    for r in 0.9 0.9 0; do
      echo "== admission $a, throughput, range $r"
      timeout 200 $B throughput $T --random-range-ratio $r --admission-tokens $a 2>&1 | quiet | tail -9
    done
  done 2>&1 | tee "$OUT/admission.log" | grep -E "^==|^qwen"
  for a in 0 4096; do
    echo "== admission $a, bench.py (nano), Qwen2-0.5B"
    timeout 200 $B nano --device cuda --admission-tokens $a 2>&1 | quiet | tail -6
    echo "== admission $a, one request 512 + 128"
    timeout 150 $B latency --device cuda --batch-size 1 --input-len 512 --output-len 128 --iters 5 \
      --admission-tokens $a 2>&1 | quiet | tail -3
  done 2>&1 | tee "$OUT/admission-nano.log" | grep -E "^==|^qwen"
fi
if [[ " $SECTIONS " == *" split "* && -x $B ]]; then
  if [ -d dist-fa3 ]; then
    echo "== FA3 decode and prefill"
    bash dist-fa3/setup.sh >/dev/null && PYTHONPATH=/tmp/fa3site timeout 300 python3 dist-fa3/fa3_attention.py \
      > "$OUT/fa3.csv" 2>&1; tail -n +1 "$OUT/fa3.csv" | grep -vE "^\s*$" | head -80
  fi
  for k in default 0; do
    keys=""; [ $k != default ] && keys="BURN_NANOVLLM_DECODE_SPLIT_KEYS=$k"
    echo "== [split $k] benches decode"
    env $keys timeout 300 $B decode --device cuda --ours-only 2>&1 | tee "$OUT/split-$k-decode.log" | quiet | grep -E "^qwen|^model"
  done
  T="--device cuda --num-prompts 1000 --input-len 528 --output-len 136"
  for k in default 0; do
    keys=""; [ $k != default ] && keys="BURN_NANOVLLM_DECODE_SPLIT_KEYS=$k"
    {
      for a in 0 4096 8192; do
        echo "== [split $k] admission $a, throughput ±90 %"
        env $keys timeout 200 $B throughput $T --random-range-ratio 0.9 --admission-tokens $a 2>&1 | quiet | tail -9
      done
      echo "== [split $k] throughput, equal lengths"
      env $keys timeout 200 $B throughput $T 2>&1 | quiet | tail -9
      echo "== [split $k] bench.py (nano), Qwen2-0.5B"
      env $keys timeout 200 $B nano --device cuda 2>&1 | quiet | tail -7
      echo "== [split $k] bench.py (nano), Qwen3-0.6B"
      env $keys timeout 200 $B nano --device cuda --dummy qwen3-0.6b 2>&1 | quiet | tail -7
      echo "== [split $k] one request, 512 + 128"
      env $keys timeout 150 $B latency --device cuda --batch-size 1 --input-len 512 --output-len 128 --iters 5 2>&1 | quiet | tail -3
    } 2>&1 | tee "$OUT/split-$k.log" | grep -E "^==|^qwen"
  done
fi
if [[ " $SECTIONS " == *" sweep "* && -x $B ]]; then
  T="--device cuda --num-prompts 1000 --input-len 528 --output-len 136"
  {
    for aw in 8192,16 12288,16 16384,16 16384,32 24576,32; do
      a=${aw%,*}; w=${aw#*,}
      echo "== admission $a, wait $w, ±90 %"
      timeout 200 $B throughput $T --random-range-ratio 0.9 --admission-tokens $a --admission-wait-steps $w 2>&1 | quiet | grep -E "^qwen"
    done
    for k in 512 2048; do
      echo "== decode pieces of >= $k keys, ±90 %"
      BURN_NANOVLLM_DECODE_SPLIT_KEYS=$k timeout 200 $B throughput $T --random-range-ratio 0.9 2>&1 | quiet | grep -E "^qwen"
    done
    for aw in 8192,16 16384,32; do
      a=${aw%,*}; w=${aw#*,}
      echo "== admission $a, wait $w, equal lengths"
      timeout 200 $B throughput $T --admission-tokens $a --admission-wait-steps $w 2>&1 | quiet | grep -E "^qwen"
    done
  } 2>&1 | tee "$OUT/sweep.log"
fi
if [[ " $SECTIONS " == *" fa3 "* && -x $B && -d dist-fa3 ]]; then
  bash dist-fa3/setup.sh >/dev/null && PYTHONPATH=/tmp/fa3site timeout 300 python3 dist-fa3/fa3_attention.py \
    2>&1 | tee "$OUT/fa3.csv" | grep -E "^fa3_"
  timeout 300 $B decode prefill --device cuda --ours-only 2>&1 | tee "$OUT/attention.log" | grep -E "^qwen|^model"
fi
if [[ " $SECTIONS " == *" kprofile "* && -x $B ]]; then
  # name:launches to skip:launches to profile:benches arguments (commas for spaces). Defaults:
  # one request and 32 of 1,024 tokens (Qwen2-0.5B), then bench.py on Qwen3-0.6B in its
  # 129-256-row, 33-128-row and 1-32-row decode phases.
  DEF="q2-b1:30000:800:latency,--batch-size,1,--input-len,512,--output-len,512,--iters,1
       q2-b32:30000:800:latency,--batch-size,32,--input-len,1024,--output-len,512,--iters,1
       q3-nano-full:50000:600:nano,--dummy,qwen3-0.6b
       q3-nano-mid:140000:600:nano,--dummy,qwen3-0.6b
       q3-nano-tail:205000:600:nano,--dummy,qwen3-0.6b"
  for spec in ${KPROFILE:-$DEF}; do
    IFS=: read -r name skip count args <<< "$spec"
    echo "== [$name] kernels, launches $skip..+$count: ${args//,/ }"
    timeout 400 ncu --clock-control none --cache-control none \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
      --launch-skip "$skip" --launch-count "$count" --print-summary per-kernel \
      $B ${args//,/ } --device cuda > "$OUT/kprofile-$name.log" 2>&1
    # Per kernel and grid: invocations, average µs, total µs, DRAM GB/s (read + write).
    awk 'function mb(u, v) { return u == "Kbyte" ? v / 1e3 : u == "Gbyte" ? v * 1e3 : u == "byte" ? v / 1e6 : v }
         /Invocations/ { n = $NF; k = $1 " " $2 $3 $4 }
         /dram__bytes_read/ { r = mb($2, $NF) }
         /dram__bytes_write/ { w = mb($2, $NF) }
         /gpu__time_duration/ { t = ($2 == "ms") ? $NF * 1e3 : $NF }
         /^ +-+ / && t > 0 { printf "%-62s %6d %9.2f %10.1f %7.0f\n", k, n, t, n * t, (r + w) / t * 1e3; t = 0 }' \
      "$OUT/kprofile-$name.log" | sort -k5 -nr | head -30
  done
fi
if [[ " $SECTIONS " == *" replay "* && -x $B ]]; then
  echo "== bench.py (graph-replayed decode steps), host profile"
  timeout 200 $B nano --device cuda --host-profile --out "$OUT/nano-profile.json" 2>&1 \
    | tee "$OUT/nano-profile.log" | quiet | tail -150
fi
