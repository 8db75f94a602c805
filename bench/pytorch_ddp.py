#!/usr/bin/env python3
"""PyTorch DDP baseline for bench/run_data_parallel.sh: eager training of the same model at the same per-GPU batch,
launched by torchrun (`torchrun --nproc_per_node N bench/pytorch_ddp.py ...`; N = 1 is plain single-GPU training).

Models: torchvision ResNet-18 with the CIFAR stem (32x32), torchvision EfficientNet-B0 (224x224), and ViT-Tiny
(patch 4 on 32x32, dim 192, depth 12, 3 heads, MLP 768, pre-norm: the shape of triaccel's vit-tiny). SGD momentum
0.9 (AdamW for ViT-Tiny), bf16 autocast, channels_last for the CNNs, synthetic GPU-resident input (no loader cost),
DDP with its default buckets (gradient all-reduce overlapped with backward, NCCL). Warm up, then time `steps` steps
with CUDA events `repeats` times; rank 0 appends one JSON row (median global images/s) to --out.
"""
import argparse
import json
import os

import torch
import torch.distributed as dist
import torchvision


class VitTiny(torch.nn.Module):
    def __init__(self, classes=10, size=32, patch=4, dim=192, depth=12, heads=3, mlp=768):
        super().__init__()
        self.patch = torch.nn.Conv2d(3, dim, patch, patch)
        n = (size // patch) ** 2
        self.cls = torch.nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = torch.nn.Parameter(torch.zeros(1, n + 1, dim))
        layer = torch.nn.TransformerEncoderLayer(dim, heads, mlp, dropout=0.0, activation="gelu", batch_first=True,
                                                 norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.size(0), -1, -1), x], 1) + self.pos
        return self.head(self.norm(self.blocks(x))[:, 0])


def make_model(name):
    if name == "resnet18":
        m = torchvision.models.resnet18(num_classes=10)
        m.conv1 = torch.nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        m.maxpool = torch.nn.Identity()
        return m, 32, True
    if name == "efficientnet-b0":
        return torchvision.models.efficientnet_b0(num_classes=10), 224, True
    if name == "vit-tiny":
        return VitTiny(), 32, False
    raise SystemExit(f"unknown model {name}")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--batch", type=int, default=512, help="per GPU")
    ap.add_argument("--warmup", type=int, default=15)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    if world > 1:
        dist.init_process_group("nccl")
    torch.manual_seed(0)
    model, size, cnn = make_model(a.model)
    mf = torch.channels_last if cnn else torch.contiguous_format
    model = model.cuda().to(memory_format=mf).train()
    opt = (torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4) if cnn
           else torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05))
    net = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local]) if world > 1 else model
    x = torch.randn(a.batch, 3, size, size, device="cuda").contiguous(memory_format=mf)
    y = torch.randint(0, 10, (a.batch,), device="cuda")
    loss_fn = torch.nn.CrossEntropyLoss()
    torch.backends.cudnn.benchmark = True

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(net(x), y)
        loss.backward()
        opt.step()

    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    rates = []
    for _ in range(a.repeats):
        if world > 1:
            dist.barrier()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(a.steps):
            step()
        stop.record()
        stop.synchronize()
        rates.append(world * a.batch * a.steps / (start.elapsed_time(stop) / 1000.0))
    rates.sort()
    if rank == 0:
        row = {"system": "pytorch-ddp-eager", "model": a.model, "world_size": world, "batch_per_gpu": a.batch,
               "images_per_s": rates[len(rates) // 2], "images_per_s_min": rates[0], "images_per_s_max": rates[-1],
               "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
        print(json.dumps(row), flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
