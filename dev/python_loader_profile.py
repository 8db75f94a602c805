#!/usr/bin/env python3
"""Where the DataLoader path loses against the tensors path (issue 54: resnet50 b96 8,315 img/s against 25,934):
the same model trained two epochs each way with a timeline of 20 steps of epoch 2 (profile_steps), then
bench/trace_summary.py over both (GPU busy/idle per step, host time of the batch fetch) and the run's graph events.
Usage: python_loader_profile.py CIFAR_BIN_DIR OUT_DIR [--model resnet50] [--batch 96] [--workers 12]"""
import argparse
import json
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import python_models as pm  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("data")
ap.add_argument("out")
ap.add_argument("--model", default="resnet50")
ap.add_argument("--batch", type=int, default=96)
ap.add_argument("--workers", type=int, default=12)
a = ap.parse_args()
train_set, test_set = pm.cifar_read(a.data)
test = (test_set[0][:2048], test_set[1][:2048])
steps = len(train_set[0]) // a.batch
window = f"{steps + 80}:{steps + 100}"
common = dict(epochs=2, batch_size=a.batch, precision="amp-bf16", seed=0, channels_last=True, profile_steps=window)
runs = {}
torch.manual_seed(0)
runs["tensors"] = (pm.train(pm.MODELS[a.model](), (train_set, test), os.path.join(a.out, "tensors"), augment="on",
                            **common), os.path.join(a.out, "tensors"))
loader = torch.utils.data.DataLoader(pm.CifarTransformed(*train_set, True), batch_size=a.batch,
                                     num_workers=a.workers, pin_memory=True)
torch.manual_seed(0)
runs["dataloader"] = (pm.train(pm.MODELS[a.model](), (loader, pm.CifarTransformed(*test, False)),
                               os.path.join(a.out, "dataloader"), augment="off", **common),
                      os.path.join(a.out, "dataloader"))
here = os.path.dirname(__file__)
for name, (row, out) in runs.items():
    print(f"== {name}: {json.dumps({k: row.get(k) for k in ('images_per_s', 'epoch_s', 'error')})}")
    events = [json.loads(line) for line in open(os.path.join(out, "events.jsonl")) if line.strip()]
    kinds = {}
    for e in events:
        kinds[e["event"]] = kinds.get(e["event"], 0) + 1
    print("   events:", kinds)
    for e in events:
        if e["event"] in ("epoch",):
            print("   epoch:", {k: e.get(k) for k in ("epoch", "images_per_s", "epoch_s", "graph_captures",
                                                      "eager_steps", "graph_replays") if k in e})
        if "graph" in e["event"] or "capture" in json.dumps(e)[:400]:
            print("   ", json.dumps(e)[:300])
    trace = os.path.join(out, "profile.json")
    if os.path.exists(trace):
        sys.stdout.flush()
        subprocess.run([sys.executable, os.path.join(here, "..", "bench", "trace_summary.py"), trace],
                       stderr=subprocess.STDOUT)
        sys.stdout.flush()
        subprocess.run([sys.executable, os.path.join(here, "..", "bench", "trace_summary.py"), "--host", trace])
