#!/usr/bin/env bash
# A test that depends on time must not depend on the machine's load: runs one unit test N times in a row while two
# CPU hogs run, and counts passes. Not part of `make test` (minutes per run under load); its result for the Tri-Accel
# loop test is in bench/results/cpu/tri_accel_loop_under_load.txt.
# Usage: bash tests/reliability/repeat_under_load.sh build/triaccel_tests [GTEST_FILTER] [N]
set -u
TESTS=$1
FILTER=${2:-TrainerTest.TriAccelLoopRunsAndLogsItsDecisions}
N=${3:-20}
( while :; do :; done ) & H1=$!
( while :; do :; done ) & H2=$!
trap 'kill $H1 $H2 2>/dev/null' EXIT
pass=0; fail=0
for i in $(seq 1 "$N"); do
  log=$(mktemp)
  if "$TESTS" --gtest_filter="$FILTER" >"$log" 2>&1; then pass=$((pass + 1)); else fail=$((fail + 1)); tail -20 "$log"; fi
  echo "run $i: pass=$pass fail=$fail $(grep -o '([0-9]* ms total)' "$log")"
  rm -f "$log"
done
echo "$FILTER: $pass of $N passed with two CPU hogs running"
[ "$fail" -eq 0 ]
