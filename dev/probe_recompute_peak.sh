#!/usr/bin/env bash
# Issue 56: where the memory model's first prediction misses a plan's own peak. Each entry of CASES
# ("tag|model|precision|batch|micro|recompute|optimizer") trains a few eager steps with every lever given by hand (no
# choice by the planner) under a budget that binds nothing (BUDGET, 20GB: the budgeted workspaces, the same
# calibration as the grid); its events' first memory_plan (the prediction as first made, the traced starting scale)
# against the plan's own measured peak (the `measured` event), with both plans' consumers. Different recompute sets
# of one model separate the recompute term from the rest. The runs go side by side, JOBS at a time; PROBE_BINS
# ("triaccel_base triaccel"): every case under each binary of .device/bin, tagged with its name (an A/B in one call).
# ONLY ("vit_none,gpt_all"): those cases alone; REPEAT=N: each N times (tags _r1.._rN: the trace's spread between
# processes of one binary).
# Usage (device machine, carry [".device"]): bash dev/probe_recompute_peak.sh; writes $OUT/recompute_peak.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${OUT:-out}
WORK=/tmp/rp_out
rm -rf "$WORK"
mkdir -p "$WORK" "$OUTDIR"
source bench/device_env.sh
device_binaries "$WORK"
cifar10_bin
shakespeare_text
BUDGET=${BUDGET:-20GB}
STEPS=${STEPS:-8}
JOBS=${JOBS:-4}
G6="blocks.0,blocks.1,blocks.2,blocks.3,blocks.4,blocks.5"
V12="blocks.0,blocks.1,blocks.2,blocks.3,blocks.4,blocks.5,blocks.6,blocks.7,blocks.8,blocks.9,blocks.10,blocks.11"
CASES=${CASES:-"gpt_none|gpt-char|fp32|64|64|none|adamw
gpt_all|gpt-char|fp32|64|64|$G6|adamw
gpt_alt|gpt-char|fp32|64|64|blocks.0,blocks.2,blocks.4|adamw
gpt_tail|gpt-char|fp32|64|64|blocks.3,blocks.4,blocks.5|adamw
gpt_allhead|gpt-char|fp32|64|64|$G6,head|adamw
gptb_none|gpt-char|amp-bf16|64|64|none|adamw
gptb_all|gpt-char|amp-bf16|64|64|$G6|adamw
vit_none|vit-tiny|fp32|171|171|none|adamw
vit_all|vit-tiny|fp32|171|171|$V12|adamw
vit_alt|vit-tiny|fp32|171|171|blocks.0,blocks.2,blocks.4,blocks.6,blocks.8,blocks.10|adamw
cnn_none|small-cnn|fp32|128|128|none|sgd
cnnb_none|small-cnn|amp-bf16|128|128|none|sgd
eff_none|efficientnet-b0|amp-bf16|96|96|none|sgd
effh_none|efficientnet-b0|amp-fp16|96|96|none|sgd"}
one() {
  local tag model precision batch micro recompute optimizer data bin=$2
  IFS='|' read -r tag model precision batch micro recompute optimizer <<<"$1"
  [ "$bin" != triaccel ] && tag="${bin}_$tag"
  data=(--dataset cifar10 --data "$DATA")
  [ "$model" = gpt-char ] && data=(--dataset tinyshakespeare --data /tmp/shakespeare)
  timeout 120 "$BIN/$bin" train --model "$model" "${data[@]}" --precision "$precision" --optimizer "$optimizer" \
    --batch-size "$batch" --micro-batch "$micro" --recompute "$recompute" --data-placement host --cuda-graphs false \
    --vram-budget "$BUDGET" --epochs 1 --max-steps "$STEPS" --progress lines --out "$WORK/$tag" >"$WORK/$tag.log" 2>&1 ||
    { echo "$tag: exit $?"; tail -2 "$WORK/$tag.log"; }
}
n=0
REPEAT=${REPEAT:-1}
for bin in ${PROBE_BINS:-triaccel}; do
  while IFS= read -r c; do
    [ -z "$c" ] && continue
    [ -n "${ONLY:-}" ] && [[ ",$ONLY," != *",${c%%|*},"* ]] && continue
    for r in $(seq 1 "$REPEAT"); do
      run_case=$c
      [ "$REPEAT" -gt 1 ] && run_case="${c%%|*}_r$r|${c#*|}"
      one "$run_case" "$bin" &
      n=$((n + 1))
      [ $((n % JOBS)) = 0 ] && wait
    done
  done <<<"$CASES"
done
wait
python3 - "$WORK" "$OUTDIR/recompute_peak.json" <<'EOF'
import glob, json, os, sys
work, dest = sys.argv[1], sys.argv[2]
rows = []
for d in sorted(glob.glob(os.path.join(work, "*/events.jsonl"))):
    tag = os.path.basename(os.path.dirname(d))
    plans = [e for line in open(d) if line.strip() for e in [json.loads(line)]
             if e["event"] == "memory_plan" and e.get("predicted_peak_bytes")]
    if not plans:
        continue
    first = plans[0]
    measured = next((e for e in plans if e.get("plan_measured_peak_bytes")), {})
    keep = ("reason", "micro_batch", "recompute", "predicted_peak_bytes", "plan_measured_peak_bytes",
            "activation_scale", "consumers", "units")
    rows.append({"tag": tag, "first": {k: first.get(k) for k in keep},
                 "measured": {k: measured.get(k) for k in keep}})
json.dump({"probe": "recompute_peak", "rows": rows}, open(dest, "w"), indent=1)
print(f"{'tag':24} {'recomp':>6} {'first MB':>9} {'meas MB':>8} {'err %':>6} {'scale0':>6} {'scale1':>6} "
      f"{'acts0 MB':>8} {'back MB':>7}")
for r in rows:
    f, m = r["first"], r["measured"]
    p, got = f["predicted_peak_bytes"], m.get("plan_measured_peak_bytes")
    acts = sum(u["activation_bytes"] for u in f.get("units") or []) / 1e6
    back = max([u.get("backward_bytes", 0) for u in f.get("units") or []] or [0]) / 1e6
    err = f"{100 * (p - got) / got:+.1f}" if got else "-"
    print(f"{r['tag']:24} {len(f.get('recompute') or []):6} {p / 1e6:9.1f} {(got or 0) / 1e6:8.1f} {err:>6} "
          f"{f.get('activation_scale') or 0:6.3f} {m.get('activation_scale') or 0:6.3f} {acts:8.1f} {back:7.1f}")
EOF
