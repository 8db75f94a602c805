#!/usr/bin/env bash
# The GPU unit suite with the carried test binary (.device/bin/triaccel_tests), and the test mutants: each
# .device/mutants/NAME.xz is triaccel_tests built with one change that a test must catch (the change is described in
# NAME.txt), run with the gtest filter in NAME.filter; a mutant passes this check when its tests FAIL.
# Writes $OUT/gpu_tests.log and $OUT/mutant_NAME.log, and prints a short table last.
# Usage: OUT=$OUT FILTER='*' bash bench/run_gpu_tests.sh   (FILTER: the suite's gtest filter, default every test)
set -uo pipefail
FINAL_OUT=${OUT:-out}
mkdir -p "$FINAL_OUT"
source "$(dirname "$0")/device_env.sh"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "gpu: $GPU x $(nvidia-smi -L | wc -l)"
rows=()
timeout 400 .device/bin/triaccel_tests --gtest_brief=1 --gtest_filter="${FILTER:-*}" >"$FINAL_OUT/gpu_tests.log" 2>&1
rc=$?
summary=$(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$FINAL_OUT/gpu_tests.log" | tr '\n' ' ')
rows+=("suite (${FILTER:-*}): exit $rc; $summary")
for xz in .device/mutants/*.xz; do
  [ -e "$xz" ] || continue
  name=$(basename "$xz" .xz)
  bin=/tmp/mutant_$name
  xz -dc "$xz" >"$bin" && chmod +x "$bin"
  timeout 300 "$bin" --gtest_brief=1 --gtest_filter="$(cat ".device/mutants/$name.filter")" \
    >"$FINAL_OUT/mutant_$name.log" 2>&1
  rc=$?
  verdict="caught"
  [ "$rc" -eq 0 ] && verdict="NOT CAUGHT"
  rows+=("mutant $name ($(cat ".device/mutants/$name.txt")): exit $rc, $verdict; $(grep -E '^\[  FAILED  \] [A-Z]' \
    "$FINAL_OUT/mutant_$name.log" | head -3 | tr '\n' ' ')")
done
printf '%s\n' "${rows[@]}"
