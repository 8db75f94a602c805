#!/usr/bin/env python3
"""Writes synthetic run folders for the report browser test: one per chart kind, plus broken ones.

  tri/      Tri-Accel: config, epoch, precision, curvature, batch (VRAM budget), summary
  baoc/     BAOC: config, epoch, plan (per-unit formats, bytes, risk), a memory plan (per-unit activations), summary
  nf/       NeuroFlux: config, its own plan, block (per-unit local accuracies), exit (the exit curve), summary
  broken/   a line that is not JSON, one that is not an event, a cut-off last line, no summary
  empty/    an empty events.jsonl
The numbers are made up but shaped like the real events (src/triaccel/train/trainer.cpp, tri_accel.cpp,
optim/baoc_driver.cpp, local/neuroflux.cpp)."""
import json
import math
import os
import sys

out = sys.argv[1]
UNITS = ["stem", "layer1.0", "layer1.1", "layer2.0", "layer2.1", "fc"]


def write(name, events, tail=""):
    os.makedirs(os.path.join(out, name), exist_ok=True)
    with open(os.path.join(out, name, "events.jsonl"), "w") as f:
        for e in events:
            f.write((e if isinstance(e, str) else json.dumps(e)) + "\n")
        f.write(tail)


def ev(kind, step, t, **fields):
    return {"event": kind, "step": step, "time_s": t, **fields}


def config(method, precision="fp32"):
    return ev("config", 0, 0.4, options={"method": method, "model": "resnet18", "dataset": "cifar10",
                                         "precision": precision, "epochs": 4})


def epochs(n, t0, dt, peak):
    return [ev("epoch", 100 * e, t0 + dt * e, epoch=e, train_loss=2.0 / e, train_acc=40 + 10 * e,
               test_loss=2.2 / e, test_acc=38 + 11 * e, epoch_s=dt, batch=96, peak_vram_gb=peak + 0.01 * e)
            for e in range(1, n + 1)]


def summary(method, acc, epoch_s, peak, **more):
    return ev("summary", 400, 50.0, test_acc=acc, epoch_s=epoch_s, peak_vram_gb=peak,
              eff_score=acc / (epoch_s * peak), params=11173962, method=method, model="resnet18", dataset="cifar10",
              **more)


tri = [config("tri-accel")]
for k in range(1, 17):
    step, t = 25 * k, 2.0 + 3.0 * k
    tri.append(ev("precision", step, t, units=UNITS, precision=["bf16"] * 6,
                  applied=["fp32" if (u == 0 and k < 5) else ("fp16" if u >= 3 and k > 8 else "bf16")
                           for u in range(6)], promoted=[False] * 6))
    tri.append(ev("batch", step, t, batch=96 + 16 * (k % 3), previous=96, changed=True, reason="grow",
                  peak_gb=0.6 + 0.1 * math.sin(k), static_gb=0.3, predicted_peak_gb=0.7, reserved_gb=0.8,
                  budget_gb=1.0, lr_scale=1.0))
    if k % 4 == 0:
        lam = [None] * 6
        lam[k // 4 % 6] = 10.0 * k
        lam[5] = 40.0 - k
        tri.append(ev("curvature", step, t, units=UNITS, probed=[UNITS[k // 4 % 6]], lambda_max=lam))
tri += epochs(4, 4.0, 12.0, 0.7)
tri.append(summary("tri-accel", 82.0, 12.0, 0.8, precision="adaptive"))
write("tri", tri)

plan_units = [{"unit": u, "format": f, "params": 1000 * (i + 1), "bytes": b, "risk": r}
              for i, (u, f, b, r) in enumerate(zip(UNITS, ["adamw-fp32", "adamw-8bit", "adamw-8bit", "sgd",
                                                           "factored", "adamw-bf16"],
                                                   [8000, 4000, 4000, 0, 900, 24000],
                                                   [0.0, 1e-4, 2e-4, 0.01, 0.003, 0.0005]))]
baoc = [config("backprop", "amp-bf16")] + epochs(3, 2.0, 9.0, 1.2)
baoc.insert(2, ev("optim_plan", 50, 6.0, units=plan_units, total_bytes=40900, budget_bytes=45000, adamw_fp32_bytes=160000,
                  total_risk=0.0137, plan=1))
baoc.insert(3, ev("memory_plan", 0, 1.5, reason="start", batch=96, micro_batch=48, accumulation=2,
                  recompute=["layer1.0", "layer2.0"], data_placement="host", predicted_peak_bytes=480000000,
                  measured_peak_bytes=470000000, budget_bytes=500000000, plan_limit_bytes=450000000,
                  units=[{"unit": u, "recompute": u in ("layer1.0", "layer2.0"), "activation_bytes": b}
                         for u, b in zip(UNITS, [60e6, 9e6, 50e6, 4e6, 30e6, 1e5])],
                  consumers={"weights": 44700000, "gradients": 44700000, "optimizer": 44700000, "data": 4000000,
                             "fixed": 30000000, "transient": 12000000}))
baoc.append(summary("backprop", 80.5, 9.0, 1.25, precision="amp-bf16"))
write("baoc", baoc)

nf_units = ["conv1", "conv2", "conv3", "fc"]
nf = [config("neuroflux"),
      ev("block_plan", 0, 0.6, method="neuroflux", budget_gb=0.008, blocks=[{"units": nf_units[:2]}, {"units": nf_units[2:]}],
         units=[{"unit": u, "params": 100} for u in nf_units])]
for b, units in enumerate([nf_units[:2], nf_units[2:]]):
    nf.append(ev("block", 10 * (b + 1), 3.0 + 4 * b, block=b, units=units, batch=64, final_batch=64 // (b + 1),
                 peak_vram_gb=0.004 + 0.002 * b, predicted_gb=0.005,
                 local=[{"unit": u, "train_loss": 1.0, "train_acc": 55 + 8 * nf_units.index(u),
                         "holdout_acc": 52 + 8 * nf_units.index(u), "test_acc": 51 + 8 * nf_units.index(u)}
                        for u in units]))
nf.append(ev("exit", 20, 12.0, exits=[{"unit": u, "index": i, "params": 300 * 4 ** i, "holdout_acc": 52 + 8 * i,
                                       "test_acc": 51 + 8 * i} for i, u in enumerate(nf_units)],
             chosen={"unit": "conv3", "index": 2}, tolerance=10.0, full_params=300 * 4 ** 3))
nf.append(ev("summary", 20, 13.0, test_acc=75.0, epoch_s=5.5, peak_vram_gb=0.006, method="neuroflux",
             model="small-cnn", dataset="fashion-mnist", precision="fp32", epochs=1))
write("nf", nf)

write("broken", [config("backprop"), "{this line is not JSON"] + epochs(2, 2.0, 10.0, 1.0) + [{"no_event": 1}],
      tail='{"event": "epoch", "step": 300, "ti')
os.makedirs(os.path.join(out, "empty"), exist_ok=True)
open(os.path.join(out, "empty", "events.jsonl"), "w").close()
