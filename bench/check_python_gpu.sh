#!/usr/bin/env bash
# The Python module as a user on the GPU machine builds it (issue 54): from this checkout, with that machine's own
# python3, compiler, torch and pybind11, through `pip install . --no-build-isolation` (scikit-build-core), the Debian
# build dependencies it lacks carried in .device/deps (scripts/pack_build_deps.sh). Then: a plan and a one-epoch run
# from Python on the CPU and the GPU (dev/python_crash_probe.py; on a crash, cuda-gdb's backtrace) and
# tests/python/test_module.py. Prints a table last. Device call: carry [".device"], `bash bench/check_python_gpu.sh`.
# MODE=cmake builds with cmake directly (the same flags) instead of pip.
set -uo pipefail
FINAL_OUT=${OUT:-out}
mkdir -p "$FINAL_OUT"
DEPS=$(pwd)/.device/deps
export CMAKE_PREFIX_PATH=$DEPS LD_LIBRARY_PATH=$DEPS/lib:${LD_LIBRARY_PATH:-}
SITE=/tmp/triaccel_site
rows=()
row() { rows+=("$1|$2"); echo "== $1: $2"; }

echo "python $(python3 -V 2>&1), torch $(python3 -c 'import torch; print(torch.__version__)'), $(g++ --version | head -1),"\
  "pybind11 $(python3 -c 'import pybind11; print(pybind11.__version__)' 2>&1), cmake $(cmake --version | head -1)"
t0=$(date +%s)
if [ -f "$SITE/triaccel/__init__.py" ] && [ -n "${REUSE_BUILD:-}" ]; then
  cp python/triaccel/*.py "$SITE/triaccel/"  # a warm machine's build of the same C++ (the Python half refreshed)
elif [ "${MODE:-pip}" = pip ]; then
  SKBUILD_BUILD_DIR=/tmp/triaccel_skbuild python3 -m pip install --no-build-isolation --no-deps --no-index \
    --target "$SITE" -v . >"$FINAL_OUT/build.log" 2>&1
else
  cmake -S . -B /tmp/triaccel_cmake -G Ninja -DCMAKE_BUILD_TYPE=Release -DTRIACCEL_BUILD_TESTS=OFF \
    -DTRIACCEL_BUILD_BENCH=OFF >"$FINAL_OUT/build.log" 2>&1 &&
    cmake --build /tmp/triaccel_cmake -j "$(nproc)" --target python >>"$FINAL_OUT/build.log" 2>&1 &&
    mkdir -p "$SITE" && cp -r /tmp/triaccel_cmake/python/triaccel "$SITE/"
fi
status=$?
row "build (${MODE:-pip})" "$([ $status = 0 ] && echo ok || echo FAILED) in $(( $(date +%s) - t0 )) s"
if [ $status != 0 ]; then grep -E "error|Error|FAILED" "$FINAL_OUT/build.log" | head -30; tail -20 "$FINAL_OUT/build.log"; fi
export PYTHONPATH=$SITE
MOD=$(ls "$SITE"/triaccel/_triaccel*.so 2>/dev/null | head -1)
echo "compiler's libstdc++: $(g++ -print-file-name=libstdc++.so) / $(g++ -print-file-name=libstdc++.so.6)"
if [ -n "$MOD" ]; then
  python3 tools/check_linkage.py "$MOD"
  row "module links the shared libstdc++" "$([ $? = 0 ] && echo yes || echo NO)"
fi

for dev in cpu cuda; do
  python3 dev/python_crash_probe.py $dev >"$FINAL_OUT/probe_$dev.log" 2>&1
  s=$?
  row "probe $dev" "$([ $s = 0 ] && echo ok || echo "exit $s")"
  if [ $s != 0 ]; then
    tail -25 "$FINAL_OUT/probe_$dev.log"
    if [ $s -ge 128 ] && [ "$dev" = cpu ]; then
      cuda-gdb -batch -ex run -ex bt -ex "info sharedlibrary" --args python3 dev/python_crash_probe.py cpu \
        >"$FINAL_OUT/gdb.log" 2>&1
      grep -E "^#|SIGSEGV" "$FINAL_OUT/gdb.log" | head -30
      grep -E "stdc\+\+|libc10|libtorch\.so|torch_cpu" "$FINAL_OUT/gdb.log" | head
    fi
  fi
done

for t in ${TESTS-test_module test_pytorch_inputs test_split}; do
  timeout ${TEST_TIMEOUT:-240} python3 tests/python/$t.py >"$FINAL_OUT/$t.log" 2>&1
  s=$?
  row "tests/python/$t.py" "$(grep -E '^(Ran|OK|FAILED)' "$FINAL_OUT/$t.log" | tr '\n' ' ') (exit $s)"
  [ $s = 0 ] || grep -E "^(ERROR|FAIL):|Error" "$FINAL_OUT/$t.log" | head -20
done

# The acceptance runs (bench/python_models.py, bench/python_resnet18.py) on the CIFAR-10 copy carried in
# .device/data, when asked.
DATA=/tmp/cifar10-bin
if [ -n "${MODELS_PART:-}${R18_ARGS:-}${LOADER_PROFILE:-}${LOADER_THREADS:-}" ] && [ ! -f $DATA/test_batch.bin ]; then
  python3 .device/data/build_cifar10_bin.py $DATA >/dev/null 2>&1 || echo "CIFAR conversion failed"
fi
# R18_ARGS: torchvision's ResNet-18 split automatically beside the built-in model, PyTorch eager and torch.compile
# (e.g. "--epochs 2", or "--protocol --epochs 15 --seeds 0,1,2 --arms auto,builtin").
# Several invocations separated by "|" (e.g. "--batch 96 | --batch 512 --arms auto,auto-unfused,builtin").
if [ -n "${R18_ARGS:-}" ]; then
  IFS='|' read -ra r18_calls <<<"$R18_ARGS"
  for i in "${!r18_calls[@]}"; do
    args=${r18_calls[$i]}
    timeout ${R18_TIMEOUT:-540} python3 bench/python_resnet18.py $DATA /tmp/r18_runs $args \
      --json "$FINAL_OUT/python_resnet18_$i.json" >"$FINAL_OUT/python_resnet18_$i.log" 2>&1
    row "bench/python_resnet18.py $args" "exit $?"
    grep -E "^\||x$" "$FINAL_OUT/python_resnet18_$i.log"
    grep -E "Error|error" "$FINAL_OUT/python_resnet18_$i.log" | head -5
  done
fi
if [ -n "${MODELS_PART:-}" ]; then
  for part in $MODELS_PART; do
    timeout ${MODELS_TIMEOUT:-300} python3 bench/python_models.py $DATA /tmp/models_runs --part "$part" \
      --json "$FINAL_OUT/python_models_$part.json" ${MODELS_ARGS:-} >"$FINAL_OUT/python_models_$part.log" 2>&1
    row "bench/python_models.py --part $part ${MODELS_ARGS:-}" "exit $?"
    grep -E "^\|" "$FINAL_OUT/python_models_$part.log"
  done
  tar czf "$FINAL_OUT/models_events.tgz" -C /tmp/models_runs $(cd /tmp/models_runs && ls -d */events.jsonl) 2>/dev/null
