#!/usr/bin/env python3
"""Memory left allocated on the GPU after each of several triaccel.train calls in one process (issue 54: the
15-epoch protocol's peaks grew by ~68 MB per run). After each run: torch.cuda.memory_allocated(), then the same
after torch._C._cuda_clearCublasWorkspaces() (cuBLAS keeps one workspace per handle and stream, and every run takes
a new stream from the pool). Usage: python_repeat_probe.py [RUNS]"""
import sys

import torch

import triaccel

runs = int(sys.argv[1]) if len(sys.argv) > 1 else 4
g = torch.Generator().manual_seed(0)
train = (torch.randint(0, 256, (2048, 3, 32, 32), dtype=torch.uint8, generator=g), torch.randint(0, 10, (2048,), generator=g))
test = (train[0][:512], train[1][:512])
base = torch.cuda.memory_allocated()
print(f"before: {base / 1e6:.1f} MB")
for i in range(runs):
    s = triaccel.train("resnet18", train=train, test=test, epochs=1, batch_size=128, precision="amp-bf16",
                       progress="off", out=f"/tmp/repeat_probe/{i}")
    left = torch.cuda.memory_allocated()
    torch._C._cuda_clearCublasWorkspaces()
    cleared = torch.cuda.memory_allocated()
    print(f"run {i}: peak {s['peak_vram_gb']:.3f} GB, left allocated {(left - base) / 1e6:.1f} MB, "
          f"after clearing cuBLAS workspaces {(cleared - base) / 1e6:.1f} MB", flush=True)
    base = cleared
