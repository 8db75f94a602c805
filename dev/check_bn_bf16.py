#!/usr/bin/env python3
"""Does cuDNN's batch norm take bf16 channels_last input, and how does it compare with ATen's native kernels that
PyTorch 2.11 uses for bf16 (bench/profile_kernels.py: 3.45 ms of a 9.3 ms ResNet-18 b512 step, against 1.9 ms for
cuDNN's fp16 kernels)? For each ResNet-18/CIFAR BN shape at batch 512: the largest differences of output, input
gradient, weight/bias gradients and running stats against F.batch_norm in float64, and the forward+backward time of
each path (CUDA events, median of 20). Usage: python3 dev/check_bn_bf16.py [--batch 512] [--out FILE]
"""
import argparse
import json

import torch
import torch.nn.functional as F


def run(path, x, w, b, rm, rv, dy):
    x = x.detach().requires_grad_(True)
    w = w.detach().requires_grad_(True)
    b = b.detach().requires_grad_(True)
    rm, rv = rm.clone(), rv.clone()
    if path == "cudnn":
        y = torch.cudnn_batch_norm(x, w, b, rm, rv, True, 0.1, 1e-5)[0]
    else:
        y = F.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5)
    y.backward(dy)
    return y, x.grad, w.grad, b.grad, rm, rv


def time_ms(fn, reps=20):
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return sorted(times)[len(times) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--out", default="check_bn_bf16.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for c, hw in ((64, 32), (128, 16), (256, 8), (512, 4)):
        x = (torch.randn(args.batch, c, hw, hw, device="cuda") * 2 + 0.5).to(torch.bfloat16)
        x = x.contiguous(memory_format=torch.channels_last)
        dy = torch.randn_like(x)
        w = torch.rand(c, device="cuda") + 0.5
        b = torch.randn(c, device="cuda")
        rm, rv = torch.zeros(c, device="cuda"), torch.ones(c, device="cuda")
        ref = run("native", x.double(), w.double(), b.double(), rm.double(), rv.double(), dy.double())
        row = {"shape": [args.batch, c, hw, hw]}
        for path in ("native", "cudnn"):
            try:
                got = run(path, x, w, b, rm, rv, dy)
            except RuntimeError as err:
                row[path] = {"error": str(err).splitlines()[0][:200]}
                continue
            names = ("y", "dx", "dw", "db", "running_mean", "running_var")
            err = {n: float((g.double() - r).abs().max() / (r.abs().max() + 1e-12)) for n, g, r in zip(names, got, ref)}
            ms = time_ms(lambda: run(path, x, w, b, rm, rv, dy))
            row[path] = {"max_rel_err": err, "fwd_bwd_ms": ms, "y_dtype": str(got[0].dtype),
                         "y_channels_last": got[0].is_contiguous(memory_format=torch.channels_last)}
        rows.append(row)
        print(row)
    json.dump({"bench": "check_bn_bf16", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "cudnn": torch.backends.cudnn.version(), "rows": rows}, open(args.out, "w"), indent=2)


if __name__ == "__main__":
    main()
