#!/usr/bin/env bash
# Where the host's time goes in two places that a GPU waits on (issue 19: Tri-Accel's first curvature round; issue
# 18: NeuroFlux's one-GPU block steps at 0.5 GB), in one call on one GPU: each run traces a few steps with
# --profile-steps, and bench/trace_summary.py --host lists the host's operators and CUDA calls by their own time.
#   first round: ResNet-18 Tri-Accel (the protocol, seed 0), steps 49:50 (the first round runs after step 50),
#                with $BIN/triaccel and, where it is there, $BIN/triaccel_base (an A/B of two builds); the range
#                triaccel::curvature_round where the build has it, else the whole window.
#   neuroflux:   ResNet-18 NeuroFlux, batch 96, --vram-budget 0.5GB, AMP bf16, steps 100:120 (block 1).
# Usage: OUT=dir bash bench/run_host_profiles.sh [first_round] [neuroflux]   (both by default)
# Results: $OUT/host_profiles.txt (the summaries; a short table printed last) and $OUT/host_profiles.tar.gz (logs
# and events; the traces stay on the machine: tens of MB each).
set -uo pipefail
FINAL_OUT=${OUT:-out}
W=/tmp/host_profiles
rm -rf "$W"
mkdir -p "$W" "$FINAL_OUT"
source "$(dirname "$0")/device_env.sh"
device_binaries "$W"
cifar10_bin
PROTO=$(tri_accel_protocol)
PARTS=${*:-first_round neuroflux}
REPORT=$W/host_profiles.txt
: >"$REPORT"
TABLE=()

trace_of() { ls "$1"/profile*.json 2>/dev/null | head -1; }

for part in $PARTS; do
  case $part in
    first_round)
      for exe in triaccel triaccel_base; do
        [ -x "$BIN/$exe" ] || continue
        run=$W/round_$exe
        "$BIN/$exe" train --model resnet18 --method tri-accel $PROTO --seed 0 --max-steps 60 --profile-steps 49:50 \
          --progress lines --log-every 100000 --out "$run" >"$run.log" 2>&1
        trace=$(trace_of "$run")
        round=$(python3 - "$run/events.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    e = json.loads(line)
    if e.get("event") == "curvature" and e.get("probed"):
        r = e.get("round") or {}
        print(f"{e['probe_s']:.3f} s (capture {r.get('capture_s', 0):.3f} s, {r.get('passes')} passes)")
        break
PY
)
        range=""
        grep -q 'triaccel::curvature_round' "$trace" 2>/dev/null && range=triaccel::curvature_round
        {
          echo "== $exe first round: $round; trace $(basename "$trace") ${range:-whole window}"
          python3 bench/trace_summary.py --host "$trace" $range 2>&1 | head -34
        } >>"$REPORT"
        TABLE+=("first round ($exe): ${round:-none}")
      done
      ;;
    neuroflux)
      run=$W/nf1
      "$BIN/triaccel" train --dataset cifar10 --data "$DATA" --model resnet18 --method neuroflux --batch-size 96 \
        --epochs 1 --vram-budget 0.5GB --precision amp-bf16 --progress lines --log-every 100000 \
        --profile-steps 100:120 --out "$run" >"$run.log" 2>&1
      trace=$(trace_of "$run")
      {
        echo "== NeuroFlux one GPU, 0.5 GB, steps 100:120"
        python3 bench/trace_summary.py "$trace" 2>&1
        python3 bench/trace_summary.py --host "$trace" triaccel::step 2>&1 | head -34
        echo "-- all 20 steps"
        python3 bench/trace_summary.py --host "$trace" 2>&1 | head -34
      } >>"$REPORT"
      TABLE+=("neuroflux block step: $(python3 bench/trace_summary.py "$trace" 2>/dev/null | python3 -c '
import json, sys
r = json.loads(sys.stdin.readline())
print("span %.2f ms, GPU busy %.2f ms, host step %.2f ms" % (r.get("span_ms", 0), r.get("busy_ms", 0),
                                                             r.get("host_step_ms", 0)))')")
      ;;
    *) echo "unknown part $part (first_round|neuroflux)"; exit 2 ;;
  esac
done
cp "$REPORT" "$FINAL_OUT/"
tar -czf "$FINAL_OUT/host_profiles.tar.gz" --exclude="*.pt" --exclude="profile*.json" -C "$W" . 2>/dev/null
echo "--- host profiles ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1))"
printf '%s\n' "${TABLE[@]}"
