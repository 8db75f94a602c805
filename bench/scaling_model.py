#!/usr/bin/env python3
"""Scaling past one host, on paper (issue 57, item 5): an alpha-beta model of triaccel's data-parallel step.

Each step on N GPUs = one GPU's step (forward, backward, optimizer) + what data parallelism adds:
  * each gradient bucket's all-reduce (ring alpha-beta; hierarchical past one host: NVLink inside a host, one NIC per
    GPU between hosts), started when backward has produced the bucket's last gradient, the buckets in order; the part
    that ends after backward is exposed (the optimizer step waits for every bucket);
  * the GPU time the all-reduce takes from backward while overlapped (kappa per byte of NVLink work, measured on two
    H200s; phi of the time a network-bound all-reduce holds its SMs);
  * a fixed cost per step (the buckets' copies, the graph's idle gaps), fitted;
  * the wait for the slowest rank: sigma * T1 * E[max of N standard normals], sigma fitted;
  * per epoch (only in an epoch's img/s, as triaccel's `epoch` event measures it): a fixed cost E, fitted.
The measured points are in MEASURED (with their sources); docs/distributed.md, "Scaling past one host, on paper",
has the equations, the fit and the predictions. Pure Python (stdlib), < 1 s:
    python3 bench/scaling_model.py [--json OUT]
"""
import argparse
import json
import math
import sys

MIB = 1 << 20
CIFAR_TRAIN = 50_000  # images per epoch (CIFAR-10's training set)


# ---------------------------------------------------------------------------------------------------------------
# The models: layers in forward order, each (parameter tensor sizes, multiply-accumulates per image). Backward is
# taken to spend its time on each layer in proportion to the layer's MACs (gradients are ready, last layer first,
# as backward passes them).
# ---------------------------------------------------------------------------------------------------------------

def resnet18_layers(classes=10, size=32):
    """ResNet-18 with the CIFAR stem (src/triaccel/models/resnet.cpp): 11,173,962 parameters at 10 classes."""
    layers = []

    def conv(cin, cout, k, hout):
        return [cout * cin * k * k], cout * cin * k * k * hout * hout

    def conv_bn(cin, cout, k, hout):
        sizes, macs = conv(cin, cout, k, hout)
        layers.append((sizes + [cout, cout], macs))

    conv_bn(3, 64, 3, size)
    cin, h = 64, size
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        for block in range(2):
            s = stride if block == 0 else 1
            h_out = h // s
            conv_bn(cin, cout, 3, h_out)
            conv_bn(cout, cout, 3, h_out)
            if s != 1 or cin != cout:
                conv_bn(cin, cout, 1, h_out)  # downsample
            cin, h = cout, h_out
    layers.append(([512 * classes, classes], 512 * classes))
    return layers


