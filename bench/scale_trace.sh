#!/usr/bin/env bash
# Which trace batches make the memory model's starting activation scale (memory_model.cpp:
# measured_activation_scale, the slope of the whole model's forward + backward peak between two batches) hold at the
# batch a run trains at (issue 56: fp32 ViT-Tiny's first plans ran out of memory at micro-batch 256 under a scale
# traced at batches 2 and 4). For each model in MODELS ("model:precision:batch:micro", micro 0: the whole batch):
# `triaccel plan --json` under each trace pair of PAIRS (TRIACCEL_SCALE_TRACE), then a few eager steps with no
# recompute and the data on the host; the scale those steps imply (the plan's peak is linear in the scale: two plans
# give its intercept and slope) against each traced scale. The models run side by side.
# Usage (device machine, carry [".device"]): bash bench/scale_trace.sh
set -uo pipefail
MODELS=${MODELS:-"vit-tiny:fp32:512:256 vit-tiny:amp-bf16:512:256 resnet18:fp32:96:0 resnet18:amp-bf16:96:0 gpt-char:fp32:64:0 efficientnet-b0:amp-bf16:96:0"}
PAIRS=${PAIRS:-"2,4 8,16 32,64"}
STEPS=${STEPS:-3}
OUTDIR=${OUT:-out}
WORK=/tmp/st_out
rm -rf "$WORK"
mkdir -p "$WORK" "$OUTDIR"
source "$(dirname "$0")/device_env.sh"
device_binaries "$WORK"
cifar10_bin
shakespeare_text
# One model's plans and steps; the models run side by side (each process reads its own allocator's peak).
one_model() {
  local model precision batch micro tag pair
  IFS=: read -r model precision batch micro <<<"$1"
  tag="${model}_${precision}"
  local data=(--dataset cifar10 --data "$DATA")
  [ "$model" = gpt-char ] && data=(--dataset tinyshakespeare --data /tmp/shakespeare)
  local levers=(--recompute none --data-placement host)
  [ "$micro" != 0 ] && levers+=(--micro-batch "$micro")
  local common=(--model "$model" "${data[@]}" --batch-size "$batch" --optimizer adamw --precision "$precision"
                "${levers[@]}")
  for pair in $PAIRS; do
    TRIACCEL_SCALE_TRACE=$pair "$BIN/triaccel" plan "${common[@]}" --json >"$OUTDIR/plan_${tag}_${pair/,/_}.json" \
      2>"$WORK/plan_$tag.err" || tail -2 "$WORK/plan_$tag.err"
  done
  "$BIN/triaccel" train "${common[@]}" --cuda-graphs false --epochs 1 --max-steps "$STEPS" --out "$WORK/run_$tag" \
    --progress lines >"$WORK/run_$tag.log" 2>&1 || tail -2 "$WORK/run_$tag.log"
  cp "$WORK/run_$tag/events.jsonl" "$OUTDIR/events_$tag.jsonl" 2>/dev/null
}
for spec in $MODELS; do one_model "$spec" & done
wait
python3 - "$OUTDIR" "$MODELS" "$PAIRS" <<'EOF'
import json, os, sys
out, models, pairs = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()
print("model              precision  measured MB  implied scale  " + "  ".join(f"scale@{p:6s} pred MB" for p in pairs))
for spec in models:
    model, precision = spec.split(":")[:2]
    tag = f"{model}_{precision}"
    plans = []
    for p in pairs:
        try:
            mp = json.load(open(os.path.join(out, f"plan_{tag}_{p.replace(',', '_')}.json")))["memory_plan"]
            plans.append((mp["activation_scale"], mp["predicted_peak_bytes"]))
        except (OSError, ValueError, KeyError):
            plans.append(None)
    try:
        ev = [json.loads(l) for l in open(os.path.join(out, f"events_{tag}.jsonl")) if l.strip()]
        measured = next(e for e in ev if e["event"] in ("stop", "summary") and "peak_vram_gb" in e)["peak_vram_gb"] * 1e9
    except (OSError, StopIteration, ValueError):
        measured = None
    known = [q for q in plans if q]
    implied = None
    if measured and len(known) >= 2 and known[0][0] != known[-1][0]:
        (s0, p0), (s1, p1) = known[0], known[-1]
        slope = (p1 - p0) / (s1 - s0)
        implied = (measured - (p0 - slope * s0)) / slope
    cells = "  ".join(f"{q[0]:13.3f} {q[1] / 1e6:7.1f}" if q else f"{'-':>13s} {'-':>7s}" for q in plans)
    f = lambda v, fmt: format(v, fmt) if v is not None else "-"
    print(f"{model:18s} {precision:9s} {f(measured and measured / 1e6, '11.1f'):>11s}  {f(implied, '13.3f'):>13s}  {cells}")
EOF
