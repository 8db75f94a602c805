#!/usr/bin/env python3
"""Tri-Accel acceptance tables from a folder of runs (NAME.events.jsonl, NAME = <model>_<method>[_<variant>]_s<seed>).

Writes OUT.json (DESIGN.md's results format: bench, gpu, command, commit, rows + the ablation and budget checks)
and OUT.md (Table 1 and Table 2 in the paper's layout, our figures beside the paper's). Mean ± sample std over seeds.
"""
import argparse
import glob
import json
import os
import re
import statistics

PAPER_T1 = {  # CIFAR-10, Table 1: acc %, s/epoch, GB, efficiency score
    ("resnet18", "fp32"): (77.0, 21.0, 0.35, 10.48), ("resnet18", "amp"): (77.2, 19.4, 0.32, 12.25),
    ("resnet18", "tri"): (78.1, 19.5, 0.31, 12.92), ("efficientnet-b0", "fp32"): (78.3, 18.5, 0.30, 14.11),
    ("efficientnet-b0", "amp"): (78.7, 17.2, 0.26, 17.59), ("efficientnet-b0", "tri"): (79.4, 16.8, 0.26, 18.17)}
PAPER_T2 = {"standard": 0.350, "batch": 0.321, "precision": 0.310, "full": 0.307}  # ResNet-18 VRAM GB
METHOD_LABEL = {"fp32": "FP32", "bf16": "AMP bf16", "fp16": "AMP fp16", "tri": "Tri-Accel",
                "prec": "Tri-Accel precision only", "curv": "Tri-Accel curvature lr only",
                "tri_fisher": "Tri-Accel, Fisher curvature", "curvf": "Tri-Accel curvature lr only, Fisher",
                "prec_norecompute": "Tri-Accel precision only, --recompute none",
                "prec_autotune": "Tri-Accel precision only, --cudnn-autotune on",
                "tri_fisher_budget2": "Tri-Accel, Fisher curvature, --curv-budget 0.02",
                "tri_cudnnoff": "Tri-Accel, probes without cuDNN",
                "tri_fisher_cudnnon": "Tri-Accel, Fisher curvature, probes with cuDNN",
                "tri_1GB": "Tri-Accel, --vram-budget 1GB", "tri_3GB": "Tri-Accel, --vram-budget 3GB",
                "precf": "Tri-Accel precision only, Fisher curvature", "default": "Tri-Accel, the defaults",
                "mean": "Tri-Accel, --curv-lr-mean true"}


def load(path):
    events = []
    for line in open(path):
        line = line.strip()
        if line:
            events.append(json.loads(line))
    return events


def run_facts(name, events):
    config = next((e for e in events if e["event"] == "config"), {})
    summary = events[-1] if events and events[-1]["event"] == "summary" else None
    epochs = [e for e in events if e["event"] == "epoch"]
    batches = [e["batch"] for e in events if e["event"] == "batch"]
    opts = config.get("options", {})
    train_samples = config.get("train_samples")
    facts = {"run": name, "finished": summary is not None, "epochs_done": len(epochs),
             "every_sample_every_epoch": bool(epochs) and all(e.get("samples") == train_samples for e in epochs),
             "oom_events": sum(e["event"] == "oom" for e in events),
             "vram_budget": opts.get("vram_budget") or None,
             "batch_min": min(batches) if batches else opts.get("batch_size"),
             "batch_max": max(batches) if batches else opts.get("batch_size"),
             "batch_final": batches[-1] if batches else opts.get("batch_size")}
    facts.update(curvature_facts(events, config, len(epochs)))
    if summary:
        for k in ("test_acc", "epoch_s", "peak_vram_gb", "eff_score", "probe_share", "skipped_steps", "total_s"):
            facts[k] = summary.get(k)
    if facts["vram_budget"] and summary:
        budget_gb = float(re.match(r"[\d.]+", facts["vram_budget"]).group()) * (1.073741824 if "i" in facts["vram_budget"].lower() else 1)
        facts["budget_gb"] = budget_gb
        facts["peak_within_budget"] = summary["peak_vram_gb"] <= budget_gb
    return facts


