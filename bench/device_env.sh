# Sourced by the bench/run_*.sh GPU jobs: the library path under which binaries built on the CPU machine (and carried
# in .device/bin) find the device machine's LibTorch and its CUDA libraries.
TORCH_LIB=$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
SITE=$(dirname "$(dirname "$TORCH_LIB")")
NV_LIBS=$(ls -d "$SITE"/nvidia/*/lib "$SITE"/nvidia/cu13/lib 2>/dev/null | tr '\n' ':')
export LD_LIBRARY_PATH="$TORCH_LIB:$NV_LIBS/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
