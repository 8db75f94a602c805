#!/usr/bin/env python3
"""Issue 20's GPU acceptance for the Python module: torchvision's ResNet-18 (CIFAR stem) defined in Python and split
into units, trained through triaccel.train, beside the built-in resnet18 trained through the same call and beside a
PyTorch eager loop training the same module, all in one process on one GPU with one recipe: CIFAR-10 (binary
layout), batch 96, amp-bf16, channels_last, SGD lr 0.05 momentum 0.9 nesterov, weight decay 5e-4, cosine decay, random
crop + flip, EPOCHS epochs, seed SEED. Throughput is the last epoch's training images/s (the first epoch holds the
warm-up and the CUDA-graph capture); accuracy is the test accuracy after the last epoch.

Usage: python_resnet18.py DATA_DIR OUT_DIR [--epochs 2] [--seed 0] [--json OUT.json]
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torchvision
from torch import nn

import triaccel

RECIPE = dict(batch_size=96, precision="amp-bf16", lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4,
              lr_decay="cosine", warmup_epochs=0, augment="on", channels_last=True)


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
                             progress="lines", **RECIPE)
    e = last_epoch(out)
    return {"run": name, "test_acc": summary["test_acc"], "images_per_s": e["images_per_s"],
            "epoch_s": e["epoch_s"], "peak_vram_gb": summary["peak_vram_gb"], "units": summary.get("units")}


def cifar_read(data_dir):
    def records(names):
        raw = np.concatenate([np.fromfile(os.path.join(data_dir, n), dtype=np.uint8) for n in names])
        raw = raw.reshape(-1, 3073)
        return torch.from_numpy(raw[:, 1:].reshape(-1, 3, 32, 32).copy()), torch.from_numpy(raw[:, 0].astype(np.int64))
    return records([f"data_batch_{i}.bin" for i in range(1, 6)]), records(["test_batch.bin"])


def run_eager(model, data_dir, epochs, seed):
    """The same module, recipe and data in a plain PyTorch loop (GPU-resident uint8 data, augmentation on the GPU)."""
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
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs * steps_per_epoch)
    loss_fn = nn.CrossEntropyLoss()
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
                loss = loss_fn(model(x), ytr[idx])
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
    return {"run": "pytorch-eager", "test_acc": 100.0 * correct / xte.shape[0], "images_per_s": rates[-1],
            "epoch_s": xtr.shape[0] / rates[-1], "peak_vram_gb": torch.cuda.max_memory_allocated() / 1e9}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("data_dir")
    ap.add_argument("out")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    ap.add_argument("--no-eager", action="store_true", help="only the two triaccel runs (more seeds of them)")
    a = ap.parse_args()
    rows = []
    torch.manual_seed(a.seed)
    rows.append(run_triaccel("python-module", CifarResNet18(), a.data_dir, os.path.join(a.out, "python"), a.epochs,
                             a.seed))
    rows.append(run_triaccel("built-in", "resnet18", a.data_dir, os.path.join(a.out, "builtin"), a.epochs, a.seed))
    if not a.no_eager:
        torch.cuda.reset_peak_memory_stats()
        torch.manual_seed(a.seed)
        t = time.time()
        rows.append(run_eager(CifarResNet18(), a.data_dir, a.epochs, a.seed))
        rows[-1]["wall_s"] = time.time() - t
    py, builtin = rows[0], rows[1]
    result = {"bench": "python_resnet18", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "recipe": RECIPE, "epochs": a.epochs, "seed": a.seed, "rows": rows,
              "python_vs_builtin": py["images_per_s"] / builtin["images_per_s"],
              "python_vs_eager": py["images_per_s"] / rows[2]["images_per_s"] if len(rows) > 2 else None}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    print(f"{'run':14} {'acc %':>7} {'img/s':>9} {'s/epoch':>8} {'peak GB':>8}")
    for r in rows:
        print(f"{r['run']:14} {r['test_acc']:7.2f} {r['images_per_s']:9.0f} {r['epoch_s']:8.3f} {r['peak_vram_gb']:8.3f}")
    print(f"python module / built-in: {result['python_vs_builtin']:.3f}x" +
          (f"   python module / eager: {result['python_vs_eager']:.2f}x" if result["python_vs_eager"] else ""))


if __name__ == "__main__":
    main()
