#!/usr/bin/env python3
"""Checks that every log the docs name exists: each `results/...` path, and each backticked
`h100-...` / `h200-...` path (relative to docs/results/), in README.md, CHANGELOG.md and
docs/*.md. Exit 1, listing them, when one is missing."""
import re
import sys
from pathlib import Path

root = Path(__file__).resolve().parent.parent
results = root / "docs" / "results"
missing = []
for doc in [root / "README.md", root / "CHANGELOG.md", *sorted((root / "docs").glob("*.md"))]:
    text = doc.read_text()
    names = set(re.findall(r"results/([A-Za-z0-9_.\-/]+)", text))
    names |= set(re.findall(r"`((?:h100|h200)-[A-Za-z0-9_.\-/]+)`", text))
    for name in sorted(names):
        path = name.rstrip("/.,")
        # `dir/{a,b}` and `prefix-*` forms name several files: check the part before them.
        path = re.split(r"[{*]", path)[0].rstrip("/-")
        if path and not (results / path).exists():
            missing.append(f"{doc.relative_to(root)}: results/{path}")
for m in missing:
    print("missing:", m)
sys.exit(1 if missing else 0)
