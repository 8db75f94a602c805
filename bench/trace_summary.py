#!/usr/bin/env python3
"""Sums up a timeline written by `--profile-steps FIRST:END` (a Chrome trace of PyTorch's profiler) per step.

    trace_summary.py TRACE [TRACE ...]        one row per trace, JSON lines on stdout, a table on stderr
    trace_summary.py --compare BASE OTHER     the kernels whose time per step differs most between two traces
    trace_summary.py --kernels TRACE          the kernels that take the most time per step, with their counts
    trace_summary.py --host TRACE [RANGE]     the host's operators and CUDA calls by their own time (their children's
                                              excluded), inside the first RANGE (e.g. triaccel::curvature_round) or all

Per traced step (the trace's "triaccel::step" ranges count the steps), in ms:
  span      the GPU's time from its first kernel, copy or set in the trace to its last one's end
  busy      time in which any of them runs (the union over streams)
  compute   time in which anything but NCCL's kernels runs
  nccl      time in which NCCL's kernels run; overlap: both at once; nccl_alone: NCCL's with nothing else
  idle      span - busy: the GPU waiting (for the host, or for another rank)
  kernels   the sum of the non-NCCL kernels' own durations: higher than one GPU's when they run slower beside NCCL
  host_*    mean host time per step in each triaccel::* range (step, batch, stop_agreement)
"""
import json
import sys
from collections import defaultdict

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def load(path):
    with open(path) as f:
        return json.load(f)["traceEvents"]


def union(intervals):
    """Merged [start, end) intervals, sorted."""
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def length(merged):
    return sum(e - s for s, e in merged)


def intersect(a, b):
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        s = max(a[i][0], b[j][0])
        e = min(a[i][1], b[j][1])
        if e > s:
            total += e - s
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def is_nccl(event):
    return "nccl" in event.get("name", "").lower()


def summary(path):
    events = [e for e in load(path) if e.get("ph") == "X"]
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    steps = sum(1 for e in events if e.get("cat") == "user_annotation" and e.get("name") == "triaccel::step")
    n = max(steps, 1)
    row = {"trace": path, "steps": steps, "gpu_events": len(gpu)}
    if gpu:
        spans = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in gpu]
        everything = union(spans)
        compute = union((e["ts"], e["ts"] + e.get("dur", 0)) for e in gpu if not is_nccl(e))
        nccl = union((e["ts"], e["ts"] + e.get("dur", 0)) for e in gpu if is_nccl(e))
        span = max(s[1] for s in spans) - min(s[0] for s in spans)
        overlap = intersect(compute, nccl)
        row.update({
            "span_ms": span / n / 1e3,
            "busy_ms": length(everything) / n / 1e3,
            "compute_ms": length(compute) / n / 1e3,
            "nccl_ms": length(nccl) / n / 1e3,
            "overlap_ms": overlap / n / 1e3,
            "nccl_alone_ms": (length(nccl) - overlap) / n / 1e3,
            "idle_ms": (span - length(everything)) / n / 1e3,
            "kernels_ms": sum(e.get("dur", 0) for e in gpu if not is_nccl(e) and e["cat"] == "kernel") / n / 1e3,
        })
    host = defaultdict(float)
    for e in events:
        if e.get("cat") == "user_annotation" and e.get("name", "").startswith("triaccel::"):
            host[e["name"].split("::", 1)[1]] += e.get("dur", 0)
    for name, total in sorted(host.items()):
        row[f"host_{name}_ms"] = total / n / 1e3
    return row


def per_kernel(path, counts=None):
    events = load(path)
    steps = sum(1 for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                and e.get("name") == "triaccel::step") or 1
    times = defaultdict(float)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in GPU_CATS:
            times[e.get("name", "?")[:90]] += e.get("dur", 0) / steps / 1e3
            if counts is not None:
                counts[e.get("name", "?")[:90]] += 1 / steps
    return times


HOST_CATS = {"cpu_op", "cuda_runtime", "cuda_driver", "user_annotation"}


