#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/, clang + ASan + UBSan) and runs each for SECONDS from generated seeds.
# Exit 0 when no target found a crash, leak or sanitizer error; a finding is saved as BUILD/crash-* (the target's
# name in the file) and printed. Usage: run_fuzz.sh SECONDS [BUILD_DIR] [TARGET...]
#   SECONDS: per target (CI: 20; the documented long run: 600). BUILD_DIR: default build-fuzz.
set -euo pipefail
SECONDS_PER=${1:?usage: run_fuzz.sh SECONDS [BUILD_DIR] [TARGET...]}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${2:-$ROOT/build-fuzz}
shift $(( $# >= 2 ? 2 : 1 ))
TARGETS=("$@")
# fuzz_checkpoint is left out by default until its open finding is fixed (docs/reliability.md, Results).
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(fuzz_idx fuzz_cifar)
if [ ! -f "$BUILD/build.ninja" ]; then
  cmake -S "$ROOT/fuzz" -B "$BUILD" -G Ninja -DCMAKE_CXX_COMPILER=clang++ >/dev/null
fi
cmake --build "$BUILD" -j "$(nproc)" --target "${TARGETS[@]}"
python3 "$ROOT/fuzz/make_seeds.py" "$BUILD/seeds"
status=0
for t in "${TARGETS[@]}"; do
  corpus="$BUILD/corpus/$t"
  mkdir -p "$corpus"
  case $t in
    fuzz_idx) seeds="$BUILD/seeds/idx" ;;
    fuzz_cifar) seeds="$BUILD/seeds/cifar" ;;
    fuzz_checkpoint)
      seeds="$BUILD/seeds/checkpoint"
      mkdir -p "$seeds"
      TRIACCEL_FUZZ_WRITE_SEED="$seeds/small.pt" "$BUILD/$t" >/dev/null 2>&1 || true ;;
  esac
  log="$BUILD/$t.log"
  # detect_leaks=0 for fuzz_checkpoint only: LibTorch keeps process-lifetime allocations (operator registry).
  leaks=1; [ "$t" = fuzz_checkpoint ] && leaks=0
  if ASAN_OPTIONS="detect_leaks=$leaks:protect_shadow_gap=0" UBSAN_OPTIONS=print_stacktrace=1 \
     "$BUILD/$t" -max_total_time="$SECONDS_PER" -max_len=65536 -timeout=20 -rss_limit_mb=4096 \
     -artifact_prefix="$BUILD/crash-$t-" "$corpus" "$seeds" >"$log" 2>&1; then
    echo "$t: $(grep -E '^#[0-9]+.*DONE' "$log" | tail -1 | sed 's/  */ /g') (no crash in ${SECONDS_PER} s)"
  else
    status=1
    echo "$t: FAILED (log: $log)"
    grep -E 'ERROR|SUMMARY|runtime error|deadly|uncaught|Test unit written' "$log" | head -20
  fi
done
exit $status
