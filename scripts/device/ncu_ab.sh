#!/usr/bin/env bash
# On the GPU machine: kernel durations at base clocks (Nsight Compute, `--clock-control base`),
# median per (kernel, block, grid), for each binary of NCU_BINS under /tmp/bin run with NCU_ARGS,
# kernels matching NCU_KERNEL (a regex), at most NCU_COUNT launches each: A/B runs whose
# timings the boost clock does not blur.
set -uo pipefail
source "$(dirname "$0")/unpack.sh"
for b in ${NCU_BINS}; do
  ncu --clock-control base --metrics gpu__time_duration.sum --kernel-name "regex:${NCU_KERNEL}" \
    --launch-count ${NCU_COUNT:-200} --csv --print-units base /tmp/bin/$b ${NCU_ARGS} 2>/dev/null > /tmp/ncu-$b.csv
  python3 - "$b" <<'PY'
import csv,sys,collections,statistics
b=sys.argv[1]
rows=[r for r in csv.reader(open(f"/tmp/ncu-{b}.csv")) if len(r)>10]
h=rows[0]; rows=rows[1:]
iG=h.index("Grid Size") if "Grid Size" in h else None
iN=h.index("Kernel Name"); iV=h.index("Metric Value")
d=collections.defaultdict(list)
for r in rows:
    key=(r[iN][:40], r[h.index("Block Size")], r[iG] if iG is not None else "")
    d[key].append(float(r[iV].replace(",",""))/1000)
for k,v in d.items(): print(b, k, f"n={len(v)} median={statistics.median(v):.1f}us min={min(v):.1f}")
PY
done
