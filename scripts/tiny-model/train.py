"""Trains the default model from scratch on the GPU machine, saves it, and computes the
transformers goldens that the CI test checks.

    python train.py --work work --out models/tiny-english [--steps 1000]

Reads `prepare.py`'s outputs under `--work` (tokenizer.json, train.npy, val.npy, corpus.json),
writes under `--out`: config.json, generation_config.json, model.safetensors (bf16),
tokenizer.json, tokenizer_config.json, training.json (config, schedule, loss curve, final
validation loss, versions), golden.safetensors + golden.json (transformers float32 on the CPU,
weights upcast from the stored bf16: prompt logits, 24-token greedy continuations with their
top-5 logits). `--goldens-only` recomputes the goldens of a saved model.
"""

import argparse
import json
import math
import os
import shutil
import time

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

# The model: ~7 M parameters, 13 MB in bf16.
MODEL = dict(
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    hidden_act="silu",
    initializer_range=0.02,
    use_sliding_window=False,
)
GENERATION = dict(
    do_sample=True,
    temperature=0.8,
    top_p=0.95,
    top_k=50,
    repetition_penalty=1.1,
)
# Golden prompts: short ones keep every position's logits, long ones the last row.
PROMPTS = [
    "It was a dark and stormy night, and",
    "Alice was beginning to get very tired of",
    "Fellow-Citizens of the Senate and House of Representatives:",
    "Call me Ishmael.",
    "The old man looked at the sea for a long time, and then he said that",
    "In the beginning of the year the people of the town gathered in the great hall to hear what"
    " the new governor had to say about the harvest, the roads and the price of bread; and when"
    " he rose to speak, there was a silence",
]
GREEDY_TOKENS = 24
FULL_LOGITS_UP_TO = 16


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="work")
    ap.add_argument("--out", default="models/tiny-english")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--goldens-only", action="store_true")
    return ap.parse_args()


def config(tok: Tokenizer) -> Qwen2Config:
    eot = tok.token_to_id("<|endoftext|>")
    return Qwen2Config(
        vocab_size=tok.get_vocab_size(),
        bos_token_id=eot,
        eos_token_id=eot,
        **MODEL,
    )


def windows(data: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator):
    """`batch` random windows of `seq_len + 1` tokens: (inputs, targets) `[batch, seq_len]`."""
    starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=gen)
    rows = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


@torch.no_grad()
def evaluate(model, val: torch.Tensor, seq_len: int, dev: str) -> float:
    """Mean next-token loss over the whole validation stream, in consecutive windows."""
    model.eval()
    n = (len(val) - 1) // seq_len
    x = val[: n * seq_len].view(n, seq_len)
    y = val[1 : n * seq_len + 1].view(n, seq_len)
    total = 0.0
    for i in range(0, n, 16):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x[i : i + 16].to(dev)).logits
        total += F.cross_entropy(
            logits.float().flatten(0, 1), y[i : i + 16].to(dev).flatten(), reduction="sum"
        ).item()
    model.train()
    return total / (n * seq_len)


def train(args, tok: Tokenizer) -> dict:
    dev = "cuda"
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    train_ids = torch.from_numpy(np.load(os.path.join(args.work, "train.npy")).astype(np.int64))
    val_ids = torch.from_numpy(np.load(os.path.join(args.work, "val.npy")).astype(np.int64))
    cfg = config(tok)
    model = Qwen2ForCausalLM(cfg).to(dev)
    params = sum(p.numel() for p in model.parameters())
    print(f"{params / 1e6:.2f} M parameters; {len(train_ids):,} train / {len(val_ids):,} val tokens")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=True,
    )

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        t = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    log, best = [], (float("inf"), -1, None)
    t0 = time.time()
    for step in range(args.steps + 1):
        if step % args.eval_every == 0 or step == args.steps:
            val = evaluate(model, val_ids, args.seq_len, dev)
            log.append({"step": step, "val_loss": round(val, 4), "seconds": round(time.time() - t0, 1)})
            print(f"step {step:5d}  val {val:.4f}  {time.time() - t0:6.1f}s", flush=True)
            if val < best[0]:
                best = (val, step, {k: v.detach().clone() for k, v in model.state_dict().items()})
        if step == args.steps:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        x, y = windows(train_ids, args.batch, args.seq_len, gen)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x.to(dev, non_blocking=True)).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.to(dev).flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0:
            log.append({"step": step, "train_loss": round(loss.item(), 4), "lr": lr_at(step)})
    seconds = time.time() - t0
    model.load_state_dict(best[2])
    model = model.to(torch.bfloat16)
    # Validation loss of the weights as stored (bf16).
    final = evaluate(model, val_ids, args.seq_len, dev)
    print(f"best step {best[1]}: val {best[0]:.4f} (f32 weights), {final:.4f} (bf16 weights); {seconds:.0f}s")
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    return {
        "parameters": params,
        "model": MODEL,
        "schedule": {
            "steps": args.steps, "batch": args.batch, "seq_len": args.seq_len,
            "tokens_per_step": args.batch * args.seq_len, "lr": args.lr, "warmup": args.warmup,
            "decay": "cosine to 10 %", "optimizer": "AdamW(0.9, 0.95), weight decay 0.1 on matrices",
            "precision": "bf16 autocast, f32 master weights", "grad_clip": 1.0, "seed": args.seed,
        },
        "train_seconds": round(seconds, 1),
        "device": torch.cuda.get_device_name(0),
        "best_step": best[1],
        "val_loss_f32_weights": round(best[0], 4),
        "val_loss_bf16_weights": round(final, 4),
        "log": log,
    }


