#!/usr/bin/env bash
# The Python module on the GPU (issue 20, docs/python.md): bench/python_resnet18.py trains torchvision's ResNet-18
# defined in Python through triaccel.train, the built-in resnet18 through the same call, and the same module in a
# PyTorch eager loop, EPOCHS (2) epochs of CIFAR-10 at batch 96 amp-bf16, seed SEED (0), in one process; then
# bench/python_optim.py: triaccel.optim (AdamW, AdamW8bit, BAOC) beside torch.optim.AdamW in a plain PyTorch loop.
# The module: .device/python (`make gpu-binaries GPU_PYTHON=<the GPU machine's python version>`, carry [".device"]).
# Writes $OUT/python_resnet18.json and $OUT/python_optim.json and prints two tables last. Usage: COMMIT=... bash bench/run_python.sh
set -uo pipefail
FINAL_OUT=${OUT:-out}
WORK=/tmp/python_out
rm -rf "$WORK"
mkdir -p "$WORK" "$FINAL_OUT"
source "$(dirname "$0")/device_env.sh"
cifar10_bin
export PYTHONPATH="$(pwd)/.device/python"
python3 -c "import triaccel" || { echo "the carried Python module does not import here (python $(python3 -V))"; exit 1; }
python3 bench/python_resnet18.py "$DATA" "$WORK/runs" --epochs "${EPOCHS:-2}" --seeds "${SEED:-0}" --arms units,builtin,eager \
  --json "$FINAL_OUT/python_resnet18.json" 2>"$WORK/progress.log"
status=$?
[ $status -eq 0 ] || tail -20 "$WORK/progress.log"
python3 bench/python_optim.py --json "$FINAL_OUT/python_optim.json" || status=1
exit $status
