#!/usr/bin/env bash
# Issue 59: dev/probe_cudnn_fusion.cpp on the GPU machine (carry [".device"], after scripts/pack_cudnn_frontend.sh
# here): built there against its PyTorch's cuDNN, run at BATCH (512), the JSON rows to $OUT/cudnn_fusion_b$BATCH.json
# and the table last.
set -euo pipefail
cd "$(dirname "$0")/.."
BATCH=${BATCH:-512}
OUTDIR=${OUT:-out}
mkdir -p "$OUTDIR"
source bench/device_env.sh
FE=.device/deps/cudnn_frontend/include
[ -f "$FE/cudnn_frontend.h" ] || { echo "no cudnn-frontend headers in $FE: run scripts/pack_cudnn_frontend.sh and carry .device"; exit 1; }
CUDNN=$(python3 -c 'import os, nvidia.cudnn as c; print(os.path.dirname(c.__file__) if c.__file__ else list(c.__path__)[0])')
CUDA=${CUDA_HOME:-/usr/local/cuda}
BIN=/tmp/probe_cudnn_fusion
t0=$SECONDS
g++ -std=c++17 -O1 -I"$FE" -I"$CUDNN/include" -I"$CUDA/include" dev/probe_cudnn_fusion.cpp -o "$BIN" \
  -L"$CUDNN/lib" -l:libcudnn.so.9 -L"$CUDA/lib64" -lcudart -lnvrtc -lcuda -ldl
echo "built in $((SECONDS - t0)) s"
LD_LIBRARY_PATH="$CUDNN/lib:$LD_LIBRARY_PATH" "$BIN" "$OUTDIR/cudnn_fusion_b$BATCH.json" "$BATCH"
