#!/usr/bin/env python3
"""A roofline of our ResNet-18/CIFAR training step on the H200 (issue 59, item 1): per kernel class, the FLOPs and
HBM bytes that OUR kernels move, the time at the H200's limits, the measured time, and what each planned fusion
would save, so the issue's targets (b512 >= 110k img/s, b96 >= 50k) are predictions with stated assumptions.

    python3 bench/roofline.py [--batch 512] [--dtype-bytes 2] [--floor-us 2.0] [--json OUT] [--layers]

Model (docs/roofline.md):
  * ResNet-18 with the CIFAR stem (src/triaccel/models/resnet.cpp): 3x3/1 stem conv, no max-pool, 32x32 input,
    BasicBlocks conv-bn-relu-conv-bn, `torch::relu(h + identity)` as two ATen kernels, a 1x1 downsample conv + BN.
  * Convolutions: FLOPs = 2*MACs; forward, dgrad (not for the stem: the images need no gradient) and wgrad, each with
    the forward's MACs. Bytes: fwd x + w + y, dgrad dy + w + dx, wgrad dy + x + dw (bf16 weights under autocast).
  * BatchNorm, from src/triaccel/kernels/batch_norm.cu: bn_stats reads x; bn_transform reads x, writes y (ReLU fused
    for the stem and every bn1); bn_backward_reduce reads dy and x (the ReLU mask is recomputed from x, y is never
    read); bn_backward_elemt reads dy and x, writes dx. The two combine kernels move C*G float2 (~KB): launch-bound.
  * Elementwise (ATen, under the CUDA graph): forward `h + identity` (read 2, write 1) and `relu` (read 1, write 1)
    per block; backward threshold_backward (grad, result -> grad: 3) per block and the accumulation of the block
    input's two gradients (conv1's dgrad + the identity/downsample path: 3). Copies: autocast's per-step fp32 -> bf16
    cast of every conv/fc weight and the bf16 -> fp32 cast of its gradient (6 B per parameter each), the input cast.
  * Bytes are counted at each kernel's boundary as if every read and write went to HBM (an upper bound: tensors that
    fit in the 50 MB L2 -- every layer at b96, layers at <= 16x16 at b512 -- may be re-read from L2).
  * roofline(kernel) = max(FLOPs / PEAK_FLOPS, bytes / PEAK_BW), summed over a class's kernels; efficiency =
    roofline / measured. A modelled kernel time is max(roofline / eff, floor): eff is the class's measured efficiency
    at b512 (calibration), ACHIEVABLE for new fused passes and unmeasured classes; floor a launch-bound kernel's
    minimum duration (--floor-us, an assumption; CUDA-graph gaps are in the trace's idle time, not here).
"""
import argparse
import json
import sys

# ---- the H200's limits (NVIDIA H200 SXM datasheet; dense BF16 = the H100/H200 SXM tensor-core peak) ----
PEAK_FLOPS = 989e12       # dense BF16 FLOP/s
PEAK_BW = 4.8e12          # HBM3e bytes/s
L2_BYTES = 50e6           # L2 cache (H100/H200 SXM: 50 MB)
ACHIEVABLE = 0.85         # assumed share of PEAK_BW a good streaming kernel reaches (80-90 %; middle taken)
FLOOR_US = 2.0            # assumed minimum duration of a launch-bound kernel inside the CUDA graph

