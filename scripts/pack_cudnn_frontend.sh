#!/usr/bin/env bash
# The header-only cudnn-frontend (PyPI's nvidia-cudnn-frontend wheel, its include/) into
# .device/deps/cudnn_frontend/include, for dev/probe_cudnn_fusion.sh on the GPU machine (no network there); carry
# ".device" in the device call. VERSION picks the wheel (default: the newest).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.device/deps/cudnn_frontend
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
pip download --no-deps -q -d "$WORK" "nvidia-cudnn-frontend${VERSION:+==$VERSION}"
rm -rf "$DEST"
mkdir -p "$DEST"
python3 - "$WORK" "$DEST" <<'PY'
import glob, os, sys, zipfile
wheel = glob.glob(os.path.join(sys.argv[1], "*.whl"))[0]
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith("include/"):
            z.extract(name, sys.argv[2])
print(os.path.basename(wheel))
PY
du -sh "$DEST"
