"""Times EfficientNet-B0's depthwise convolutions (32x32 input, the NeuroFlux shapes) forward + backward, per
precision and memory layout, to find where the B0 blocks' step time goes. Prints a table, writes JSON (--out).
Usage: python3 dev/probe_depthwise.py [--batch 416] [--heuristics | --native] [--out FILE]"""
import argparse, json, torch

# (channels, input H=W, kernel, stride): B0's depthwise layers at a 32x32 input (stem stride 2 -> 16x16)
SHAPES = [(32, 16, 3, 1), (96, 16, 3, 2), (144, 8, 3, 1), (144, 8, 5, 2), (240, 4, 5, 1), (240, 4, 3, 2),
          (480, 2, 3, 1), (480, 2, 5, 1), (672, 2, 5, 1), (672, 2, 5, 2), (1152, 1, 5, 1), (1152, 1, 3, 1)]


def time_ms(fn, reps=30):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=416)
    ap.add_argument("--out")
    ap.add_argument("--heuristics", action="store_true", help="cuDNN heuristics instead of autotuning")
    ap.add_argument("--native", action="store_true", help="PyTorch's own depthwise kernels (cuDNN off)")
    a = ap.parse_args()
    torch.backends.cudnn.benchmark = not a.heuristics
    torch.backends.cudnn.enabled = not a.native
    mode = "native" if a.native else "heuristics" if a.heuristics else "autotuned"
    rows = []
    for c, h, k, s in SHAPES:
        row = {"channels": c, "hw": h, "kernel": k, "stride": s}
        for dtype in (torch.bfloat16, torch.float32):
            for cl in (True, False):
                x = torch.randn(a.batch, c, h, h, device="cuda", dtype=dtype)
                conv = torch.nn.Conv2d(c, c, k, s, k // 2, groups=c, bias=False).cuda().to(dtype)
                if cl:
                    x = x.contiguous(memory_format=torch.channels_last)
                    conv = conv.to(memory_format=torch.channels_last)
                x.requires_grad_(True)
                y = conv(x)
                g = torch.randn_like(y)

                def step():
                    out = conv(x)
                    out.backward(g)
                key = f"{'bf16' if dtype == torch.bfloat16 else 'fp32'}_{'cl' if cl else 'nchw'}_ms"
                row[key] = round(time_ms(step), 4)
        rows.append(row)
    keys = ["bf16_cl_ms", "bf16_nchw_ms", "fp32_cl_ms", "fp32_nchw_ms"]
    print(f"depthwise conv fwd+bwd, batch {a.batch}, ms per call ({torch.cuda.get_device_name()}, "
          f"{mode})")
    print(f"{'C':>5s} {'HW':>3s} {'k':>2s} {'s':>2s} " + " ".join(f"{k[:-3]:>10s}" for k in keys))
    for r in rows:
        print(f"{r['channels']:5d} {r['hw']:3d} {r['kernel']:2d} {r['stride']:2d} " + " ".join(f"{r[k]:10.4f}" for k in keys))
    tot = {k: round(sum(r[k] for r in rows), 3) for k in keys}
    print("sum", tot)
    if a.out:
        json.dump({"batch": a.batch, "cudnn": mode, "device": torch.cuda.get_device_name(), "rows": rows, "sum_ms": tot},
                  open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
