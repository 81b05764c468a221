"""Compare the GPU kernel time per decode step of two runs profiled by Nsight Compute.

    ncu --csv --metrics gpu__time_duration.sum --cache-control none --clock-control none CMD > run.csv
    python tools/ncu_compare.py pydflash.csv STEPS_A llama.csv STEPS_B

STEPS: how many single-token decode steps the profiled run made (each run's kernels are summed and divided by
it, so the runs should hold nothing but decode steps besides uploads). Prints a markdown table of kernel
families (the kernel name up to its template arguments), microseconds per step for each run, and the totals.
"""
from __future__ import annotations

import csv
import io
import sys
from collections import defaultdict


def kernel_times(path: str) -> dict[str, float]:
    """Total ns per kernel family in one ncu CSV (lines before the CSV header are the profiled program's)."""
    text = open(path, encoding="utf-8", errors="replace").read()
    start = text.find('"ID","Process ID"')
    if start < 0:
        raise SystemExit(f"{path}: no ncu CSV table in it")
    totals: dict[str, float] = defaultdict(float)
    for row in csv.DictReader(io.StringIO(text[start:])):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(row["Metric Value"].replace(",", ""))
        unit = row.get("Metric Unit", "nsecond")
        scale = {"nsecond": 1.0, "usecond": 1e3, "msecond": 1e6}.get(unit, 1.0)
        name = row["Kernel Name"].split("<")[0].split("(")[0].strip()
        totals[name] += value * scale
    return totals


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print(__doc__)
        return 2
    a, steps_a, b, steps_b = argv[0], int(argv[1]), argv[2], int(argv[3])
    ta, tb = kernel_times(a), kernel_times(b)
    rows = sorted(set(ta) | set(tb), key=lambda k: -(ta.get(k, 0) / steps_a + tb.get(k, 0) / steps_b))
    print(f"| kernel | {a} us/step | {b} us/step |\n|---|---|---|")
    for k in rows:
        print(f"| `{k}` | {ta.get(k, 0) / steps_a / 1e3:.1f} | {tb.get(k, 0) / steps_b / 1e3:.1f} |")
    print(f"| **total** | **{sum(ta.values()) / steps_a / 1e3:.1f}** | **{sum(tb.values()) / steps_b / 1e3:.1f}** |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
