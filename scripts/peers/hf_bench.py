#!/usr/bin/env python3
"""The transformers peer of `benches nano` / `benches throughput`: the same workloads through
transformers' continuous batching (`generate_batch`, paged attention), random weights of the
same config, on the GPU machine. Prints one CSV row per run and, with --record, appends a JSON
line in the shape of `benches --record` (suite, model, workload totals, wall time, throughput).

usage: hf_bench.py nano [--dummy qwen2-0.5b] [--num-seqs 256]
       hf_bench.py throughput --num-prompts 256 --input-len 512 --output-len 256 [--random-range-ratio 0.5]
"""
import argparse, json, os, random, subprocess, time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

CONFIGS = os.path.join(os.path.dirname(__file__), "../../benches/configs")

p = argparse.ArgumentParser()
p.add_argument("suite", choices=["nano", "throughput"])
p.add_argument("--dummy", default="qwen2-0.5b")
p.add_argument("--num-seqs", type=int, default=256)
p.add_argument("--num-prompts", type=int, default=256)
p.add_argument("--input-len", type=int, default=512)
p.add_argument("--output-len", type=int, default=128)
p.add_argument("--random-range-ratio", type=float, default=0.0)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--record")
args = p.parse_args()


def workload():
    """(prompt ids, max tokens) per request, as the benches binary draws them."""
    if args.suite == "nano":
        # nano-vLLM's bench.py, call for call.
        random.seed(0)
        prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))]
                   for _ in range(args.num_seqs)]
        return [(q, random.randint(100, 1024)) for q in prompts]
    rng = random.Random(args.seed)
    scale = lambda n: max(1, round(n * (1 + args.random_range_ratio * (2 * rng.random() - 1))))
    out = []
    for _ in range(args.num_prompts):
        n, m = scale(args.input_len), scale(args.output_len)
        out.append(([rng.randrange(10000) for _ in range(n)], m))
    return out


config = AutoConfig.for_model(**json.load(open(os.path.join(CONFIGS, f"{args.dummy}.json"))))
torch.manual_seed(0)
model = None
for attn in ["paged|sdpa", "sdpa_paged"]:
    try:
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.bfloat16)
        break
    except Exception as e:  # older/newer spellings of the paged implementation
        print(f"attn_implementation={attn!r}: {e}")
model = model.to("cuda").eval()
work = workload()
prompts = [w[0] for w in work]
# The manager API, so that every request gets its own max_new_tokens (bench.py's lengths).
gen = GenerationConfig(max_new_tokens=max(m for _, m in work), do_sample=True, temperature=0.6,
                       pad_token_id=0)
with torch.no_grad():
    model.generate_batch(inputs=[[33, 44, 55, 66]], generation_config=GenerationConfig(
        max_new_tokens=16, do_sample=False, pad_token_id=0))
    with model.continuous_batching_context_manager(generation_config=gen, block=True, timeout=5) as manager:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i, (ids, m) in enumerate(work):
            manager.add_request(ids, request_id=f"r{i}", max_new_tokens=m)
        done, generated, errors = 0, 0, 0
        while done < len(work):
            r = manager.get_result(timeout=1)
            if r is None:
                if not manager.is_running():
                    raise SystemExit("the transformers manager stopped early")
                continue
            if r.is_finished():
                done += 1
                generated += len(r.generated_tokens)
                errors += r.error is not None
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
prompt_tokens = sum(len(q) for q in prompts)
row = {
    "peer": "transformers", "suite": args.suite, "model": args.dummy, "num_requests": len(work),
    "prompt_tokens": prompt_tokens, "output_tokens": generated,
    "requested_tokens": sum(m for _, m in work), "errors": errors,
    "wall_s": wall, "output_tok_s": generated / wall,
    "total_tok_s": (prompt_tokens + generated) / wall, "req_s": len(work) / wall,
}
print(",".join(row.keys()))
print(",".join(str(v) for v in row.values()))
if args.record:
    sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    import transformers
    with open(args.record, "a") as f:
        f.write(json.dumps({"git_sha": sha or "unknown", "device": torch.cuda.get_device_name(0),
                            "dtype": "BF16", "versions": {"torch": torch.__version__,
                            "transformers": transformers.__version__}, "table": f"peer {args.suite}",
                            "row": row}) + "\n")
