#!/usr/bin/env python3
"""Charts for docs/BENCHMARKS.md and the README from benchmark records: PNG files.

usage: plots.py RECORDS.jsonl OUTDIR [--torch-step torch_decode_step.csv]

RECORDS.jsonl holds lines appended by `benches --record` and `scripts/peers/hf_bench.py
--record`. Charts (each drawn when its records are there):
- throughput_vs_batch.png: output tokens/s against requests sent at once (the throughput
  suite, ours and the transformers peer);
- serve_latency.png: TTFT and TPOT p50/p90/p99 per request rate (the serve suite);
- decode_step.png: decode-step time against M (the step suite: ours without and with
  attention, and PyTorch + CUDA graph from the CSV of scripts/baselines/torch_decode_step.py).
"""
import argparse, csv, json, os
from collections import defaultdict

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt


def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def throughput(records, out):
    series = defaultdict(dict)
    for r in records:
        row, table = r["row"], r.get("table", "")
        if table.startswith("engine throughput"):
            series["burn-nanovllm"][int(row["num_prompts"])] = row["output_tok_s"]
        elif table == "peer throughput":
            series[row.get("peer", "peer")][int(row["num_requests"])] = row["output_tok_s"]
    if not series:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in sorted(series.items()):
        xs = sorted(points)
        ax.plot(xs, [points[x] for x in xs], marker="o", label=name)
    ax.set(xscale="log", yscale="log", xlabel="requests at once (batch)",
           ylabel="output tokens/s", title="Throughput vs batch (Qwen2-0.5B, H100)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "throughput_vs_batch.png"), dpi=120)


def serve(records, out):
    rows = [r["row"] for r in records if r.get("table") == "serve"]
    if not rows:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    labels = [str(r["request_rate"]) for r in rows]
    for ax, metric in zip(axes, ["ttft", "tpot"]):
        width = 0.25
        for i, q in enumerate(["p50", "p90", "p99"]):
            xs = [j + (i - 1) * width for j in range(len(rows))]
            ax.bar(xs, [r[f"{metric}_{q}_ms"] for r in rows], width, label=q)
        ax.set_xticks(range(len(rows)), labels)
        ax.set(xlabel="request rate (req/s)", ylabel="ms", yscale="log",
               title=f"{metric.upper()} ({rows[0]['target']})")
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "serve_latency.png"), dpi=120)


def step(records, torch_csv, out):
    rows = [r["row"] for r in records if r.get("table", "").startswith("decode step")]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    ms = [int(r["M"]) for r in rows]
    ax.plot(ms, [r["ours_graph_ms"] for r in rows], marker="o", label="ours (graph)")
    ax.plot(ms, [r["ours_graph_attn1k_ms"] for r in rows], marker="s",
            label="ours + paged attention, 1k context (graph)")
    if torch_csv:
        with open(torch_csv) as f:
            t = [row for row in csv.DictReader(f)]
        ax.plot([int(r["M"]) for r in t], [float(r["torch_graph_ms"]) for r in t], marker="^",
                label="PyTorch + CUDA graph (no attention)")
    ax.set(xscale="log", xlabel="rows per step (M)", ylabel="ms per step",
           title="Decode step, Qwen2-0.5B bf16, H100")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "decode_step.png"), dpi=120)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("records")
    p.add_argument("out")
    p.add_argument("--torch-step")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    records = load(a.records)
    throughput(records, a.out)
    serve(records, a.out)
    step(records, a.torch_step, a.out)
    print("\n".join(sorted(os.listdir(a.out))))


if __name__ == "__main__":
    main()
