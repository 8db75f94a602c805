#!/usr/bin/env python3
"""Issue 54's language-model acceptance: a GPT-style character model defined in Python (the built-in gpt-char's shape:
6 pre-norm causal blocks, 6 heads, width 384, context 256, GELU MLP, trunc-normal 0.02 init) with its embedding and
output layer TIED (and the same model untied), trained through triaccel.train on tinyshakespeare tensors with loss=
next-token cross-entropy, beside the built-in gpt-char (untied) trained through the same call on the same windows (the engine's text reader:
90 % / 10 % split, windows of 257 characters at stride 256), same optimizer, schedule, batch, steps and seed.
Compares the validation loss (nats per character) after the same steps; arms torch_tied and torch_untied train the same
models in a plain PyTorch loop (the reference a tied model is judged against).

Usage: python_gpt.py TINYSHAKESPEARE_DIR OUT_DIR [--epochs 3] [--warmup-epochs 0] [--seed 0] [--json OUT.json]
"""
import argparse
import json
import math
import os

import torch
from torch import nn

import triaccel

BLOCK, DIM, HEADS, LAYERS = 256, 384, 6, 6


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.fc1, self.fc2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return h + self.fc2(nn.functional.gelu(self.fc1(self.norm2(h))))


class TiedGpt(nn.Module):
    def __init__(self, vocab, tied=True):
        super().__init__()
        self.tok = nn.Embedding(vocab, DIM)
        self.pos = nn.Parameter(torch.zeros(1, BLOCK, DIM))
        self.blocks = nn.Sequential(*[Block() for _ in range(LAYERS)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, vocab, bias=False)
        if tied:
            self.head.weight = self.tok.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.trunc_normal_(m.weight, std=0.02, a=-0.04, b=0.04)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
        nn.init.trunc_normal_(self.pos, std=0.02, a=-0.04, b=0.04)

    def forward(self, idx):
        h = self.tok(idx) + self.pos[:, : idx.shape[1]]
        return self.head(self.norm(self.blocks(h)))


def next_token_loss(logits, targets):
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def torch_loop(model, train, val, epochs, batch, lr, seed, device, warmup_epochs=0.0):
    """The same model, windows and recipe in a plain PyTorch loop: AdamW (weight decay 0.01 on matrices only),
    linear warm-up, then cosine decay to 0, bf16 autocast, a new order each epoch; the validation loss after the
    last."""
    torch.manual_seed(seed)
    model = model.to(device).train()
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}], lr=lr)
    n = len(train[0])
    per_epoch = (n + batch - 1) // batch
    steps, warm = epochs * per_epoch, int(warmup_epochs * per_epoch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / warm if s < warm else
                                              0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm))))
    x, y = train[0].to(device), train[1].to(device)
    cuda = str(device).startswith("cuda")
    for _ in range(epochs):
        order = torch.randperm(n, device=device)
        for i in range(0, n, batch):
            idx = order[i:i + batch]
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                loss = next_token_loss(model(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
        for i in range(0, len(val[0]), batch):
            xv, yv = val[0][i:i + batch].to(device), val[1][i:i + batch].to(device)
            total += float(next_token_loss(model(xv), yv)) * len(xv)
            count += len(xv)
    return total / count, steps


def windows(text_path):
    raw = open(text_path, "rb").read()
    vocab = sorted(set(raw))
    lookup = torch.full((256,), -1, dtype=torch.long)
    lookup[torch.tensor(vocab)] = torch.arange(len(vocab))
    data = lookup[torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()]
    cut = len(data) * 9 // 10

    def split(d):
        n = (len(d) - 1) // BLOCK
        w = d[: n * BLOCK + 1]
        x = torch.stack([w[i * BLOCK:(i + 1) * BLOCK] for i in range(n)])
        y = torch.stack([w[i * BLOCK + 1:(i + 1) * BLOCK + 1] for i in range(n)])
        return x, y
    return split(data[:cut]), split(data[cut:]), len(vocab)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("data")
    ap.add_argument("out")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--warmup-epochs", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    a = ap.parse_args()
    if os.environ.get("GPT_SMALL"):  # 2 layers of width 64 (dev/tied_probe.py --small's model)
        global DIM, LAYERS, HEADS
        DIM, LAYERS, HEADS = 64, 2, 2
    train, val, vocab = windows(os.path.join(a.data, "input.txt"))
    recipe = dict(epochs=a.epochs, batch_size=64, optimizer="adamw", lr=1e-3, warmup_epochs=a.warmup_epochs,
                  precision="amp-bf16", seed=a.seed, progress="off", device=os.environ.get("BENCH_DEVICE", "cuda"))
    arms = os.environ.get("GPT_ARMS", "tied,builtin,untied").split(",")
    makers = {
        "tied": ("python_tied_gpt", lambda: TiedGpt(vocab), {}),
        "untied": ("python_untied_gpt", lambda: TiedGpt(vocab, tied=False), {}),
        "eager": ("python_tied_gpt_eager", lambda: TiedGpt(vocab), {"cuda_graphs": False}),
        "fp32": ("python_tied_gpt_fp32", lambda: TiedGpt(vocab), {"precision": "fp32"}),
        "eager_fp32": ("python_tied_gpt_eager_fp32", lambda: TiedGpt(vocab), {"precision": "fp32", "cuda_graphs": False}),
        "no_decay": ("python_tied_gpt_no_decay", lambda: TiedGpt(vocab), {"weight_decay": 0.0}),
        "sgd": ("python_tied_gpt_sgd", lambda: TiedGpt(vocab), {"optimizer": "sgd", "lr": 0.1}),
    }
    rows = []
    for arm in arms:
        torch.manual_seed(a.seed)
        if arm in ("torch_tied", "torch_untied"):
            loss, steps = torch_loop(TiedGpt(vocab, tied=arm == "torch_tied"), train, val, a.epochs, recipe["batch_size"],
                                     recipe["lr"], a.seed, recipe["device"], a.warmup_epochs)
            rows.append({"run": "pytorch_" + arm[6:] + "_gpt", "val_loss": loss, "test_acc": None, "steps": steps})
            continue
        if arm == "builtin":
            s = triaccel.train("gpt-char", dataset="tinyshakespeare", data_dir=a.data,
                               out=os.path.join(a.out, "builtin"), **recipe)
            rows.append({"run": "builtin_gpt_char", "val_loss": s["test_loss"], "test_acc": s["test_acc"],
                         "steps": s.get("steps"), "peak_vram_gb": s.get("peak_vram_gb")})
            continue
        name, make, extra = makers[arm]
        s = triaccel.train(make(), train=train, test=val, loss=next_token_loss, out=os.path.join(a.out, arm),
                           **{**recipe, **extra})
        rows.append({"run": name, "val_loss": s["test_loss"], "test_acc": s["test_acc"], "steps": s.get("steps"),
                     "units": s.get("units"), "peak_vram_gb": s.get("peak_vram_gb")})
    ratio = rows[0]["val_loss"] / rows[1]["val_loss"] if len(rows) > 1 else None
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    result = {"gpu": gpu, "rows": rows, "val_loss_ratio": ratio,
              "train_windows": len(train[0]), "val_windows": len(val[0]), "vocab": vocab}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    print("\n| run | val loss | next-char acc | steps | units |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['val_loss']:.4f} | {r['test_acc']} | {r['steps']} | {len(r.get('units') or [])} |")
    print(f"val loss ratio (first / second arm): {ratio}")


if __name__ == "__main__":
    main()
