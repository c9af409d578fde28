"""Compare the top log-probabilities `generate --logprobs N` printed in several runs.

    python3 scripts/device/compare_logprobs.py RUN.txt...

Each file holds, per prompt, a `--- [i] "prompt"` line, the text, and one line per generated
token: `  "token" logprob  ["t1" l1, "t2" l2, ...]`. For each run against `*bf16-tp1.txt` and
`*f32-tp1.txt`: the greedy tokens that differ, and the largest difference of a log-probability
of a token both runs list in their top N (over every prompt and position).
"""

import re
import sys
from pathlib import Path

ENTRY = re.compile(r'("(?:[^"\\]|\\.)*") (-?[0-9.]+|-inf)')


def parse(path: Path) -> list[tuple[str, dict[str, float]]]:
    rows = []
    for line in path.read_text().splitlines():
        if line.startswith("  ") and "[" in line:
            head, _, top = line.strip().partition("  [")
            chosen = ENTRY.match(head)
            listed = {t: float(v) for t, v in ENTRY.findall(top)}
            rows.append((chosen.group(1) if chosen else head, listed))
    return rows


def compare(a: list, b: list) -> tuple[int, float]:
    differ, worst = 0, 0.0
    for (ta, la), (tb, lb) in zip(a, b):
        differ += ta != tb
        for token in la.keys() & lb.keys():
            worst = max(worst, abs(la[token] - lb[token]))
    return differ, worst


def main() -> None:
    runs = {Path(p).stem.removeprefix("logprobs-"): parse(Path(p)) for p in sys.argv[1:]}
    print("run, positions, vs bf16-tp1: greedy tokens differing / max |d logprob|, vs f32-tp1: same")
    for name, rows in sorted(runs.items()):
        cells = [name, str(len(rows))]
        for ref in ("bf16-tp1", "f32-tp1"):
            if ref in runs:
                differ, worst = compare(rows, runs[ref])
                cells.append(f"{differ} / {worst:.3f}")
        print(", ".join(cells))


if __name__ == "__main__":
    main()
