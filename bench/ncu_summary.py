#!/usr/bin/env python3
"""Sums Nsight Compute's raw CSV (`ncu --csv --page raw --metrics gpu__time_duration.sum`) per kernel name and prints
the kernels that take most of the time, with their launch counts and share.
Usage: python3 bench/ncu_summary.py FILE.csv [--top 15]"""
import argparse
import collections
import csv
import io


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    text = open(a.csv, errors="replace").read()
    start = text.find('"ID"')
    if start < 0:
        print("no kernel rows in", a.csv)
        return
    rows = list(csv.DictReader(io.StringIO(text[start:])))
    total = collections.Counter()
    count = collections.Counter()
    scale = 1.0  # to nanoseconds, from the units row
    for r in rows:
        value = r.get("gpu__time_duration.sum", "")
        try:
            ns = float(value.replace(",", "")) * scale
        except ValueError:  # the units row
            scale = {"nsecond": 1.0, "usecond": 1e3, "msecond": 1e6, "second": 1e9}.get(value.strip(), 1.0)
            continue
        name = r.get("Kernel Name", "?")[:90]
        total[name] += ns
        count[name] += 1
    all_ns = sum(total.values())
    print(f"{len(rows)} kernel launches, {all_ns / 1e6:.2f} ms of kernel time")
    for name, ns in total.most_common(a.top):
        print(f"{ns / 1e6:9.3f} ms {100 * ns / all_ns:5.1f} % {count[name]:5d}x  {name}")


if __name__ == "__main__":
    main()
