"""Joins `benches linear --out ours.json` with `torch_linear.py` CSV: one Markdown table per
dtype (ours, cuBLAS `F.linear` on the same shape, ratio; PyTorch's composition of the same
result and that ratio; route) and the worst ratios per M for each form of product.

Usage: python3 compare_linear.py ours.json torch.csv
"""
import csv, json, statistics, sys
from collections import defaultdict

# Form of each op, as benches/src/linear.rs names them.
FORMS = {"qkv": "fused op", "gate_up": "fused op", "lm_head": "fused op",
         "o_proj": "plain", "down": "plain",
         "o_proj+residual": "+residual", "down+residual": "+residual",
         "gate_up+silu_mul": "model's gate_up"}

ours = {}
for table in json.load(open(sys.argv[1])):
    if not table["name"].startswith("linear"):
        continue
    for r in table["rows"]:
        ours[(r["model"], r["op"], r["dtype"], int(r["M"]))] = r
torch = {}
with open(sys.argv[2]) as f:
    for row in csv.reader(f):
        if len(row) >= 9 and row[0] != "model":
            act = float(row[9]) if len(row) > 9 else float("nan")
            torch[(row[0], row[1], row[2], int(row[3]))] = (float(row[6]), float(row[8]), act)
ratios = defaultdict(list)  # (dtype, M, form) -> [(vs F.linear, vs composition, vs act)]
for dtype in sorted({k[2] for k in ours}):
    print(f"\n### {dtype}\n")
    print("| model | op | M | K | N | route | ours µs | F.linear µs | ratio | PyTorch same result µs | ratio |")
    print("|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    for key in sorted(k for k in ours if k[2] == dtype):
        r, t = ours[key], torch.get(key)
        if t is None:
            continue
        ratio, same = r["ours_us"] / t[0], r["ours_us"] / t[1]
        ratios[(dtype, key[3], FORMS.get(key[1], key[1]))].append((ratio, same, r["ours_us"] / t[2]))
        print(f"| {key[0]} | {key[1]} | {key[3]} | {r['K']} | {r['N']} | {r['route']} | "
              f"{r['ours_us']:.1f} | {t[0]:.1f} | {ratio:.2f} | {t[1]:.1f} | {same:.2f} |")
forms = [f for f in dict.fromkeys(FORMS.values()) if any(k[2] == f for k in ratios)]
print("\nWorst (median) ratio over the models per M and form: against F.linear on the same shape;"
      " in brackets, worst against PyTorch computing the same result (fused op: F.rms_norm +"
      " F.linear; +residual: F.linear + add; model's gate_up: F.rms_norm + F.linear + silu·mul);"
      " in braces, for the model's gate_up, worst against F.linear + silu·mul without any norm.\n")
print("| dtype | M | " + " | ".join(forms) + " |")
print("|---|---:|" + "---:|" * len(forms))
for dtype, m in sorted({(k[0], k[1]) for k in ratios}):
    cells = []
    for form in forms:
        v = ratios.get((dtype, m, form))
        if not v:
            cells.append("")
            continue
        worst, med = max(a for a, _, _ in v), statistics.median(a for a, _, _ in v)
        same = [b for _, b, _ in v if b == b]
        act = [c for _, _, c in v if c == c]
        cells.append(f"{worst:.2f} ({med:.2f})" + (f" [{max(same):.2f}]" if same else "")
                     + (f" {{{max(act):.2f}}}" if act else ""))
    print(f"| {dtype} | {m} | " + " | ".join(cells) + " |")
