#!/usr/bin/env bash
# Packs the Debian build dependencies that the GPU machine's image lacks (it has no Debian headers) into
# .device/deps as an install prefix: headers under include/, libraries under lib/, CMake package files under
# share/cmake/. A source build there finds them with CMAKE_PREFIX_PATH=$PWD/.device/deps (docs/python.md, "On a GPU
# machine without the system packages"); carry ".device" in the device call. Run after `make setup`.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.device/deps
rm -rf "$DEST"
mkdir -p "$DEST/include" "$DEST/lib" "$DEST/share/cmake"
for pkg in libjpeg62-turbo-dev libpng-dev zlib1g-dev nlohmann-json3-dev libcli11-dev libgloo-dev; do
  dpkg -L "$pkg" | while read -r f; do
    [ -f "$f" ] || continue
    case "$f" in
      /usr/include/x86_64-linux-gnu/*) rel=${f#/usr/include/x86_64-linux-gnu/}; mkdir -p "$DEST/include/$(dirname "$rel")"; cp "$f" "$DEST/include/$rel" ;;
      /usr/include/*) rel=${f#/usr/include/}; mkdir -p "$DEST/include/$(dirname "$rel")"; cp "$f" "$DEST/include/$rel" ;;
      /usr/share/cmake/*) rel=${f#/usr/share/cmake/}; mkdir -p "$DEST/share/cmake/$(dirname "$rel")"; cp "$f" "$DEST/share/cmake/$rel" ;;
    esac
  done
done
# libpng's headers sit in include/libpng16 with links at include/: dereferenced above (cp follows links).
for lib in libjpeg.so.62 libpng16.so.16 libz.so.1; do
  cp -L "/usr/lib/x86_64-linux-gnu/$lib" "$DEST/lib/$lib"
  ln -sf "$lib" "$DEST/lib/${lib%%.so*}.so"
done
du -sh "$DEST"
