# What a dependent gets — cuBLASLt fenced on its own stream (the published cubecl-cuda's
# route; BURN_NANOVLLM_CUBLAS=fenced forces it in this build) against the stream-ordered route.
mkdir -p /tmp/bin && xz -T0 -dc dist-bench/benches.xz > /tmp/bin/benches && chmod +x /tmp/bin/benches
B=/tmp/bin/benches
for route in stream fenced; do
  [ $route = fenced ] && export BURN_NANOVLLM_CUBLAS=fenced
  echo "== route $route: bench.py"
  timeout 120 $B nano --device cuda 2>&1 | grep -E "^qwen2"
  echo "== route $route: throughput equal, ±90 %"
  for r in 0 0.9; do timeout 120 $B throughput --device cuda --num-prompts 1000 --input-len 528 --output-len 136 --random-range-ratio $r 2>&1 | grep -E "^qwen2"; done
  echo "== route $route: decode step (ours only)"
  timeout 200 $B step --device cuda --ours-only 2>&1 | grep -vE "^\s*$" | tail -8
done
