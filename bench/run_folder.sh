#!/usr/bin/env bash
# `--dataset folder` against the CIFAR-10 binary layout on the GPU (docs/results/foundation.md): the same images as
# an image folder (the JPEG copy, decoded by libjpeg-turbo) and as the binary files (decoded by Pillow,
# build_cifar10_bin.py), ResNet-18 b512 amp-bf16 with the README's accuracy recipe, EPOCHS (10) epochs, seeds SEEDS
# (0 1). The folder's sample order is its sorted file names, the binary's the official order, so the runs differ by
# more than the seed: the accuracies should agree within the seed-to-seed spread. Also times the first load (decode
# and cache) and a second (cache). Binaries: .device/bin (`make gpu-binaries`, carry [".device"]).
# Writes $OUT/folder.json and prints a table last. Usage: COMMIT=... bash bench/run_folder.sh
set -uo pipefail
EPOCHS=${EPOCHS:-10}
SEEDS=${SEEDS:-0 1}
FINAL_OUT=${OUT:-out}
WORK=/tmp/folder_out
rm -rf "$WORK"
mkdir -p "$WORK" "$FINAL_OUT"
source "$(dirname "$0")/device_env.sh"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
device_binaries "$WORK"
cifar10_bin
JPEG=/tmp/cifar-jpeg
if [ ! -d "$JPEG/train" ]; then
  mkdir -p "$JPEG" && tar xJf .device/data/cifar10-jpeg.tar.xz -C "$JPEG"
  [ -d "$JPEG/train" ] || JPEG=$(dirname "$(find "$JPEG" -maxdepth 3 -type d -name train | head -1)")
fi
rm -f "$JPEG"/.triaccel-cache-*
for load in first second; do
  start=$EPOCHREALTIME
  "$BIN/triaccel" plan --dataset folder --data "$JPEG" --model resnet18 --batch-size 512 --json >/dev/null \
    2>"$WORK/load_$load.log"
  awk -v a="$start" -v b="$EPOCHREALTIME" -v l="$load" 'BEGIN { printf "load_%s %.2f\n", l, b - a }' >>"$WORK/loads.txt"
done
for seed in $SEEDS; do
  for source in folder cifar10; do
    data=$DATA; [ "$source" = folder ] && data=$JPEG
    "$BIN/triaccel" train --model resnet18 --dataset "$source" --data "$data" --epochs "$EPOCHS" --batch-size 512 \
      --precision amp-bf16 --augment on --momentum 0.9 --nesterov true --lr 0.8 --weight-decay 5e-4 \
      --label-smoothing 0.1 --warmup-epochs 5 --lr-decay cosine --cutout 12 --seed "$seed" --progress lines \
      --log-every 100000 --out "$WORK/runs/${source}_s$seed" >"$WORK/${source}_s$seed.log" 2>&1
    echo "${source}_s$seed: exit $? $(grep -E '^done' "$WORK/${source}_s$seed.log" | cut -c1-160)"
  done
done
python3 - "$WORK" "$FINAL_OUT/folder.json" "$GPU" "${COMMIT:-unknown}" <<'PY'
import glob, json, os, statistics, sys
work, dst, gpu, commit = sys.argv[1:5]
rows = []
for ev in sorted(glob.glob(f"{work}/runs/*/events.jsonl")):
    events = [json.loads(l) for l in open(ev) if l.strip()]
    s = next((e for e in events if e["event"] == "summary"), None)
    rows.append({"run": os.path.basename(os.path.dirname(ev)), "test_acc": s and s["test_acc"],
                 "epoch_s": s and s["epoch_s"], "peak_vram_gb": s and s["peak_vram_gb"]})
loads = dict(l.split() for l in open(f"{work}/loads.txt"))
json.dump({"bench": "folder", "gpu": gpu, "commit": commit, "command": f"COMMIT={commit} bash bench/run_folder.sh",
           "loads_s": loads, "rows": rows}, open(dst, "w"), indent=1)
print(f"{'run':16} {'acc %':>7} {'s/epoch':>8} {'peak GB':>8}")
for r in rows:
    print(f"{r['run']:16} {r['test_acc'] or 0:7.2f} {r['epoch_s'] or 0:8.3f} {r['peak_vram_gb'] or 0:8.3f}")
for src in ("folder", "cifar10"):
    accs = [r["test_acc"] for r in rows if r["run"].startswith(src + "_") and r["test_acc"] is not None]
    if accs:
        print(f"{src}: mean {statistics.mean(accs):.2f} % over {len(accs)} seeds")
print("loads (s): " + ", ".join(f"{k} {float(v):.1f}" for k, v in loads.items()))
PY
tar czf "$FINAL_OUT/folder_logs.tgz" --exclude='*.pt' -C "$WORK" . 2>/dev/null