def vit_tiny_layers(classes=10, size=32, patch=4, dim=192, depth=12, mlp=4):
    """triaccel's built-in vit-tiny (src/triaccel/models/vit.cpp): patch 4, dim 192, depth 12, 5,362,762 params."""
    tokens = (size // patch) ** 2 + 1
    layers = [([dim, tokens * dim, dim * 3 * patch * patch, dim], (tokens - 1) * 3 * patch * patch * dim)]
    for _ in range(depth):
        layers.append(([dim, dim, 3 * dim * dim, 3 * dim], tokens * dim * 3 * dim))  # norm1, qkv
        layers.append(([], 2 * tokens * tokens * dim))  # attention's two matmuls: no parameters
        layers.append(([dim * dim, dim], tokens * dim * dim))  # proj
        layers.append(([dim, dim, mlp * dim * dim, mlp * dim], tokens * dim * mlp * dim))  # norm2, fc1
        layers.append(([mlp * dim * dim, dim], tokens * mlp * dim * dim))  # fc2
    layers.append(([dim, dim, dim * classes, classes], dim * classes))  # norm, head
    return layers


def efficientnet_b0_layers(classes=10, size=224):
    """EfficientNet-B0 per stage (torchvision's parameter counts per `features.i`, 4,020,358 at 10 classes); MACs
    of the convolutions from the B0 configuration. Used only for the two-GPU calibration point (one bucket)."""
    params = [928, 1448, 16714, 46640, 242930, 543148, 2026348, 717232, 412160]
    cfg = [(1, 3, 1, 32, 16, 1), (6, 3, 2, 16, 24, 2), (6, 5, 2, 24, 40, 2), (6, 3, 2, 40, 80, 3),
           (6, 5, 1, 80, 112, 3), (6, 5, 2, 112, 192, 4), (6, 3, 1, 192, 320, 1)]
    h = size // 2
    macs = [h * h * 27 * 32]
    for expand, k, stride, cin, cout, n in cfg:
        m = 0
        for i in range(n):
            c_in = cin if i == 0 else cout
            hidden = c_in * expand
            h_out = h // stride if i == 0 else h
            m += (h * h * c_in * hidden if expand != 1 else 0) + h_out * h_out * (k * k * hidden + hidden * cout)
            h = h_out
        macs.append(m)
    macs.append(h * h * 320 * 1280)
    layers = [([p], m) for p, m in zip(params, macs)]
    layers.append(([1280 * classes, classes], 1280 * classes))
    return layers


MODELS = {
    "resnet18": {"layers": resnet18_layers(), "optimizer": "sgd"},
    "vit-tiny": {"layers": vit_tiny_layers(), "optimizer": "adamw"},
    "efficientnet-b0": {"layers": efficientnet_b0_layers(), "optimizer": "sgd"},
}
OPTIMIZER_BYTES = {"sgd": 20, "adamw": 28}  # per parameter, read + written by the fused step (fp32 state)


def param_count(layers):
    """Parameters of a model's layer list."""
    return sum(sum(sizes) for sizes, _ in layers)


# ---------------------------------------------------------------------------------------------------------------
# Hardware and the fitted constants
# ---------------------------------------------------------------------------------------------------------------

GPUS = {"h100": {"hbm_gbs": 0.8 * 3350}, "h200": {"hbm_gbs": 0.8 * 4800}}  # 80 % of the datasheet's HBM bandwidth

FABRIC = {
    # Effective bus bandwidth of a ring all-reduce inside a host, in the step: 45 MB of ResNet-18 gradients took
    # 0.31 ms of NCCL kernels on two H200s (docs/distributed.md), 150 GB/s less the latency. nccl-tests reach
    # 350-450 GB/s busbw on 8 x H100/H200 SXM alone (NVLink 4: 450 GB/s a direction a GPU) at large messages; in the
    # step, beside backward's kernels, at 25 MiB buckets, triaccel's collectives got 150. Used for N <= 8 alike.
    "nvlink_gbs": 150.0,
    "nvlink_alpha_s": 5e-6,  # per ring step (NCCL Simple/LL over NVLink: a few us)
    "gpus_per_host": 8,
    "net_alpha_s": 5e-6,  # per ring step between hosts (RDMA ~2 us + NCCL's proxy)
    "net_efficiency": 0.8,  # of the NIC's line rate that NCCL's busbw gets at MiB-sized chunks
}
NETWORKS_GBIT = (200, 400)  # per-GPU NIC, Gb/s

CAL = {
    "backward_share": 2.0 / 3.0,  # of forward + backward (backward ~ 2 x forward's FLOPs)
    "kappa": 0.6,  # compute lost per second of NVLink all-reduce work overlapped (2 x H200: +0.17 ms beside 0.28)
    "phi": 0.1,  # compute lost per second a network-bound all-reduce holds its SMs beyond that (~16 of 132 SMs)
    "bucket_mib": 25.0,
    "tail_mib": 1.0,  # GradBucketsOptions::tail_bytes (7e0e28f); 0 for builds before it
    # fitted by fit() below (these are its result, kept so that predictions need no fit):
    "t_dp_s": None,
    "sigma": None,
    "epoch_s": None,
}


# ---------------------------------------------------------------------------------------------------------------
# The measurements (same per-GPU batch, amp-bf16, CIFAR-10). kind "epoch": an epoch's training img/s (per-epoch
# costs count); "steady": medians of 10-step windows inside epochs (no per-epoch cost). tail: the build had the 1 MiB
# tail bucket. img_s: {N: img/s}.
# ---------------------------------------------------------------------------------------------------------------

MEASURED = [
    {"id": "h200-resnet18-epoch", "gpu": "h200", "model": "resnet18", "batch": 512, "kind": "epoch", "tail": True,
     "img_s": {1: 81279, 2: 150499, 4: 286554},
     "ddp_img_s": {1: 54619, 2: 79624, 4: 175986},
     "source": "issue 57 (H200, bench/run_data_parallel.sh, ours and PyTorch DDP in one call; recent build)"},
    {"id": "h200-resnet18-steady", "gpu": "h200", "model": "resnet18", "batch": 512, "kind": "steady",
     "tail": False, "img_s": {1: 80340, 2: 150482},
     "source": "docs/results/data-parallel.md, e9db85b (bench/results/h200x2/steady_e9db85b in git history)"},
    {"id": "h200-vit-tiny-steady", "gpu": "h200", "model": "vit-tiny", "batch": 512, "kind": "steady",
     "tail": False, "img_s": {1: 23457, 2: 45855},
     "source": "docs/results/data-parallel.md, e9db85b (bench/results/h200x2/steady_e9db85b in git history)"},
    {"id": "h100-resnet18-epoch", "gpu": "h100", "model": "resnet18", "batch": 512, "kind": "epoch", "tail": False,
     "img_s": {1: 70702, 2: 130951}, "ddp_img_s": {1: 53183, 2: 86162},
     "source": "bench/results/h100x2/data_parallel_3785320/scale.json (third epoch)"},
    {"id": "h100-resnet18-steady", "gpu": "h100", "model": "resnet18", "batch": 512, "kind": "steady",
     "tail": False, "img_s": {1: 70498, 2: 132129},
     "source": "bench/results/h100x2/data_parallel_3785320/steady.json"},
    {"id": "h100-vit-tiny-epoch", "gpu": "h100", "model": "vit-tiny", "batch": 512, "kind": "epoch", "tail": False,
     "img_s": {1: 21903, 2: 42848}, "ddp_img_s": {1: 19932, 2: 38553},
     "source": "bench/results/h100x2/data_parallel_3785320/scale.json (third epoch)"},
    {"id": "h100-efficientnet-b0-epoch", "gpu": "h100", "model": "efficientnet-b0", "batch": 96, "kind": "epoch",
     "tail": False, "img_s": {1: 5016, 2: 9900}, "ddp_img_s": {1: 3434, 2: 4909},
     "source": "bench/results/h100x2/data_parallel_3785320/scale.json (third epoch, 224 px)"},
]


# ---------------------------------------------------------------------------------------------------------------
# The all-reduce
# ---------------------------------------------------------------------------------------------------------------

def ring_allreduce_s(nbytes, n, busbw_gbs, alpha_s):
    """Ring all-reduce of `nbytes` over `n` ranks: 2(n-1)/n * bytes / busbw + 2(n-1) * alpha (reduce-scatter then
    all-gather, n-1 steps each). busbw is NCCL's bus bandwidth (per-GPU link rate). 0 for n == 1."""
    if n <= 1:
        return 0.0
    return 2.0 * (n - 1) / n * nbytes / (busbw_gbs * 1e9) + 2.0 * (n - 1) * alpha_s


def net_busbw_gbs(net_gbit, fabric=FABRIC):
    """Effective per-NIC bus bandwidth between hosts in GB/s: line rate / 8 x NCCL's efficiency."""
    return net_gbit / 8.0 * fabric["net_efficiency"]


def allreduce_s(nbytes, n, net_gbit, fabric=FABRIC):
    """One bucket's all-reduce on n GPUs, `gpus_per_host` a host, and its NVLink work (the GPU-side reduction).

    Inside one host: a ring over NVLink. Past one host, hierarchical (what NCCL's rings over rail-aligned NICs
    amount to): reduce-scatter inside the host, a ring all-reduce of each GPU's 1/L shard with its peers on the
    other hosts through its own NIC, all-gather inside the host; the phases are summed (not pipelined): an upper
    bound. Returns (seconds, nvlink_work_seconds)."""
    per_host = fabric["gpus_per_host"]
    if n <= per_host:
        t = ring_allreduce_s(nbytes, n, fabric["nvlink_gbs"], fabric["nvlink_alpha_s"])
        return t, t
    hosts = math.ceil(n / per_host)
    intra = ring_allreduce_s(nbytes, per_host, fabric["nvlink_gbs"], fabric["nvlink_alpha_s"])
    inter = ring_allreduce_s(nbytes / per_host, hosts, net_busbw_gbs(net_gbit, fabric), fabric["net_alpha_s"])
    work = intra + ring_allreduce_s(nbytes / per_host, hosts, fabric["nvlink_gbs"], 0.0)
    return intra + inter, work


def buckets(layers, bytes_per_grad, cap_mib, tail_mib):
    """triaccel's bucket layout (train/grad_buckets.cpp): parameters last first; a new bucket where the next tensor
    would pass the cap, or where the tail (the first parameters, up to tail_mib) begins. Returns a list of
    (bytes, index of the forward layer whose gradient completes the bucket), in the order they start."""
    tensors = [(i, s * bytes_per_grad) for i, (sizes, _) in enumerate(layers) for s in sizes]
    cap, tail = cap_mib * MIB, tail_mib * MIB
    front = [0]
    for _, b in tensors:
        front.append(front[-1] + b)
    out = []
    for k in range(len(tensors) - 1, -1, -1):
        layer, b = tensors[k]
        tail_begins = tail > 0 and cap > 0 and k + 1 < len(tensors) and front[k + 1] <= tail < front[k + 2]
        fresh = not out or (out[-1][0] > 0 and tail_begins) or (cap > 0 and out[-1][0] > 0 and out[-1][0] + b > cap)
        if fresh:
            out.append([0, layer])
        out[-1][0] += b
        out[-1][1] = layer
    return [tuple(b) for b in out]


# ---------------------------------------------------------------------------------------------------------------
# The step
# ---------------------------------------------------------------------------------------------------------------

def expected_max_normal(n):
    """E[max of n independent standard normals] (0 for n == 1; 0.564 for 2; 2.04 for 8), by quadrature."""
    if n <= 1:
        return 0.0
    h, total = 0.01, 0.0
    for i in range(-800, 801):
        x = i * h
        pdf = math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        total += x * n * pdf * cdf ** (n - 1) * h
    return total


def step_s(model, n, t1_s, gpu="h200", net_gbit=400, compress=False, tail=True, cal=CAL, fabric=FABRIC):
    """The step's seconds on n GPUs at the per-GPU batch whose one-GPU step takes t1_s, and its parts.

    t_n = t1 + exposed + interference + t_dp + sigma * t1 * E[max of n normals] (+ the bf16 casts), where
    exposed = max(0, end of the last bucket's all-reduce - end of backward): bucket i starts at
    max(ready_i, end_{i-1}) and ready_i is when backward has passed the bucket's first layer."""
    layers = MODELS[model]["layers"]
    params = param_count(layers)
    parts = {"t1": t1_s, "exposed": 0.0, "interference": 0.0, "t_dp": 0.0, "skew": 0.0, "cast": 0.0, "comm": 0.0}
    if n <= 1:
        parts["total"] = t1_s
        return parts
    hbm = GPUS[gpu]["hbm_gbs"] * 1e9
    t_opt = params * OPTIMIZER_BYTES[MODELS[model]["optimizer"]] / hbm
    t_bwd = cal["backward_share"] * (t1_s - t_opt)
    macs = [m for _, m in layers]
    after = [sum(macs[i:]) for i in range(len(macs))]  # MACs of layer i and the layers after it
    grad_bytes = 2 if compress else 4
    end = 0.0
    for nbytes, first_layer in buckets(layers, grad_bytes, cal["bucket_mib"], cal["tail_mib"] if tail else 0.0):
        ready = t_bwd * after[first_layer] / after[0]
        t, work = allreduce_s(nbytes, n, net_gbit, fabric)
        start = max(ready, end)
        end = start + t
        overlapped = max(0.0, min(end, t_bwd) - start) / t if t > 0 else 0.0
        parts["interference"] += overlapped * (cal["kappa"] * work + cal["phi"] * max(0.0, t - work))
        parts["comm"] += t
    parts["exposed"] = max(0.0, end - t_bwd)
    parts["t_dp"] = cal["t_dp_s"]
    parts["skew"] = cal["sigma"] * t1_s * expected_max_normal(n)
    if compress:
        parts["cast"] = params * 12 / hbm  # fp32 -> bf16 and back: read 4 + write 2, read 2 + write 4 bytes
    parts["total"] = t1_s + sum(parts[k] for k in ("exposed", "interference", "t_dp", "skew", "cast"))
    return parts


def t1_from_img_s(img_s_1, batch, kind, cal=CAL):
    """One GPU's step from its img/s: an epoch's img/s holds the per-epoch cost E as well."""
    per_image = 1.0 / img_s_1 - (cal["epoch_s"] / CIFAR_TRAIN if kind == "epoch" else 0.0)
    return batch * per_image


def img_s(model, n, t1_s, batch, kind="steady", **kw):
    """Modelled img/s on n GPUs: steady (steps alone) or of a CIFAR-10 epoch (steps + the per-epoch cost)."""
    cal = kw.get("cal", CAL)
    t = step_s(model, n, t1_s, **kw)["total"]
    per_image = t / (batch * n) + (cal["epoch_s"] / CIFAR_TRAIN if kind == "epoch" else 0.0)
    return 1.0 / per_image


# ---------------------------------------------------------------------------------------------------------------
# The fit: t_dp, sigma, E by weighted least squares on each multi-GPU point's per-image time
# ---------------------------------------------------------------------------------------------------------------

def _solve(a, b):
    """Gaussian elimination with partial pivoting (a small dense system)."""
    m = [row[:] + [v] for row, v in zip(a, b)]
    k = len(m)
    for c in range(k):
        p = max(range(c, k), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        for r in range(k):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c])]
    return [m[i][k] / m[i][i] for i in range(k)]


