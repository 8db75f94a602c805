#!/usr/bin/env python3
"""Merges the C++ and PyTorch throughput JSON into bench/results/<gpu>/<bench>.json (DESIGN.md format):
one row per (model, batch, precision) with ours and the baseline side by side. The baseline is PyTorch eager's
best layout (channels_last or NCHW) for that configuration, so the ratio never flatters us."""
import argparse
import json
import subprocess


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", required=True)
    ap.add_argument("--pytorch", required=True)
    ap.add_argument("--bench", required=True)
    ap.add_argument("--command", required=True)
    ap.add_argument("--gpu", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", help="the commit the binaries were built from (the device copy has no .git)")
    a = ap.parse_args()
    ours = json.load(open(a.ours))
    ref = json.load(open(a.pytorch))
    commit = a.commit
    if not commit:
        try:
            commit = subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
        except Exception:
            commit = "unknown"
    rows = []
    for o in ours["rows"]:
        same = [r for r in ref["rows"] if (r["model"], r["batch"], r["precision"]) == (o["model"], o["batch"], o["precision"])]
        best = max(same, key=lambda r: r["images_per_s"]) if same else None
        row = {"model": o["model"], "batch": o["batch"], "precision": o["precision"],
               "triaccel_images_per_s": round(o["images_per_s"]), "triaccel_peak_gb": round(o["peak_allocated_gb"], 3),
               "triaccel_cuda_graph": o["graph_captured"]}
        if best:
            row.update({"pytorch_images_per_s": round(best["images_per_s"]),
                        "pytorch_layout": "channels_last" if best["channels_last"] else "nchw",
                        "pytorch_peak_gb": round(best["peak_allocated_gb"], 3),
                        "speedup": round(o["images_per_s"] / best["images_per_s"], 3),
                        "pytorch_all_layouts": [{"channels_last": r["channels_last"],
                                                 "images_per_s": round(r["images_per_s"]),
                                                 "peak_gb": round(r["peak_allocated_gb"], 3)} for r in same]})
        rows.append(row)
    out = {"bench": a.bench, "gpu": ours["gpu"], "torch": ref.get("torch"), "command": a.command, "commit": commit,
           "rows": rows}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"{'model':10s} {'batch':>5s} {'precision':9s} {'triaccel':>9s} {'pytorch':>9s} {'x':>6s} {'GB ours':>8s} {'GB pt':>7s}")
    for r in rows:
        print(f"{r['model']:10s} {r['batch']:5d} {r['precision']:9s} {r['triaccel_images_per_s']:9d} "
              f"{r.get('pytorch_images_per_s', 0):9d} {r.get('speedup', 0):6.2f} {r['triaccel_peak_gb']:8.3f} "
              f"{r.get('pytorch_peak_gb', 0):7.3f}")


if __name__ == "__main__":
    main()
