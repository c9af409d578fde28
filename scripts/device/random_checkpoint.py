"""Write a random-weight Qwen2 checkpoint of any config (GPU machine, PyTorch only).

    python3 scripts/device/random_checkpoint.py CONFIG.json TOKENIZER_DIR OUT_DIR [--seed S]

OUT_DIR gets CONFIG.json as config.json, the tokenizer files of TOKENIZER_DIR, and
model.safetensors in bf16 written directly (header + raw bytes, no safetensors package):
linear weights and q/k/v biases ~ N(0, 0.02), embeddings too, RMSNorm weights 1. Unlike
`benches --dummy`, whose ranks each draw their own shard, one checkpoint is the same model at
every tensor-parallel size.
"""

import json
import shutil
import struct
import sys
from pathlib import Path

import torch


def tensors(c: dict):
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    d = c.get("head_dim", h // heads)
    yield "model.embed_tokens.weight", [v, h]
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        yield p + "input_layernorm.weight", [h]
        yield p + "post_attention_layernorm.weight", [h]
        for name, rows in (("q", heads * d), ("k", kv * d), ("v", kv * d)):
            yield p + f"self_attn.{name}_proj.weight", [rows, h]
            yield p + f"self_attn.{name}_proj.bias", [rows]
        yield p + "self_attn.o_proj.weight", [h, heads * d]
        yield p + "mlp.gate_proj.weight", [i, h]
        yield p + "mlp.up_proj.weight", [i, h]
        yield p + "mlp.down_proj.weight", [h, i]
    yield "model.norm.weight", [h]
    if not c.get("tie_word_embeddings", False):
        yield "lm_head.weight", [v, h]


def main() -> None:
    config_path, tokenizer_dir, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    seed = int(sys.argv[sys.argv.index("--seed") + 1]) if "--seed" in sys.argv else 0
    config = json.loads(config_path.read_text())
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(config_path, out / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    specs = list(tensors(config))
    header, offset = {}, 0
    for name, shape in specs:
        size = 2
        for s in shape:
            size *= s
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    torch.manual_seed(seed)
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape in specs:
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                t = torch.ones(shape, dtype=torch.bfloat16, device="cuda")
            else:
                t = torch.empty(shape, dtype=torch.bfloat16, device="cuda").normal_(0.0, 0.02)
            f.write(t.view(torch.int16).cpu().numpy().tobytes())
    print(f"{out}: {len(specs)} tensors, {offset / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
