#!/usr/bin/env python3
"""What was allocated on the GPU at the moment of the allocator's peak, from a memory snapshot.

A run started with TRIACCEL_MEMORY_HISTORY=FILE (docs/measuring.md) writes PyTorch's memory snapshot (a pickle: the
allocator's blocks now and its last allocations and frees, each with its C++ stack) to FILE.PHASE each time that
phase's peak rises (FILE.step: the training steps'). This walks the recorded events back from the blocks alive at the
end, finds the moment the allocated bytes were highest, and lists what was alive then, grouped by where it was
allocated; with --compare, what differs from another snapshot's peak:

    python3 bench/memory_peak.py runs/x/memory.pickle.step [--top 25] [--frames 4] [--compare runs/y/memory.pickle.step]

The peak found is the highest within the recorded events (the snapshot's ring of the last N); the line `events`
says how far back they reach.
"""
import argparse
import bisect
import collections
import pickle
import shutil
import subprocess
import sys

# Frames that say nothing about who asked for the memory: the allocator, tensor factories, dispatch.
DULL = ("c10::cuda::CUDACachingAllocator", "c10::", "at::detail::empty", "at::empty", "at::native::empty",
        "at::_ops::", "at::(anonymous", "torch::autograd::VariableType", "c10::impl::", "at::TensorBase",
        "at::native::(anonymous namespace)::create_out", "wrapper_", "std::", "__libc", "_start", "??",
        "torch::unwind", "torch::CapturedTraceback", "at::meta::", "at::compositeexplicitautograd",
        "at::cuda::", "torch::ADInplaceOrView", "torch::autograd::impl", "at::functionalization")


DEMANGLED = {}


def demangle_all(names):
    """Mangled C++ names (TORCH_SYMBOLIZE_MODE=dladdr gives them) through c++filt, where the machine has it."""
    todo = sorted({n for n in names if n.startswith("_Z") and n not in DEMANGLED})
    if not todo or not shutil.which("c++filt"):
        return
    out = subprocess.run(["c++filt"], input="\n".join(todo), capture_output=True, text=True).stdout.splitlines()
    if len(out) == len(todo):
        DEMANGLED.update(zip(todo, out))


def frame_name(f):
    name = f.get("name", "?") if isinstance(f, dict) else str(f)
    return DEMANGLED.get(name, name)


def site(frames, depth):
    names = [frame_name(f) for f in frames]
    keep = [n for n in names if not n.startswith(DULL) and n.strip()]
    return " <- ".join(n[:90] for n in keep[:depth]) or "(no stack)"


def read_snapshot(path):
    """(events, segments) of a snapshot's device with the most recorded events."""
    with open(path, "rb") as f:
        snap = pickle.load(f)
    traces = snap.get("device_traces", [])
    dev = max(range(len(traces)), key=lambda d: len(traces[d])) if traces else 0
    events = traces[dev] if traces else []
    return events, [s for s in snap.get("segments", []) if s.get("device", dev) == dev]


def live_at_end(segs):
    """{address: (size, frames)} of the blocks alive when the snapshot was written."""
    live = {}
    for seg in segs:
        addr = seg["address"]
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                live[addr] = (b["size"], b.get("frames", []))
            addr += b["size"]
    return live


