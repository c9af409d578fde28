"""Joins `benches linear --out ours.json` with `torch_linear.py` CSV: one Markdown table per
dtype (ours, cuBLAS `F.linear`, ratio; for the fused products also PyTorch's `F.rms_norm` +
`F.linear` and that ratio; route) and the worst ratios per M.

Usage: python3 compare_linear.py ours.json torch.csv
"""
import csv, json, statistics, sys
from collections import defaultdict

ours = {}
for table in json.load(open(sys.argv[1])):
    if not table["name"].startswith("linear"):
        continue
    for r in table["rows"]:
        ours[(r["model"], r["op"], r["dtype"], int(r["M"]))] = r
torch = {}
with open(sys.argv[2]) as f:
    for row in csv.reader(f):
        if len(row) == 9 and row[0] != "model":
            torch[(row[0], row[1], row[2], int(row[3]))] = (float(row[6]), float(row[8]))
worst = defaultdict(lambda: [0.0, 0.0, 0.0])
plain_ratios = defaultdict(list)
for dtype in sorted({k[2] for k in ours}):
    print(f"\n### {dtype}\n")
    print("| model | op | M | K | N | route | ours µs | F.linear µs | ratio | rms_norm + F.linear µs | ratio |")
    print("|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    for key in sorted(k for k in ours if k[2] == dtype):
        r, t = ours[key], torch.get(key)
        if t is None:
            continue
        ratio, fused = r["ours_us"] / t[0], r["ours_us"] / t[1]
        w = worst[(dtype, key[3])]
        if t[1] == t[1]:  # a fused product
            w[1], w[2] = max(w[1], ratio), max(w[2], fused)
        else:
            w[0] = max(w[0], ratio)
            plain_ratios[(dtype, key[3])].append(ratio)
        print(f"| {key[0]} | {key[1]} | {key[3]} | {r['K']} | {r['N']} | {r['route']} | "
              f"{r['ours_us']:.1f} | {t[0]:.1f} | {ratio:.2f} | {t[1]:.1f} | {fused:.2f} |")
print("\nWorst ratio over the three models, per M: plain products (o_proj, down) against F.linear;"
      " fused products (qkv, gate_up, lm_head) against F.linear and against rms_norm + F.linear.\n")
print("| dtype | M | plain / F.linear (median) | fused / F.linear | fused / (rms_norm + F.linear) |")
print("|---|---:|---:|---:|---:|")
for (dtype, m), v in sorted(worst.items()):
    med = statistics.median(plain_ratios[(dtype, m)]) if plain_ratios[(dtype, m)] else float("nan")
    print(f"| {dtype} | {m} | {v[0]:.2f} ({med:.2f}) | {v[1]:.2f} | {v[2]:.2f} |")
