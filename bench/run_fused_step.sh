#!/usr/bin/env bash
# Issue 59's step in one device call: our step with and without a fused kernel, PyTorch eager and torch.compile of
# the same module, on the same GPU (docs/measuring.md, docs/roofline.md). Stages (STAGES, comma-separated; default
# "tests,throughput,pytorch"):
#   tests       the BatchNorm GPU tests (TESTS_FILTER) and the step tests that run ResNet-18 on the GPU
#   kernels     bench_batch_norm: the BatchNorm kernels alone on ResNet-18/CIFAR's 20 layers at BATCHES, per launch
#               choice (BN_CONFIGS; the rules, the launch before them) and ATen's unfused sequence
#   throughput  bench_train_throughput, ResNet-18 CIFAR synthetic, PRECISIONS (amp-bf16) at BATCHES (96,512), REPEATS
#               (5) × 50 steps: the block-end fusion on and off (--bn-tail), and on with the BatchNorm launch before
#               its rules (--bn-launch 4:4)
#   pytorch     bench/pytorch_reference.py on the same rows, channels_last, eager and torch.compile
#   acc         the 15-epoch protocol (ResNet-18 b96 amp-bf16) for ACC_SEEDS (0 1 2), fusion on and off
#               (TRIACCEL_BN_TAIL=off)
#   profile     a timeline of steps 60-80 at batch 512 (--profile-steps), its kernel classes (bench/trace_summary.py)
# Binaries: built here into build-gpu (cmake + ninja, bench targets on; the Debian headers carried in .device/deps).
# Writes $OUT/fused_step.json ({"bench","gpu","commit","command","rows"}) and the logs; prints a short table last.
# Usage: COMMIT=$(git rev-parse --short HEAD) STAGES=... bash bench/run_fused_step.sh
set -uo pipefail
STAGES=${STAGES:-tests,throughput,pytorch}
BATCHES=${BATCHES:-96,512}
PRECISIONS=${PRECISIONS:-amp-bf16}
REPEATS=${REPEATS:-5}
FINAL_OUT=${OUT:-out}
WORK=/tmp/fused_out
rm -rf "$WORK"
mkdir -p "$WORK" "$FINAL_OUT"
source "$(dirname "$0")/device_env.sh"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "gpu: $GPU; commit ${COMMIT:-?}; stages $STAGES"
has() { case ",$STAGES," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

t0=$SECONDS
device_cmake_build . build-gpu "$FINAL_OUT" "-DTRIACCEL_BUILD_BENCH=ON" triaccel_cli triaccel_tests \
  bench_train_throughput bench_batch_norm || exit 1
BIN=build-gpu
echo "built in $((SECONDS - t0)) s"

if has tests; then
  "$BIN/triaccel_tests" --gtest_brief=1 --gtest_filter="${TESTS_FILTER:-BatchNorm*:StepGraph*:TrainStep*}" \
    >"$FINAL_OUT/tests_gpu.log" 2>&1
  echo "gpu tests: exit $?; $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$FINAL_OUT/tests_gpu.log" | tr '\n' ' ')"
  grep -A12 -E '^\[ RUN|Failure' "$FINAL_OUT/tests_gpu.log" | grep -B2 -A10 Failure | head -40
fi

if has kernels; then
  "$BIN/bench_batch_norm" --batch-sizes "$BATCHES" --configs "${BN_CONFIGS:-rule:0:0,old:4:4,rows4:4:0,rows2:2:0,aten}" \
    --commit "${COMMIT:-unknown}" --out "$FINAL_OUT/batch_norm_kernels.json" 2>&1 | tee "$FINAL_OUT/kernels.log"
fi

