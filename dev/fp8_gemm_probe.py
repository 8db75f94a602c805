"""The FP8 ceiling of a linear layer on this GPU (issue 58): for a GPT's linear shapes, the time of one training
step's three products (forward, dgrad, wgrad) in bf16 (F.linear with autograd) against the same three products through
torch._scaled_mm on E4M3/E5M2 operands already quantized (the GEMMs alone: what FP8 can win at most), and the passes
FP8 adds around them when written in plain torch ops (a quantize of x, W and the gradient, and three transposed copies).

Usage: python3 dev/fp8_gemm_probe.py [--tokens 16384] [--embeds 768,1024] [--json FILE]
Prints one row per shape and a total per embedding width (a block's qkv, proj, fc1, fc2)."""
import argparse
import json

import torch
import torch.nn.functional as F


def timed(fn, iters=50, warm=5):
    for _ in range(warm):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters  # ms


def shape_row(m, k, n):
    dev = "cuda"
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(m, n, device=dev, dtype=torch.bfloat16)

    def bf16_step():
        y = F.linear(x, w)
        y.backward(g)

    one = torch.ones((), device=dev)
    xq = x.detach().to(torch.float8_e4m3fn)
    wq = w.detach().to(torch.float8_e4m3fn)
    gq = g.to(torch.float8_e5m2)
    wq_t, gq_t, xq_t = wq.t().contiguous(), gq.t().contiguous(), xq.t().contiguous()

    def fp8_gemms():
        torch._scaled_mm(xq, wq.t(), one, one, out_dtype=torch.bfloat16)        # y = x W^T
        torch._scaled_mm(gq, wq_t.t(), one, one, out_dtype=torch.bfloat16)      # dx = g W
        torch._scaled_mm(gq_t, xq_t.t(), one, one, out_dtype=torch.float32)     # dW = g^T x

    scale = torch.ones((), device=dev)

    def quant(t, dtype):
        fmax = torch.finfo(dtype).max
        return t.float().mul(scale).clamp(-fmax, fmax).to(dtype)

    def fp8_passes():  # the passes around the GEMMs, in plain torch ops
        for t, dt in ((x.detach(), torch.float8_e4m3fn), (w.detach(), torch.float8_e4m3fn), (g, torch.float8_e5m2)):
            quant(t, dt)
            t.abs().amax()
        wq.t().contiguous()
        gq.t().contiguous()
        xq.t().contiguous()

    flops = 3 * 2 * m * k * n
    r = {"m": m, "k": k, "n": n, "bf16_ms": timed(bf16_step), "fp8_gemms_ms": timed(fp8_gemms),
         "fp8_torch_passes_ms": timed(fp8_passes)}
    r["bf16_tflops"] = flops / r["bf16_ms"] / 1e9
    r["fp8_tflops"] = flops / r["fp8_gemms_ms"] / 1e9
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--embeds", default="768,1024")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    rows, totals = [], []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {a.tokens} tokens")
    print("| d | shape (M,K,N) | bf16 ms | fp8 GEMMs ms | ratio | torch passes ms | bf16 TF/s | fp8 TF/s |")
    print("|---|---|---|---|---|---|---|---|")
    for d in (int(v) for v in a.embeds.split(",")):
        block = [(a.tokens, d, 3 * d), (a.tokens, d, d), (a.tokens, d, 4 * d), (a.tokens, 4 * d, d)]
        t = {"d": d, "bf16_ms": 0.0, "fp8_gemms_ms": 0.0, "fp8_torch_passes_ms": 0.0}
        for m, k, n in block:
            r = shape_row(m, k, n)
            r["d"] = d
            rows.append(r)
            for key in ("bf16_ms", "fp8_gemms_ms", "fp8_torch_passes_ms"):
                t[key] += r[key]
            print(f"| {d} | {m},{k},{n} | {r['bf16_ms']:.3f} | {r['fp8_gemms_ms']:.3f} | "
                  f"{r['bf16_ms'] / r['fp8_gemms_ms']:.2f}x | {r['fp8_torch_passes_ms']:.3f} | "
                  f"{r['bf16_tflops']:.0f} | {r['fp8_tflops']:.0f} |")
        totals.append(t)
        print(f"| {d} | block | {t['bf16_ms']:.3f} | {t['fp8_gemms_ms']:.3f} | "
              f"{t['bf16_ms'] / t['fp8_gemms_ms']:.2f}x | {t['fp8_torch_passes_ms']:.3f} | | |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": a.tokens,
                       "rows": rows, "blocks": totals}, f, indent=1)


if __name__ == "__main__":
    main()
