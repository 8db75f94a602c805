#!/usr/bin/env bash
# The curvature probe's cost on a GPU (issue 19), in one device call: bench_curvature per unit and probe precision
# (ResNet-18 at 32, EfficientNet-B0 at 224, b_curv = 32), then Nsight Compute's kernel times of layer4.1's products
# (eager, so each kernel is seen) in fp32 and bf16, summed per kernel name (bench/ncu_summary.py).
# Usage: OUT=dir bash bench/run_curvature.sh   (carried binaries: make gpu-binaries, carry .device)
set -uo pipefail
FINAL_OUT=${OUT:-out}
mkdir -p "$FINAL_OUT"
source "$(dirname "$0")/device_env.sh"
echo "gpu: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
device_binaries "$FINAL_OUT" bench_curvature
B=$BIN/bench_curvature
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