fi
# TIED=1: one optimizer step of the engine beside PyTorch's for the tied and untied GPT (dev/tied_probe.py).
if [ -n "${TIED:-}" ]; then
  timeout ${TIED_TIMEOUT:-180} python3 dev/tied_probe.py .device/data/tinyshakespeare cuda ${TIED_ARGS:-} >"$FINAL_OUT/tied_probe.log" 2>&1
  row "dev/tied_probe.py" "exit $?"
  grep -E "^==|worst|\| (tok|head)" "$FINAL_OUT/tied_probe.log"
fi
if [ -n "${GPT:-}" ]; then
  timeout ${GPT_TIMEOUT:-240} python3 bench/python_gpt.py .device/data/tinyshakespeare /tmp/gpt_runs --epochs "${GPT_EPOCHS:-3}" ${GPT_ARGS:-} \
    --json "$FINAL_OUT/python_gpt.json" >"$FINAL_OUT/python_gpt.log" 2>&1
  row "bench/python_gpt.py" "exit $?"
  grep -E "^\||ratio" "$FINAL_OUT/python_gpt.log"
fi

# LOADER_PROFILE=1: the DataLoader path beside the tensors path with a timeline of each (dev/python_loader_profile.py).
if [ -n "${LOADER_PROFILE:-}" ]; then
  timeout ${LOADER_TIMEOUT:-300} python3 dev/python_loader_profile.py $DATA /tmp/loader_profile ${LOADER_ARGS:-} 2>&1 \
    | grep -vE "Warning|warn" | head -150
  row "dev/python_loader_profile.py ${LOADER_ARGS:-}" "exit ${PIPESTATUS[0]}"
fi
# LOADER_THREADS=1: the DataLoader path's CPU per thread and per worker, variant by variant (dev/python_loader_threads.py).
if [ -n "${LOADER_THREADS:-}" ]; then
  echo "shared memory: $(df -h /dev/shm | tail -1)"  # the workers' ring of slots lives there (python/triaccel/_data.py)
  timeout ${LOADER_TIMEOUT:-420} python3 dev/python_loader_threads.py $DATA /tmp/loader_threads ${LOADER_THREADS_ARGS:-} \
    --json "$FINAL_OUT/python_loader_threads.json" 2>&1 | grep -vE "Warning|warn" | tail -40
  row "dev/python_loader_threads.py ${LOADER_THREADS_ARGS:-}" "exit ${PIPESTATUS[0]}"
fi
# REPEAT=N: memory left on the GPU after each of N train() calls in one process (dev/python_repeat_probe.py).
if [ -n "${REPEAT:-}" ]; then
  timeout 240 python3 dev/python_repeat_probe.py "$REPEAT" 2>&1 | grep -E "^(before|run)"
  row "dev/python_repeat_probe.py $REPEAT" "exit ${PIPESTATUS[0]}"
fi

(cd "$FINAL_OUT" && ls *.log >/dev/null 2>&1 && tar czf logs.tgz *.log && rm -f *.log)  # 8 files come back at most
echo
echo "| check | result |"
echo "|---|---|"
for r in "${rows[@]}"; do echo "| ${r%%|*} | ${r#*|} |"; done
