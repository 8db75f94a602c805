#!/usr/bin/env bash
# The foundation's GPU job, in one call on the device machine (see docs/measuring.md):
#   1. binaries: the ones carried in .device/bin if they run here, else a fresh build (cmake + ninja)
#   2. every unit test on the GPU (GPU tests skip on a CPU machine, so this is where they really run)
#   3. throughput + peak VRAM: bench_train_throughput and the PyTorch eager reference, same GPU, same job
#   4. accuracy: ResNet-18 on the CIFAR-10 copy (batch 96 fp32 and amp-fp16, 10 epochs; batch 512 amp-bf16, 30)
# Results go to $OUT (copied by hand to bench/results/<gpu>/). Usage: bash bench/run_foundation.sh [stages]
# where stages ⊆ {tests,bench,accuracy} (default: all). Set COMMIT=<hash> (the device copy has no .git).
set -uo pipefail
STAGES=${1:-tests,bench,accuracy}
FINAL_OUT=${OUT:-out}
OUT=/tmp/foundation_out   # everything lands here; $FINAL_OUT gets one archive + the tables (8 files come back)
mkdir -p "$OUT" "$FINAL_OUT"
ROOT=$(pwd)
source "$(dirname "$0")/device_env.sh"  # LD_LIBRARY_PATH for the carried binaries
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "gpu: $GPU; torch: $(python3 -c 'import torch; print(torch.__version__)')"

device_binaries "$OUT" triaccel_tests bench_train_throughput
cat > "$OUT/commands.txt" <<TXT
gpu: $GPU
host command: bash bench/run_foundation.sh $STAGES
TXT

summary=()
if [[ $STAGES == *tests* ]]; then
  "$BIN/triaccel_tests" --gtest_brief=1 >"$OUT/unit_tests_gpu.log" 2>&1
  rc=$?
  tail -5 "$OUT/unit_tests_gpu.log"
  summary+=("unit tests on GPU: exit $rc; $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/unit_tests_gpu.log" | tr '\n' ' ')")
fi

if [[ $STAGES == *bench* ]]; then
  "$BIN/bench_train_throughput" --out "$OUT/ours.json" 2>&1 | tee "$OUT/bench.log"
  python3 bench/pytorch_reference.py --out "$OUT/pytorch.json" 2>&1 | tee -a "$OUT/bench.log"
  python3 bench/merge_results.py --ours "$OUT/ours.json" --pytorch "$OUT/pytorch.json" --bench train_throughput \
    --gpu "$GPU" --commit "${COMMIT:-unknown}" --command "bash bench/run_foundation.sh bench" --out "$OUT/train_throughput.json" | tee "$OUT/throughput_table.txt"
fi

if [[ $STAGES == *accuracy* ]]; then
  cifar10_bin
  run() {  # name, then train flags
    local name=$1; shift
    echo "== $name: triaccel train $*" | tee -a "$OUT/commands.txt"
    "$BIN/triaccel" train --model resnet18 --dataset cifar10 --data "$DATA" --progress lines --log-every 100000 \
      --out "/tmp/runs/$name" "$@" 2>&1 | tail -3
    cp "/tmp/runs/$name/events.jsonl" "$OUT/$name.events.jsonl"
  }
  run b96_fp32 --batch-size 96 --lr 0.075 --epochs 10 --precision fp32 --label-smoothing 0.1
  run b96_fp16 --batch-size 96 --lr 0.075 --epochs 10 --precision amp-fp16 --label-smoothing 0.1
  run b512_bf16 --batch-size 512 --lr 0.4 --epochs 30 --warmup-epochs 2 --precision amp-bf16 --label-smoothing 0.1 --tta flip
  run b512_bf16_wd1e-3 --batch-size 512 --lr 0.4 --weight-decay 1e-3 --epochs 30 --warmup-epochs 2 --precision amp-bf16 --label-smoothing 0.1 --tta flip
  run b512_bf16_lr02 --batch-size 512 --lr 0.2 --epochs 30 --warmup-epochs 2 --precision amp-bf16 --label-smoothing 0.1 --tta flip
  python3 - "$OUT" <<'PY'
import json, sys, glob, os
out = sys.argv[1]
rows = []
for f in sorted(glob.glob(f"{out}/*.events.jsonl")):
    ev = [json.loads(l) for l in open(f)]
    s = ev[-1]
    if s["event"] != "summary":
        print(f"{f}: no summary"); continue
    cfg = ev[0]["options"] if ev[0]["event"] == "config" else {}
    rows.append({"run": os.path.basename(f).split(".")[0], "batch": s["batch_size"], "precision": s["precision"],
                 "epochs": s["epochs"], "test_acc": round(s["test_acc"], 2),
                 "test_acc_tta": s.get("test_acc_tta") and round(s["test_acc_tta"], 2), "weight_decay": cfg.get("weight_decay"), "epoch_s": round(s["epoch_s"], 3),
                 "peak_vram_gb": round(s["peak_vram_gb"], 3), "eff_score": round(s["eff_score"], 2),
                 "skipped_steps": s["skipped_steps"], "lr": cfg.get("lr"), "label_smoothing": cfg.get("label_smoothing")})
json.dump({"bench": "resnet18_cifar10_accuracy", "rows": rows}, open(f"{out}/accuracy.json", "w"), indent=2)
print(f"{'run':18s} {'acc %':>7s} {'tta %':>7s} {'s/epoch':>8s} {'peak GB':>8s} {'eff':>7s}")
for r in rows:
    print(f"{r['run']:18s} {r['test_acc']:7.2f} {r['test_acc_tta'] or 0:7.2f} {r['epoch_s']:8.3f} {r['peak_vram_gb']:8.3f} {r['eff_score']:7.2f}")
PY
fi
tar czf "$FINAL_OUT/foundation.tgz" -C "$OUT" .
cp "$OUT"/*.json "$FINAL_OUT"/ 2>/dev/null
for s in "${summary[@]}"; do echo "$s"; done
[ -f "$OUT/throughput_table.txt" ] && cat "$OUT/throughput_table.txt"
exit 0
