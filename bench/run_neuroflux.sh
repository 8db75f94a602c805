#!/usr/bin/env bash
# NeuroFlux vs backprop under GPU-memory budgets, side by side in one call on the device machine (docs/neuroflux.md).
# For every model × budget: NeuroFlux runs first (its `plan` event predicts the largest batch backprop fits under the
# same budget, from the measured memory profile); backprop then runs at the largest batch, from that prediction down,
# whose 40-step trial under the budget had no out-of-memory retry — same epochs, same budget.
# Writes $OUT/neuroflux_budgets.json ({"bench","gpu","command","commit","rows"}; copy it to bench/results/<gpu>/),
# $OUT/neuroflux_events.tgz (every run's events and the batch searches), and prints a table last.
# Usage: bash bench/run_neuroflux.sh       env: MODELS ("resnet18 small-cnn"), BUDGETS ("0.5GB 1GB"), PAIRS (model:budget
#        pairs, e.g. "resnet18:0.5GB efficientnet-b0:0.4GB", run in that order instead of MODELS × BUDGETS), EPOCHS (2),
#        NF_EXIT_TOL (5: accuracy points the exported exit may lose against NeuroFlux's full network),
#        DEADLINE (420 s: no new pair after it), COMMIT (the device copy has no .git),
#        EXTRA (flags given to both methods' runs, e.g. "--cudnn-autotune on")
set -uo pipefail
MODELS=${MODELS:-resnet18 small-cnn}
BUDGETS=${BUDGETS:-0.5GB 1GB}
EPOCHS=${EPOCHS:-2}
NF_EXIT_TOL=${NF_EXIT_TOL:-5}
FINAL_OUT=${OUT:-out}
mkdir -p "$FINAL_OUT/runs"
source "$(dirname "$0")/device_env.sh"  # LD_LIBRARY_PATH for the carried binaries
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "gpu: $GPU"

device_binaries "$FINAL_OUT"
cifar10_bin

COMMON=(--dataset cifar10 --data "$DATA" --epochs "$EPOCHS" --precision amp-bf16 --progress lines --log-every 100000 ${EXTRA:-})
START=$SECONDS
DEADLINE=${DEADLINE:-420}   # seconds: no new pair starts after this (the device call is limited to ~8 min)
if [ -z "${PAIRS:-}" ]; then
  PAIRS=$(for m in $MODELS; do for b in $BUDGETS; do printf '%s:%s ' "$m" "$b"; done; done)
