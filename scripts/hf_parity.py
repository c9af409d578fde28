#!/usr/bin/env python3
"""Parity of burn-nanovllm against Hugging Face transformers (run on a GPU machine with torch +
transformers): how bf16 correctness is re-checked after kernel changes.

1. the checkpoint: `--model DIR` (a trained one, e.g. models/tiny-english, with text prompts
   tokenized by its tokenizer.json), or by default Qwen2ForCausalLM with the Qwen2-0.5B config
   and random weights (seeded), saved in bf16 under --dir, with random token-id prompts;
2. runs transformers' forward (f32 and bf16) on the prompts, and its greedy continuation;
3. runs `burn-nanovllm logits` (bf16 and f32) on the same folder and token ids;
4. prints the max logit errors, the greedy agreement, and at the first point where our
   continuation leaves transformers' f32 one, transformers' top-2 margin there.

Verdict (exit status 1 when it fails): per prompt, our bf16 logit error against transformers f32
is no larger than transformers' own bf16-vs-f32 error (x1.25 slack), and where our bf16 greedy
continuation leaves transformers' f32 one, that step is a near-tie (its top-2 margin below that
error); f32: every divergence is a near-tie below 1e-3.

usage: hf_parity.py BINARY [--model DIR] [--text PROMPT ...] [--tokens 64] [--dir /tmp/qwen2-0.5b-random]
"""
import argparse, json, os, subprocess, sys, tempfile, time

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

p = argparse.ArgumentParser()
p.add_argument("binary")
p.add_argument("--tokens", type=int, default=64)
p.add_argument("--dir", default="/tmp/qwen2-0.5b-random")
p.add_argument("--lengths", default="1,7,33,200")
p.add_argument("--model", help="an existing checkpoint folder instead of the random Qwen2-0.5B")
p.add_argument("--text", action="append", help="text prompts for --model (repeatable)")
args = p.parse_args()
DEFAULT_TEXTS = [
    "It was a dark and stormy night, and",
    "The President of the United States said that",
    "She opened the door and saw",
    "In the morning the children went down to the river, where the old boat was waiting for them.",
]

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
dev = "cuda"
print("torch", torch.__version__, "transformers", __import__("transformers").__version__, torch.cuda.get_device_name(0))

def random_checkpoint():
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
    return [torch.randint(0, 151643, (int(n),), generator=g).tolist() for n in args.lengths.split(",")]

args.out_dir = tempfile.mkdtemp(prefix="hf_parity_")
if args.model:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    texts = args.text or DEFAULT_TEXTS
    prompts = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    args.dir = args.model
    for t, ids in zip(texts, prompts):
        print(f"prompt {t!r}: {len(ids)} tokens")
else:
    prompts = random_checkpoint()
with open(os.path.join(args.out_dir, "ids.json"), "w") as f:
    json.dump(prompts, f)

def hf(dtype):
    m = AutoModelForCausalLM.from_pretrained(args.dir, dtype=dtype, attn_implementation="eager").to(dev).eval()
    m.generation_config = GenerationConfig(pad_token_id=0)  # plain greedy: no stored sampling defaults
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
    out = os.path.join(args.out_dir, f"ours_{dtype}.safetensors")
    cmd = [args.binary, "logits", "--model", args.dir, "--ids", os.path.join(args.out_dir, "ids.json"),
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
    ref_greedy = hf32_greedy
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

# Verdict.
failures = []
for (dtype, i), r in results.items():
    bound = 1.25 * ref_bf16_err[i] if dtype == "bf16" else 1e-3
    if r["max_err_vs_hf_f32"] > bound:
        failures.append(f"{dtype} prompt {i}: logit error {r['max_err_vs_hf_f32']:.4g} > {bound:.4g}")
    if r["first_divergence"] < args.tokens and not r["hf_margin_there"] < bound:
        failures.append(f"{dtype} prompt {i}: greedy leaves transformers f32 at step "
                        f"{r['first_divergence']} where the top-2 margin {r['hf_margin_there']:.4g} is not a near-tie (< {bound:.4g})")
for (dtype, i), r in results.items():
    if r["first_divergence"] < args.tokens:
        print(f"{dtype} prompt {i}: leaves transformers f32 at step {r['first_divergence']}, "
              f"top-2 margin there {r['hf_margin_there']:.4g}")
print("hf32 min greedy margin per prompt: " + ", ".join(f"{min(m):.4g}" for m in hf32_margin))
print("PASS" if not failures else "FAIL\n" + "\n".join(failures))
sys.exit(1 if failures else 0)