def fit(measured=MEASURED, cal=CAL, fabric=FABRIC, iterations=6):
    """Fits t_dp_s, sigma and epoch_s (the model is linear in them once t1 is known; t1 depends on epoch_s, so a few
    rounds). Each point's per-image time is weighted by 1 / its value, so the residuals are relative. Returns a new
    cal dict."""
    cal = dict(cal, t_dp_s=0.0, sigma=0.0, epoch_s=0.0)
    for _ in range(iterations):
        rows, ys = [], []
        for m in measured:
            t1 = t1_from_img_s(m["img_s"][1], m["batch"], m["kind"], cal)
            for n, v in m["img_s"].items():
                if n == 1:
                    continue
                base = step_s(m["model"], n, t1, gpu=m["gpu"], tail=m["tail"],
                              cal=dict(cal, t_dp_s=0.0, sigma=0.0), fabric=fabric)["total"]
                extra = base - t1  # exposed + interference (+ casts): fixed once t1 is
                w = v  # 1 / the measured per-image time
                bn = m["batch"] * n
                # per_image(n) = t_n / (b n) + [epoch] E / D with t1 = b (1 / img_1 - [epoch] E / D):
                # = 1 / (n img_1) + extra / (b n) + t_dp / (b n) + sigma t1 m(n) / (b n) + [epoch] E (1 - 1/n) / D
                e_coef = (1.0 - 1.0 / n) / CIFAR_TRAIN if m["kind"] == "epoch" else 0.0
                rows.append([w / bn, w * t1 * expected_max_normal(n) / bn, w * e_coef])
                ys.append(w * (1.0 / v - 1.0 / (n * m["img_s"][1]) - extra / bn))
        ata = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
        aty = [sum(r[i] * y for r, y in zip(rows, ys)) for i in range(3)]
        t_dp, sigma, e = _solve(ata, aty)
        cal = dict(cal, t_dp_s=t_dp, sigma=sigma, epoch_s=e)
    return cal