def curvature_facts(events, config, epochs_done):
    """From the curvature events: probes, the longest gap (in epochs) any unit went unprobed (start and end
    included), α and the final lr scales' range."""
    probes = [e for e in events if e["event"] == "curvature" and e.get("probed")]
    if not probes:
        return {}
    opts = config.get("options", {})
    steps_per_epoch = -(-config.get("train_samples", 1) // opts.get("batch_size", 1))
    units = probes[-1]["units"]
    last_step = max((e.get("step", 0) for e in events if e["event"] == "epoch"), default=probes[-1]["step"])
    gaps = []
    for u in units:
        steps = [e["step"] for e in probes if u in e["probed"]]
        marks = [0] + steps + [last_step]
        gaps.append(max(b - a for a, b in zip(marks, marks[1:])) / steps_per_epoch)
    scales = probes[-1].get("lr_scale") or [1.0]
    return {"probes": len(probes), "units": len(units),
            "units_probed": sum(any(u in e["probed"] for e in probes) for u in units),
            "max_unprobed_epochs": max(gaps), "alpha": probes[-1].get("alpha"),
            "lr_scale_min": min(scales), "lr_scale_max": max(scales),
            "hvp_products": sum(e.get("hvp_products", 0) for e in probes)}


def mean_std(values):
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def fmt(m, s, digits=2):
    if m is None:
        return "—"
    return f"{m:.{digits}f} ± {s:.{digits}f}" if s else f"{m:.{digits}f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("--gpu", default="unknown")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--command", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    runs = {}
    for path in sorted(glob.glob(os.path.join(args.folder, "*.events.jsonl"))):
        name = os.path.basename(path)[: -len(".events.jsonl")]
        runs[name] = run_facts(name, load(path))

    groups = {}
    for name, f in runs.items():
        m = re.match(r"(r18|effb0)_(.+?)(?:_check)?(?:_s(\d+))?$", name)
        if not m:
            continue
        model = "resnet18" if m.group(1) == "r18" else "efficientnet-b0"
        groups.setdefault((model, m.group(2)), []).append(f)

    rows = []
    for (model, method), fs in sorted(groups.items()):
        done = [f for f in fs if f["finished"]]
        row = {"model": model, "method": method, "label": METHOD_LABEL.get(method, method), "seeds": len(done),
               "runs": [f["run"] for f in fs], "crashed": len(fs) - len(done)}
        for k in ("test_acc", "epoch_s", "peak_vram_gb", "eff_score", "probe_share", "max_unprobed_epochs",
                  "lr_scale_min"):
            row[k + "_mean"], row[k + "_std"] = mean_std([f.get(k) for f in done])
        paper_key = {"fp32": "fp32", "bf16": "amp", "fp16": "amp", "tri": "tri"}.get(method)
        if paper_key and (model, paper_key) in PAPER_T1:
            row["paper"] = dict(zip(("test_acc", "epoch_s", "peak_vram_gb", "eff_score"), PAPER_T1[(model, paper_key)]))
        rows.append(row)

    def row_of(model, method):
        return next((r for r in rows if r["model"] == model and r["method"] == method and r["seeds"]), None)

    acceptance = {}
    for model in ("resnet18", "efficientnet-b0"):
        tri = row_of(model, "tri")
        for amp in ("bf16", "fp16"):
            a = row_of(model, amp)
            if tri and a:
                acceptance[f"{model}: tri vs amp-{amp}"] = {
                    "acc_delta_pp": tri["test_acc_mean"] - a["test_acc_mean"],
                    "acc_ok (>= -0.2 pp)": tri["test_acc_mean"] >= a["test_acc_mean"] - 0.2,
                    "eff_ratio": tri["eff_score_mean"] / a["eff_score_mean"],
                    "eff_ok (>= 1.0x)": tri["eff_score_mean"] / a["eff_score_mean"] >= 1.0}

    ablation = []
    std = runs.get("r18_fp32_s0")
    for key, run, paper in (("standard (FP32)", "r18_fp32_s0", "standard"),
                            ("+ dynamic batch (--vram-budget 1GB)", "r18_abl_batch_s0", "batch"),
                            ("+ dynamic precision", "r18_abl_prec_s0", "precision"),
                            ("+ curvature lr scaling", "r18_abl_curv_s0", None),
                            ("full Tri-Accel", "r18_tri_s0", "full"),
                            ("full Tri-Accel, --vram-budget 1GB", "r18_tri_1GB_s0", None)):
        f = runs.get(run)
        if not f or not f["finished"]:
            continue
        entry = {"configuration": key, "run": run, "peak_vram_gb": f["peak_vram_gb"], "test_acc": f["test_acc"],
                 "epoch_s": f["epoch_s"], "eff_score": f["eff_score"], "batch_range": [f["batch_min"], f["batch_max"]]}
        if std and std["finished"]:
            entry["reduction_pct"] = 100.0 * (1 - f["peak_vram_gb"] / std["peak_vram_gb"])
        if paper:
            entry["paper_vram_gb"] = PAPER_T2[paper]
            entry["paper_reduction_pct"] = 100.0 * (1 - PAPER_T2[paper] / PAPER_T2["standard"])
        ablation.append(entry)

    budget_runs = [f for f in runs.values() if f["vram_budget"]]
    result = {"bench": "tri_accel_table1", "gpu": args.gpu, "command": args.command, "commit": args.commit,
              "peak_vram_rule": "allocator peak allocated bytes, resident dataset included (same rule for all rows)",
              "rows": rows, "acceptance": acceptance, "ablation": ablation, "budget_runs": budget_runs,
              "runs": list(runs.values())}
    with open(args.out + ".json", "w") as fh:
        json.dump(result, fh, indent=1)

    md = [f"GPU: {args.gpu}; commit {args.commit}; `{args.command}`", "",
          "| Model | Method | seeds | Acc (%) | Time (s/epoch) | VRAM (GB) | Eff. score | probe share | paper: Acc / Time / VRAM / Eff |",
          "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r.get("paper")
        paper = f"{p['test_acc']} / {p['epoch_s']} / {p['peak_vram_gb']} / {p['eff_score']}" if p else ""
        md.append(f"| {r['model']} | {r['label']} | {r['seeds']} | {fmt(r['test_acc_mean'], r['test_acc_std'])} | "
                  f"{fmt(r['epoch_s_mean'], r['epoch_s_std'], 3)} | {fmt(r['peak_vram_gb_mean'], r['peak_vram_gb_std'], 3)} | "
                  f"{fmt(r['eff_score_mean'], r['eff_score_std'])} | "
                  f"{fmt(r['probe_share_mean'], r['probe_share_std'], 3) if r['probe_share_mean'] is not None else ''} | {paper} |")
    curv = [f for f in runs.values() if f.get("probes")]
    if curv:
        md += ["", "| run | probes | units probed | longest unprobed (epochs) | probe share | alpha | lr scales |",
               "|---|---|---|---|---|---|---|"]
        for f in curv:
            alpha = f"{f['alpha']:.4g}" if f.get("alpha") is not None and f["alpha"] >= 0 else "not calibrated"
            share = f"{f['probe_share']:.3f}" if f.get("probe_share") is not None else ""
            md.append(f"| {f['run']} | {f['probes']} | {f['units_probed']}/{f['units']} | "
                      f"{f['max_unprobed_epochs']:.2f} | {share} | {alpha} | "
                      f"{f['lr_scale_min']:.3f}–{f['lr_scale_max']:.3f} |")
    if acceptance:
        md += ["", "| acceptance | Δacc (pp) | acc ok | eff ratio | eff ok |", "|---|---|---|---|---|"]
        for k, a in acceptance.items():
            md.append(f"| {k} | {a['acc_delta_pp']:+.2f} | {a['acc_ok (>= -0.2 pp)']} | {a['eff_ratio']:.3f} | {a['eff_ok (>= 1.0x)']} |")
    if ablation:
        md += ["", "| ResNet-18 ablation (seed 0) | VRAM (GB) | reduction | Acc (%) | s/epoch | batch range | paper VRAM (reduction) |",
               "|---|---|---|---|---|---|---|"]
        for e in ablation:
            paper = f"{e['paper_vram_gb']} ({e['paper_reduction_pct']:.1f} %)" if "paper_vram_gb" in e else ""
            red = f"{e['reduction_pct']:.1f} %" if "reduction_pct" in e else ""
            md.append(f"| {e['configuration']} | {e['peak_vram_gb']:.3f} | {red} | {e['test_acc']:.2f} | {e['epoch_s']:.3f} | "
                      f"{e['batch_range'][0]}–{e['batch_range'][1]} | {paper} |")
    if budget_runs:
        md += ["", "| budget run | budget | peak GB | within | finished | every sample, every epoch | OOM retries | batch range |",
               "|---|---|---|---|---|---|---|---|"]
        for f in budget_runs:
            md.append(f"| {f['run']} | {f['vram_budget']} | {f.get('peak_vram_gb', float('nan')):.3f} | "
                      f"{f.get('peak_within_budget')} | {f['finished']} ({f['epochs_done']} epochs) | "
                      f"{f['every_sample_every_epoch']} | {f['oom_events']} | {f['batch_min']}–{f['batch_max']} |")
    with open(args.out + ".md", "w") as fh:
        fh.write("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
