#!/usr/bin/env python3
"""Every combination inside every budget (issue 56): a seeded random grid of `triaccel train` runs over the options a
budget combines with, each classified by how it ended.

Axes: model (the built-in ones, each on its dataset at a batch it is trained at, and two defined in Python, trained
through `triaccel.train` by bench/grid_python_model.py: torchvision's ResNet-18 and a GPT with tied weights), method
(backprop, tri-accel, neuroflux, auto), optimizer (sgd, adamw, baoc), precision (fp32, amp-bf16, amp-fp16;
--precisions adds amp-fp8, which changes what every seed draws, so it is not in the default), Tri-Accel's controllers
(all, or one of them off), vram_budget (none, or a share of the model's unbudgeted peak on the H200 at that batch:
0.9 down to 0.2), data placement (auto, device, host), CUDA graphs (on, off) and processes (1, or 2 where GPUS >= 2). A
combination the CLI refuses in one line (exit 2: an option that does not apply, a budget below the floor) is a
result, not a failure.

Outcomes: ok (exit 0, and under a budget the peak within it), refused (exit 2, one `triaccel:` line), over_budget
(exit 0, peak above the budget), samples_dropped (exit 0, a sample of a step not trained: `dropped_samples`),
wrong_floor (refused for a floor the budget is not below), internal_error (a `triaccel: internal error` line), crash
(killed by a signal, or an exit code other than 0 and 2), timeout. All but the first two are bugs (issue 56: "never
internal error", "every refusal is below the named floor", "every sample once per epoch").

The predicted peak is judged against the peak the final plan's own steps reached (the summary's
memory_plan.measured_peak_gb: what the plan predicts), and also against the run's peak (which includes the steps of an
earlier plan an out-of-memory error corrected).

Usage: budget_grid.py --list [--seed 0 --count 150]         the combinations, one per line (no GPU needed)
       budget_grid.py --bin triaccel --data-cifar DIR --data-text DIR [--shard 0/3] [--max-steps 60] [--json OUT]
The runs of one call: those with index % n == i for --shard i/n (a grid of 150 takes ~3 calls of 10 minutes).
"""
import argparse
import json
import os
import random
import re
import subprocess
import sys
import time

# Each built-in model: its dataset, batch, and about its unbudgeted peak (GB) on the H200 at that batch in amp-bf16
# (the README's tables; the budgets are shares of it, so a rough figure only moves where the shares fall).
MODELS = {
    "resnet18": {"dataset": "cifar10", "batch": 96, "peak_gb": 0.62},
    "efficientnet-b0": {"dataset": "cifar10", "batch": 96, "peak_gb": 0.45},
    "small-cnn": {"dataset": "cifar10", "batch": 128, "peak_gb": 0.25},
    "vit-tiny": {"dataset": "cifar10", "batch": 512, "peak_gb": 1.9},
    "gpt-char": {"dataset": "tinyshakespeare", "batch": 64, "peak_gb": 1.79},
    # Defined in Python (bench/grid_python_model.py), about the built-in models of their shape.
    "tv-resnet18": {"dataset": "cifar10", "batch": 96, "peak_gb": 0.62, "python": True},
    "py-gpt-tied": {"dataset": "tinyshakespeare", "batch": 64, "peak_gb": 1.79, "python": True},
}
PYTHON_RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "grid_python_model.py")
METHODS = ["backprop", "tri-accel", "neuroflux", "auto"]
OPTIMIZERS = ["sgd", "adamw", "baoc"]
PRECISIONS = ["fp32", "amp-bf16", "amp-fp16"]
CONTROLLERS = ["all", "ta_precision", "ta_curvature", "ta_batch"]  # tri-accel: all on, or this one off
BUDGET_SHARES = [None, 0.9, 0.7, 0.5, 0.35, 0.25, 0.2]
PLACEMENTS = ["auto", "device", "host"]
GRAPHS = ["true", "false"]


