#!/usr/bin/env python3
"""triaccel.optim in a plain PyTorch loop on the GPU, beside torch.optim.AdamW (fused) in the same process:
torchvision's ResNet-18 (CIFAR stem) on one fixed synthetic batch (batch 256, autocast bf16, channels_last),
STEPS steps per optimizer. Reports each optimizer's median step time over the last half of the steps (a whole
training step: forward, backward, optimizer; CUDA events), its optimizer-state bytes against fp32 AdamW's, and the
loss after the last step (all start from the same weights, so the losses should be close).

Each optimizer runs three ways (mode): "eager" (opt.step() called from Python), "compiled" (opt.step under
torch.compile, Inductor: the step is one traced graph), "graph" (the whole training step, forward, backward and
opt.step, captured in one CUDA graph and replayed, lr a tensor on the GPU; torch's AdamW with capturable=True).

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


def train_step(model, opt, x, y, loss_fn, opt_step, zero=True):
    if zero:
        opt.zero_grad(set_to_none=False)  # the gradient tensors stay where a captured step reads them
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):  # a cache would not survive a capture
        loss = loss_fn(model(x), y)
    loss.backward()
    opt_step()
    return loss


def capture(model, opt, x, y, loss_fn):
    """The training step (forward, backward into the zeroed gradients, opt.step) in a CUDA graph, after three warm-up
    steps on the capture's stream (PyTorch's whole-network recipe)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            train_step(model, opt, x, y, loss_fn, opt.step)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=False)
    with torch.cuda.graph(graph, stream=side):
        loss = train_step(model, opt, x, y, loss_fn, opt.step, zero=False)
    return graph, loss


def first_capture(base, x, y):
    """Captures a throwaway copy with torch's AdamW; returns the error's first line, or None. On the H100 the first
    model captured in a process failed ("operation failed due to a previous error during capture"), with torch's AdamW
    and with ours alike, twice in a row, while every later model captured (a bare forward and backward captured first
    was fine: not understood). This takes that first capture, so that the rows compare like with like."""
    model = copy.deepcopy(base).cuda().to(memory_format=torch.channels_last).train()
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3, device="cuda"), fused=True, capturable=True)
    try:
        capture(model, opt, x, y, nn.CrossEntropyLoss())
        return None
    except Exception as e:  # torch.AcceleratorError
        torch.cuda.synchronize()
        return str(e).splitlines()[0]


def run(name, make_opt, base, x, y, steps, mode):
    model = copy.deepcopy(base).cuda().to(memory_format=torch.channels_last).train()
    opt = make_opt(model)
    loss_fn = nn.CrossEntropyLoss()
    opt_step = torch.compile(opt.step) if mode == "compiled" else opt.step
    graph, times = None, []
    for i in range(steps):
        if mode == "graph" and i == steps // 4:  # warm (BAOC has planned): capture once, then replay
            graph, loss = capture(model, opt, x, y, loss_fn)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if graph is not None:
            opt.zero_grad(set_to_none=False)
            graph.replay()
        else:
            loss = train_step(model, opt, x, y, loss_fn, opt_step)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    tail = sorted(times[steps // 2:])
    params = sum(p.numel() for p in model.parameters())
    state = getattr(opt, "state_bytes", None)
    if state is None:  # torch.optim.AdamW: exp_avg and exp_avg_sq in fp32
        state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim() > 0)
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())  # reset with torch._dynamo.reset()
    return {"optimizer": name, "mode": mode, "graph_breaks": breaks, "step_ms": tail[len(tail) // 2], "state_bytes": state, "adamw_fp32_bytes": 8 * params,
            "final_loss": loss.item(), "formats": sorted(set(getattr(opt, "formats", {}).values()))}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--modes", default="eager,compiled,graph")
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.manual_seed(0)
    base = resnet18()
    x = torch.randn(256, 3, 32, 32, device="cuda").contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (256,), device="cuda")
    torch.backends.cudnn.benchmark = True

    def lr():  # a tensor on the GPU: a captured step reads it at each replay
        return torch.tensor(1e-3, device="cuda")

    def torch_adamw(m):
        decay = [p for p in m.parameters() if p.dim() >= 2]
        rest = [p for p in m.parameters() if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 1e-2}, {"params": rest, "weight_decay": 0.0}],
                                 lr=lr(), fused=True, capturable=True)

    makers = {"torch AdamW (fused)": torch_adamw,
              "triaccel AdamW fp32": lambda m: triaccel.optim.AdamW(m.named_parameters(), lr=lr()),
              "triaccel AdamW8bit": lambda m: triaccel.optim.AdamW8bit(m.named_parameters(), lr=lr()),
              "triaccel BAOC 25%": lambda m: triaccel.optim.BAOC(m.named_parameters(), memory_budget="25%", lr=lr(),
                                                                  plan_warmup=a.steps // 8)}
    rows, first_capture_error = [], None
    for mode in a.modes.split(","):
        if mode == "graph":
            first_capture_error = first_capture(base, x, y)
        for name, make in makers.items():
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            try:
                rows.append(run(name, make, base, x, y, a.steps, mode))
            except Exception as e:  # a mode this optimizer cannot run: its row says why
                torch.cuda.synchronize()
                rows.append({"optimizer": name, "mode": mode, "error": str(e).splitlines()[0]})
            print(rows[-1], flush=True)
    result = {"bench": "python_optim", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "steps": a.steps, "batch": 256, "first_capture_error": first_capture_error, "rows": rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    print(f"{'optimizer':22} {'mode':9} {'ms/step':>8} {'state MB':>9} {'of fp32':>8} {'loss':>7}  formats")
    for r in rows:
        if "error" in r:
            print(f"{r['optimizer']:22} {r['mode']:9} error: {r['error']}")
            continue
        print(f"{r['optimizer']:22} {r['mode']:9} {r['step_ms']:8.2f} {r['state_bytes'] / 1e6:9.1f} "
              f"{r['state_bytes'] / r['adamw_fp32_bytes']:8.2f} {r['final_loss']:7.3f}  {','.join(r['formats'])}")


if __name__ == "__main__":
    main()
