#!/usr/bin/env bash
# The C++ package end to end (docs/cpp-package.md): `cmake --install` of a build tree into a fresh prefix, then
# examples/custom_model/ built against that prefix as a separate CMake project (find_package(triaccel CONFIG)),
# and run: it registers its own model and trains it one epoch on Fashion-MNIST on the CPU. Passes when the example
# exits 0 and prints its test accuracy (it exits 1 below MIN_TEST_ACC). The example is compiled without optimization
# (no CMAKE_BUILD_TYPE): compiling it is most of this test's time. A sanitizer build's package exports its
# sanitizer link flags, so this works on make test's ASan build as on a release build.
# Usage: run_package_test.sh BUILD_DIR [MIN_TEST_ACC]
set -euo pipefail
BUILD=$(cd "${1:?usage: run_package_test.sh BUILD_DIR [MIN_TEST_ACC]}" && pwd)
MIN_ACC=${2:-50}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WORK=$BUILD/package_test
PREFIX=$WORK/prefix
rm -rf "$WORK"
mkdir -p "$WORK"
# Like make test's environment, for a run outside it (pip's torch maps CUDA libraries into ASan's shadow gap).
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:protect_shadow_gap=0}

fail() { echo "FAIL package: $*"; exit 1; }

cmake --install "$BUILD" --prefix "$PREFIX" > "$WORK/install.log" ||
  { cat "$WORK/install.log"; fail "cmake --install"; }
for f in include/triaccel/triaccel.h include/triaccel/api/api.h lib/cmake/triaccel/triaccelConfig.cmake \
         lib/cmake/triaccel/triaccelTargets.cmake lib/libtriaccel_api.a lib/libtriaccel_core.a; do
  [ -f "$PREFIX/$f" ] || fail "the install lacks $f"
done

TORCH_DIR=$(python3 -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')/Torch
generator=()
if command -v ninja > /dev/null; then generator=(-G Ninja); fi
cmake -S "$ROOT/examples/custom_model" -B "$WORK/example" "${generator[@]}" -DCMAKE_BUILD_TYPE= \
  -DCMAKE_PREFIX_PATH="$PREFIX" -DTorch_DIR="$TORCH_DIR" > "$WORK/configure.log" 2>&1 ||
  { cat "$WORK/configure.log"; fail "configuring examples/custom_model against the install"; }
cmake --build "$WORK/example" > "$WORK/build.log" 2>&1 ||
  { cat "$WORK/build.log"; fail "building examples/custom_model"; }

set +e
out=$("$WORK/example/custom_model" "$WORK/run" "$MIN_ACC" 2>&1)
rc=$?
set -e
echo "$out"
[ "$rc" -eq 0 ] || fail "custom_model exited $rc"
grep -qE '^custom_model: [0-9]+ steps, test_acc [0-9.]+%, test_loss [0-9.]+$' <<< "$out" ||
  fail "custom_model printed no summary line"
[ -f "$WORK/run/events.jsonl" ] || fail "custom_model wrote no $WORK/run/events.jsonl"
echo "PASS package"
