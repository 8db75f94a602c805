#!/usr/bin/env bash
# The foundation's GPU job, in one call on the device machine (see docs/measuring.md):
#   1. binaries: the ones carried in .device/bin if they run here, else a fresh build (cmake + ninja)
#   2. every unit test on the GPU (GPU tests skip on a CPU machine, so this is where they really run)
#   3. throughput + peak VRAM: bench_train_throughput and the PyTorch eager reference, same GPU, same job
#   4. accuracy: ResNet-18 on the CIFAR-10 copy (batch 96 fp32 and amp-fp16, 10 epochs; batch 512 amp-bf16, 30)
#   5. sweep (only when named): 14 recipes in two rounds (SWEEP_RUNS picks) for the 93 % target, ResNet-18 batch 512 amp-bf16 30 epochs, flip TTA;
#      about 50 s a run on an H100 (the 90.11 % run took 48.5 s end to end), 7 minutes with carried binaries.
#      SWEEP_RUNS=<regex> runs the matching names only (to split it over two device calls when a build eats the time).
# Results go to $OUT (copied by hand to bench/results/<gpu>/): foundation.tgz (everything: logs, events, tables) and
# the JSON tables (accuracy.json, sweep.json, ...): at most 7 files, under the device's 8. Usage:
# bash bench/run_foundation.sh [stages] where stages ⊆ {tests,bench,accuracy,sweep,ceiling} (default: tests,bench,accuracy).
# Set COMMIT=<hash> (the device copy has no .git).
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
  # A/B: the bf16 rows again with LibTorch's own BatchNorm (our fused kernel off; docs/foundation.md)
  "$BIN/bench_train_throughput" --precisions amp-bf16 --bn-kernel off --out "$OUT/ours_native_bn.json" 2>&1 | tee -a "$OUT/bench.log"
  python3 bench/pytorch_reference.py --out "$OUT/pytorch.json" 2>&1 | tee -a "$OUT/bench.log"
  python3 bench/merge_results.py --ours "$OUT/ours.json" --pytorch "$OUT/pytorch.json" --bench train_throughput \
    --gpu "$GPU" --commit "${COMMIT:-unknown}" --command "bash bench/run_foundation.sh bench" --out "$OUT/train_throughput.json" | tee "$OUT/throughput_table.txt"
fi

# r18 DIR NAME FLAGS...: one ResNet-18 CIFAR-10 run (from scratch), its events copied to DIR/NAME.events.jsonl.
r18() {
  local dir=$1 name=$2; shift 2
  echo "== $name: triaccel train $*" | tee -a "$OUT/commands.txt"
  rm -rf "/tmp/runs/$name"
  "$BIN/triaccel" train --model resnet18 --dataset cifar10 --data "$DATA" --progress lines --log-every 100000 \
    --out "/tmp/runs/$name" "$@" 2>&1 | tail -3
  cp "/tmp/runs/$name/events.jsonl" "$dir/$name.events.jsonl"
}
# table DIR JSON BENCH: the summary row of every DIR/*.events.jsonl into JSON, and printed as a table.
table() {
  python3 - "$@" <<'PY'
import json, sys, glob, os
src, dst, bench = sys.argv[1:4]
rows = []
for f in sorted(glob.glob(f"{src}/*.events.jsonl")):
    ev = [json.loads(l) for l in open(f)]
    s = ev[-1]
    if s["event"] != "summary":
        print(f"{f}: no summary"); continue
    cfg = ev[0]["options"] if ev[0]["event"] == "config" else {}
    rows.append({"run": os.path.basename(f).split(".events")[0], "batch": s["batch_size"], "precision": s["precision"],
                 "epochs": s["epochs"], "test_acc": round(s["test_acc"], 2),
                 "test_acc_tta": s.get("test_acc_tta") and round(s["test_acc_tta"], 2),
                 "weight_decay": cfg.get("weight_decay"), "epoch_s": round(s["epoch_s"], 3),
                 "peak_vram_gb": round(s["peak_vram_gb"], 3), "eff_score": round(s["eff_score"], 2),
                 "skipped_steps": s["skipped_steps"], "lr": cfg.get("lr"), "label_smoothing": cfg.get("label_smoothing"),
                 "warmup_epochs": cfg.get("warmup_epochs"), "lr_decay": cfg.get("lr_decay", "cosine"),
                 "cutout": cfg.get("cutout", 0)})
json.dump({"bench": bench, "rows": rows}, open(dst, "w"), indent=2)
print(f"{'run':22s} {'lr':>5s} {'wd':>7s} {'ls':>4s} {'warm':>4s} {'decay':>6s} {'cut':>3s} {'acc %':>7s} {'tta %':>7s} "
      f"{'s/epoch':>8s} {'peak GB':>8s} {'eff':>7s}")
for r in rows:
    print(f"{r['run']:22s} {r['lr']:5g} {r['weight_decay']:7g} {r['label_smoothing']:4g} {r['warmup_epochs']:4g} "
          f"{r['lr_decay']:>6s} {r['cutout']:3d} {r['test_acc']:7.2f} {r['test_acc_tta'] or 0:7.2f} {r['epoch_s']:8.3f} "
          f"{r['peak_vram_gb']:8.3f} {r['eff_score']:7.2f}")
PY
}