# ---- the issue's measurements (issue 59: H200, ResNet-18 CIFAR, b512, amp-bf16, channels_last, CUDA-graph step,
# a 20-step timeline from `--profile-steps 120:140` summed by bench/trace_summary.py) ----
MEASURED_B512 = {
    "step_ms": 6.49, "idle_ms": 0.20, "img_s": 82.3e3, "torch_compile_img_s": 62.3e3,
    "conv_share": 0.55, "bn_share": 0.27, "elementwise_share": 0.15,  # shares of kernel time
    "bn_backward_reduce": 0.52, "bn_backward_elemt": 0.52, "bn_transform": 0.30, "bn_stats": 0.24,
    "residual_add": 0.39, "relu_backward": 0.17, "copies": 0.15,  # "other binary ops" = threshold_backward (assumed)
}
BN_MS = sum(MEASURED_B512[k] for k in ("bn_backward_reduce", "bn_backward_elemt", "bn_transform", "bn_stats"))
KERNEL_MS = BN_MS / MEASURED_B512["bn_share"]  # derived: 1.58 ms is 27 % of kernel time -> ~5.85 ms
MEASURED_CLASS_MS = {  # per class, ms per step at b512; conv derived from its 55 % share
    "conv": MEASURED_B512["conv_share"] * KERNEL_MS,
    **{k: MEASURED_B512[k] for k in ("bn_stats", "bn_transform", "bn_backward_reduce", "bn_backward_elemt",
                                      "residual_add", "relu_backward", "copies")},
}
TARGETS = {512: 110e3, 96: 50e3}  # issue 59's img/s targets
REFERENCE_B96_IMG_S_H100 = 41297  # docs/results/foundation.md (H100, amp-bf16 b96, BN kernel on): no H200 b96 trace

CLASSES = ["conv", "bn_stats", "bn_transform", "bn_backward_reduce", "bn_backward_elemt", "bn_combine",
           "residual_add", "relu_forward", "relu_backward", "copies", "fused_tail"]

# Fusions, applied cumulatively in this order (docs/roofline.md says what each one is).
FUSIONS = [
    ("F1", "BN statistics in the conv epilogue (bn_stats gone; combine stays)"),
    ("F2", "block tail in one pass: bn2 (+downsample BN) + add + ReLU, writing a 1-bit ReLU mask"),
    ("F3", "stem/bn1 normalize+ReLU in the next conv's prologue (bn_transform gone)"),
    ("F4", "backward: mask bit instead of threshold_backward; dgrad accumulates (beta=1) the identity gradient"),
    ("F5", "backward: BN's sums (dy, dy*x) in the epilogue of the dgrad that makes dy (bn_backward_reduce gone)"),
]