if has throughput; then
  for variant in on:0:0 off:0:0 on:4:4; do
    tail=${variant%%:*}
    launch=${variant#*:}
    "$BIN/bench_train_throughput" --precisions "$PRECISIONS" --batch-sizes "$BATCHES" --repeats "$REPEATS" \
      --bn-tail "$tail" --bn-launch "$launch" --out "$WORK/ours_tail_${tail}_launch_${launch/:/_}.json" \
      >>"$FINAL_OUT/throughput.log" 2>&1 || echo "bench_train_throughput --bn-tail $tail --bn-launch $launch: exit $?"
  done
fi

if has pytorch; then
  python3 bench/pytorch_reference.py --precisions "$PRECISIONS" --batch-sizes "$BATCHES" --layouts channels_last \
    --modes eager,compile --repeats "$REPEATS" --out "$WORK/pytorch.json" >>"$FINAL_OUT/pytorch.log" 2>&1 ||
    echo "pytorch_reference: exit $?"
fi

if has acc; then
  cifar10_bin
  read -ra PROTO <<<"$(tri_accel_protocol)"
  for seed in ${ACC_SEEDS:-0 1 2}; do
    for tail in on off; do
      tag="acc_tail_${tail}_s$seed"
      env_tail=()
      [ "$tail" = off ] && env_tail=(TRIACCEL_BN_TAIL=off)
      env "${env_tail[@]}" "$BIN/triaccel" train --model resnet18 "${PROTO[@]}" --precision amp-bf16 --seed "$seed" \
        --progress lines --log-every 100000 --out "$WORK/$tag" >"$WORK/$tag.log" 2>&1
      echo "$tag: exit $? $(tail -1 "$WORK/$tag.log" | cut -c1-160)"
      cp "$WORK/$tag/events.jsonl" "$WORK/$tag.events.jsonl" 2>/dev/null
    done
  done
fi

if has profile; then
  cifar10_bin
  "$BIN/triaccel" train --model resnet18 --dataset cifar10 --data "$DATA" --batch-size 512 --epochs 1 \
    --precision amp-bf16 --profile-steps 60:80 --progress lines --log-every 100000 --out "$WORK/profile" \
    >"$WORK/profile.log" 2>&1
  echo "profile: exit $?"
  trace="$WORK/profile/profile.json"
  if [ -f "$trace" ]; then
    { python3 bench/trace_summary.py "$trace"; python3 bench/trace_summary.py --kernels "$trace"; } \
      >"$FINAL_OUT/profile_summary.txt" 2>&1
    head -45 "$FINAL_OUT/profile_summary.txt"
  fi
fi

python3 - "$WORK" "$FINAL_OUT/fused_step.json" "$GPU" "${COMMIT:-unknown}" "$STAGES" <<'PY'
import glob, json, os, sys
work, dst, gpu, commit, stages = sys.argv[1:6]
rows = []
for f in sorted(glob.glob(f"{work}/ours_tail_*.json")):
    for r in json.load(open(f))["rows"]:
        launch = r.get("bn_launch", "0:0")
        tail = "on" if r["bn_tail"] else "off"
        rows.append({"system": "triaccel", "variant": f"bn-tail {tail}" + ("" if launch == "0:0" else f" {launch}"),
                     **r})
f = f"{work}/pytorch.json"
if os.path.exists(f):
    for r in json.load(open(f))["rows"]:
        rows.append({"system": "pytorch", "variant": r["mode"], **r})
for f in sorted(glob.glob(f"{work}/acc_*.events.jsonl")):
    ev = [json.loads(l) for l in open(f) if l.strip()]
    s = next((e for e in ev if e["event"] == "summary"), None)
    if s:
        rows.append({"system": "triaccel", "variant": os.path.basename(f).split(".events")[0], "test_acc": s["test_acc"],
                     "epoch_s": s["epoch_s"], "peak_vram_gb": s["peak_vram_gb"]})
json.dump({"bench": "fused_step", "gpu": gpu, "commit": commit,
           "command": f"COMMIT={commit} STAGES={stages} bash bench/run_fused_step.sh", "rows": rows},
          open(dst, "w"), indent=2)
speed = [r for r in rows if "images_per_s" in r]
base = {(r["batch"], r["precision"]): r["images_per_s"] for r in speed if r["variant"] == "bn-tail off"}
comp = {(r["batch"], r["precision"]): r["images_per_s"] for r in speed if r["variant"] == "compile"}
old = {(r["batch"], r["precision"]): r["images_per_s"] for r in speed if r["variant"] == "bn-tail on 4:4"}
print(f"{'system':9s} {'variant':16s} {'batch':>5s} {'precision':9s} {'img/s':>9s} {'/tail off':>9s} {'/compile':>9s} "
      f"{'peak GB':>8s}")
for r in speed:
    k = (r["batch"], r["precision"])
    rel = lambda d: f"{r['images_per_s'] / d[k]:9.3f}" if k in d else f"{'':9s}"
    print(f"{r['system']:9s} {r['variant']:16s} {r['batch']:5d} {r['precision']:9s} {r['images_per_s']:9.0f} "
          f"{rel(base)} {rel(old)} {rel(comp)} {r['peak_allocated_gb']:8.3f}")
acc = [r for r in rows if "test_acc" in r]
for tail in ("on", "off"):
    a = [r["test_acc"] for r in acc if f"tail_{tail}_" in r["variant"]]
    if a:
        m = sum(a) / len(a)
        sd = (sum((x - m) ** 2 for x in a) / max(len(a) - 1, 1)) ** 0.5
        e = [r["epoch_s"] for r in acc if f"tail_{tail}_" in r["variant"]]
        print(f"accuracy, bn-tail {tail}: {m:.2f} +- {sd:.2f} % over {len(a)} seeds ({', '.join(f'{x:.2f}' for x in a)}); "
              f"s/epoch {sum(e) / len(e):.3f}")
PY