if [[ $STAGES == *accuracy* ]]; then
  cifar10_bin
  r18 "$OUT" b96_fp32 --batch-size 96 --lr 0.075 --epochs 10 --precision fp32 --label-smoothing 0.1
  r18 "$OUT" b96_fp16 --batch-size 96 --lr 0.075 --epochs 10 --precision amp-fp16 --label-smoothing 0.1
  r18 "$OUT" b512_bf16 --batch-size 512 --lr 0.4 --epochs 30 --warmup-epochs 2 --precision amp-bf16 --label-smoothing 0.1 --tta flip
  r18 "$OUT" b512_bf16_wd1e-3 --batch-size 512 --lr 0.4 --weight-decay 1e-3 --epochs 30 --warmup-epochs 2 --precision amp-bf16 --label-smoothing 0.1 --tta flip
  r18 "$OUT" b512_bf16_lr02 --batch-size 512 --lr 0.2 --epochs 30 --warmup-epochs 2 --precision amp-bf16 --label-smoothing 0.1 --tta flip
  table "$OUT" "$OUT/accuracy.json" resnet18_cifar10_accuracy | tee "$OUT/accuracy_table.txt"
fi

# The accuracy sweep for the foundation's target: >= 93 % at batch 512, amp-bf16, 30 epochs. Best so far 90.11 %
# (90.66 % with flip TTA) at a final train accuracy of 98.9 % (augmented): a 9-point generalization gap, so the levers
# tried are regularizers. Every run: SGD nesterov 0.9 (the fast CIFAR recipes use it, and the 90.11 % run had it),
# no weight decay on norms and biases, the same seed (0). Run-to-run spread at this size is a few tenths of a point:
# differences under ~0.3 are not evidence. The recipes (flags below; all others as in s0_base):
#   s0_base             the current best: lr 0.4, wd 5e-4, ls 0.1, 2 warm-up epochs, cosine. The control, same binary.
#   s1_cut8             + cutout 8: the size the fast ResNet-9 CIFAR-10 recipes (24 epochs, batch 512) use.
#   s2_cut12            + cutout 12: between those and DeVries & Taylor's 16; ResNet-18 has more capacity to tame.
#   s3_cut16            + cutout 16: DeVries & Taylor's CIFAR-10 size for ResNet-18 (200 epochs; may be too strong
#                       for 30).
#   s4_cut8_wd1e-3      cutout 8 with wd 1e-3: wd 1e-3 alone was flat (90.05 %); does it pay with cutout on?
#   s5_cut12_ls0.2      cutout 12 with label smoothing 0.2 (the ResNet-9 recipes' value) instead of 0.1.
#   s6_cut12_lr0.8      cutout 12, lr 0.8 with 5 warm-up epochs: a larger step regularizes too (lr 0.2 lost 0.6 points).
#   s7_cut12_ls0.2_lin  the ResNet-9 recipes' shape: cutout 12, ls 0.2, 5 warm-up epochs, then a linear decay to 0
#                       (--lr-decay linear) instead of the cosine.
if [[ $STAGES == *sweep* ]]; then
  cifar10_bin
  rm -rf "$OUT/sweep" && mkdir -p "$OUT/sweep"
  SWEEP=(--batch-size 512 --epochs 30 --precision amp-bf16 --tta flip --momentum 0.9 --nesterov true)
  sweep() {  # name, then the recipe's flags; SWEEP_RUNS (a regex) picks names
    [[ $1 =~ ${SWEEP_RUNS:-.} ]] || return 0
    r18 "$OUT/sweep" "$1" "${SWEEP[@]}" "${@:2}"
  }
  sweep s0_base --lr 0.4 --weight-decay 5e-4 --label-smoothing 0.1 --warmup-epochs 2 --lr-decay cosine --cutout 0
  sweep s1_cut8 --lr 0.4 --weight-decay 5e-4 --label-smoothing 0.1 --warmup-epochs 2 --lr-decay cosine --cutout 8
  sweep s2_cut12 --lr 0.4 --weight-decay 5e-4 --label-smoothing 0.1 --warmup-epochs 2 --lr-decay cosine --cutout 12
  sweep s3_cut16 --lr 0.4 --weight-decay 5e-4 --label-smoothing 0.1 --warmup-epochs 2 --lr-decay cosine --cutout 16
  sweep s4_cut8_wd1e-3 --lr 0.4 --weight-decay 1e-3 --label-smoothing 0.1 --warmup-epochs 2 --lr-decay cosine --cutout 8
  sweep s5_cut12_ls0.2 --lr 0.4 --weight-decay 5e-4 --label-smoothing 0.2 --warmup-epochs 2 --lr-decay cosine --cutout 12
  sweep s6_cut12_lr0.8 --lr 0.8 --weight-decay 5e-4 --label-smoothing 0.1 --warmup-epochs 5 --lr-decay cosine --cutout 12
  sweep s7_cut12_ls0.2_lin --lr 0.4 --weight-decay 5e-4 --label-smoothing 0.2 --warmup-epochs 5 --lr-decay linear --cutout 12
  # Second round (after the first on the H100 at 5f58b7f: only the peak lr moved the result, +0.5 pp at 0.8 with 5
  # warm-up epochs): higher peaks, and 0.8 repeated to see the spread. Run it alone with SWEEP_RUNS='^s[89]|^s1[0-3]'.
  sweep s8_lr0.8_rep --lr 0.8 --weight-decay 5e-4 --label-smoothing 0.1 --warmup-epochs 5 --lr-decay cosine --cutout 12
  sweep s9_lr1.2 --lr 1.2 --weight-decay 5e-4 --label-smoothing 0.1 --warmup-epochs 5 --lr-decay cosine --cutout 12
  sweep s10_lr1.6 --lr 1.6 --weight-decay 5e-4 --label-smoothing 0.1 --warmup-epochs 5 --lr-decay cosine --cutout 12
  sweep s11_lr1.2_wd2.5e-4 --lr 1.2 --weight-decay 2.5e-4 --label-smoothing 0.1 --warmup-epochs 5 --lr-decay cosine --cutout 12
  sweep s12_lr0.8_lin --lr 0.8 --weight-decay 5e-4 --label-smoothing 0.1 --warmup-epochs 5 --lr-decay linear --cutout 12
  sweep s13_lr0.8_nocut --lr 0.8 --weight-decay 5e-4 --label-smoothing 0.1 --warmup-epochs 5 --lr-decay cosine --cutout 0
  table "$OUT/sweep" "$OUT/sweep.json" resnet18_cifar10_sweep | tee "$OUT/sweep_table.txt"