def peak_of(path, depth, at_end=False):
    """(peak bytes, events before the end, blocks, end bytes, events, {group: [bytes, blocks, how]}) of a snapshot;
    at_end: the blocks alive when it was written instead of at the peak."""
    events, segs = read_snapshot(path)

    # addr -> (size, frames, how it is known)
    live = {a: (size, frames, "alive at the end") for a, (size, frames) in live_at_end(segs).items()}
    total = sum(s for s, _, _ in live.values())
    end_total = total

    # The allocation behind each free in the ring (its stack), where the ring reaches back to it.
    alloc_of = {}
    last_alloc = {}
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            last_alloc[e["addr"]] = i
        elif e["action"] == "free_completed" and e["addr"] in last_alloc:
            alloc_of[i] = last_alloc.pop(e["addr"])

    demangle_all(frame_name(f) for e in events for f in e.get("frames", []))
    demangle_all(frame_name(f) for _, frames, _ in live.values() for f in frames)
    best, best_at, best_live = total, len(events), dict(live)
    for i in range(len(events) - 1 if not at_end else -1, -1, -1):
        e = events[i]
        if e["action"] == "alloc":
            if e["addr"] in live:
                total -= live.pop(e["addr"])[0]
        elif e["action"] == "free_completed":
            j = alloc_of.get(i)
            frames, how = (events[j].get("frames", []), "allocated and freed in the ring") if j is not None else (
                e.get("frames", []), "freed in the ring (stack of the free)")
            live[e["addr"]] = (e["size"], frames, how)
            total += e["size"]
        else:
            continue
        if total > best:
            best, best_at, best_live = total, i, dict(live)

    groups = collections.defaultdict(lambda: [0, 0, ""])
    for size, frames, how in best_live.values():
        g = groups[site(frames, depth)]
        g[0] += size
        g[1] += 1
        g[2] = how
    return best, len(events) - best_at, len(best_live), end_total, len(events), groups


def address_ranges(segs, events, gap=1 << 30):
    """Sorted [(first, last, default)]: the address ranges of the allocator's segments, each the cluster of segment
    bases and mapped addresses with no gap over `gap` (an expandable segment maps pages next to each other in a range
    of its own); default: it holds a segment of the default pool alive at the snapshot's end (else it was another
    pool's, e.g. a capture's that was released after it failed)."""
    points = [(s["address"], tuple(s.get("segment_pool_id", (0, 0))) == (0, 0)) for s in segs]
    points += [(e["addr"], False) for e in events if e["action"] in ("segment_alloc", "segment_map")]
    ranges = []
    for addr, default in sorted(points):
        if ranges and addr - ranges[-1][1] <= gap:
            first, _, was = ranges[-1]
            ranges[-1] = (first, addr, was or default)
        else:
            ranges.append((addr, addr, default))
    return ranges


PAGE = 2 << 20  # the granularity of an expandable segment's mappings (a large pool's pages are 10 of them)


