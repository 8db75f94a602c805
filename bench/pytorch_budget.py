#!/usr/bin/env python3
"""PyTorch under a GPU-memory cap: the best recipe a PyTorch user has for training batch B inside the budget.

The same job as triaccel's budget runs (bench/run_memory_planner.sh): torchvision ResNet-18 with the CIFAR stem, SGD
momentum 0.9 nesterov, weight decay 5e-4, bf16 autocast, channels_last, cuDNN heuristics (benchmark off: autotuning's
workspace tries fill a cap), synthetic GPU-resident input of one batch; --resident-gb holds that much GPU memory as a
resident dataset would (0: the data comes from the host, as with a DataLoader).
The cap: torch.cuda.set_per_process_memory_fraction(cap / total), which caps what the caching allocator reserves, as
triaccel's --vram-budget does. Recipes, each at micro-batches B/k (k = 1, 2, 3, 6):
  - accumulation: k micro-batches, loss / k, one optimizer step;
  - checkpoint: the same with torch.utils.checkpoint around each of the four stages (use_reentrant=False);
  - compile: torch.compile of the model with torch._functorch.config.activation_memory_budget = 0.5 (its
    min-cut recompute), at k = 1 and 2.
A recipe that runs out of memory scores 0. Each recipe runs in a fresh process (an out-of-memory error can leave
the allocator fragmented). Prints and writes one JSON object: every recipe's img/s and peak, and the best.
Usage: pytorch_budget.py --cap-gb 0.5 --batch 96 --out pytorch_budget.json
"""
import argparse
import json
import subprocess
import sys
import time


def one(recipe, batch, k, cap_gb, steps, warmup, resident_gb):
    import torch
    import torchvision
    from torch.utils.checkpoint import checkpoint

    total = torch.cuda.get_device_properties(0).total_memory
    if cap_gb > 0:
        torch.cuda.set_per_process_memory_fraction(cap_gb * 1e9 / total)
    torch.backends.cudnn.benchmark = False
    torch.manual_seed(0)
    resident = torch.empty(int(resident_gb * 1e9), dtype=torch.uint8, device="cuda")  # a GPU-resident dataset
    m = torchvision.models.resnet18(num_classes=10)
    m.conv1 = torch.nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = torch.nn.Identity()
    m = m.cuda().to(memory_format=torch.channels_last).train()
    decay = [p for p in m.parameters() if p.dim() > 1]
    no_decay = [p for p in m.parameters() if p.dim() <= 1]
    opt = torch.optim.SGD([{"params": decay, "weight_decay": 5e-4}, {"params": no_decay, "weight_decay": 0.0}],
                          lr=0.01, momentum=0.9, nesterov=True)
    loss_fn = torch.nn.CrossEntropyLoss()
    micro = (batch + k - 1) // k
    x = torch.randn(batch, 3, 32, 32, device="cuda").contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,), device="cuda")

    stages = [m.layer1, m.layer2, m.layer3, m.layer4]

    def forward_checkpointed(inp):
        h = m.relu(m.bn1(m.conv1(inp)))
        for s in stages:
            h = checkpoint(s, h, use_reentrant=False)
        return m.fc(torch.flatten(m.avgpool(h), 1))

    fwd = m
    if recipe == "checkpoint":
        fwd = forward_checkpointed
    elif recipe == "compile":
        import torch._functorch.config as fconfig
        fconfig.activation_memory_budget = 0.5
        fwd = torch.compile(m)

    def step():
        opt.zero_grad(set_to_none=True)
        for start in range(0, batch, micro):
            xs, ys = x[start:start + micro], y[start:start + micro]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_fn(fwd(xs), ys) * (xs.shape[0] / batch)
            loss.backward()
        opt.step()

    try:
        for _ in range(warmup):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        return {"recipe": recipe, "k": k, "micro_batch": micro, "ok": True, "img_s": steps * batch / dt,
                "peak_allocated_gb": torch.cuda.max_memory_allocated() / 1e9,
                "peak_reserved_gb": torch.cuda.max_memory_reserved() / 1e9}
    except torch.OutOfMemoryError:
        return {"recipe": recipe, "k": k, "micro_batch": micro, "ok": False, "img_s": 0.0, "error": "out of memory"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cap-gb", type=float, default=0.5)
    ap.add_argument("--batch", type=int, default=96)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--resident-gb", type=float, default=0.0,
                    help="GPU memory held as a resident dataset (CIFAR-10 uint8 train + test: 0.185)")
    ap.add_argument("--out", default="")
    ap.add_argument("--one", nargs=2, metavar=("RECIPE", "K"))
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one[0], a.batch, int(a.one[1]), a.cap_gb, a.steps, a.warmup, a.resident_gb)))
        return
    ks = [k for k in (1, 2, 3, 6) if a.batch // k >= 8]
    jobs = [("accumulation", k) for k in ks] + [("checkpoint", k) for k in ks] + [("compile", 1), ("compile", 2)]
    rows = []
    for recipe, k in jobs:
        r = subprocess.run([sys.executable, __file__, "--one", recipe, str(k), "--cap-gb", str(a.cap_gb),
                            "--batch", str(a.batch), "--steps", str(a.steps), "--warmup", str(a.warmup),
                            "--resident-gb", str(a.resident_gb)],
                           capture_output=True, text=True, timeout=600)
        try:
            row = json.loads(r.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            row = {"recipe": recipe, "k": k, "ok": False, "img_s": 0.0, "error": r.stderr.strip()[-300:]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    best = max(rows, key=lambda r: r["img_s"])
    out = {"bench": "pytorch_budget", "cap_gb": a.cap_gb, "batch": a.batch, "resident_gb": a.resident_gb,
           "rows": rows, "best": best}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps({"best": best}))


if __name__ == "__main__":
    main()
