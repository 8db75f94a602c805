#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/, clang + ASan + UBSan) and runs each for SECONDS from generated seeds, one
# target at a time (one job). Exit 0 when no target found a crash, leak, sanitizer error or out-of-memory; a finding
# is saved as BUILD/crash-* (the target's name in the file) and printed. Usage: run_fuzz.sh SECONDS [BUILD_DIR]
# [TARGET...]
#   SECONDS: per target (CI: 20; the documented long run: 600). BUILD_DIR: default build-fuzz.
# Limits (docs/reliability.md): inputs up to 64 KiB; libFuzzer's default RSS limit of 2048 MB (fuzz_checkpoint's
# baseline, LibTorch under ASan, is about 560 MB); and -malloc_limit_mb=256: a single allocation over 256 MB made for
# an input of at most 64 KiB is reported as a finding (an allocation sized from a field of the input).
set -euo pipefail
SECONDS_PER=${1:?usage: run_fuzz.sh SECONDS [BUILD_DIR] [TARGET...]}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${2:-$ROOT/build-fuzz}
shift $(( $# >= 2 ? 2 : 1 ))
TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(fuzz_idx fuzz_cifar fuzz_text fuzz_checkpoint)
if [ ! -f "$BUILD/build.ninja" ]; then
  cmake -S "$ROOT/fuzz" -B "$BUILD" -G Ninja -DCMAKE_CXX_COMPILER=clang++ >/dev/null
fi
cmake --build "$BUILD" -j "$(nproc)" --target "${TARGETS[@]}"
# fuzz_checkpoint writes its own seed; make_seeds.py derives the crafted checkpoints from it.
mkdir -p "$BUILD/seeds/checkpoint"
if [[ " ${TARGETS[*]} " == *" fuzz_checkpoint "* ]]; then
  TRIACCEL_FUZZ_WRITE_SEED="$BUILD/seeds/checkpoint/small.pt" "$BUILD/fuzz_checkpoint" >/dev/null 2>&1
fi
python3 "$ROOT/fuzz/make_seeds.py" "$BUILD/seeds"
status=0
for t in "${TARGETS[@]}"; do
  corpus="$BUILD/corpus/$t"
  mkdir -p "$corpus"
  seeds="$BUILD/seeds/${t#fuzz_}"
  log="$BUILD/$t.log"
  # detect_leaks=0 for fuzz_checkpoint only: LibTorch keeps process-lifetime allocations (operator registry).
  leaks=1; [ "$t" = fuzz_checkpoint ] && leaks=0
  if ASAN_OPTIONS="detect_leaks=$leaks:protect_shadow_gap=0" UBSAN_OPTIONS=print_stacktrace=1 \
     "$BUILD/$t" -max_total_time="$SECONDS_PER" -max_len=65536 -timeout=20 -rss_limit_mb=2048 -malloc_limit_mb=256 \
     -artifact_prefix="$BUILD/crash-$t-" "$corpus" "$seeds" >"$log" 2>&1; then
    echo "$t: $(grep -E '^#[0-9]+.*DONE' "$log" | tail -1 | sed 's/  */ /g') (no crash in ${SECONDS_PER} s)"
  else
    status=1
    echo "$t: FAILED (log: $log)"
    grep -E 'ERROR|SUMMARY|runtime error|deadly|uncaught|Test unit written' "$log" | head -20
  fi
done
exit $status
