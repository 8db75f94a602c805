#!/usr/bin/env bash
# What storing a unit's activations instead of recomputing them costs on the GPU, against the memory model's price
# (issue 56: a first step that ran out of memory under a plan priced too low). One model at one batch and micro-batch,
# a few steps of eager training for each recompute set in SETS (space-separated; each "a,b,c" or "none"), data on the
# host; for each set the plan's predicted peak (the `memory_plan` event of the run, the levers given by hand) beside
# the allocator's peak (the summary). Also `triaccel plan --json`'s per-unit prices.
# Usage (device machine, carry [".device"]): MODEL=vit-tiny PRECISION=fp32 BATCH=512 MICRO=256 SETS="..." \
#   bash bench/recompute_price.sh
set -uo pipefail
MODEL=${MODEL:-vit-tiny}
PRECISION=${PRECISION:-fp32}
BATCH=${BATCH:-512}
MICRO=${MICRO:-256}
SETS=${SETS:-none}
STEPS=${STEPS:-3}
OUTDIR=${OUT:-out}
WORK=/tmp/rp_out
rm -rf "$WORK"
mkdir -p "$WORK" "$OUTDIR"
source "$(dirname "$0")/device_env.sh"
device_binaries "$WORK"
cifar10_bin
common=(--model "$MODEL" --dataset cifar10 --data "$DATA" --batch-size "$BATCH" --optimizer adamw
        --precision "$PRECISION")
"$BIN/triaccel" plan "${common[@]}" --micro-batch "$MICRO" --recompute none --json >"$OUTDIR/plan.json" 2>"$WORK/plan.err" ||
  tail -3 "$WORK/plan.err"
k=0
for set in $SETS; do
  k=$((k + 1))
  "$BIN/triaccel" train "${common[@]}" --micro-batch "$MICRO" --recompute "$set" --data-placement host \
    --cuda-graphs false --epochs 1 --max-steps "$STEPS" --out "$WORK/run_$k" --progress lines >"$WORK/run_$k.log" 2>&1 ||
    tail -2 "$WORK/run_$k.log"
  cp "$WORK/run_$k/events.jsonl" "$OUTDIR/events_$k.jsonl" 2>/dev/null
done
python3 - "$OUTDIR" "$SETS" <<'EOF'
import json, os, sys
out, sets = sys.argv[1], sys.argv[2].split()
try:
    plan = json.load(open(os.path.join(out, "plan.json")))
    units = (plan.get("memory_plan") or {}).get("units") or []
    print("unit                 saved B/sample (model, profile %s)" % (plan.get("memory_plan") or {}).get("profile"))
    for u in units:
        print(f"{u['unit']:20s} {u['saved_bytes_per_sample']:12.0f}")
except (OSError, ValueError) as e:
    print("plan:", e)
rows = []
for k, s in enumerate(sets, 1):
    try:
        ev = [json.loads(l) for l in open(os.path.join(out, f"events_{k}.jsonl")) if l.strip()]
    except OSError:
        rows.append((s, None, None, None)); continue
    plans = [e for e in ev if e["event"] == "memory_plan"]
    summ = next((e for e in ev if e["event"] in ("summary", "stop") and "peak_vram_gb" in e), {})
    p = plans[0] if plans else {}
    stored = ",".join(u["unit"].replace("blocks.", "b") for u in p.get("units", []) if not u["recompute"])
    rows.append((stored or s, p.get("predicted_peak_bytes"), p.get("activation_scale"), summ.get("peak_vram_gb")))
print("\nunits stored (the rest recomputed)                predicted MB  scale   measured MB")
for s, pred, scale, peak in rows:
    f = lambda v, m=1: f"{v * m:10.1f}" if isinstance(v, (int, float)) else "         -"
    print(f"{s[:48]:48s} {f(pred, 1e-6)}  {scale if scale is None else round(scale, 3)!s:6s} {f(peak, 1e3)}")
EOF
