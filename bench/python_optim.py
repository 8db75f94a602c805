#!/usr/bin/env python3
"""triaccel.optim in a plain PyTorch loop on the GPU, beside torch.optim.AdamW (fused) in the same process:
torchvision's ResNet-18 (CIFAR stem) on one fixed synthetic batch (batch 256, autocast bf16, channels_last),
STEPS steps per optimizer. Reports each optimizer's median step time over the last half of the steps (a whole
training step: forward, backward, optimizer; CUDA events), its optimizer-state bytes against fp32 AdamW's, and the
loss after the last step (all start from the same weights, so the losses should be close).

Usage: python_optim.py [--steps 120] [--json OUT.json]
"""
import argparse
import copy
import json

import torch
import torchvision
from torch import nn

import triaccel


def resnet18():
    m = torchvision.models.resnet18(num_classes=10)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


def run(name, make_opt, base, x, y, steps):
    model = copy.deepcopy(base).cuda().to(memory_format=torch.channels_last).train()
    opt = make_opt(model)
    loss_fn = nn.CrossEntropyLoss()
    times = []
    for _ in range(steps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    tail = sorted(times[steps // 2:])
    params = sum(p.numel() for p in model.parameters())
    state = getattr(opt, "state_bytes", None)
    if state is None:  # torch.optim.AdamW: exp_avg and exp_avg_sq in fp32
        state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim() > 0)
    return {"optimizer": name, "step_ms": tail[len(tail) // 2], "state_bytes": state, "adamw_fp32_bytes": 8 * params,
            "final_loss": loss.item(), "formats": sorted(set(getattr(opt, "formats", {}).values()))}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.manual_seed(0)
    base = resnet18()
    x = torch.randn(256, 3, 32, 32, device="cuda").contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (256,), device="cuda")
    torch.backends.cudnn.benchmark = True

    def torch_adamw(m):
        decay = [p for p in m.parameters() if p.dim() >= 2]
        rest = [p for p in m.parameters() if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 1e-2}, {"params": rest, "weight_decay": 0.0}],
                                 lr=1e-3, fused=True)

    rows = [run("torch AdamW (fused)", torch_adamw, base, x, y, a.steps),
            run("triaccel AdamW fp32", lambda m: triaccel.optim.AdamW(m.named_parameters(), lr=1e-3), base, x, y,
                a.steps),
            run("triaccel AdamW8bit", lambda m: triaccel.optim.AdamW8bit(m.named_parameters(), lr=1e-3), base, x, y,
                a.steps),
            run("triaccel BAOC 25%", lambda m: triaccel.optim.BAOC(m.named_parameters(), memory_budget="25%", lr=1e-3,
                                                                    plan_warmup=a.steps // 4), base, x, y, a.steps)]
    result = {"bench": "python_optim", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "steps": a.steps, "batch": 256, "rows": rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    print(f"{'optimizer':22} {'ms/step':>8} {'state MB':>9} {'of fp32':>8} {'loss':>7}  formats")
    for r in rows:
        print(f"{r['optimizer']:22} {r['step_ms']:8.2f} {r['state_bytes'] / 1e6:9.1f} "
              f"{r['state_bytes'] / r['adamw_fp32_bytes']:8.2f} {r['final_loss']:7.3f}  {','.join(r['formats'])}")


if __name__ == "__main__":
    main()