def residuals(cal, measured=MEASURED, fabric=FABRIC):
    """Modelled against measured img/s for every point (one GPU's points are the model's input)."""
    out = []
    for m in measured:
        t1 = t1_from_img_s(m["img_s"][1], m["batch"], m["kind"], cal)
        for n, v in m["img_s"].items():
            pred = img_s(m["model"], n, t1, m["batch"], m["kind"], gpu=m["gpu"], tail=m["tail"], cal=cal,
                         fabric=fabric)
            out.append({"id": m["id"], "gpus": n, "measured": v, "modelled": round(pred, 1),
                        "rel_err": (pred - v) / v})
    return out


def predict(cal, fabric=FABRIC, gpus=(8, 16, 64)):
    """ResNet-18 and ViT-Tiny at b512 per GPU on H200 hosts of 8 GPUs, 200 and 400 Gb/s, fp32 and bf16 gradients.
    One GPU's step from the H200 steady points; efficiency = img/s / (n x one GPU's img/s)."""
    base = {"resnet18": 80340, "vit-tiny": 23457}  # H200 steady img/s at b512 (MEASURED)
    out = []
    for model, one in base.items():
        t1 = 512 / one
        for n in gpus:
            for net in (NETWORKS_GBIT if n > fabric["gpus_per_host"] else (None,)):
                row = {"model": model, "gpus": n, "network_gbit": net}
                for compress in (False, True):
                    kw = dict(gpu="h200", net_gbit=net or 400, compress=compress, tail=True, cal=cal, fabric=fabric)
                    s = img_s(model, n, t1, 512, "steady", **kw)
                    key = "bf16" if compress else "fp32"
                    row[key + "_img_s"] = round(s)
                    row[key + "_efficiency"] = s / (n * one)
                    row[key + "_parts_ms"] = {k: v * 1e3 for k, v in step_s(model, n, t1, **kw).items()}
                epoch = img_s(model, n, t1_from_img_s(one, 512, "steady", cal), 512, "epoch", gpu="h200",
                              net_gbit=net or 400, tail=True, cal=cal, fabric=fabric)
                one_epoch = img_s(model, 1, t1, 512, "epoch", cal=cal)
                row["cifar_epoch_efficiency_fp32"] = epoch / (n * one_epoch)
                row["cifar_steps_per_epoch"] = CIFAR_TRAIN / (512 * n)
                out.append(row)
    return out


