"""Device time per kernel from an Nsight Compute CSV (`ncu --csv --metrics gpu__time_duration.sum`).

Usage (on the GPU machine):
  ncu --clock-control none --csv --metrics gpu__time_duration.sum PROGRAM ... > run.csv
  python3 scripts/device/kernel_times.py run.csv [--grid] [--top 25]

Prints the kernels by total device time (launch count, total ms, mean µs), one line each; with
--grid, launches of different grid sizes are counted apart.
"""

import argparse
import collections
import csv
import io


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("csv")
    parser.add_argument("--grid", action="store_true")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    text = open(args.csv, encoding="utf-8", errors="replace").read()
    # ncu prints its own log lines (==PROF==) before the table.
    start = text.find('"ID"')
    rows = csv.DictReader(io.StringIO(text[start:]))
    total = collections.defaultdict(float)
    count = collections.Counter()
    for row in rows:
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(row["Metric Value"].replace(",", ""))
        unit = row["Metric Unit"]
        scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}[unit]
        name = row["Kernel Name"][:70]
        if args.grid:
            name += " " + row.get("Grid Size", "")
        total[name] += value * scale
        count[name] += 1
    whole = sum(total.values())
    print(f"all kernels: {whole / 1e3:.2f} ms over {sum(count.values())} launches")
    for name, us in sorted(total.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"{us / 1e3:9.2f} ms {100 * us / whole:5.1f} % {count[name]:7d} x {us / count[name]:8.1f} us  {name}")


if __name__ == "__main__":
    main()