fi
for pair in $PAIRS; do
  model=${pair%%:*}
  budget=${pair#*:}
  tag="${model}_${budget}"
  if [ $((SECONDS - START)) -gt "$DEADLINE" ]; then echo "skipping $tag: past ${DEADLINE}s"; continue; fi
  nf="$FINAL_OUT/runs/${tag}_neuroflux"
  bp="$FINAL_OUT/runs/${tag}_backprop"
  echo "== $tag neuroflux"
  "$BIN/triaccel" train --method neuroflux --model "$model" --vram-budget "$budget" --nf-exit-tolerance "$NF_EXIT_TOL" \
    "${COMMON[@]}" --out "$nf" 2>&1 | grep -E "^(block|done|triaccel)" | tail -20
  batch=$(python3 -c "import json,sys; ev=[json.loads(l) for l in open(sys.argv[1])]; print([e for e in ev if e['event'] in ('block_plan', 'plan')][0]['backprop_max_batch'])" "$nf/events.jsonl" 2>/dev/null)
  if [ -z "$batch" ] || [ "$batch" -lt 2 ]; then echo "no backprop batch fits $budget for $model"; continue; fi
  # The profile's backprop batch is a prediction (it misses cuDNN workspaces, the loss, fragmentation): backprop
  # runs at the largest batch, from it down by 20 % steps, whose 40-step trial under the budget had no
  # out-of-memory retry, so it is not measured at a batch its own out-of-memory handling shrinks mid-epoch.
  : > "$FINAL_OUT/runs/${tag}_search.txt"
  while :; do
    trial="$FINAL_OUT/runs/${tag}_trial"
    rm -rf "$trial"
    "$BIN/triaccel" train --method backprop --model "$model" --vram-budget "$budget" --batch-size "$batch" \
      "${COMMON[@]}" --max-steps 40 --out "$trial" >/dev/null 2>&1
    ooms=$(grep -c '"event":"oom"' "$trial/events.jsonl" 2>/dev/null)
    echo "$batch ${ooms:-fail}" >> "$FINAL_OUT/runs/${tag}_search.txt"
    [ "${ooms:-1}" = 0 ] && break
    next=$(( batch * 4 / 5 / 8 * 8 ))
    if [ "$next" -lt 8 ]; then batch=0; break; fi
    batch=$next
  done
  rm -rf "$FINAL_OUT/runs/${tag}_trial"
  echo "backprop batch search (batch, oom events in 40 steps): $(tr '\n' ' ' < "$FINAL_OUT/runs/${tag}_search.txt")"
  if [ "$batch" -lt 8 ]; then echo "no backprop batch runs under $budget for $model"; continue; fi
  echo "== $tag backprop at batch $batch"
  # lr follows the batch by the sqrt rule from the default 0.1 at 128 (the same rule NeuroFlux's blocks use)
  lr=$(python3 -c "print(0.1 * ($batch / 128) ** 0.5)")
  "$BIN/triaccel" train --method backprop --model "$model" --vram-budget "$budget" --batch-size "$batch" --lr "$lr" \
    "${COMMON[@]}" --out "$bp" 2>&1 | grep -E "^(epoch|done|triaccel)" | tail -5
done

python3 - "$FINAL_OUT" "$GPU" "${COMMIT:-unknown}" "$PAIRS" "$EPOCHS" "$NF_EXIT_TOL" "${EXTRA:-}" <<'PY'
import json, os, sys
out, gpu, commit, pairs, epochs, tol, extra = sys.argv[1:8]
def events(path):
    p = os.path.join(path, "events.jsonl")
    return [json.loads(l) for l in open(p)] if os.path.exists(p) else []
def parse_gb(b):
    return float(b[:-2]) * (1.0 if b.endswith("GB") else 1.073741824)
rows = []
for pair in pairs.split():
    model, budget = pair.split(":", 1)
    tag = f"{model}_{budget}"
    nf, bp = events(f"{out}/runs/{tag}_neuroflux"), events(f"{out}/runs/{tag}_backprop")
    row = {"model": model, "budget": budget, "epochs": int(epochs)}
    if nf and nf[-1]["event"] == "summary":
        s = nf[-1]; ex = [e for e in nf if e["event"] == "exit"][0]["chosen"]
        row["neuroflux"] = {k: s[k] for k in ("test_acc", "train_s", "epoch_s", "peak_vram_gb", "blocks", "block_batches",
                                             "params", "exit_unit", "exit_params", "exit_test_acc", "exit_images_per_s")}
        row["neuroflux"]["full_images_per_s"] = ex["full_images_per_s"]
        row["neuroflux"]["exit_params_ratio"] = ex["params_ratio"]
    if bp and bp[-1]["event"] == "summary":
        s = bp[-1]
        train_s = sum(e["epoch_s"] for e in bp if e["event"] == "epoch")
        ep = [e for e in bp if e["event"] == "epoch"]
        row["backprop"] = {"batch": s["batch_size"], "test_acc": s["test_acc"], "train_s": train_s,
                           "epoch_s": s["epoch_s"], "peak_vram_gb": s["peak_vram_gb"], "params": s["params"],
                           "oom_events": sum(1 for e in bp if e["event"] == "oom"),
                           "cuda_graph": ep[-1].get("cuda_graph"), "graph_capture_ooms": ep[-1].get("graph_capture_ooms"),
                           "final_batch": ep[-1].get("batch")}
        search = f"{out}/runs/{tag}_search.txt"
        if os.path.exists(search):
            row["backprop"]["batch_search"] = [[int(a) for a in l.split()] for l in open(search) if l.split()[1:] and l.split()[1].isdigit()]
    if nf and nf[-1]["event"] == "summary":
        row["neuroflux"]["cache_s"] = sum(e["cache_s"] for e in nf if e["event"] == "block")
        row["neuroflux"]["block_train_s"] = sum(e["train_s"] for e in nf if e["event"] == "block")
        row["neuroflux"]["alloc_retries"] = sum(e.get("alloc_retries", 0) for e in nf if e["event"] == "block")
    if "neuroflux" in row and "backprop" in row:
        b = parse_gb(budget)
        row["speedup"] = row["backprop"]["train_s"] / max(row["neuroflux"]["train_s"], 1e-9)
        row["both_within_budget"] = row["backprop"]["peak_vram_gb"] <= b and row["neuroflux"]["peak_vram_gb"] <= b
    rows.append(row)
doc = {"bench": "neuroflux_budgets", "gpu": gpu, "commit": commit,
       "command": f"PAIRS='{pairs.strip()}' EPOCHS={epochs} NF_EXIT_TOL={tol} EXTRA='{extra}' bash bench/run_neuroflux.sh",
       "rows": rows}
json.dump(doc, open(f"{out}/neuroflux_budgets.json", "w"), indent=2)
print(f"{'model':15s} {'budget':6s} {'bp batch':>8s} {'bp acc':>7s} {'bp s':>7s} {'bp GB':>6s} {'nf acc':>7s} {'nf s':>7s} {'nf GB':>6s} {'speedup':>7s} {'exit':>9s} {'exit acc':>8s} {'x fewer':>7s}")
for r in rows:
    b, n = r.get("backprop", {}), r.get("neuroflux", {})
    f = lambda d, k, fmt: (fmt % d[k]) if k in d else "-"
    print(f"{r['model']:15s} {r['budget']:6s} {f(b,'batch','%8d')} {f(b,'test_acc','%7.2f')} {f(b,'train_s','%7.1f')} {f(b,'peak_vram_gb','%6.3f')} "
          f"{f(n,'test_acc','%7.2f')} {f(n,'train_s','%7.1f')} {f(n,'peak_vram_gb','%6.3f')} {f(r,'speedup','%7.2f')} "
          f"{n.get('exit_unit','-'):>9s} {f(n,'exit_test_acc','%8.2f')} {f(n,'exit_params_ratio','%7.1f')}")
PY
# The runs' events and backprop batch searches in one archive (model files stay behind: the device returns 8 files).
(cd "$FINAL_OUT" && tar czf neuroflux_events.tgz runs/*/events.jsonl runs/*_search.txt 2>/dev/null && rm -rf runs)