def state_at(events, segs, index):
    """({address: (size, frames)} of the live blocks, set of mapped 2 MiB pages) just before event `index`, walked back
    from the snapshot's end."""
    live = live_at_end(segs)
    pages = set()
    for s in segs:
        pages |= set(range(s["address"] // PAGE, (s["address"] + s["total_size"]) // PAGE))
    for e in reversed(events[index:]):
        a = e["action"]
        span = set(range(e["addr"] // PAGE, (e["addr"] + e["size"]) // PAGE)) if "segment" in a else set()
        if a == "alloc":
            live.pop(e["addr"], None)
        elif a == "free_completed":
            live[e["addr"]] = (e["size"], e.get("frames", []))
        elif a in ("segment_alloc", "segment_map"):
            pages -= span
        elif a in ("segment_free", "segment_unmap"):
            pages |= span
    return live, pages


def mapped_ranges(live, pages):
    """[(first address, end, bytes used by live blocks, [free gaps of 1 MiB or more, largest first])] of the runs of
    mapped pages."""
    runs = []
    for p in sorted(pages):
        if runs and runs[-1][1] == p * PAGE:
            runs[-1][1] += PAGE
        else:
            runs.append([p * PAGE, (p + 1) * PAGE])
    blocks = sorted((a, size) for a, (size, _) in live.items())
    out = []
    for lo, hi in runs:
        used, gaps, at = 0, [], lo
        for a, size in blocks:
            if lo <= a < hi:
                if a - at >= 1 << 20:
                    gaps.append(a - at)
                used += size
                at = max(at, a + size)
        if hi - at >= 1 << 20:
            gaps.append(hi - at)
        out.append((lo, hi, used, sorted(gaps, reverse=True)))
    return out


def ooms_of(path):
    """[(event index, requested bytes, device free bytes, allocated, reserved, {pool: (allocated, reserved)}, ranges,
    where the refused allocation was asked for)]
    at each refused allocation in the ring (a capture that ran out of memory: TRIACCEL_MEMORY_HISTORY's
    FILE.capture_oom.N); pools "default" (the default pool's segments) and "other" (the rest); ranges: mapped_ranges
    then, each with its pool; where: its stack's first frames that name a caller (FILE.fatal: the run's last, refused
    one)."""
    events, segs = read_snapshot(path)
    ranges = address_ranges(segs, events)
    bases = [r[0] for r in ranges]

    def pool(addr):
        i = bisect.bisect_right(bases, addr) - 1
        return "default" if i >= 0 and ranges[i][2] else "other"

    out = []
    for i, e in enumerate(events):
        if e["action"] != "oom":
            continue
        live, pages = state_at(events, segs, i)
        alloc, res = collections.Counter(), collections.Counter()
        for a, (size, _) in live.items():
            alloc[pool(a)] += size
        for p in pages:
            res[pool(p * PAGE)] += PAGE
        pools = {k: (alloc[k], res[k]) for k in ("default", "other")}
        runs = [(pool(lo), lo, hi, used, gaps) for lo, hi, used, gaps in mapped_ranges(live, pages)]
        frames = e.get("frames", [])
        demangle_all(frame_name(f) for f in frames)
        out.append((i, e["size"], e.get("device_free", e.get("addr", 0)), sum(alloc.values()), sum(res.values()),
                    pools, runs, site(frames, 8)))
    return out


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("snapshot")
    ap.add_argument("--top", type=int, default=25, help="groups listed (largest first)")
    ap.add_argument("--frames", type=int, default=4, help="frames naming a group")
    ap.add_argument("--compare", help="another run's snapshot: list the groups whose bytes at the peak differ")
    ap.add_argument("--at-end", action="store_true", help="the blocks alive when the snapshot was written instead")
    ap.add_argument("--ooms", action="store_true", help="the refused allocations in the ring, with the allocated "
                    "and reserved bytes when each was refused")
    args = ap.parse_args(argv)
    mb = 1e6
    if args.ooms:
        mib = 1 << 20
        for i, size, free, allocated, reserved, pools, runs, where_asked in ooms_of(args.snapshot):
            by_pool = "; ".join(f"{k} pool {a / mb:.1f} allocated in {r / mb:.1f} reserved" for k, (a, r) in
                                pools.items())
            print(f"oom at event {i}: asked {size / mb:.1f} MB, device free {free / mb:.1f} MB, "
                  f"allocated {allocated / mb:.1f} MB, reserved {reserved / mb:.1f} MB ({by_pool})")
            print(f"  asked by {where_asked}")
            for where, lo, hi, used, gaps in runs:
                print(f"  mapped {where:7s} {hex(lo)}: {(hi - lo) / mib:6.1f} MiB, {used / mib:6.1f} used, free gaps "
                      f"of 1 MiB or more: {', '.join(f'{g / mib:.1f} MiB' for g in gaps) or 'none'}")
    best, before_end, blocks, end_total, n_events, groups = peak_of(args.snapshot, args.frames, args.at_end)
    print(f"events: {n_events} recorded; allocated at the end {end_total / mb:.1f} MB")
    what = "alive at the end" if args.at_end else f"peak within them, {before_end} events before the end"
    print(f"{what}: {best / mb:.1f} MB, {blocks} blocks")
    if args.compare:
        other = peak_of(args.compare, args.frames, args.at_end)
        print(f"{args.compare}: peak {other[0] / mb:.1f} MB; this one {(best - other[0]) / mb:+.2f} MB")
        diffs = []
        for name in set(groups) | set(other[5]):
            a, b = groups.get(name, [0, 0, ""]), other[5].get(name, [0, 0, ""])
            if a[0] != b[0] or a[1] != b[1]:
                diffs.append((a[0] - b[0], a[1] - b[1], name))
        print(f"{'MB':>8} {'blocks':>6}  where allocated (this run minus the other)")
        for d, c, name in sorted(diffs, key=lambda t: -abs(t[0]))[:args.top]:
            print(f"{d / mb:+8.2f} {c:+6d}  {name}")
        return 0
    print(f"{'MB':>8} {'blocks':>6}  where allocated")
    for name, (size, count, how) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"{size / mb:8.1f} {count:6d}  {name}" + ("" if how == "alive at the end" else f"   [{how}]"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
