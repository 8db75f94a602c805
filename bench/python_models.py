#!/usr/bin/env python3
"""Issue 54's GPU acceptance: torchvision models with no units() written, trained through triaccel.train.

Part 1 (models): resnet18 (CIFAR stem set here), resnet50, mobilenet_v3_small, convnext_tiny and vit_b_16 (image
size 32: 2x2 patches) on a CIFAR-10 subset (TRAIN_N train, 2,048 test images, 32x32, batch 96, amp-bf16, one epoch),
each unbudgeted and then, from a fresh copy, under vram_budget = 60 % of its own unbudgeted peak; the units found,
the peaks against the budget, s/epoch and accuracy.
Part 2 (resnet18): torchvision's ResNet-18 (CIFAR stem) split automatically beside the built-in resnet18, same call,
batch 96 and 512, amp-bf16, EPOCHS epochs of the full CIFAR-10; images/s of the last epoch.

Part 3 (loader): a DataLoader of CIFAR-10 with the user's transforms on CPU workers beside the tensors path (the
engine's GPU augmentation), where the loader is not the bottleneck (resnet50, b96) and where it is (resnet18, b512,
against the loader's own rate).

Usage: python_models.py CIFAR_BIN_DIR OUT_DIR [--json OUT.json] [--part models|resnet18|loader|all] [--train-n N]
       [--image-size 64] [--model-epochs 2] [--only resnet50,convnext_tiny]
"""
import argparse
import gc
import json
import os
import time

import numpy as np
import torch
import torchvision
from torch import nn

import triaccel


def cifar_read(data_dir):
    def records(names):
        raw = np.concatenate([np.fromfile(os.path.join(data_dir, n), dtype=np.uint8) for n in names]).reshape(-1, 3073)
        return torch.from_numpy(raw[:, 1:].reshape(-1, 3, 32, 32).copy()), torch.from_numpy(raw[:, 0].astype(np.int64))
    return records([f"data_batch_{i}.bin" for i in range(1, 6)]), records(["test_batch.bin"])


def cifar_resnet18():
    m = torchvision.models.resnet18(num_classes=10)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


N_LOADER = int(os.environ.get("N_LOADER", "0"))  # a subset for a quick check (0: all)

MODELS = {
    "resnet18": cifar_resnet18,
    "resnet50": lambda: torchvision.models.resnet50(num_classes=10),
    "mobilenet_v3_small": lambda: torchvision.models.mobilenet_v3_small(num_classes=10),
    "convnext_tiny": lambda: torchvision.models.convnext_tiny(num_classes=10),
    "vit_b_16": lambda: torchvision.models.vit_b_16(num_classes=10, image_size=32),
}


def last_epoch(out):
    events = [json.loads(line) for line in open(os.path.join(out, "events.jsonl")) if line.strip()]
    return [e for e in events if e["event"] == "epoch"][-1], [e for e in events if e["event"] == "oom"]


def train(model, data, out, **kw):
    gc.collect()  # an earlier run's model (a failed run's traceback holds it) leaves the GPU first
    torch.cuda.empty_cache()
    t = time.time()
    try:
        s = triaccel.train(model, train=data[0], test=data[1], out=out, progress="off",
                           device=os.environ.get("BENCH_DEVICE", "cuda"), **kw)
    except Exception as e:  # noqa: BLE001 - a row that failed is a row of the table
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}", "error_text": str(e)[:6000],
                "wall_s": round(time.time() - t, 1)}
    e, ooms = last_epoch(out)
    return {"test_acc": s.get("test_acc"), "peak_vram_gb": s.get("peak_vram_gb"), "epoch_s": e.get("epoch_s"),
            "images_per_s": e.get("images_per_s"), "units": s.get("units"), "units_found": s.get("units_found"),
            "oom_events": len(ooms), "wall_s": round(time.time() - t, 1)}


def part_models(train_set, test_set, out_dir, n, image_size, epochs, only):
    data = ((train_set[0][:n], train_set[1][:n]), (test_set[0][:2048], test_set[1][:2048]))
    rows = []
    for name, make in MODELS.items():
        if only and name not in only:
            continue
        if name == "vit_b_16" and image_size:
            make = lambda: torchvision.models.vit_b_16(num_classes=10, image_size=image_size)  # noqa: E731
        common = dict(epochs=epochs, batch_size=96, precision="amp-bf16", seed=0, augment="on",
                      image_size=image_size)
        torch.manual_seed(0)
        free = train(make(), data, os.path.join(out_dir, name + "_free"), **common)
        row = {"model": name, "unbudgeted": free}
        if "peak_vram_gb" in free:
            budget = round(0.6 * free["peak_vram_gb"], 3)
            torch.manual_seed(0)
            tight = train(make(), data, os.path.join(out_dir, name + "_budget"), vram_budget=f"{budget}GB", **common)
            tight["budget_gb"] = budget
            tight["within"] = "peak_vram_gb" in tight and tight["peak_vram_gb"] <= budget
            row["budget_60pct"] = tight
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def part_resnet18(train_set, test_set, out_dir, epochs):
    data = (train_set, (test_set[0], test_set[1]))
    rows = []
    for batch in (96, 512):
        for arm, model in (("torchvision_auto", cifar_resnet18), ("builtin", lambda: "resnet18")):
            torch.manual_seed(0)
            r = train(model(), data, os.path.join(out_dir, f"r18_{arm}_{batch}"), epochs=epochs, batch_size=batch,
                      precision="amp-bf16", seed=0, augment="on", channels_last=True)
            r.update(arm=arm, batch=batch)
            rows.append(r)
            print(json.dumps(r), flush=True)
    return rows


