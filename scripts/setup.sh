#!/usr/bin/env bash
# Installs whatever the build, the default job and the tests need and is missing: Debian packages (compilers'
# header-only libraries, GoogleTest, zlib, Fashion-MNIST, chromium for the headless report test) and, from PyPI,
# torch==2.11.0 (LibTorch) with torchvision, and pybind11 (the Python module's bindings).
# Idempotent: a second run installs nothing and takes a second.
set -euo pipefail

TORCH_VERSION=2.11.0
TORCHVISION_VERSION=0.26.0
PYBIND11_VERSION=3.0.1  # the version torch 2.11's own headers carry
# libjpeg62-turbo-dev, libpng-dev: the image-folder reader; libgloo-dev: the Gloo headers c10d's ProcessGroupGloo
# includes (the pip wheel's libtorch carries Gloo itself, not its headers); chromium: the report's headless-browser
# test; clang + libclang-rt-14-dev: the libFuzzer targets with ASan/UBSan (make test-fuzz, docs/reliability.md).
APT_PACKAGES=(cmake ninja-build g++ make zlib1g-dev nlohmann-json3-dev libcli11-dev libgtest-dev dataset-fashion-mnist
              libjpeg62-turbo-dev libpng-dev libgloo-dev chromium clang libclang-rt-14-dev)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
have_torch=$($PY -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null || true)
have_tv=$($PY -c "import torchvision; print(torchvision.__version__.split('+')[0])" 2>/dev/null || true)
have_np=$($PY -c "import numpy; print('ok')" 2>/dev/null || true)
have_pb=$($PY -c "import pybind11; print(pybind11.__version__)" 2>/dev/null || true)
if [ "$have_torch" != "$TORCH_VERSION" ] || [ "$have_tv" != "$TORCHVISION_VERSION" ] || [ "$have_np" != "ok" ] ||
   [ "$have_pb" != "$PYBIND11_VERSION" ]; then
  echo "setup: installing torch==$TORCH_VERSION torchvision==$TORCHVISION_VERSION numpy pybind11==$PYBIND11_VERSION from PyPI"
  $PY -m pip install -q "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION" numpy "pybind11==$PYBIND11_VERSION"
fi
