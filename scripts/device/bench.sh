#!/usr/bin/env bash
# On the GPU machine (device tool): PyTorch baselines and our benchmarks in one command, so
# that ratios come from one device. Usage: bench.sh SUITE... (linear, decode, prefill, step,
# torch). Needs dist-bench/benches.xz. Results go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
mkdir -p /tmp/bin
[ -x /tmp/bin/benches ] || { xz -dc dist-bench/benches.xz > /tmp/bin/benches && chmod +x /tmp/bin/benches; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
ours=()
for s in "$@"; do
  case "$s" in
    torch)
      for p in torch_attention torch_linear torch_decode_step; do
        PYTHONUNBUFFERED=1 python3 "scripts/baselines/$p.py" 2>&1 | tee "$OUT/$p.csv"
      done ;;
    *) ours+=("$s") ;;
  esac
done
if [ ${#ours[@]} -gt 0 ]; then
  /tmp/bin/benches "${ours[@]}" --device cuda --out "$OUT/benches-$(IFS=-; echo "${ours[*]}").json" 2>&1 | tee "$OUT/benches-$(IFS=-; echo "${ours[*]}").log"
fi
