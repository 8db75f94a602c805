# Sourced by the bench/run_*.sh GPU jobs: the library path under which binaries built on the CPU machine (and carried
# in .device/bin) find the device machine's LibTorch and its CUDA libraries, and the Debian libjpeg and libpng they
# link (carried in .device/lib: `make gpu-binaries` copies them; the device machine has other sonames).
TORCH_LIB=$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
SITE=$(dirname "$(dirname "$TORCH_LIB")")
NV_LIBS=$(ls -d "$SITE"/nvidia/*/lib "$SITE"/nvidia/cu13/lib 2>/dev/null | tr '\n' ':')
export LD_LIBRARY_PATH="$TORCH_LIB:$NV_LIBS/usr/local/cuda/lib64:$(pwd)/.device/lib:${LD_LIBRARY_PATH:-}"

# Binaries carried compressed (.device/bin/NAME.xz: the carry holds 64 MiB with the tracked files) are unpacked once.
for packed in .device/bin/*.xz; do
  [ -e "$packed" ] && { [ ! -x "${packed%.xz}" ] || [ "$packed" -nt "${packed%.xz}" ]; } && python3 -c 'import lzma, os, sys
src = sys.argv[1]
with lzma.open(src) as f, open(src[:-3], "wb") as out:
    out.write(f.read())
os.chmod(src[:-3], 0o755)' "$packed"
done

# The binaries to run: BIN=.device/bin when the carried ones run here and include every file named (e.g.
# bench_optim_step), else a fresh build in build-gpu (several minutes; logs in LOGDIR). Exits on a failed build.
# device_cmake_build SRC DIR LOGDIR "CMAKE_FLAGS" TARGET...: a Release build of the checkout at SRC into DIR for this
# GPU (sm_90) with this machine's torch and the Debian build dependencies carried in .device/deps
# (scripts/pack_build_deps.sh); logs LOGDIR/cmake.log and build.log (prefixed by DIR's name). Returns 1 on a failure.
device_cmake_build() {
  local src=$1 dir=$2 logdir=$3 flags=$4 prefix log
  shift 4
  log="$logdir/$(basename "$dir")"
  prefix=$(python3 -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
  [ -d .device/deps ] && export CMAKE_PREFIX_PATH=$(pwd)/.device/deps LD_LIBRARY_PATH=$(pwd)/.device/deps/lib:$LD_LIBRARY_PATH
  # shellcheck disable=SC2086  # flags is a list
  cmake -S "$src" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
    -DTRIACCEL_CUDA_ARCHITECTURES=90 -DTRIACCEL_PYTHON=OFF $flags >"$log.cmake.log" 2>&1 ||
    { tail -30 "$log.cmake.log"; return 1; }
  cmake --build "$dir" -j "$(nproc)" --target "$@" >"$log.build.log" 2>&1 ||
    { grep -E "error|FAILED" "$log.build.log" | head -30; return 1; }
}

# The binaries to run: BIN=.device/bin when the carried ones run here and include every file named (e.g.
# bench_optim_step), else a fresh build in build-gpu (several minutes; logs in LOGDIR). Exits on a failed build.
device_binaries() {
  local logdir=$1 f
  shift
  BIN=.device/bin
  local ok=1
  "$BIN/triaccel" --help >/dev/null 2>&1 || ok=0
  for f in "$@"; do [ -x "$BIN/$f" ] || ok=0; done
  [ "$ok" = 1 ] && return 0
  echo "carried binaries do not run here; building"
  local t0=$SECONDS
  local bench=OFF  # the files named are targets too: only those and the command line are built
  for f in "$@"; do case $f in bench_*) bench=ON ;; esac; done
  device_cmake_build . build-gpu "$logdir" "-DTRIACCEL_BUILD_BENCH=$bench" triaccel_cli "$@" || exit 1
  echo "built in $((SECONDS - t0)) s"
  BIN=build-gpu
  # PACK_BIN=DIR: the binaries compressed into DIR (e.g. $OUT/bin), to carry as .device/bin in later calls.
  if [ -n "${PACK_BIN:-}" ]; then
    mkdir -p "$PACK_BIN"
    for f in triaccel triaccel_tests; do [ -f "$BIN/$f" ] && xz -T0 -6 -c "$BIN/$f" >"$PACK_BIN/$f.xz"; done
    ls -la "$PACK_BIN"
  fi
}

# CIFAR-10 in the binary layout at /tmp/cifar10-bin (from the carried JPEG copy, once per machine); sets DATA.
cifar10_bin() {
  DATA=/tmp/cifar10-bin
  if [ ! -f "$DATA/test_batch.bin" ]; then
    python3 .device/data/build_cifar10_bin.py "$DATA" >/dev/null 2>&1 || { echo "CIFAR conversion failed"; exit 1; }
  fi
}

# TinyShakespeare at /tmp/shakespeare (from the carried copy): a gpt-char run's --data.
shakespeare_text() {
  mkdir -p /tmp/shakespeare && cp .device/data/tinyshakespeare/input.txt /tmp/shakespeare/ 2>/dev/null
}

# The Tri-Accel protocol's flags (docs/tri-accel.md: SGD momentum 0.9 nesterov, wd 5e-4, lr 0.075 at batch 96, label
# smoothing 0.1, 5 warm-up epochs then cosine, 15 epochs in all) on the CIFAR-10 copy; after cifar10_bin.
tri_accel_protocol() {
  echo "--dataset cifar10 --data $DATA --batch-size 96 --lr 0.075 --label-smoothing 0.1 --epochs 15 --warmup-epochs 5"
}
