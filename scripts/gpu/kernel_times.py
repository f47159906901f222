"""Summarises Nsight Compute's CSV of `gpu__time_duration.sum` (one row per
kernel launch): total GPU time, launches, and the kernels that take most.

    python3 scripts/gpu/kernel_times.py profile.csv [--top 12]
"""

from __future__ import annotations

import argparse
import collections
import csv
import io


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv")
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    text = open(args.csv, errors="replace").read()
    header = text.find('"ID"')
    tail = [line for line in text.splitlines() if " ms per " in line]
    if header < 0:
        print(f"{args.csv}: no kernel rows ({' '.join(tail) or 'no timing line'})")
        return
    rows = list(csv.DictReader(io.StringIO(text[header:])))
    by_kernel = collections.defaultdict(lambda: [0, 0.0])
    for r in rows:
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(r.get("Metric Unit", "nsecond"), 1e-3)
        name = r["Kernel Name"].split("(")[0][:70]
        by_kernel[name][0] += 1
        by_kernel[name][1] += float(r["Metric Value"].replace(",", "")) * scale
    total = sum(t for _, t in by_kernel.values())
    launches = sum(n for n, _ in by_kernel.values())
    print(f"== {args.csv}: {launches} launches, {total:.1f} us of GPU time; {' '.join(tail)}")
    for name, (n, t) in sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[: args.top]:
        print(f"{t:10.1f} us {100 * t / max(total, 1e-9):5.1f}% {n:5d}x  {name}")


if __name__ == "__main__":
    main()
