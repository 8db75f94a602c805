#!/usr/bin/env python3
"""Where a ResNet-18/CIFAR training step spends its GPU time, per precision: the PyTorch eager step of
pytorch_reference.py (same model, optimizer, layout), run under torch.profiler; prints, per precision, the GPU kernel
time per step and the kernels that take most of it, and writes them as JSON.

The kernels are the ones our CUDA-graph step replays too (the same ATen/cuDNN ops under autocast), so the sum is a
floor for either runtime's step. Used to find why amp-bf16 steps are slower than amp-fp16 ones (bench/results/h100).
Usage: python3 bench/profile_kernels.py [--batch 512] [--precisions amp-bf16,amp-fp16] [--out FILE]
"""
import argparse
import collections
import json

import torch
from torch.profiler import ProfilerActivity, profile

from pytorch_reference import make_model


def profile_one(batch, precision, steps):
    torch.manual_seed(0)
    mf = torch.channels_last
    model = make_model("resnet18", 32).cuda().to(memory_format=mf).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)
    dtype = {"fp32": torch.float32, "amp-bf16": torch.bfloat16, "amp-fp16": torch.float16}[precision]
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "amp-fp16")
    x = torch.randn(batch, 3, 32, 32, device="cuda").contiguous(memory_format=mf)
    y = torch.randint(0, 10, (batch,), device="cuda")
    loss_fn = torch.nn.CrossEntropyLoss()
    torch.backends.cudnn.benchmark = True

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dtype, enabled=precision != "fp32"):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    for _ in range(20):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per_kernel = collections.defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = per_kernel[e.name]
            k[0] += e.device_time_total / steps / 1000.0  # ms per step
            k[1] += 1
    total = sum(v[0] for v in per_kernel.values())
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])
    return {"precision": precision, "batch": batch, "kernel_ms_per_step": total,
            "kernels": [{"name": n[:140], "ms_per_step": v[0], "calls_per_step": v[1] / steps} for n, v in top[:25]]}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--precisions", default="amp-bf16,amp-fp16")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default="profile_kernels.json")
    args = ap.parse_args()
    rows = [profile_one(args.batch, p, args.steps) for p in args.precisions.split(",")]
    json.dump({"bench": "profile_kernels", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "rows": rows}, open(args.out, "w"), indent=2)
    for r in rows:
        print(f"== {r['precision']} batch {r['batch']}: {r['kernel_ms_per_step']:.3f} ms of kernels per step")
        for k in r["kernels"][:14]:
            print(f"  {k['ms_per_step']:7.3f} ms {k['calls_per_step']:5.1f}x  {k['name'][:110]}")


if __name__ == "__main__":
    main()