# ChatML (Qwen2's turn format, without its default system prompt): the model was never trained
# on conversations, but `chat` and `/v1/chat/completions` work with it out of the box; a reply
# ends at <|im_end|> (an end-of-sequence id) or at max_tokens.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def write_side_files(args, tok: Tokenizer):
    shutil.copy(os.path.join(args.work, "tokenizer.json"), os.path.join(args.out, "tokenizer.json"))
    eot = tok.token_to_id("<|endoftext|>")
    im_end = tok.token_to_id("<|im_end|>")
    with open(os.path.join(args.out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": eot, "eos_token_id": [eot, im_end], **GENERATION}, f, indent=2)
    added = {
        str(tok.token_to_id(t)): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
        for t in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    }
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
            "model_max_length": MODEL["max_position_embeddings"],
            "clean_up_tokenization_spaces": False,
            "added_tokens_decoder": added,
            "chat_template": CHAT_TEMPLATE,
        }, f, indent=2)


@torch.no_grad()
def goldens(args, tok: Tokenizer):
    """transformers float32 on the CPU (eager attention) from the stored bf16 weights."""
    model = Qwen2ForCausalLM.from_pretrained(
        args.out, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    # Plain greedy: none of the stored sampling defaults (repetition penalty) may apply.
    sampling = model.generation_config
    model.generation_config = GenerationConfig(pad_token_id=0)
    tensors, prompts = {}, []
    for i, text in enumerate(PROMPTS):
        ids = tok.encode(text, add_special_tokens=False).ids
        x = torch.tensor([ids])
        logits = model(x).logits[0].float()
        key = f"prompt.{i}"
        tensors[f"{key}.input_ids"] = torch.tensor(ids, dtype=torch.int64)
        if len(ids) <= FULL_LOGITS_UP_TO:
            tensors[f"{key}.logits"] = logits.contiguous()
        else:
            tensors[f"{key}.last_logits"] = logits[-1].contiguous()
            top = logits.topk(5, dim=-1)
            tensors[f"{key}.top5_ids"] = top.indices.to(torch.int64).contiguous()
            tensors[f"{key}.top5_logits"] = top.values.contiguous()
        out = model.generate(
            x, max_new_tokens=GREEDY_TOKENS, do_sample=False, num_beams=1, eos_token_id=None,
            pad_token_id=0, output_logits=True, return_dict_in_generate=True,
        )
        greedy = out.sequences[0, len(ids):]
        steps = torch.stack([l[0].float() for l in out.logits])  # [24, V]
        top = steps.topk(5, dim=-1)
        tensors[f"{key}.greedy_ids"] = greedy.to(torch.int64).contiguous()
        tensors[f"{key}.greedy_top5_ids"] = top.indices.to(torch.int64).contiguous()
        tensors[f"{key}.greedy_top5_logits"] = top.values.contiguous()
        margins = (top.values[:, 0] - top.values[:, 1]).tolist()
        prompts.append({
            "index": i, "text": text, "length": len(ids), "input_ids": ids,
            "greedy_ids": greedy.tolist(), "greedy_text": tok.decode(greedy.tolist()),
            "min_greedy_margin": min(margins),
        })
        print(f"{key}: {text!r} -> {tok.decode(greedy.tolist())!r} (min margin {min(margins):.4f})")
    save_file(tensors, os.path.join(args.out, "golden.safetensors"), metadata={"format": "pt"})
    # One sampled continuation with the generation defaults, for the record.
    model.generation_config = sampling
    torch.manual_seed(0)
    x = torch.tensor([tok.encode(PROMPTS[0], add_special_tokens=False).ids])
    sample = model.generate(x, max_new_tokens=64, pad_token_id=0)[0, x.shape[1]:].tolist()
    import transformers

    with open(os.path.join(args.out, "golden.json"), "w") as f:
        json.dump({
            "model": os.path.basename(os.path.normpath(args.out)),
            "architecture": "Qwen2ForCausalLM",
            "weights_dtype": "bfloat16",
            "compute_dtype": "float32",
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
            "reference": "transformers AutoModelForCausalLM, float32 (weights upcast exactly from the"
            " stored bf16), attn_implementation='eager', CPU, batch size 1, positions 0..L-1",
            "generation": {
                "method": f"model.generate(do_sample=False, max_new_tokens={GREEDY_TOKENS}, KV cache,"
                " output_logits=True); EOS stopping disabled, no logits processors",
                "new_tokens": GREEDY_TOKENS,
            },
            "sampled_with_generation_config": {"prompt": PROMPTS[0], "seed": 0, "text": tok.decode(sample)},
            "prompts": prompts,
        }, f, indent=1)
    print("sampled:", PROMPTS[0] + tok.decode(sample))


def main():
    args = parse()
    tok = Tokenizer.from_file(os.path.join(args.work, "tokenizer.json"))
    if not args.goldens_only:
        record = train(args, tok)
        record["corpus"] = json.load(open(os.path.join(args.work, "corpus.json")))
        record["versions"] = {"torch": torch.__version__, "transformers": __import__("transformers").__version__}
        with open(os.path.join(args.out, "training.json"), "w") as f:
            json.dump(record, f, indent=1)
        write_side_files(args, tok)
    goldens(args, tok)


if __name__ == "__main__":
    main()
