#!/usr/bin/env python3
"""torchvision's ResNet-18 (CIFAR stem) from Python through triaccel.train, beside the built-in resnet18 and beside
PyTorch training the same module, eager and under torch.compile, all in one process on one GPU with one recipe:
CIFAR-10 (binary layout), batch 96, amp-bf16, channels_last, SGD momentum 0.9 nesterov, weight decay 5e-4, cosine
decay, random crop + flip, seed SEED. Throughput is the last epoch's training images/s (the first epoch holds the
warm-up, the CUDA-graph capture and torch.compile's compilation); accuracy is the test accuracy after the last epoch.

Arms (--arms): auto (torchvision's module as it is: the engine splits it with torch.fx, no units() written),
units (the same module with a hand-written units(); issue 20), builtin (the engine's own resnet18), eager (a plain
PyTorch loop, GPU-resident data, augmentation on the GPU), compile (the same loop over torch.compile(module)).
--protocol: the 15-epoch protocol of the README's accuracy tables (lr 0.075, label smoothing 0.1, 5 warm-up
epochs, 15 epochs) instead of lr 0.05 without warm-up.

Usage: python_resnet18.py DATA_DIR OUT_DIR [--epochs 2] [--seeds 0] [--arms auto,builtin,eager,compile]
       [--protocol] [--json OUT.json]
"""
import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torchvision
from torch import nn

import triaccel

RECIPE = dict(batch_size=96, precision="amp-bf16", lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4,
              lr_decay="cosine", warmup_epochs=0, augment="on", channels_last=True, label_smoothing=0.0)
PROTOCOL = dict(RECIPE, lr=0.075, label_smoothing=0.1, warmup_epochs=5)


def cifar_resnet18_plain():
    """torchvision's ResNet-18 with the CIFAR stem, forward untouched (no units())."""
    m = torchvision.models.resnet18(num_classes=10)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


class CifarResNet18(torchvision.models.ResNet):
    """torchvision's ResNet-18 with the CIFAR stem (3x3 conv, no max-pool); units() lists its modules in forward
    order (the parameterless ones join the unit before them). Its state_dict is torchvision's."""

    def __init__(self):
        super().__init__(torchvision.models.resnet.BasicBlock, [2, 2, 2, 2], num_classes=10)
        self.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        self.maxpool = nn.Identity()
        self.flatten = nn.Flatten()  # torchvision's forward calls torch.flatten; as a module it can be in a unit

    def units(self):
        blocks = [b for layer in (self.layer1, self.layer2, self.layer3, self.layer4) for b in layer]
        return [self.conv1, self.bn1, self.relu, self.maxpool, *blocks, self.avgpool, self.flatten, self.fc]


def last_epoch(out):
    events = [json.loads(line) for line in open(os.path.join(out, "events.jsonl")) if line.strip()]
    epochs = [e for e in events if e["event"] == "epoch"]
    return epochs[-1]


def run_triaccel(name, model, data_dir, out, epochs, seed):
    summary = triaccel.train(model, dataset="cifar10", data_dir=data_dir, epochs=epochs, seed=seed, out=out,
                             progress="off", **RECIPE)
    e = last_epoch(out)
    return {"run": name, "test_acc": summary["test_acc"], "images_per_s": e["images_per_s"],
            "epoch_s": e["epoch_s"], "peak_vram_gb": summary["peak_vram_gb"], "units": summary.get("units")}


def cifar_read(data_dir):
    def records(names):
        raw = np.concatenate([np.fromfile(os.path.join(data_dir, n), dtype=np.uint8) for n in names])
        raw = raw.reshape(-1, 3073)
        return torch.from_numpy(raw[:, 1:].reshape(-1, 3, 32, 32).copy()), torch.from_numpy(raw[:, 0].astype(np.int64))
    return records([f"data_batch_{i}.bin" for i in range(1, 6)]), records(["test_batch.bin"])


