#!/usr/bin/env bash
# The curvature probe's cost on a GPU (issue 19), in one device call: bench_curvature per unit and probe precision
# (ResNet-18 at 32, EfficientNet-B0 at 224, b_curv = 32), then Nsight Compute's kernel times of layer4.1's products
# (eager, so each kernel is seen) in fp32 and bf16, summed per kernel name (bench/ncu_summary.py).
# Usage: OUT=dir bash bench/run_curvature.sh [cold|cudnn]   (carried binaries: make gpu-binaries, carry .device)
# cold: where the Fisher's first round goes on EfficientNet-B0 at 224 (issue 19): whole rounds from untouched cuDNN
# (--train-steps 0) with graphs, a second round object after the first (cuDNN set up), eager passes, cuDNN off, one
# chunk per pass; then the first probe of a short Tri-Accel training run with the Fisher (its curvature event).
# cudnn: whole Fisher rounds (a cold one, three warm) with and without cuDNN, ResNet-18 at 32 and EfficientNet-B0 at 224.
set -uo pipefail
STAGE=${1:-all}
FINAL_OUT=${OUT:-out}
mkdir -p "$FINAL_OUT"
source "$(dirname "$0")/device_env.sh"
echo "gpu: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
device_binaries "$FINAL_OUT" bench_curvature
B=$BIN/bench_curvature
if [ "$STAGE" = cudnn ]; then  # whole Fisher rounds with and without cuDNN (--curv-cudnn), ResNet-18 and EfficientNet-B0
  for m in "resnet18 --image-size 32" "efficientnet-b0 --image-size 224"; do
    for c in true false; do
      echo "== ${m%% *}, cuDNN $c"
      "$B" --model $m --precisions '' --estimators fisher --rounds 4 --cudnn-rounds $c \
        --out "$FINAL_OUT/cudnn_${m%% *}_$c.json" 2>&1 | grep -E "^round|rror" | tee "$FINAL_OUT/cudnn_${m%% *}_$c.txt"
    done
  done
  exit 0
fi
if [ "$STAGE" = cold ]; then
  E="--model efficientnet-b0 --image-size 224 --precisions '' --train-steps 0 --rounds 3"
  run_cold() {  # name, extra flags
    local name=$1
    shift
    echo "== $name: bench_curvature $E $*"
    eval "$B" "$E" "$@" --out "$FINAL_OUT/cold_$name.json" 2>&1 | grep -E "^round|rror" | tee "$FINAL_OUT/cold_$name.txt"
  }
  run_cold graphs --estimators fisher
  run_cold twice --estimators fisher,fisher
  run_cold eager --estimators fisher --cuda-graphs false
  run_cold nocudnn --estimators fisher --cudnn-rounds false
  run_cold chunk32 --estimators fisher --chunk 32
  cifar10_bin
  "$BIN/triaccel" train --model efficientnet-b0 --image-size 224 --method tri-accel --curv-estimator fisher \
    $(tri_accel_protocol) --max-steps 120 --progress lines --out /tmp/cold_run >"$FINAL_OUT/cold_run.log" 2>&1
  echo "== training run (exit $?): the first curvature event"
  grep '"curvature"' /tmp/cold_run/events.jsonl | head -1 | python3 -c "
import json, sys
e = json.loads(sys.stdin.read())
print({k: v for k, v in e.items() if not isinstance(v, list)})" | tee "$FINAL_OUT/cold_run_curvature.txt"
  exit 0
fi
"$B" --model resnet18 --precisions fp32,bf16 --top-k 1 --iters 10 --out "$FINAL_OUT/probe_r18.json" \
  | tee "$FINAL_OUT/probe_r18.txt"
"$B" --model efficientnet-b0 --image-size 224 --precisions fp32,bf16 --top-k 1 --iters 4 \
  --out "$FINAL_OUT/probe_effb0.json" | tee "$FINAL_OUT/probe_effb0.txt"
if command -v ncu >/dev/null; then
  for p in fp32 bf16; do
    timeout 240 ncu --csv --page raw --metrics gpu__time_duration.sum \
      "$B" --model resnet18 --units layer4.1 --precisions $p --iters 3 --cuda-graphs false --train-steps 0 \
      >"$FINAL_OUT/ncu_layer4.1_$p.csv" 2>"$FINAL_OUT/ncu_layer4.1_$p.log"
    echo "== ncu layer4.1 $p (exit $?)"
    python3 "$(dirname "$0")/ncu_summary.py" "$FINAL_OUT/ncu_layer4.1_$p.csv" | tee "$FINAL_OUT/ncu_layer4.1_$p.txt"
  done
fi
