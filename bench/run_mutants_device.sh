#!/usr/bin/env bash
# Test mutants built on the GPU machine (docs/measuring.md: a test must fail against a broken implementation):
# triaccel_tests is built here (build-gpu) and run on CLEAN_FILTER (default: the mutants' filters; must pass), then
# for each bench/mutants/NAME.json ({"what", "file", "old", "new", "filter"}: one exact replacement in one source
# file) the file is changed, the tests rebuilt (one object and the link) and run with its filter (must FAIL), and the
# file is restored (the build is left with the last mutant). Writes $OUT/clean.log and $OUT/mutant_NAME.log; prints a
# short table last.
# Device call: carry [".device"], `MUTANTS="bn_masked_walk_skips_rows" bash bench/run_mutants_device.sh`
# (MUTANTS: names under bench/mutants, default all).
set -uo pipefail
FINAL_OUT=${OUT:-out}
WORK=/tmp/mutants_work
mkdir -p "$FINAL_OUT" "$WORK"
source "$(dirname "$0")/device_env.sh"
echo "gpu: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
names=${MUTANTS:-$(ls bench/mutants/*.json | xargs -n1 basename | sed 's/\.json$//')}
field() { python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$1" "$2"; }
# A warm machine keeps build-gpu between calls, and a mutated file comes back from the checkout with its own time,
# which may be older than the last call's mutant object: touched, its object is rebuilt from the clean source.
for name in $names; do touch "$(field "bench/mutants/$name.json" file)"; done
t0=$SECONDS
device_cmake_build . build-gpu "$WORK" "-DTRIACCEL_BUILD_BENCH=OFF" triaccel_tests || exit 1
echo "built in $((SECONDS - t0)) s"
# mutate SPEC apply|restore: the exact replacement, or the file back as it was.
mutate() {
  python3 - "$1" "$2" <<'PY'
import json, shutil, sys
spec, how = json.load(open(sys.argv[1])), sys.argv[2]
path, saved = spec["file"], "/tmp/mutants_work/" + spec["file"].replace("/", "_") + ".orig"
if how == "restore":
    shutil.copyfile(saved, path)
    sys.exit(0)
text = open(path).read()
if text.count(spec["old"]) != 1:
    sys.exit(f"{sys.argv[1]}: the text to replace is not in {path} exactly once")
shutil.copyfile(path, saved)
open(path, "w").write(text.replace(spec["old"], spec["new"]))
PY
}
filters=$(for name in $names; do field "bench/mutants/$name.json" filter; done | paste -sd:)
TRIACCEL_SOURCE_DIR=$(pwd) timeout 300 build-gpu/triaccel_tests --gtest_brief=1 \
  --gtest_filter="${CLEAN_FILTER:-$filters}" >"$FINAL_OUT/clean.log" 2>&1
clean="exit $?: $(grep -E '^\[  (PASSED|FAILED) ' "$FINAL_OUT/clean.log" | tr '\n' ' ')"
rows=()
for name in $names; do
  spec=bench/mutants/$name.json
  filter=$(field "$spec" filter)
  mutate "$spec" apply || { rows+=("$name: could not apply"); continue; }
  if cmake --build build-gpu -j "$(nproc)" --target triaccel_tests >"$WORK/build_$name.log" 2>&1; then
    TRIACCEL_SOURCE_DIR=$(pwd) timeout 300 build-gpu/triaccel_tests --gtest_brief=1 --gtest_filter="$filter" \
      >"$FINAL_OUT/mutant_$name.log" 2>&1
    rc=$?
    verdict=$([ "$rc" -ne 0 ] && echo caught || echo "NOT CAUGHT")
    failed=$(grep -E '^\[  FAILED  \] [A-Z]' "$FINAL_OUT/mutant_$name.log" | head -3 | awk '{print $4}' | tr '\n' ' ')
  else
    rc=build; verdict="mutant did not build"; failed=$(grep -E "error" "$WORK/build_$name.log" | head -3)
  fi
  mutate "$spec" restore
  rows+=("$name | $filter | exit $rc, $verdict | $failed")
done
echo
echo "clean build on ${CLEAN_FILTER:-$filters} (must pass): $clean"
echo "| mutant | filter | mutant run (must fail) | failed tests |"
echo "|---|---|---|---|"
for r in "${rows[@]}"; do echo "| $r |"; done