def combos(seed, count, gpus=1, precisions=None):
    """`count` combinations drawn with random.Random(seed): the same list on every machine. Each axis value appears
    about equally often (each axis is drawn uniformly, independently). precisions: the precision axis (default
    PRECISIONS; another list draws another grid)."""
    precisions = precisions or PRECISIONS
    rng = random.Random(seed)
    out = []
    for i in range(count):
        model = rng.choice(sorted(MODELS))
        c = {
            "index": i,
            "model": model,
            "method": rng.choice(METHODS),
            "optimizer": rng.choice(OPTIMIZERS),
            "precision": rng.choice(precisions),
            "controllers": rng.choice(CONTROLLERS),
            "budget_share": rng.choice(BUDGET_SHARES),
            "placement": rng.choice(PLACEMENTS),
            "cuda_graphs": rng.choice(GRAPHS),
            "nproc": rng.choice([1, 2]) if gpus >= 2 else 1,
        }
        share = c["budget_share"]
        c["vram_budget"] = None if share is None else f"{round(share * MODELS[model]['peak_gb'], 3)}GB"
        out.append(c)
    return out


def args_of(c, data_cifar, data_text, max_steps, out):
    """The `triaccel train` arguments of a combination."""
    m = MODELS[c["model"]]
    data = data_text if m["dataset"] == "tinyshakespeare" else data_cifar
    a = ["train", "--model", c["model"], "--dataset", m["dataset"], "--data", data, "--batch-size", str(m["batch"]),
         "--method", c["method"], "--optimizer", c["optimizer"], "--precision", c["precision"],
         "--data-placement", c["placement"], "--cuda-graphs", c["cuda_graphs"], "--epochs", "1",
         "--max-steps", str(max_steps), "--out", out, "--progress", "lines", "--log-every", "1000000"]
    if c["method"] == "tri-accel" and c["controllers"] != "all":
        a += ["--" + c["controllers"].replace("_", "-"), "false"]
    if c["vram_budget"]:
        a += ["--vram-budget", c["vram_budget"]]
    if c["nproc"] > 1:
        a += ["--nproc", str(c["nproc"])]
    return a


def floor_named(line):
    """The floor in bytes a refusal names ("below ...'s floor of N bytes", "needs at least N bytes"), or None."""
    m = re.search(r"floor of (\d+) bytes|needs at least (\d+) bytes", line)
    return int(m.group(1) or m.group(2)) if m else None