def sensitivity(cal, fabric=FABRIC):
    """fp32 efficiency of ResNet-18 and ViT-Tiny on 64 GPUs when one assumption moves (the others as fitted)."""
    variants = [("as fitted, 200 Gb/s", {}, {}, 200), ("NIC 100 Gb/s", {}, {}, 100), ("NIC 25 Gb/s (one 200 Gb/s NIC a host)", {}, {}, 25),
                ("NVLink busbw 360 GB/s (nccl-tests)", {"nvlink_gbs": 360.0}, {}, 200),
                ("alpha between hosts 20 us", {"net_alpha_s": 20e-6}, {}, 200),
                ("kappa 0.3", {}, {"kappa": 0.3}, 200), ("kappa 0.9", {}, {"kappa": 0.9}, 200),
                ("backward share 1/2", {}, {"backward_share": 0.5}, 200), ("sigma x 2", {}, {"sigma": 2 * cal["sigma"]}, 200)]
    out = []
    for name, fab, c, net in variants:
        row = {"variant": name}
        for model, one in (("resnet18", 80340), ("vit-tiny", 23457)):
            s = img_s(model, 64, 512 / one, 512, "steady", gpu="h200", net_gbit=net, tail=True,
                      cal=dict(cal, **c), fabric=dict(fabric, **fab))
            row[model] = s / (64 * one)
        out.append(row)
    return out


