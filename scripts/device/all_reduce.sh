#!/usr/bin/env bash
# On a GPU machine with several GPUs of one host (device tool, nvidia-h100-x2 or x4):
# tensor parallelism's sum alone (dist-b/benches.xz: `benches all-reduce`). At 2 ranks and, where
# 4 GPUs are seen, at 4: every message's sums checked exact on every rank, and device time per
# call back to back, with the IPC kernels (default) and with NCCL only
# (BURN_NANOVLLM_ALL_REDUCE=nccl). $DTYPES: the dtypes (default bf16,f32); $SIZES: the group
# sizes (default 4 and 2, or 2); $VARIANTS: more runs as NAME:VAR=VALUE (e.g.
# one-shot:BURN_NANOVLLM_ALL_REDUCE_ONE_SHOT_MAX=16777216). Logs go to $OUT.
set -uo pipefail
source "$(dirname "$0")/unpack.sh"
export NCCL_NVLS_ENABLE=0
gpus=$(nvidia-smi --list-gpus | wc -l)
sizes="2"
[ "$gpus" -ge 4 ] && sizes="4 2"
for tp in ${SIZES:-$sizes}; do
  for spec in ipc:X=1 nccl:BURN_NANOVLLM_ALL_REDUCE=nccl ${VARIANTS:-}; do
    path=${spec%%:*}
    env=("${spec#*:}")
    name="all-reduce-tp$tp-$path"
    echo "== $name"
    env "${env[@]}" timeout 120 /tmp/bin/benches all-reduce --device cuda -tp "$tp" \
      --dtypes "${DTYPES:-bf16,f32}" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
    echo "exit $?"
    # Rank 0's table (the other ranks print theirs too; any wrong sum is reported by its rank).
    grep -E "wrong|rank [0-9]|^## " "$OUT/$name.log" | sort | uniq -c | head -8
    grep -E "^(BF16|F32|F16)," "$OUT/$name.log" | awk -F, '!seen[$1 FS $2 FS $3]++' | cut -d, -f1-6
  done
done
