"""Which EfficientNet-B0 layer (32x32 input, bf16 autocast, channels_last, cuDNN heuristics) fails CUDA-graph capture
of its forward + backward at a given batch? NeuroFlux blocks features.5.1 / 6.0 / 3.1 fell back to eager steps with
"operation failed due to a previous error during capture" at batch 512 but captured at 344-416.
Usage: python3 dev/probe_capture.py [--batches 344,416,512] [--out FILE]"""
import argparse, json, subprocess, sys, torch
import torch.nn as nn


def cases(c_exp):
    # (name, module factory, input (C, H)) for the layers of features.3-6 at a 32x32 input
    return [
        ("dw3_s1_480_2x2", lambda: nn.Conv2d(480, 480, 3, 1, 1, groups=480, bias=False), (480, 2)),
        ("dw5_s1_240_4x4", lambda: nn.Conv2d(240, 240, 5, 1, 2, groups=240, bias=False), (240, 4)),
        ("dw3_s2_240_4x4", lambda: nn.Conv2d(240, 240, 3, 2, 1, groups=240, bias=False), (240, 4)),
        ("dw5_s1_672_2x2", lambda: nn.Conv2d(672, 672, 5, 1, 2, groups=672, bias=False), (672, 2)),
        ("dw5_s2_672_2x2", lambda: nn.Conv2d(672, 672, 5, 2, 2, groups=672, bias=False), (672, 2)),
        ("dw5_s1_1152_1x1", lambda: nn.Conv2d(1152, 1152, 5, 1, 2, groups=1152, bias=False), (1152, 1)),
        ("pw_112_672_2x2", lambda: nn.Conv2d(112, 672, 1, bias=False), (112, 2)),
        ("pw_672_112_2x2", lambda: nn.Conv2d(672, 112, 1, bias=False), (672, 2)),
        ("se_672_28", lambda: nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(672, 28, 1), nn.SiLU(),
                                             nn.Conv2d(28, 672, 1), nn.Sigmoid()), (672, 2)),
        ("bn_silu_672_2x2", lambda: nn.Sequential(nn.BatchNorm2d(672), nn.SiLU()), (672, 2)),
    ]


def try_capture(make, shape, batch):
    m = make().cuda().to(memory_format=torch.channels_last).train()
    x = torch.randn(batch, shape[0], shape[1], shape[1], device="cuda").contiguous(memory_format=torch.channels_last)
    x.requires_grad_(True)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = m(x)
        y.float().sum().backward()

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            step()
        g.replay()
        torch.cuda.synchronize()
        return "ok"
    except Exception as e:  # noqa: BLE001 - the probe reports every failure
        torch.cuda.synchronize()
        return str(e).splitlines()[0][:100]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="344,416,512")
    ap.add_argument("--out")
    ap.add_argument("--case", help="run one case at one batch (--batches) in this process and print the outcome")
    a = ap.parse_args()
    torch.backends.cudnn.benchmark = False
    if a.case:
        make, shape = [(m, s) for n, m, s in cases(672) if n == a.case][0]
        print(try_capture(make, shape, int(a.batches)))
        return
    rows = []
    for name, _, _ in cases(672):  # each capture in its own process: a failed one leaves the process's state behind
        row = {"case": name}
        for b in a.batches.split(","):
            r = subprocess.run([sys.executable, __file__, "--case", name, "--batches", b], capture_output=True, text=True)
            row[b] = (r.stdout.strip().splitlines() or [r.stderr.strip()[-100:]])[-1]
        rows.append(row)
        print(name, {k: v for k, v in row.items() if k != "case"}, flush=True)
    if a.out:
        json.dump(rows, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
