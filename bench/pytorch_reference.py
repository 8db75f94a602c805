#!/usr/bin/env python3
"""PyTorch eager (and torch.compile, --modes) reference for bench_train_throughput: the same protocol on the same GPU in the same job.

torchvision ResNet-18 with the CIFAR stem (3x3 conv, no max-pool), SGD momentum 0.9 nesterov, weight decay 5e-4,
autocast per precision (GradScaler for fp16), synthetic GPU-resident input, zero_grad(set_to_none=True).
Warm up, then time `steps` steps with CUDA events, `repeats` times; report the median images/s and the allocator's
peak allocated bytes from model creation to the end of the timed steps. Writes JSON rows like the C++ bench.
"""
import argparse
import json

import torch
import torchvision


def make_model(name, image_size):
    if name == "resnet18":
        m = torchvision.models.resnet18(num_classes=10)
        m.conv1 = torch.nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        m.maxpool = torch.nn.Identity()
        return m
    if name == "efficientnet-b0":
        return torchvision.models.efficientnet_b0(num_classes=10)
    raise SystemExit(f"unknown model {name}")


def bench_one(model_name, batch, precision, channels_last, image_size, warmup, steps, repeats, mode="eager"):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    mf = torch.channels_last if channels_last else torch.contiguous_format
    model = make_model(model_name, image_size).cuda().to(memory_format=mf).train()
    forward = torch.compile(model) if mode == "compile" else model  # compile: its default mode; warm-up compiles
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.SGD([{"params": decay, "weight_decay": 5e-4}, {"params": no_decay, "weight_decay": 0.0}],
                          lr=0.01, momentum=0.9, nesterov=True)
    dtype = {"fp32": None, "amp-bf16": torch.bfloat16, "amp-fp16": torch.float16}[precision]
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "amp-fp16")
    x = torch.randn(batch, 3, image_size, image_size, device="cuda").contiguous(memory_format=mf)
    y = torch.randint(0, 10, (batch,), device="cuda")
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = loss_fn(forward(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    torch.backends.cudnn.benchmark = True
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    rates = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            loss = step()
        stop.record()
        stop.synchronize()
        rates.append(batch * steps / (start.elapsed_time(stop) / 1000.0))
    rates.sort()
    return {"model": model_name, "mode": mode, "batch": batch, "precision": precision, "channels_last": channels_last,
            "image_size": image_size, "images_per_s": rates[len(rates) // 2], "images_per_s_min": rates[0],
            "images_per_s_max": rates[-1], "peak_allocated_gb": torch.cuda.max_memory_allocated() / 1e9,
            "final_loss_finite": bool(torch.isfinite(loss).item())}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--batch-sizes", default="96,512")
    ap.add_argument("--precisions", default="fp32,amp-bf16,amp-fp16")
    ap.add_argument("--layouts", default="channels_last,nchw")
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=15)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--modes", default="eager", help="comma-separated: eager, compile (torch.compile of the model)")
    ap.add_argument("--out")
    a = ap.parse_args()
    rows = []
    for b in map(int, a.batch_sizes.split(",")):
        for p in a.precisions.split(","):
            for layout in a.layouts.split(","):
                for mode in a.modes.split(","):
                    r = bench_one(a.model, b, p, layout == "channels_last", a.image_size, a.warmup, a.steps,
                                  a.repeats, mode)
                    print(f"pytorch  {mode:7s} {a.model:16s} batch {b:4d} {p:9s} {layout:13s} "
                          f"{r['images_per_s']:9.0f} img/s  peak {r['peak_allocated_gb']:.3f} GB", flush=True)
                    rows.append(r)
    result = {"system": "pytorch-eager", "torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