class CifarTransformed(torch.utils.data.Dataset):
    """CIFAR-10 uint8 tensors with the user's CPU transforms at each access: random crop (pad 4) + flip, to float,
    normalize (torchvision.transforms.v2 on tensors)."""

    def __init__(self, images, labels, train):
        from torchvision.transforms import v2
        self.images, self.labels = images, labels
        steps = [v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip()] if train else []
        self.t = v2.Compose(steps + [v2.ToDtype(torch.float32, scale=True),
                                     v2.Normalize((0.491, 0.482, 0.447), (0.247, 0.243, 0.262))])

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.t(self.images[i]), self.labels[i]


def part_loader(train_set, test_set, out_dir, epochs, workers):
    """The DataLoader path beside the tensors path: resnet50 (32 px, b96: the loader is not the bottleneck) and
    resnet18 (b512: it is; its rate is compared with the loader's own rate, iterating it alone)."""
    rows = []
    test = (test_set[0][:2048], test_set[1][:2048])
    train_set = (train_set[0][:N_LOADER], train_set[1][:N_LOADER]) if N_LOADER else train_set
    for name, batch in (("resnet50", 96), ("resnet18", 512)):
        common = dict(epochs=epochs, batch_size=batch, precision="amp-bf16", seed=0, channels_last=True)
        torch.manual_seed(0)
        t = train(MODELS[name](), (train_set, test), os.path.join(out_dir, f"ld_{name}_tensors"), augment="on",
                  **common)
        loader = torch.utils.data.DataLoader(CifarTransformed(*train_set, True), batch_size=batch,
                                             num_workers=workers, pin_memory=True)
        torch.manual_seed(0)
        d = train(MODELS[name](), (loader, CifarTransformed(*test, False)), os.path.join(out_dir, f"ld_{name}_dl"),
                  augment="off", **common)
        n, t0 = 0, time.time()
        for k, (x, _) in enumerate(loader):  # the loader alone, after its workers' start
            if k == 2:
                t0, n = time.time(), 0
            n += len(x)
            if k == 2 + 40:
                break
        alone = n / max(time.time() - t0, 1e-9)
        row = {"model": name, "batch": batch, "workers": workers, "tensors_images_per_s": t.get("images_per_s"),
               "dataloader_images_per_s": d.get("images_per_s"), "loader_alone_images_per_s": round(alone),
               "tensors_acc": t.get("test_acc"), "dataloader_acc": d.get("test_acc"), "errors": [t.get("error"),
                                                                                                  d.get("error")]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("data")
    ap.add_argument("out")
    ap.add_argument("--json")
    ap.add_argument("--part", default="all")
    ap.add_argument("--train-n", type=int, default=10240)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--image-size", type=int, default=0, help="part models: the engine resizes to this (0: 32)")
    ap.add_argument("--model-epochs", type=int, default=1)
    ap.add_argument("--only", default="", help="part models: these models (comma-separated)")
    a = ap.parse_args()
    train_set, test_set = cifar_read(a.data)
    result = {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "torch": torch.__version__}
    if a.part in ("models", "all"):
        result["models"] = part_models(train_set, test_set, a.out, a.train_n, a.image_size, a.model_epochs,
                                       [m for m in a.only.split(",") if m])
    if a.part in ("resnet18", "all"):
        result["resnet18"] = part_resnet18(train_set, test_set, a.out, a.epochs)
    if a.part in ("loader", "all"):
        result["loader"] = part_loader(train_set, test_set, a.out, a.epochs, a.workers)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    print("\n| model | units | unbudgeted peak GB | s/epoch | budget GB | peak GB | within | s/epoch | acc |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in result.get("models", []):
        f, b = r["unbudgeted"], r.get("budget_60pct", {})
        print(f"| {r['model']} | {len(f.get('units') or [])} | {f.get('peak_vram_gb', f.get('error'))} | "
              f"{f.get('epoch_s')} | {b.get('budget_gb')} | {b.get('peak_vram_gb', b.get('error'))} | "
              f"{b.get('within')} | {b.get('epoch_s')} | {f.get('test_acc')} |")
    for r in result.get("resnet18", []):
        print(f"| resnet18 {r['arm']} b{r['batch']} | img/s {r.get('images_per_s', r.get('error'))} | "
              f"peak {r.get('peak_vram_gb')} | acc {r.get('test_acc')} |")
    for r in result.get("loader", []):
        print(f"| loader {r['model']} b{r['batch']} | tensors {r['tensors_images_per_s']} | DataLoader "
              f"{r['dataloader_images_per_s']} | loader alone {r['loader_alone_images_per_s']} | {r['errors']} |")


if __name__ == "__main__":
    main()