def conv_layers():
    """(name, cin, cout, k, stride, h_in) per conv of ResNet-18/CIFAR; h_out = h_in / stride (padding (k-1)/2)."""
    convs = [("conv1", 3, 64, 3, 1, 32)]
    cin, h = 64, 32
    for li, (cout, stride) in enumerate([(64, 1), (128, 2), (256, 2), (512, 2)], start=1):
        for b in range(2):
            s = stride if b == 0 else 1
            convs.append((f"layer{li}.{b}.conv1", cin, cout, 3, s, h))
            convs.append((f"layer{li}.{b}.conv2", cout, cout, 3, 1, h // s))
            if s != 1 or cin != cout:
                convs.append((f"layer{li}.{b}.downsample.0", cin, cout, 1, s, h))
            cin, h = cout, h // s
    return convs


def network(batch):
    """Per-image shapes: convs, BN layers (name, C, H, relu, kind) and blocks (name, in (C, H), out (C, H), ds)."""
    convs = []
    for name, cin, cout, k, s, h in conv_layers():
        ho = h // s
        convs.append({"name": name, "cin": cin, "cout": cout, "k": k, "stride": s, "h_in": h, "h_out": ho,
                      "macs": cin * cout * k * k * ho * ho, "params": cin * cout * k * k,
                      "in_elems": cin * h * h, "out_elems": cout * ho * ho, "dgrad": name != "conv1"})
    bns, blocks = [{"name": "bn1", "C": 64, "H": 32, "relu": True, "kind": "stem"}], []
    for c in convs[1:]:
        prefix = c["name"].rsplit(".", 1)[0]
        if c["name"].endswith("conv1"):
            bns.append({"name": prefix + ".bn1", "C": c["cout"], "H": c["h_out"], "relu": True, "kind": "bn1"})
            blocks.append({"name": prefix, "in": (c["cin"], c["h_in"]), "out": (c["cout"], c["h_out"]),
                           "ds": False})
        elif c["name"].endswith("conv2"):
            bns.append({"name": prefix + ".bn2", "C": c["cout"], "H": c["h_out"], "relu": False, "kind": "bn2"})
        else:
            bns.append({"name": c["name"][:-2] + ".1", "C": c["cout"], "H": c["h_out"], "relu": False,
                        "kind": "ds"})
            blocks[-1]["ds"] = True
    for b in bns:
        b["elems"] = b["C"] * b["H"] * b["H"]
    fc_params = 512 * 10 + 10
    return convs, bns, blocks, fc_params


def forward_macs_per_image():
    return sum(c["macs"] for c in network(1)[0]) + 512 * 10


def bn_activation_elems_per_image():
    return sum(b["elems"] for b in network(1)[1])


def activation_elems_per_image():
    """Every activation tensor the forward writes, per image: conv outputs, BN outputs (y) and, per block, the add's
    and the ReLU's outputs (the pooled vector and logits, 522 values, included)."""
    convs, bns, blocks, _ = network(1)
    out = sum(c["out_elems"] for c in convs) + sum(b["elems"] for b in bns)
    out += sum(2 * blk["out"][0] * blk["out"][1] ** 2 for blk in blocks)
    return out + 512 + 10


def pass_bytes(elems, batch, passes, dtype_bytes=2):
    """HBM bytes of `passes` full reads or writes of an activation of `elems` values per image."""
    return passes * elems * batch * dtype_bytes


def roofline_s(flops, nbytes, peak_flops=PEAK_FLOPS, peak_bw=PEAK_BW):
    return max(flops / peak_flops, nbytes / peak_bw)


def kernel(cls, name, flops, nbytes, eff=None):
    return {"cls": cls, "name": name, "flops": float(flops), "bytes": float(nbytes), "eff": eff}


def step_kernels(batch, fusions=(), dtype_bytes=2):
    """The kernels of one training step with the fusions in `fusions` applied; bytes at the kernel boundary."""
    f = set(fusions)
    d = dtype_bytes
    convs, bns, blocks, fc_params = network(batch)
    ks = []
    bn_by = {b["name"]: b for b in bns}
    for c in convs:
        fl = 2 * c["macs"] * batch
        x, y, w = c["in_elems"] * batch * d, c["out_elems"] * batch * d, c["params"] * d
        ks.append(kernel("conv", c["name"] + " fwd", fl, x + w + y))
        if c["dgrad"]:
            # F4: the dgrad of a block's conv1 / downsample adds into the identity gradient: one more read of dx
            extra = x if "F4" in f and (c["name"].endswith("conv1") or "downsample" in c["name"]) else 0
            # F5: the epilogue of the dgrad that makes the previous BN's dy reads that BN's x (same size as dx)
            extra += x if "F5" in f else 0
            ks.append(kernel("conv", c["name"] + " dgrad", fl, y + w + x + extra))
        ks.append(kernel("conv", c["name"] + " wgrad", fl, y + x + w))
    for b in bns:
        a = b["elems"]
        # the channel partials (C x G float2, G ~ 4*132/ceil(C/64)) and the (4, C) stats: KB
        small = b["C"] * 8 * 528 / max(1, -(-b["C"] // 64)) + 4 * b["C"] * 4
        if "F1" not in f:
            ks.append(kernel("bn_stats", b["name"], 0, pass_bytes(a, batch, 1, d)))
        ks.append(kernel("bn_combine", b["name"] + " stats_combine", 0, small))
        fused_tail = "F2" in f and b["kind"] in ("bn2", "ds")
        in_prologue = "F3" in f and b["kind"] in ("stem", "bn1")
        if not fused_tail and not in_prologue:
            ks.append(kernel("bn_transform", b["name"], 0, pass_bytes(a, batch, 2, d)))
        if "F5" not in f:
            ks.append(kernel("bn_backward_reduce", b["name"], 0, pass_bytes(a, batch, 2, d)))
        ks.append(kernel("bn_combine", b["name"] + " backward_combine", 0, small))
        ks.append(kernel("bn_backward_elemt", b["name"], 0, pass_bytes(a, batch, 3, d)))
    for blk in blocks:
        out = blk["out"][0] * blk["out"][1] ** 2
        inp = blk["in"][0] * blk["in"][1] ** 2
        if "F2" in f:  # read bn2's x and (identity or downsample BN's x), write the block output (+ 1/16 mask)
            ks.append(kernel("fused_tail", blk["name"], 0, pass_bytes(out, batch, 3, d) + out * batch / 8))
        else:
            ks.append(kernel("residual_add", blk["name"] + " add", 0, pass_bytes(out, batch, 3, d)))
            ks.append(kernel("relu_forward", blk["name"] + " relu", 0, pass_bytes(out, batch, 2, d)))
        if "F4" not in f:
            ks.append(kernel("relu_backward", blk["name"] + " threshold_backward", 0, pass_bytes(out, batch, 3, d)))
            ks.append(kernel("residual_add", blk["name"] + " grad accumulate", 0, pass_bytes(inp, batch, 3, d)))
    for c in convs:  # autocast: fp32 -> bf16 weight cast in the forward, bf16 -> fp32 gradient cast in the backward
        ks.append(kernel("copies", c["name"] + " weight cast", 0, c["params"] * 6))
        ks.append(kernel("copies", c["name"] + " grad cast", 0, c["params"] * 6))
    ks.append(kernel("copies", "fc weight cast", 0, fc_params * 6))
    ks.append(kernel("copies", "fc grad cast", 0, fc_params * 6))
    ks.append(kernel("copies", "input cast", 0, 3 * 32 * 32 * batch * 6))  # assumes an fp32 input batch
    return ks


def calibrate(floor_us=FLOOR_US):
    """Per measured class, the efficiency e with sum over its b512 kernels of max(roofline / e, floor) = measured
    (bisection; without the floor e = roofline / measured, the efficiency column)."""
    ks = step_kernels(512)
    eff = {}
    for cls, ms in MEASURED_CLASS_MS.items():
        roofs = [roofline_s(k["flops"], k["bytes"]) * 1e3 for k in ks if k["cls"] == cls]
        lo, hi = 1e-4, 1e3
        for _ in range(200):
            mid = (lo * hi) ** 0.5
            if sum(max(r / mid, floor_us * 1e-3) for r in roofs) > ms:
                lo = mid
            else:
                hi = mid
        eff[cls] = hi
    return eff


def modelled_ms(ks, eff, floor_us=FLOOR_US):
    """Per class: modelled ms = sum over kernels of max(roofline / eff, floor)."""
    out = {}
    for k in ks:
        e = eff.get(k["cls"], ACHIEVABLE)
        t = max(roofline_s(k["flops"], k["bytes"]) / e, floor_us * 1e-6) * 1e3
        out[k["cls"]] = out.get(k["cls"], 0.0) + t
    return out


def class_table(batch, floor_us=FLOOR_US, fusions=(), dtype_bytes=2):
    ks = step_kernels(batch, fusions, dtype_bytes)
    eff = calibrate(floor_us)
    model = modelled_ms(ks, eff, floor_us)
    rows = []
    for cls in CLASSES:
        sel = [k for k in ks if k["cls"] == cls]
        if not sel:
            continue
        flops = sum(k["flops"] for k in sel)
        nbytes = sum(k["bytes"] for k in sel)
        roof = sum(roofline_s(k["flops"], k["bytes"]) for k in sel) * 1e3
        measured = MEASURED_CLASS_MS.get(cls) if batch == 512 and not fusions and dtype_bytes == 2 else None
        rows.append({"class": cls, "kernels": len(sel), "gflop": flops / 1e9, "gb": nbytes / 1e9,
                     "roofline_ms": roof, "measured_ms": measured,
                     "efficiency": roof / measured if measured else None, "modelled_ms": model[cls]})
    return rows


def predict(batch, floor_us=FLOOR_US, dtype_bytes=2):
    """Cumulative fusions: modelled kernel ms, ms saved against no fusion, the predicted step and img/s. At b512 the
    saving is taken off the measured step and the img/s scaled from the measured 82.3k; at b96 (no H200 trace) the
    step is modelled: kernels + the b512 unexplained kernel time + the b512 idle time (both assumed
    batch-independent)."""
    eff = calibrate(floor_us)
    base = sum(modelled_ms(step_kernels(batch, (), dtype_bytes), eff, floor_us).values())
    base512 = sum(modelled_ms(step_kernels(512), eff, floor_us).values())
    busy512 = MEASURED_B512["step_ms"] - MEASURED_B512["idle_ms"]
    unexplained = busy512 - base512  # optimizer, loss, pool/fc, ... (not modelled)
    out = []
    applied = []
    for tag, what in [("F0", "today (no fusion)")] + FUSIONS:
        if tag != "F0":
            applied.append(tag)
        ks = step_kernels(batch, applied, dtype_bytes)
        total = sum(modelled_ms(ks, eff, floor_us).values())
        saved = base - total
        if batch == 512 and dtype_bytes == 2:
            step = MEASURED_B512["step_ms"] - saved
            img_s = MEASURED_B512["img_s"] * MEASURED_B512["step_ms"] / step
        else:
            step = total + unexplained + MEASURED_B512["idle_ms"]
            img_s = batch / step * 1e3
        out.append({"fusion": tag, "what": what, "kernels": len(ks), "modelled_kernel_ms": total,
                    "saved_ms": saved, "step_ms": step, "img_s": img_s})
    return out, unexplained


def ceilings(batch, floor_us=FLOOR_US, dtype_bytes=2):
    """Bounds: everything at the roofline; convs alone at the roofline; convs at their measured efficiency alone."""
    ks = step_kernels(batch, [t for t, _ in FUSIONS], dtype_bytes)
    roof_all = sum(roofline_s(k["flops"], k["bytes"]) for k in ks) * 1e3
    conv_roof = sum(roofline_s(k["flops"], k["bytes"]) for k in ks if k["cls"] == "conv") * 1e3
    conv_model = modelled_ms([k for k in ks if k["cls"] == "conv"], calibrate(floor_us), floor_us)["conv"]
    return {"all_fused_at_roofline_img_s": batch / roof_all * 1e3, "conv_roofline_img_s": batch / conv_roof * 1e3,
            "conv_measured_eff_only_img_s": batch / conv_model * 1e3,
            "flop_bound_img_s": PEAK_FLOPS / (2 * 3 * forward_macs_per_image())}


def layer_rows(batch, dtype_bytes=2):
    convs, bns, _, _ = network(batch)
    rows = [{"layer": c["name"], "shape_out": f"{c['cout']}x{c['h_out']}x{c['h_out']}", "elems_img": c["out_elems"],
             "mb_batch": c["out_elems"] * batch * dtype_bytes / 1e6, "gflop_fwd_img": 2 * c["macs"] / 1e9,
             "fits_l2": c["out_elems"] * batch * dtype_bytes < L2_BYTES} for c in convs]
    rows += [{"layer": b["name"], "shape_out": f"{b['C']}x{b['H']}x{b['H']}", "elems_img": b["elems"],
              "mb_batch": b["elems"] * batch * dtype_bytes / 1e6, "gflop_fwd_img": 0.0,
              "fits_l2": b["elems"] * batch * dtype_bytes < L2_BYTES}
             for b in bns]
    return rows


def fmt(v, spec):
    return "—" if v is None else format(v, spec)


def markdown(batch, rows, preds):
    lines = [f"| class (b{batch}) | kernels | GFLOP | GB | roofline ms | measured ms | efficiency | modelled ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['class']} | {r['kernels']} | {r['gflop']:.0f} | {r['gb']:.3f} | {r['roofline_ms']:.3f} | "
                     f"{fmt(r['measured_ms'], '.2f')} | {fmt(r['efficiency'], '.0%')} | {r['modelled_ms']:.3f} |")
    lines += ["", f"| fusion (b{batch}, cumulative) | kernels | saved ms | step ms | img/s |",
              "|---|---:|---:|---:|---:|"]
    for p in preds:
        lines.append(f"| {p['fusion']}: {p['what']} | {p['kernels']} | {p['saved_ms']:.3f} | {p['step_ms']:.3f} | "
                     f"{p['img_s'] / 1e3:.1f}k |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--floor-us", type=float, default=FLOOR_US)
    ap.add_argument("--dtype-bytes", type=int, default=2, help="bytes per activation value (bf16: 2; the "
                    "measurements and the calibration are bf16; BN statistics are fp32 and tiny)")
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--layers", action="store_true", help="print the per-layer activation table too")
    a = ap.parse_args(argv)
    b, d = a.batch, a.dtype_bytes
    macs = forward_macs_per_image()
    bn_elems = bn_activation_elems_per_image()
    print(f"ResNet-18/CIFAR, batch {b}, {d}-byte activations: forward {macs / 1e9:.4f} GMAC = "
          f"{2 * macs / 1e9:.4f} GFLOP per image, fwd+bwd {6 * macs / 1e9:.3f} GFLOP; activations written per image "
          f"{activation_elems_per_image()} values, in the 20 BN layers {bn_elems} ({bn_elems * b * d / 1e6:.0f} MB "
          f"per pass at b{b})")
    print(f"H200: {PEAK_FLOPS / 1e12:.0f} TFLOP/s dense BF16, {PEAK_BW / 1e12:.1f} TB/s HBM3e (achievable assumed "
          f"{ACHIEVABLE:.0%}), L2 {L2_BYTES / 1e6:.0f} MB; kernel floor {a.floor_us} us")
    if a.layers:
        for r in layer_rows(b, d):
            print(f"  {r['layer']:<24} {r['shape_out']:>10} {r['elems_img']:>8} el/img {r['mb_batch']:8.1f} MB"
                  f" {r['gflop_fwd_img']:.4f} GFLOP/img {'L2' if r['fits_l2'] else 'HBM'}")
    rows = class_table(b, a.floor_us, (), d)
    preds, unexplained = predict(b, a.floor_us, d)
    ceil = ceilings(b, a.floor_us, d)
    total_roof = sum(r["roofline_ms"] for r in rows)
    print(f"step roofline (all kernels at the limits, today's bytes): {total_roof:.3f} ms = "
          f"{b / total_roof:.1f}k img/s")
    print(f"unexplained kernel time at b512 (optimizer, loss, pool/fc, ...): {unexplained:.3f} ms; "
          f"ceilings: {json.dumps({k: round(v) for k, v in ceil.items()})}")
    target = TARGETS.get(b)
    if target and d == 2:
        need = b / target * 1e3
        print(f"target {target / 1e3:.0f}k img/s = step <= {need:.3f} ms")
        if b == 512:
            trace_need = MEASURED_B512["step_ms"] * MEASURED_B512["img_s"] / target  # in the trace's ms
            gap = preds[-1]["step_ms"] - trace_need
            conv = next(r for r in rows if r["class"] == "conv")
            print(f"  in the trace's ms: step <= {trace_need:.3f}; after F1-F5 {preds[-1]['step_ms']:.3f}, gap "
                  f"{gap:.3f} ms = the convolutions going from {conv['roofline_ms'] / conv['modelled_ms']:.0%} to "
                  f"{conv['roofline_ms'] / (conv['modelled_ms'] - gap):.0%} of their roofline (or idle + copies)")
        if b != 512:
            saved = preds[-1]["saved_ms"]
            print(f"  all fusions save {saved:.3f} ms here: 50k holds if today's measured b{b} step is <= "
                  f"{need + saved:.3f} ms, i.e. today >= {b / (need + saved):.1f}k img/s "
                  f"(H100 reference today: {REFERENCE_B96_IMG_S_H100 / 1e3:.1f}k)")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"batch": b, "limits": {"peak_flops": PEAK_FLOPS, "peak_bw": PEAK_BW, "l2_bytes": L2_BYTES,
                                              "achievable": ACHIEVABLE, "floor_us": a.floor_us},
                       "measured_b512": MEASURED_B512, "measured_class_ms_b512": MEASURED_CLASS_MS,
                       "classes": rows, "fusions": preds, "ceilings": ceil, "layers": layer_rows(b, d)}, fh, indent=1)
    print()
    print(markdown(b, rows, preds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