def classify(returncode, stderr, summary, budget_bytes, timed_out=False):
    """(outcome, the line that says why). summary: the events' last `summary` (or `stop`) event, or None."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    if timed_out:
        return "timeout", lines[-1] if lines else ""
    internal = [line for line in lines if "internal error" in line]
    if internal:
        return "internal_error", internal[0]
    if returncode < 0 or returncode not in (0, 2):
        return "crash", (lines[-1] if lines else f"exit {returncode}")
    if returncode == 2:
        said = [line for line in lines if line.startswith("triaccel:")]
        why = said[-1] if said else (lines[-1] if lines else "")
        floor = floor_named(why)
        if budget_bytes and floor is not None and budget_bytes >= floor:
            return "wrong_floor", why
        return "refused", why
    peak = (summary or {}).get("peak_vram_gb")
    if budget_bytes and peak is not None and peak * 1e9 > budget_bytes:
        return "over_budget", f"peak {peak:.3f} GB above {budget_bytes / 1e9:.3f} GB"
    dropped = (summary or {}).get("dropped_samples") or 0
    if dropped:
        return "samples_dropped", f"{dropped} samples of its steps not trained"
    return "ok", ""


def bytes_of(size):
    if not size:
        return 0
    value, unit = re.fullmatch(r"([0-9.]+)\s*(GB|MB)", size).groups()
    return float(value) * (1e9 if unit == "GB" else 1e6)


def run_one(c, a, timeout):
    out = os.path.join(a.work, f"run_{c['index']}")
    python = MODELS[c["model"]].get("python")
    front = [a.python, PYTHON_RUNNER] if python else [a.bin]
    shown = ["python3", "bench/grid_python_model.py"] if python else ["triaccel"]  # the command, without local paths
    argv = front + args_of(c, a.data_cifar, a.data_text, a.max_steps, out)
    if a.device:
        argv += ["--device", a.device]
    t = time.time()
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        code, err, timed_out = p.returncode, p.stderr, False
    except subprocess.TimeoutExpired as e:
        err = e.stderr if isinstance(e.stderr, str) else (e.stderr or b"").decode(errors="replace")
        code, timed_out = None, True
    events = []
    path = os.path.join(out, "events.jsonl")
    if os.path.exists(path):
        events = [json.loads(line) for line in open(path) if line.strip()]
    last = next((e for e in reversed(events) if e["event"] in ("summary", "stop")), None)
    outcome, why = classify(code if code is not None else 0, err, last, bytes_of(c["vram_budget"]), timed_out)
    epochs = [e for e in events if e["event"] == "epoch"]
    plans = [e for e in events if e["event"] == "memory_plan" and e.get("predicted_peak_bytes")]
    final_plan = (last or {}).get("memory_plan") or {}
    return dict(c, outcome=outcome,
                predicted_peak_gb=final_plan.get("predicted_peak_gb") or (
                    plans[-1]["predicted_peak_bytes"] / 1e9 if plans else None),
                first_predicted_peak_gb=first_prediction(events),
                plan_measured_peak_gb=final_plan.get("measured_peak_gb"),
                dropped_samples=(last or {}).get("dropped_samples"),
                method_run=plans[-1].get("method") if plans else None, why=why[:300], exit=code, wall_s=round(time.time() - t, 1),
                plan_trail=plan_trail(events),
                oom_events=sum(1 for e in events if e["event"] == "oom"),
                peak_vram_gb=(last or {}).get("peak_vram_gb"), steps=(last or {}).get("steps"),
                images_per_s=epochs[-1].get("images_per_s") if epochs else None,
                command=" ".join(shown + argv[len(front):]))


# The levers of a memory_plan event: two events with equal levers (and no model change between them) are one plan.
LEVERS = ("micro_batch", "accumulation", "recompute", "fp8_saved", "data_placement", "update_in_backward")
# Reasons that change the model a plan is priced on, its levers kept or not: a new prediction, made before its steps.
NEW_MODEL = ("start", "oom", "oom_fp8_off", "optimizer_state", "precision")


def first_prediction(events):
    """The final plan's prediction as first made, before any of its own steps corrected it (GB; None without a plan):
    the first event of the last run of memory_plan events with the same levers, a new model starting a new run."""
    first = None
    last_levers = None
    for e in events:
        if e["event"] != "memory_plan" or not e.get("predicted_peak_bytes"):
            continue
        levers = tuple(json.dumps(e.get(k), sort_keys=True) for k in LEVERS)
        if levers != last_levers or e.get("reason") in NEW_MODEL:
            first = e["predicted_peak_bytes"] / 1e9
        last_levers = levers
    return first


def plan_trail(events):
    """The memory plans of a run in order, one short string each: the step it came after, its reason, micro-batch ×
    accumulation, units recomputed, predicted and (where read) its own steps' peak in MB, the activation scale and the
    fixed bytes in MB (which of the two a calibration moved); and each `oom` event (the story behind a final
    prediction that misses its steps' peak)."""
    trail, step = [], 0
    for e in events:
        step = e.get("step", step)
        if e["event"] == "oom":
            trail.append(f"@{step} oom")
        elif e["event"] == "memory_plan" and e.get("predicted_peak_bytes"):
            mb = lambda k: f"{e[k] / 1e6:.0f}" if isinstance(e.get(k), (int, float)) else "-"
            recompute = e.get("recompute") or []
            fixed = (e.get("consumers") or {}).get("fixed")
            scale = e.get("activation_scale")
            trail.append(f"@{step} {e.get('reason', '?')} {e.get('micro_batch', '?')}x{e.get('accumulation', '?')} "
                         f"r{len(recompute) if isinstance(recompute, list) else recompute} "
                         f"p{mb('predicted_peak_bytes')} m{mb('plan_measured_peak_bytes')}"
                         + (f" s{scale:.3f}" if isinstance(scale, (int, float)) else "")
                         + (f" f{fixed / 1e6:.0f}" if isinstance(fixed, (int, float)) else ""))
        elif e["event"] == "optim_plan":
            trail.append(f"@{step} optim_plan {e.get('state_bytes', 0) / 1e6:.0f}MB")
    return trail


def prediction_error(r, measured="plan_measured_peak_gb", predicted="predicted_peak_gb"):
    """|predicted − measured| / measured of a budgeted run that trained, or None (no budget, no training, or a peak
    missing). measured: the key of the peak measured: the final plan's own steps' (default) or the run's
    (peak_vram_gb). predicted: the final plan's prediction as it ended (default: corrected by its own steps where they
    were off) or as first made (first_predicted_peak_gb)."""
    if not (r.get("vram_budget") and r["outcome"] in ("ok", "over_budget", "samples_dropped")
            and r.get(predicted) and r.get(measured)):
        return None
    return abs(r[predicted] - r[measured]) / r[measured]


def peak_prediction(rows, measured="plan_measured_peak_gb", predicted="predicted_peak_gb"):
    """How close the final memory plan's predicted peak came to a measured one (prediction_error), over the runs
    that have both: {runs, within_5pct, median_abs_error}."""
    errors = sorted(e for e in (prediction_error(r, measured, predicted) for r in rows) if e is not None)
    return {"runs": len(errors), "within_5pct": sum(e <= 0.05 for e in errors),
            "median_abs_error": errors[len(errors) // 2] if errors else None}


def shard_of(grid, shard, models="", only=""):
    """Shard "I/N"'s combinations: those whose index is I modulo N (of `models` alone when given); with `only`
    (indices, comma-separated), those combinations dealt out among the N shards in turn."""
    i, n = (int(x) for x in shard.split("/"))
    if only:
        wanted = {int(k) for k in only.split(",")}
        return [c for c in grid if c["index"] in wanted][i::n]
    return [c for c in grid if c["index"] % n == i and not (models and c["model"] not in models.split(","))]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--count", type=int, default=150)
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--bin", default="triaccel")
    ap.add_argument("--data-cifar", default="")
    ap.add_argument("--data-text", default="")
    ap.add_argument("--work", default="/tmp/budget_grid")
    ap.add_argument("--shard", default="0/1")
    ap.add_argument("--max-steps", type=int, default=60)
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--precisions", default=",".join(PRECISIONS),
                    help="the precision axis, comma-separated (e.g. fp32,amp-bf16,amp-fp16,amp-fp8)")
    ap.add_argument("--models", default="", help="only these models' combinations (comma-separated; a quick check)")
    ap.add_argument("--only", default="",
                    help="only these combinations' indices (comma-separated; a re-run of some rows), shared out "
                         "among the shards in turn")
    ap.add_argument("--device", default="", help="cpu: a smoke test of the runner (budgets and graphs are no-ops)")
    ap.add_argument("--python", default=sys.executable,
                    help="the interpreter that imports triaccel, for the models defined in Python")
    ap.add_argument("--no-python-models", action="store_true",
                    help="list the combinations of the models defined in Python as not run (no module here)")
    ap.add_argument("--json", help="the shard's result, rewritten after every run (a call cut short keeps its runs)")
    ap.add_argument("--deadline-s", type=float, default=0,
                    help="start no run after this many seconds (a device call's limit); the rest are listed as not run")
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="print the table of these shards' JSON files together (runs nothing)")
    ap.add_argument("--rows", action="store_true", help="with --merge: every run as a row of a markdown table too")
    a = ap.parse_args()
    if a.merge:
        shards = [json.load(open(f)) for f in a.merge]
        rows = sorted((r for s in shards for r in s["rows"]), key=lambda r: r.get("index", 0))
        not_run = [i for s in shards for i in s["not_run"]]
        if a.rows:
            rows_print(rows)
        return report(rows, not_run, f"{len(shards)} shards ({', '.join(s['shard'] for s in shards)})")
    grid = combos(a.seed, a.count, a.gpus, a.precisions.split(","))
    if a.list:
        for c in grid:
            print(json.dumps(c))
        return 0
    mine = shard_of(grid, a.shard, a.models, a.only)
    rows, not_run = [], [c["index"] for c in mine]
    start = time.monotonic()
    for c in mine:
        if (a.deadline_s and time.monotonic() - start > a.deadline_s) or \
                (a.no_python_models and MODELS[c["model"]].get("python")):
            continue
        rows.append(run_one(c, a, a.timeout))
        not_run.remove(c["index"])
        r = rows[-1]
        print(f"{r['index']:4d} {r['outcome']:14s} {r['wall_s']:6.1f}s {r['command'].partition(' train ')[2][:150]}  "
              f"{r['why'][:120]}", flush=True)
        if a.json:
            shard_write(a, rows, not_run)
    if a.json:
        shard_write(a, rows, not_run)
    return report(rows, not_run, f"shard {a.shard}")


def shard_write(a, rows, not_run):
    result = {"bench": "budget_grid", "seed": a.seed, "count": a.count, "shard": a.shard, "max_steps": a.max_steps,
              "counts": outcome_counts(rows), "peak_prediction": peak_prediction(rows),
              "peak_prediction_run_peak": peak_prediction(rows, "peak_vram_gb"),
              "peak_prediction_first": peak_prediction(rows, predicted="first_predicted_peak_gb"),
              "not_run": not_run, "rows": rows}
    with open(a.json + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(a.json + ".tmp", a.json)


def rows_print(rows):
    """Every run as a markdown row: the combination, how it ended, its peaks against the plan's prediction."""
    def gb(v):
        return f"{v:.3f}" if isinstance(v, (int, float)) else ""
    print("| # | model | method | optimizer | precision | budget | data | graphs | outcome | peak GB | predicted | "
          "its steps | oom | why |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        method = r["method"] + (f" → {r['method_run']}" if r["method"] == "auto" and r.get("method_run") else "")
        if r["method"] == "tri-accel" and r.get("controllers", "all") != "all":
            method += f" ({r['controllers']} off)"
        why = r.get("why", "").replace("|", "/")
        print(f"| {r['index']} | {r['model']} | {method} | {r['optimizer']} | {r['precision']} | "
              f"{r.get('vram_budget') or 'none'} | {r['placement']} | {r['cuda_graphs']} | {r['outcome']} | "
              f"{gb(r.get('peak_vram_gb'))} | {gb(r.get('predicted_peak_gb'))} | "
              f"{gb(r.get('plan_measured_peak_gb'))} | {r.get('oom_events', 0)} | {why[:110]} |")


def outcome_counts(rows):
    counts = {}
    for r in rows:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    return counts


def report(rows, not_run, what):
    """Prints the outcome table of `rows` (and how many were not run); returns 1 when any run is a bug."""
    counts = outcome_counts(rows)
    print(f"\n{what}: {len(rows)} runs")
    if not_run:
        print(f"not run (deadline): {len(not_run)} combinations")
    print("\n| outcome | runs |\n|---|---|")
    for k in ("ok", "refused") + BUGS:
        print(f"| {k} | {counts.get(k, 0)} |")
    for key, predicted, what in (("plan_measured_peak_gb", "predicted_peak_gb", "predicted peak"),
                                 ("plan_measured_peak_gb", "first_predicted_peak_gb",
                                  "predicted peak as first made (before its steps)"),
                                 ("peak_vram_gb", "predicted_peak_gb", "predicted peak")):
        p = peak_prediction(rows, key, predicted)
        of = "the final plan's own steps" if key == "plan_measured_peak_gb" else "the run"
        if p["runs"]:
            print(f"\n{what} within 5 % of the peak of {of}: {p['within_5pct']} of {p['runs']} budgeted runs "
                  f"(median |error| {p['median_abs_error']:.1%})")
    for r in rows:
        error = prediction_error(r, predicted="first_predicted_peak_gb")
        if error is not None and error > 0.05:
            print(f"  off by more than 5 %: #{r['index']} {r['model']} {r['method']} {r['optimizer']} {r['precision']} "
                  f"{r['vram_budget']}: predicted {r['first_predicted_peak_gb']:.3f} GB first, "
                  f"{r['predicted_peak_gb']:.3f} in the end, its steps "
                  f"{r['plan_measured_peak_gb']:.3f}, {r.get('oom_events', 0)} oom events")
            if r.get("plan_trail"):
                print(f"    {'; '.join(r['plan_trail'])[:600]}")
    bad = sum(counts.get(k, 0) for k in BUGS)
    return 1 if bad else 0


# The outcomes that are bugs (issue 56's targets).
BUGS = ("over_budget", "samples_dropped", "wrong_floor", "internal_error", "crash", "timeout")


if __name__ == "__main__":
    sys.exit(main())
