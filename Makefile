# Quick start:  make run   (install what is missing, build, train the default job)
#               make test  (same set-up, then all tests)
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
RUN_ARGS ?=

.PHONY: all setup configure build run test bench-gpu clean

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

test: build
	cd $(BUILD) && ctest --output-on-failure

clean:
	rm -rf $(BUILD)
