# Quick start:  make run   (install what is missing, build, train the default job)
#               make test  (same set-up, then all tests)
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
RUN_ARGS ?=

ASAN_BUILD ?= build-asan
FUZZ_BUILD ?= build-fuzz
FUZZ_SECONDS ?= 12
# The unit tests under ASan + UBSan: our code instrumented (LibTorch, pip's build, is not), CPU only, every UBSan
# finding fatal. -fno-sanitize=vptr: the vptr check needs RTTI of LibTorch's classes from the uninstrumented library.
SAN_FLAGS = -O1 -g1 -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all -fno-sanitize=vptr
# detect_leaks=0: LibTorch allocates process-lifetime registries that LeakSanitizer would report at exit.
# protect_shadow_gap=0: pip's torch loads CUDA libraries, which map memory where ASan's shadow gap would be.
ASAN_ENV = ASAN_OPTIONS=detect_leaks=0:protect_shadow_gap=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1

.PHONY: all setup configure build run test test-asan test-fuzz fuzz-long bench-gpu clean

all: build

setup:
	@bash scripts/setup.sh

$(BUILD)/build.ninja:
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

configure: setup $(BUILD)/build.ninja

build: configure
	cmake --build $(BUILD) -j $(JOBS)

# The default job: the small CNN on Fashion-MNIST for one epoch on whatever device exists.
run: build
	$(BUILD)/triaccel train --model small-cnn --dataset fashion-mnist --epochs 1 --out runs/default $(RUN_ARGS)

# All tests: the ctest suite (unit, cli, bad_input, crash_resume, pytorch_interop), the unit tests again under
# ASan/UBSan, and a short fuzz run of every reader (docs/reliability.md).
test: build
	cd $(BUILD) && ctest --output-on-failure
	$(MAKE) test-asan
	$(MAKE) test-fuzz

test-asan: setup
	cmake -S . -B $(ASAN_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Asan -DCMAKE_CXX_FLAGS_ASAN="$(SAN_FLAGS)" \
	  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" -DTRIACCEL_CUDA=OFF -DTRIACCEL_BUILD_BENCH=OFF
	cmake --build $(ASAN_BUILD) -j $(JOBS) --target triaccel_tests
	cd $(ASAN_BUILD) && $(ASAN_ENV) ./triaccel_tests

test-fuzz: setup
	bash tests/reliability/run_fuzz.sh $(FUZZ_SECONDS) $(FUZZ_BUILD)

# The documented long fuzz run (docs/reliability.md): 10 minutes per target.
fuzz-long: setup
	bash tests/reliability/run_fuzz.sh 600 $(FUZZ_BUILD)

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(FUZZ_BUILD)
