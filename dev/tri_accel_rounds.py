#!/usr/bin/env python3
"""One row per Tri-Accel run of a folder (NAME.events.jsonl): accuracy, s/epoch, peak and budget, the curvature
rounds run and skipped (by reason), the longest stretch without a round in epochs, the probe share and the step
graph's captures. Usage: tri_accel_rounds.py FOLDER [--json OUT.json]."""
import argparse
import collections
import glob
import json
import os


def facts(path):
    events = [json.loads(line) for line in open(path) if line.strip()]
    summary = next((e for e in events if e["event"] == "summary"), {})
    epochs = [e for e in events if e["event"] == "epoch"]
    rounds = [e["step"] for e in events if e["event"] == "curvature" and "lambda_max" in e]
    skipped = collections.Counter(e["skipped"] for e in events if e["event"] == "curvature" and "skipped" in e)
    steps = summary.get("steps") or (epochs[-1]["step"] if epochs else 0)
    per_epoch = steps / max(len(epochs), 1)
    marks = [0] + rounds + [steps]
    longest = max((b - a for a, b in zip(marks, marks[1:])), default=0) / per_epoch if per_epoch else None
    last_round = next((e for e in reversed(events) if e["event"] == "curvature" and "lambda_max" in e), {})
    return {
        "run": os.path.basename(path)[: -len(".events.jsonl")],
        "test_acc": summary.get("test_acc"),
        "epoch_s": summary.get("epoch_s"),
        "peak_vram_gb": summary.get("peak_vram_gb"),
        "vram_budget_gb": summary.get("vram_budget_gb"),
        "rounds": len(rounds),
        "skipped": dict(skipped),
        "longest_unprobed_epochs": round(longest, 2) if longest is not None else None,
        "probe_share": summary.get("probe_share"),
        "lr_scales_away_from_1": any(abs(s - 1) > 1e-6 for s in last_round.get("lr_scale", [])),
        "graph_captures": epochs[-1].get("graph_captures") if epochs else None,
        "exit": "finished" if summary else "no summary",
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = [facts(p) for p in sorted(glob.glob(os.path.join(a.folder, "*.events.jsonl")))]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    cols = ["run", "test_acc", "epoch_s", "peak_vram_gb", "vram_budget_gb", "rounds", "skipped",
            "longest_unprobed_epochs", "probe_share", "lr_scales_away_from_1", "graph_captures", "exit"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        cells = []
        for c in cols:
            v = r[c]
            cells.append(f"{v:.3f}" if isinstance(v, float) else json.dumps(v) if isinstance(v, dict) else str(v))
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