fi
# ceiling (only when named): is 93 % reachable on this JPEG copy at all? The sweep's best recipe (s6/s8: lr 0.8, 5
# warm-up epochs, cutout 12, ls 0.1) at 30 epochs (the control), 60 and 100 epochs, same binary, same seed. If even
# 100 epochs stay under 93 %, the 30-epoch target is out of reach for ResNet-18 on this copy, not for the runtime.
if [[ $STAGES == *ceiling* ]]; then
  cifar10_bin
  rm -rf "$OUT/ceiling" && mkdir -p "$OUT/ceiling"
  for e in ${CEILING_EPOCHS:-30 60 100}; do
    r18 "$OUT/ceiling" "c_${e}ep" --batch-size 512 --epochs "$e" --precision amp-bf16 --tta flip --momentum 0.9 \
      --nesterov true --lr 0.8 --weight-decay 5e-4 --label-smoothing 0.1 --warmup-epochs 5 --lr-decay cosine --cutout 12
  done
  table "$OUT/ceiling" "$OUT/ceiling.json" resnet18_cifar10_ceiling | tee "$OUT/ceiling_table.txt"
fi
tar czf "$FINAL_OUT/foundation.tgz" -C "$OUT" .
cp "$OUT"/*.json "$FINAL_OUT"/ 2>/dev/null
for s in "${summary[@]}"; do echo "$s"; done
[ -f "$OUT/throughput_table.txt" ] && cat "$OUT/throughput_table.txt"
[[ $STAGES == *sweep* ]] && [ -f "$OUT/sweep_table.txt" ] && cat "$OUT/sweep_table.txt"
[[ $STAGES == *ceiling* ]] && [ -f "$OUT/ceiling_table.txt" ] && cat "$OUT/ceiling_table.txt"
exit 0
