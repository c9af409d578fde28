#!/usr/bin/env bash
# On the GPU machine (device tool): the issue-12 figures in one command, every run appended to
# one record file — throughput against batch size (ours and the transformers peer), latency at
# batch 1 and 64, serve in process at two rates and all at once, prefix caching on and off, the
# decode step against PyTorch + graph — then the charts (scripts/plots.py) and a kernel-time
# profile of the decode step at M = 256 (ncu). Needs dist/benches.xz. Results go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
mkdir -p /tmp/bin
xz -dc dist/benches.xz > /tmp/bin/benches && chmod +x /tmp/bin/benches
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
R="$OUT/records.jsonl"
B=/tmp/bin/benches
quiet() { grep -vE "^\s*$|^step profile|^(prefill|decode) |^decode graphs" | tail -"$1"; }
echo "== throughput vs batch (512 + 128 tokens), ours then transformers"
for n in 1 8 32 128; do
  timeout 90 $B throughput --device cuda --num-prompts $n --record "$R" 2>&1 | quiet 1
done
for n in 1 8 32 128; do
  PYTHONUNBUFFERED=1 timeout 120 python3 scripts/peers/hf_bench.py throughput --num-prompts $n --record "$R" 2>&1 | tail -1
done
echo "== latency"
timeout 120 $B latency --device cuda --batch-size 1,64 --record "$R" 2>&1 | quiet 3
echo "== serve in process (200 requests, 512 + 128)"
timeout 150 $B serve --device cuda --request-rate 8,32,inf --record "$R" 2>&1 | quiet 4
echo "== prefix caching (200 requests, 512 shared + 512 own tokens, 128 out)"
timeout 120 $B prefix --device cuda --record "$R" 2>&1 | quiet 3
echo "== decode step vs PyTorch"
timeout 120 $B step --device cuda --ours-only --record "$R" 2>&1 | quiet 5
PYTHONUNBUFFERED=1 timeout 60 python3 scripts/baselines/torch_decode_step.py > "$OUT/torch_decode_step.csv" 2>&1
cat "$OUT/torch_decode_step.csv"
echo "== charts"
python3 scripts/plots.py "$R" "$OUT/plots" --torch-step "$OUT/torch_decode_step.csv" 2>&1 | tail -4
echo "== kernel time of a decode step at M = 256 (ncu, first 600 launches, eager)"
timeout 150 ncu --clock-control none --print-units base --metrics gpu__time_duration.sum --csv --launch-count 600 \
  $B step --device cuda --ours-only --ms 256 > "$OUT/ncu_step_m256.csv" 2>/dev/null
python3 - "$OUT/ncu_step_m256.csv" <<'PY' | tee "$OUT/ncu_step_m256_top.txt"
import csv, sys
from collections import defaultdict
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head = rows[0]; name_i = head.index("Kernel Name"); val_i = head.index("Metric Value")
total = defaultdict(float); count = defaultdict(int)
for r in rows[1:]:
    name = r[name_i]
    key = "cuBLAS " + name.split("_")[0] if ("gemm" in name or "xmma" in name or name.startswith("sm90")) else name.split("(")[0][:60]
    total[key] += float(r[val_i].replace(",", "")); count[key] += 1
s = sum(total.values())
print(f"{len(rows) - 1} launches, {s / 1e6:.2f} ms of kernel time")
for k, v in sorted(total.items(), key=lambda kv: -kv[1])[:10]:
    print(f"{100 * v / s:5.1f} %  {v / 1e3:9.1f} us  {count[k]:4d} launches  {k}")
PY
tar -C "$OUT" -czf "$OUT/bench-all.tgz" --exclude bench-all.tgz --exclude ncu_step_m256.csv . 2>/dev/null || true
