#!/usr/bin/env python3
"""Parity of burn-nanovllm against Hugging Face transformers on a random checkpoint with the
real Qwen2-0.5B config (run on a GPU machine with torch + transformers).

1. builds Qwen2ForCausalLM with the Qwen2-0.5B config, random weights (seeded), saves it in bf16;
2. runs transformers' forward (f32 and bf16) on a few prompts, and its greedy continuation;
3. runs `burn-nanovllm logits` (bf16 and f32) on the same folder and token ids;
4. prints the max logit error and the greedy agreement over the continuation.

usage: hf_parity.py BINARY [--tokens 64] [--dir /tmp/qwen2-0.5b-random]
"""
import argparse, json, os, subprocess, sys, time

import torch
from safetensors.torch import load_file
from transformers import Qwen2Config, Qwen2ForCausalLM

p = argparse.ArgumentParser()
p.add_argument("binary")
p.add_argument("--tokens", type=int, default=64)
p.add_argument("--dir", default="/tmp/qwen2-0.5b-random")
p.add_argument("--lengths", default="1,7,33,200")
args = p.parse_args()

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
dev = "cuda"
print("torch", torch.__version__, "transformers", __import__("transformers").__version__, torch.cuda.get_device_name(0))

cfg = Qwen2Config(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
    sliding_window=32768, max_window_layers=24, hidden_act="silu", bos_token_id=151643,
    eos_token_id=151643, initializer_range=0.02,
)
torch.manual_seed(0)
model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
model.save_pretrained(args.dir)
del model
print("saved", args.dir, sorted(os.listdir(args.dir)))

g = torch.Generator().manual_seed(1)
prompts = [torch.randint(0, 151643, (int(n),), generator=g).tolist() for n in args.lengths.split(",")]
with open(os.path.join(args.dir, "ids.json"), "w") as f:
    json.dump(prompts, f)

def hf(dtype):
    m = Qwen2ForCausalLM.from_pretrained(args.dir, dtype=dtype, attn_implementation="eager").to(dev).eval()
    logits, greedy, margins = [], [], []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids], device=dev)
            logits.append(m(x).logits[0].float().cpu())
            out = m.generate(x, max_new_tokens=args.tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
            greedy.append(out.sequences[0, len(ids):].tolist())
            top2 = torch.stack([l[0].float().topk(2).values for l in out.logits])
            margins.append((top2[:, 0] - top2[:, 1]).cpu().tolist())
    del m
    torch.cuda.empty_cache()
    return logits, greedy, margins

t = time.time()
hf32, hf32_greedy, hf32_margin = hf(torch.float32)
hf16, hf16_greedy, _ = hf(torch.bfloat16)
print(f"transformers done in {time.time() - t:.1f}s")

def ours(dtype):
    out = os.path.join(args.dir, f"ours_{dtype}.safetensors")
    cmd = [args.binary, "logits", "--model", args.dir, "--ids", os.path.join(args.dir, "ids.json"),
           "--out", out, "--dtype", dtype, "--device", "cuda", "--greedy", str(args.tokens)]
    t = time.time()
    subprocess.run(cmd, check=True)
    print(f"ours {dtype} done in {time.time() - t:.1f}s")
    r = load_file(out)
    return [r[f"prompt.{i}.logits"] for i in range(len(prompts))], [r[f"prompt.{i}.greedy_ids"].tolist() for i in range(len(prompts))]

def agreement(a, b):
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    return sum(x == y for x, y in zip(a, b)), first

results = {}
for dtype in ["f32", "bf16"]:
    logits, greedy = ours(dtype)
    ref_greedy = hf32_greedy if dtype == "f32" else hf16_greedy
    for i, ids in enumerate(prompts):
        err32 = (logits[i] - hf32[i]).abs().max().item()
        err_hf = (logits[i] - (hf32 if dtype == "f32" else hf16)[i]).abs().max().item()
        same, first = agreement(greedy[i], ref_greedy[i])
        m = hf32_margin[i][first] if first < len(hf32_margin[i]) else float("nan")
        results[(dtype, i)] = dict(len=len(ids), max_err_vs_hf_f32=err32, max_err_vs_hf_same_dtype=err_hf,
                                   greedy_same=same, first_divergence=first, hf_margin_there=m)
ref_bf16_err = [(hf16[i] - hf32[i]).abs().max().item() for i in range(len(prompts))]
scale = max(l.abs().max().item() for l in hf32)

print(f"\nmax |logit| of transformers f32: {scale:.3f}; transformers bf16 vs f32 max error per prompt: "
      + ", ".join(f"{e:.4f}" for e in ref_bf16_err))
print("dtype,prompt,len,max_err_vs_hf_f32,max_err_vs_hf_same_dtype,greedy_agree,tokens,first_divergence,hf_f32_margin_there")
for (dtype, i), r in results.items():
    print(f"{dtype},{i},{r['len']},{r['max_err_vs_hf_f32']:.3g},{r['max_err_vs_hf_same_dtype']:.3g},"
          f"{r['greedy_same']},{args.tokens},{r['first_divergence']},{r['hf_margin_there']:.3g}")