def run_eager(model, data_dir, epochs, seed, compiled=False):
    """The same module, recipe and data in a plain PyTorch loop (GPU-resident uint8 data, augmentation on the GPU);
    compiled: the module under torch.compile (Inductor, default mode)."""
    torch.manual_seed(seed)
    (xtr, ytr), (xte, yte) = cifar_read(data_dir)
    xtr, ytr, xte, yte = xtr.cuda(), ytr.cuda(), xte.cuda(), yte.cuda()
    mean = (xtr.float() / 255).mean(dim=(0, 2, 3)).view(1, 3, 1, 1)
    std = (xtr.float() / 255).std(dim=(0, 2, 3), unbiased=False).view(1, 3, 1, 1)
    model = model.cuda().to(memory_format=torch.channels_last).train()
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.SGD([{"params": decay, "weight_decay": RECIPE["weight_decay"]},
                           {"params": no_decay, "weight_decay": 0.0}],
                          lr=RECIPE["lr"], momentum=RECIPE["momentum"], nesterov=RECIPE["nesterov"])
    b = RECIPE["batch_size"]
    steps_per_epoch = xtr.shape[0] // b
    warm = int(RECIPE["warmup_epochs"] * steps_per_epoch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / warm if s < warm else
                                              0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, epochs * steps_per_epoch - warm))))
    loss_fn = nn.CrossEntropyLoss(label_smoothing=RECIPE["label_smoothing"])
    run = torch.compile(model) if compiled else model
    torch.backends.cudnn.benchmark = True
    rates = []
    for _ in range(epochs):
        order = torch.randperm(xtr.shape[0], device="cuda")
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for s in range(steps_per_epoch):
            idx = order[s * b:(s + 1) * b]
            x = nn.functional.pad(xtr[idx].float() / 255, (4, 4, 4, 4))
            dx, dy = torch.randint(0, 9, (2,)).tolist()
            x = x[:, :, dy:dy + 32, dx:dx + 32]
            if torch.rand(()) < 0.5:
                x = x.flip(3)
            x = ((x - mean) / std).contiguous(memory_format=torch.channels_last)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_fn(run(x), ytr[idx])
            loss.backward()
            opt.step()
            sched.step()
        stop.record()
        stop.synchronize()
        rates.append(steps_per_epoch * b / (start.elapsed_time(stop) / 1000))
    model.eval()
    correct = 0
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        for s in range(0, xte.shape[0], 500):
            x = ((xte[s:s + 500].float() / 255 - mean) / std).contiguous(memory_format=torch.channels_last)
            correct += (model(x).argmax(1) == yte[s:s + 500]).sum().item()
    return {"run": "pytorch-compile" if compiled else "pytorch-eager", "test_acc": 100.0 * correct / xte.shape[0], "images_per_s": rates[-1],
            "epoch_s": xtr.shape[0] / rates[-1], "peak_vram_gb": torch.cuda.max_memory_allocated() / 1e9}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("data_dir")
    ap.add_argument("out")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--arms", default="auto,builtin,eager,compile")
    ap.add_argument("--protocol", action="store_true")
    ap.add_argument("--batch", type=int, default=RECIPE["batch_size"], help="batch size of every arm")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.protocol:
        RECIPE.update(PROTOCOL)
    RECIPE["batch_size"] = a.batch
    rows = []
    for seed in [int(s) for s in a.seeds.split(",")]:
        for arm in a.arms.split(","):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            torch.manual_seed(seed)
            t = time.time()
            out = os.path.join(a.out, f"{arm}_s{seed}")
            if arm in ("auto", "auto-unfused"):  # unfused: the units keep PyTorch's BatchNorm (triaccel/_fused.py)
                triaccel._fused.ENABLED = arm == "auto"
                r = run_triaccel("python-" + arm, cifar_resnet18_plain(), a.data_dir, out, a.epochs, seed)
                triaccel._fused.ENABLED = True
            elif arm == "units":
                r = run_triaccel("python-units", CifarResNet18(), a.data_dir, out, a.epochs, seed)
            elif arm == "builtin":
                r = run_triaccel("built-in", "resnet18", a.data_dir, out, a.epochs, seed)
            else:
                r = run_eager(cifar_resnet18_plain(), a.data_dir, a.epochs, seed, compiled=arm == "compile")
            r.update(seed=seed, wall_s=round(time.time() - t, 1))
            r.pop("units", None)
            rows.append(r)
            print(json.dumps(r), flush=True)
    by = {}
    for r in rows:
        by.setdefault(r["run"], []).append(r)
    mean = {k: {"test_acc": sum(x["test_acc"] for x in v) / len(v),
                "images_per_s": sum(x["images_per_s"] for x in v) / len(v), "seeds": len(v)} for k, v in by.items()}
    auto = mean.get("python-auto", {}).get("images_per_s")
    ratios = {f"python_auto_vs_{k}": auto / m["images_per_s"] for k, m in mean.items() if auto and k != "python-auto"}
    result = {"bench": "python_resnet18", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "recipe": RECIPE, "epochs": a.epochs, "rows": rows, "mean": mean, "ratios": ratios}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    print(f"| run | seeds | acc % | img/s (last epoch) |")
    print("|---|---|---|---|")
    for k, m in mean.items():
        print(f"| {k} | {m['seeds']} | {m['test_acc']:.2f} | {m['images_per_s']:.0f} |")
    for k, v in ratios.items():
        print(f"{k}: {v:.3f}x")


if __name__ == "__main__":
    main()
