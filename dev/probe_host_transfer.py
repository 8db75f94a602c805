#!/usr/bin/env python3
"""Ceilings of NeuroFlux's host activation cache on this machine (docs/neuroflux.md, "On the GPU"): how fast the
host gathers cache rows, how fast pinned memory crosses to and from the GPU, whether a copy on its own stream overlaps
GPU work, and what first touch of fresh host memory costs. Prints one JSON object (the rates in GB/s).

Usage: python3 dev/probe_host_transfer.py [--rows 20000] [--row-kb 128] [--batch 112]
"""
import argparse
import json
import time

import torch


def seconds_per_call(fn, iters):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def rate(nbytes, fn, iters):
    return nbytes / seconds_per_call(fn, iters) / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--row-kb", type=int, default=128)
    ap.add_argument("--batch", type=int, default=112)
    ap.add_argument("--iters", type=int, default=100)
    a = ap.parse_args()
    row = a.row_kb * 1024 // 2
    out = {"gpu": torch.cuda.get_device_name(), "threads": torch.get_num_threads(), "row_kb": a.row_kb,
           "batch": a.batch}
    try:
        out["thp"] = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
    except OSError:
        out["thp"] = None
    t0 = time.perf_counter()
    cache = torch.empty(a.rows, row, dtype=torch.bfloat16)
    cache.fill_(1.0)
    out["first_touch_gb_s"] = cache.numel() * 2 / (time.perf_counter() - t0) / 1e9
    t0 = time.perf_counter()
    cache.fill_(2.0)
    out["touched_fill_gb_s"] = cache.numel() * 2 / (time.perf_counter() - t0) / 1e9
    batch_bytes = a.batch * row * 2
    pinned = torch.empty(a.batch, row, dtype=torch.bfloat16).pin_memory()
    g = torch.Generator().manual_seed(0)
    idx = [torch.randint(0, a.rows, (a.batch,), generator=g) for _ in range(a.iters + 1)]
    it = iter(range(10 ** 9))

    def gather():
        torch.index_select(cache, 0, idx[next(it) % len(idx)], out=pinned)

    try:
        out["cpu"] = [l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")][0]
    except (OSError, IndexError):
        out["cpu"] = None
    # One thread: libc's memcpy (ctypes.memmove) against ATen's copy_ on the same 16 MB.
    import ctypes
    src, dst = cache[: a.batch], torch.empty(a.batch, row, dtype=torch.bfloat16)
    dst.fill_(0)
    torch.set_num_threads(1)
    out["memcpy_1thread_gb_s"] = rate(batch_bytes, lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), batch_bytes), a.iters)
    out["aten_copy_1thread_gb_s"] = rate(batch_bytes, lambda: dst.copy_(src), a.iters)
    torch.set_num_threads(out["threads"])
    out["aten_copy_gb_s"] = rate(batch_bytes, lambda: dst.copy_(src), a.iters)
    out["gather_gb_s"] = rate(batch_bytes, gather, a.iters)
    torch.set_num_threads(1)
    out["gather_1thread_gb_s"] = rate(batch_bytes, gather, a.iters)
    torch.set_num_threads(out["threads"])
    dev = torch.empty(a.batch, row, dtype=torch.bfloat16, device="cuda")
    out["h2d_gb_s"] = rate(batch_bytes, lambda: dev.copy_(pinned, non_blocking=True), a.iters)
    out["d2h_gb_s"] = rate(batch_bytes, lambda: pinned.copy_(dev, non_blocking=True), a.iters)
    pinned2 = torch.empty_like(pinned).pin_memory()
    dev2 = torch.empty_like(dev)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def both():
        with torch.cuda.stream(s1):
            dev.copy_(pinned, non_blocking=True)
        with torch.cuda.stream(s2):
            pinned2.copy_(dev2, non_blocking=True)
    out["h2d_plus_d2h_gb_s"] = rate(2 * batch_bytes, both, a.iters)
    # A copy beside GPU work: the time of (matmul; copy) on one stream vs on two.
    m = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def timed(fn, iters=50):
        return seconds_per_call(fn, iters) * 1e3

    out["matmul_ms"] = timed(lambda: m @ m)
    out["copy_ms"] = timed(lambda: dev.copy_(pinned, non_blocking=True))

    def one_stream():
        m @ m
        dev.copy_(pinned, non_blocking=True)

    def two_streams():
        m @ m
        with torch.cuda.stream(s1):
            dev.copy_(pinned, non_blocking=True)
    out["matmul_then_copy_one_stream_ms"] = timed(one_stream)
    out["matmul_and_copy_two_streams_ms"] = timed(two_streams)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
