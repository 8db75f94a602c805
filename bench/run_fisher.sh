#!/usr/bin/env bash
# Issue 19's Fisher estimator on one GPU, in one device call: the curvature unit tests on the GPU, bench_curvature's
# whole rounds (ResNet-18 at 32: the Hessian's and the Fisher's, λ per unit side by side, each round's time, and the
# Fisher's one sample per forward/backward (--chunk 1) against its default 4; with
# EFFB0=1 also EfficientNet-B0 at 224, the Fisher's only), then `run_tri_accel.sh fisher` (the 15-epoch protocol:
# Tri-Accel with the Fisher, its curvature lr alone under AMP bf16, AMP bf16; SEEDS, FISHER_EFFB0 pass through).
# Usage: COMMIT=<hash> OUT=dir [SEEDS="0 1 2"] [START_BUDGET_S=330] bash bench/run_fisher.sh
set -uo pipefail
FINAL_OUT=${OUT:-out}
mkdir -p "$FINAL_OUT"
source "$(dirname "$0")/device_env.sh"
device_binaries "$FINAL_OUT" bench_curvature triaccel_tests
"$BIN/triaccel_tests" --gtest_brief=1 --gtest_filter='Curvature*:Hvp*:PowerIteration*' >"$FINAL_OUT/unit_tests_gpu.log" 2>&1
echo "curvature unit tests on the GPU: exit $? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$FINAL_OUT/unit_tests_gpu.log" | tr '\n' ' ')"
"$BIN/bench_curvature" --model resnet18 --precisions "" --estimators hessian,fisher --rounds 4 --iters 20 --tol 0.01 \
  --out "$FINAL_OUT/rounds_r18.json" | tee "$FINAL_OUT/rounds_r18.txt"
"$BIN/bench_curvature" --model resnet18 --precisions "" --estimators fisher --chunk 1 --rounds 3 --iters 20 --tol 0.01 \
  --out "$FINAL_OUT/rounds_r18_fisher_chunk1.json" | tail -12 | tee "$FINAL_OUT/rounds_r18_fisher_chunk1.txt"
if [ -n "${EFFB0:-}" ]; then
  "$BIN/bench_curvature" --model efficientnet-b0 --image-size 224 --precisions "" --estimators fisher --rounds 3 \
    --iters 20 --tol 0.01 --out "$FINAL_OUT/rounds_effb0.json" | tee "$FINAL_OUT/rounds_effb0.txt"
fi
[ -n "${SKIP_RUNS:-}" ] || OUT="$FINAL_OUT" bash "$(dirname "$0")/run_tri_accel.sh" fisher
