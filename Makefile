# Quick start:  make run   (install what is missing, build, train the default job)
#               make test  (same set-up, then all tests)
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
RUN_ARGS ?=

ASAN_BUILD ?= build-asan
FUZZ_BUILD ?= build-fuzz
FUZZ_SECONDS ?= 12
# The sanitizer flags of `make test`: our code instrumented (LibTorch, pip's build, is not), CPU only, every UBSan
# finding fatal. -fno-sanitize=vptr: the vptr check needs RTTI of LibTorch's classes from the uninstrumented library.
SAN_FLAGS = -O1 -g1 -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all -fno-sanitize=vptr
# detect_leaks=0: LibTorch allocates process-lifetime registries that LeakSanitizer would report at exit.
# protect_shadow_gap=0: pip's torch loads CUDA libraries, which map memory where ASan's shadow gap would be.
# OMP_WAIT_POLICY=PASSIVE: ctest runs two tests at once, each with LibTorch's OpenMP threads; spinning at its barriers,
# they took turns with the other test's on two cores (two copies of one Tri-Accel test side by side: 132 s, 33 s passive).
ASAN_ENV = ASAN_OPTIONS=detect_leaks=0:protect_shadow_gap=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
  OMP_WAIT_POLICY=PASSIVE

.PHONY: all setup configure build python run test test-unit test-fuzz fuzz-long gpu-binaries clean

all: build

setup:
	@bash scripts/setup.sh

$(BUILD)/build.ninja:
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

configure: setup $(BUILD)/build.ninja

build: configure
	cmake --build $(BUILD) -j $(JOBS)

# The Python module alone (docs/python.md): build/python/triaccel; use it with PYTHONPATH=build/python.
python: configure
	cmake --build $(BUILD) -j $(JOBS) --target python

# The default job: the small CNN on Fashion-MNIST for one epoch on whatever device exists.
run: build
	$(BUILD)/triaccel train --model small-cnn --dataset fashion-mnist --epochs 1 --out runs/default $(RUN_ARGS)

# All tests, on one build with ASan + UBSan (our code instrumented; LibTorch, pip's build, is not; CPU only, every
# UBSan finding fatal): the ctest suite (unit, layers, cli, report_browser, bad_input, crash_resume, signal_stop,
# pytorch_interop), then a short fuzz run of every reader (docs/reliability.md). One build, not a release build
# and a sanitizer build. The sanitizer build is a unity build (ASAN_UNITY): CMake compiles each target's sources in
# batches of ASAN_UNITY_BATCH files, one compiler job a batch, so what every job pays whatever its size (loading the
# 700 MB precompiled LibTorch header, instrumenting and compiling the inline LibTorch code a file uses: ~12 CPU-s) is
# paid once a batch: 37 jobs and 1,780 CPU-s (a fresh clone on 2 idle cores: build 12.6 minutes, make test 25 in
# all), where ~160 jobs, one a file, kept 2 cores busy for 28 minutes (8 files of data/: 41 CPU-s as one batch, 156 one by one). A batch is one translation
# unit: the file-local names (static, anonymous namespace) of one target's sources must differ. A changed file
# rebuilds its batch; `make test ASAN_UNITY=OFF` builds file by file. The release and CUDA builds stay file by file.
# No link-time optimization of the Python module here (pybind11 turns it on unless told): its link took 34-79 s on
# the build's critical path, for a module the tests only import.
ASAN_UNITY ?= ON
ASAN_UNITY_BATCH ?= 8
test: setup
	cmake -S . -B $(ASAN_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Asan -DCMAKE_CXX_FLAGS_ASAN="$(SAN_FLAGS)" \
	  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" -DTRIACCEL_CUDA=OFF -DTRIACCEL_BUILD_BENCH=OFF \
	  -DCMAKE_UNITY_BUILD=$(ASAN_UNITY) -DCMAKE_UNITY_BUILD_BATCH_SIZE=$(ASAN_UNITY_BATCH) \
	  -DCMAKE_INTERPROCEDURAL_OPTIMIZATION=OFF
	cmake --build $(ASAN_BUILD) -j $(JOBS)
	cd $(ASAN_BUILD) && $(ASAN_ENV) ctest --output-on-failure -j $(JOBS)
	$(MAKE) test-fuzz

# The unit tests alone on the release build (quick local checks; GPU tests run where a GPU is).
test-unit: build
	cd $(BUILD) && ./triaccel_tests

test-fuzz: setup
	bash tests/reliability/run_fuzz.sh $(FUZZ_SECONDS) $(FUZZ_BUILD)

# Binaries for the GPU machine, built here with the CUDA kernels (nvcc; no GPU needed): build-cuda/, copied with the
# Debian libraries they link into .device/ (carried to the device: bench/device_env.sh).
# GPU_PYTHON: the interpreter of the GPU machine's Python version (the Python module is built for it, into
# .device/python; empty: this machine's python3).
GPU_PYTHON ?=
gpu-binaries: setup
	cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DTRIACCEL_CUDA=ON \
	  $(if $(GPU_PYTHON),-DTRIACCEL_PYTHON_EXE=$(GPU_PYTHON)) $(CMAKE_FLAGS)
	cmake --build build-cuda -j $(JOBS)
	mkdir -p .device/bin .device/lib
	cp build-cuda/triaccel build-cuda/triaccel_tests build-cuda/bench_curvature .device/bin/
	if [ -d build-cuda/python/triaccel ]; then rm -rf .device/python && cp -r build-cuda/python .device/python; fi
	cp -L $$(ldd build-cuda/triaccel | awk '/libjpeg|libpng/ {print $$3}') .device/lib/

# The documented long fuzz run (docs/reliability.md): 10 minutes per target.
fuzz-long: setup
	bash tests/reliability/run_fuzz.sh 600 $(FUZZ_BUILD)

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(FUZZ_BUILD) build-cuda
