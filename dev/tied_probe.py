#!/usr/bin/env python3
"""Why the tied GPT of bench/python_gpt.py learns only the unigram on the GPU (issue 54): one optimizer step of the
engine beside the same step in PyTorch, from the same weights, on one batch, for the tied and the untied model.

The engine: triaccel.train over exactly one batch (16 windows, batch 16, one epoch: one step), SGD without momentum or
weight decay, fp32, no CUDA graphs. PyTorch: the same loss, backward, p -= lr * grad. Prints, per model, the largest
difference of each changed tensor between the two, the step's size, whether the tied tensors are still one, and
whether the weights moved at all.

Usage: tied_probe.py TINYSHAKESPEARE_DIR [cuda|cpu] [--small] [--steps=N]
(--small: 2 layers of width 64, quick on a CPU; --steps: N steps of the same batch, lr on the engine's cosine)
"""
import copy
import math
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import python_gpt  # noqa: E402  (the model and loss of the acceptance run)

import triaccel  # noqa: E402


def steps_of(model, x, y, device, lr, optimizer, steps):
    """The engine's one step and PyTorch's, from the same weights: {tensor: (max |engine - torch|, max |torch's step|,
    max |engine's step|)}. optimizer: sgd (no momentum) or adamw (no weight decay; its first step is about
    lr * sign(grad), so a tensor updated twice moves 2 lr)."""
    reference = copy.deepcopy(model).to(device)
    extra = {"momentum": 0.0, "nesterov": False} if optimizer == "sgd" else {}
    with tempfile.TemporaryDirectory() as d:
        triaccel.train(model, train=(x, y), test=(x, y), loss=python_gpt.next_token_loss, epochs=steps, batch_size=len(x),
                       optimizer=optimizer, weight_decay=0.0, lr=lr, warmup_epochs=0, precision="fp32",
                       cuda_graphs=False, device=device, progress="off", out=d, seed=0, **extra)
    before = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    reference.train()
    adamw = torch.optim.AdamW(reference.parameters(), lr=lr, weight_decay=0.0) if optimizer == "adamw" else None
    first_loss = None
    for step in range(steps):  # the engine's schedule: half a cosine from lr to 0 over the steps, no warm-up
        lr_now = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
        reference.zero_grad(set_to_none=True)
        loss = python_gpt.next_token_loss(reference(x.to(device)), y.to(device))
        first_loss = float(loss) if first_loss is None else first_loss
        loss.backward()
        if adamw is None:
            with torch.no_grad():
                for p in reference.parameters():
                    p -= lr_now * p.grad
        else:
            for group in adamw.param_groups:
                group["lr"] = lr_now
            adamw.step()
    engine = {k: v.detach().to(device) for k, v in model.state_dict().items()}
    rows = {}
    for k, v in reference.state_dict().items():
        rows[k] = (float((engine[k] - v).abs().max()), float((v - before[k]).abs().max()),
                   float((engine[k] - before[k]).abs().max()))
    return rows, first_loss


def main():
    data, device = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "cuda"
    steps = int(next((a.split("=")[1] for a in sys.argv if a.startswith("--steps=")), 1))
    if "--small" in sys.argv:
        python_gpt.DIM, python_gpt.LAYERS, python_gpt.HEADS = 64, 2, 2
    train, _, vocab = python_gpt.windows(os.path.join(data, "input.txt"))
    x, y = train[0][:16], train[1][:16]
    for tied, optimizer in ((True, "sgd"), (False, "sgd"), (True, "adamw"), (False, "adamw")):
        torch.manual_seed(0)
        model = python_gpt.TiedGpt(vocab, tied=tied)
        rows, loss = steps_of(model, x, y, device, 0.1 if optimizer == "sgd" else 1e-3, optimizer, steps)
        same = model.head.weight is model.tok.weight
        print(f"\n== {'tied' if tied else 'untied'}, {optimizer}, {steps} steps on {device}: loss before {loss:.4f}; "
              f"head.weight is tok.weight after the run: {same}")
        print("| tensor | max |engine - torch| | torch's step | engine's step |")
        print("|---|---|---|---|")
        worst = 0.0
        for k, (diff, step, estep) in rows.items():
            worst = max(worst, diff / max(step, 1e-12))
            if k.startswith(("tok", "head", "pos", "norm", "blocks.0.", "blocks.5.qkv")) or diff > 1e-4 * max(step, 1e-6):
                print(f"| {k} | {diff:.3g} | {step:.3g} | {estep:.3g} |")
        print(f"worst difference relative to the step: {worst:.3g} ({'SAME' if worst < 1e-2 else 'DIFFERENT'})")


if __name__ == "__main__":
    main()