def host_self_times(path, within=None):
    """Per host event name: (count, ms of its own time: its duration less its direct children's on the same thread),
    inside the ranges named `within` when given (all of them); and those ranges' count and total length in ms."""
    events = [e for e in load(path) if e.get("ph") == "X" and e.get("cat") in HOST_CATS]
    windows = [(float("-inf"), float("inf"))]
    if within:
        windows = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events if e.get("name") == within)
        if not windows:
            raise SystemExit(f"no range named {within} in {path}")

    def inside(e):
        return any(lo <= e["ts"] and e["ts"] + e.get("dur", 0) <= hi for lo, hi in windows)

    threads = defaultdict(list)
    for e in events:
        if inside(e):
            threads[(e.get("pid"), e.get("tid"))].append(e)
    own = defaultdict(float)
    count = defaultdict(int)
    for evs in threads.values():
        evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        stack = []  # [end, name, own time so far]
        for e in evs:
            end = e["ts"] + e.get("dur", 0)
            while stack and stack[-1][0] <= e["ts"]:
                done = stack.pop()
                own[done[1]] += done[2]
            if stack:
                stack[-1][2] -= e.get("dur", 0)
            stack.append([end, e.get("name", "?")[:90], e.get("dur", 0)])
            count[e.get("name", "?")[:90]] += 1
        for done in stack:
            own[done[1]] += done[2]
    span = sum(hi - lo for lo, hi in windows) / 1e3 if within else None
    return {k: (count[k], v / 1e3) for k, v in own.items()}, (len(windows), span)


def main(argv):
    if len(argv) in (3, 4) and argv[1] == "--host":
        times, (ranges, span) = host_self_times(argv[2], argv[3] if len(argv) == 4 else None)
        if span is not None:
            print(f"{argv[3]}: {ranges} ranges, {span:.1f} ms in all")
        print(f"{'own ms':>9} {'count':>7}  host event")
        for k in sorted(times, key=lambda k: -times[k][1])[:30]:
            print(f"{times[k][1]:9.2f} {times[k][0]:7d}  {k}")
        print(f"{sum(v[1] for v in times.values()):9.2f} {sum(v[0] for v in times.values()):7d}  (all)")
        return 0
    if len(argv) == 4 and argv[1] == "--compare":
        base, other = per_kernel(argv[2]), per_kernel(argv[3])
        names = sorted(set(base) | set(other), key=lambda k: -abs(other.get(k, 0) - base.get(k, 0)))
        print(f"{'ms/step base':>12} {'other':>8} {'diff':>8}  kernel")
        for k in names[:25]:
            print(f"{base.get(k, 0):12.4f} {other.get(k, 0):8.4f} {other.get(k, 0) - base.get(k, 0):+8.4f}  {k}")
        print(f"{sum(base.values()):12.4f} {sum(other.values()):8.4f} "
              f"{sum(other.values()) - sum(base.values()):+8.4f}  (all)")
        return 0
    if len(argv) == 3 and argv[1] == "--kernels":
        counts = defaultdict(float)
        times = per_kernel(argv[2], counts)
        print(f"{'ms/step':>8} {'n/step':>7}  kernel")
        for k in sorted(times, key=lambda k: -times[k])[:25]:
            print(f"{times[k]:8.4f} {counts[k]:7.1f}  {k}")
        print(f"{sum(times.values()):8.4f} {sum(counts.values()):7.1f}  (all)")
        return 0
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    rows = [summary(p) for p in argv[1:]]
    for r in rows:
        print(json.dumps(r))
    keys = ["steps", "span_ms", "busy_ms", "compute_ms", "kernels_ms", "nccl_ms", "overlap_ms", "nccl_alone_ms",
            "idle_ms"]
    keys += sorted({k for r in rows for k in r if k.startswith("host_")})
    print(f"{'trace':>34} " + " ".join(f"{k:>13}" for k in keys), file=sys.stderr)
    for r in rows:
        parts = r["trace"].split("/")
        label = "/".join(parts[-2:])[-34:]
        cells = [r.get(k, "") for k in keys]
        print(f"{label:>34} " + " ".join(f"{c:>13.3f}" if isinstance(c, float) else f"{c!s:>13}" for c in cells),
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