def markdown(cal, res, preds, sens):
    """The fit, the predictions and the sensitivity as markdown tables."""
    lines = [f"Fitted: t_dp = {cal['t_dp_s'] * 1e3:.3f} ms/step, sigma = {cal['sigma'] * 100:.2f} % of the step, "
             f"E = {cal['epoch_s'] * 1e3:.1f} ms/epoch", "",
             "| point | GPUs | measured img/s | modelled | error |", "|---|---|---|---|---|"]
    for r in res:
        if r["gpus"] > 1:
            lines.append(f"| {r['id']} | {r['gpus']} | {r['measured']:,} | {r['modelled']:,.0f} | "
                         f"{r['rel_err'] * 100:+.1f} % |")
    lines += ["", "| model | GPUs | network | img/s fp32 | eff. fp32 | img/s bf16 | eff. bf16 | "
                  "CIFAR-10 epoch eff. (steps/epoch) |", "|---|---|---|---|---|---|---|---|"]
    for p in preds:
        net = f"{p['network_gbit']} Gb/s" if p["network_gbit"] else "NVLink"
        lines.append(f"| {p['model']} | {p['gpus']} | {net} | {p['fp32_img_s']:,} | {p['fp32_efficiency']:.2f} | "
                     f"{p['bf16_img_s']:,} | {p['bf16_efficiency']:.2f} | {p['cifar_epoch_efficiency_fp32']:.2f} "
                     f"({p['cifar_steps_per_epoch']:.1f}) |")
    lines += ["", "| 64 GPUs, fp32: one assumption moved | ResNet-18 eff. | ViT-Tiny eff. |", "|---|---|---|"]
    lines += [f"| {r['variant']} | {r['resnet18']:.3f} | {r['vit-tiny']:.3f} |" for r in sens]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="OUT", help="write the fit, its residuals and the predictions here")
    args = ap.parse_args(argv)
    cal = fit()
    res = residuals(cal)
    preds = predict(cal)
    sens = sensitivity(cal)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cal": cal, "fabric": FABRIC, "networks_gbit": NETWORKS_GBIT, "measured": MEASURED,
                       "residuals": res, "predictions": preds, "sensitivity": sens}, f, indent=1)
    print(markdown(cal, res, preds, sens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
