#!/usr/bin/env bash
# A/B of two builds on one GPU in one device call: is the behaviour unchanged (a refactor), or by how much did it move?
#   A: .device/a/{triaccel,bench_train_throughput}    B: .device/b/{triaccel,bench_train_throughput,triaccel_tests}
#      (binaries built on the CPU machine and carried: `carry: [".device"]`)
#   1. B's unit tests on the GPU (GPU tests skip on a CPU machine, so this is where they run)
#   2. throughput: bench_train_throughput of A, B, A, B interleaved (ResNet-18, batch 96 and 512, fp32 / amp-bf16 /
#      amp-fp16, synthetic input, median of 5 x 50 steps); each row's B/A from the two medians of each build
#   3. training: ResNet-18 on the CIFAR-10 copy, amp-bf16, batch 512, 2 epochs, seed 0, cuDNN heuristics (autotuning
#      picks algorithms by timing, so two runs of one binary may differ): A, B, A again (A vs A is the run-to-run floor)
# Results in $OUT: ab.json (every row) and ab_logs.tgz; a short table last. Set A_COMMIT / B_COMMIT (the device copy
# has no .git). Usage: A_COMMIT=... B_COMMIT=... bash bench/run_ab.sh
set -uo pipefail
FINAL_OUT=${OUT:-out}
WORK=/tmp/ab_out
rm -rf "$WORK"
mkdir -p "$WORK" "$FINAL_OUT"
source "$(dirname "$0")/device_env.sh"  # LD_LIBRARY_PATH for the carried binaries; cifar10_bin
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "gpu: $GPU; A ${A_COMMIT:-?} B ${B_COMMIT:-?}"
A=.device/a
B=.device/b
for bin in "$A/triaccel" "$A/bench_train_throughput" "$B/triaccel" "$B/bench_train_throughput" "$B/triaccel_tests"; do
  "$bin" --help >/dev/null 2>&1 || { echo "missing or not runnable here: $bin"; exit 1; }
done

TRIACCEL_SOURCE_DIR=$(pwd) "$B/triaccel_tests" --gtest_brief=1 >"$WORK/unit_tests_gpu.log" 2>&1
echo "unit tests (B) on the GPU: exit $?; $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$WORK/unit_tests_gpu.log" | tr '\n' ' ')"

for round in 1 2; do
  for side in a b; do
    bin=.device/$side/bench_train_throughput
    "$bin" --out "$WORK/throughput_${side}${round}.json" >"$WORK/throughput_${side}${round}.log" 2>&1 ||
      echo "bench $side round $round failed: $(tail -2 "$WORK/throughput_${side}${round}.log")"
  done
done

cifar10_bin
train() {  # train SIDE NAME
  local side=$1 name=$2
  rm -rf "/tmp/ab_runs/$name"
  ".device/$side/triaccel" train --model resnet18 --dataset cifar10 --data "$DATA" --epochs 2 --batch-size 512 \
    --precision amp-bf16 --cudnn-autotune off --seed 0 --progress lines --log-every 100000 --out "/tmp/ab_runs/$name" \
    >"$WORK/$name.log" 2>&1 || echo "training $name failed: $(tail -2 "$WORK/$name.log")"
  cp "/tmp/ab_runs/$name/events.jsonl" "$WORK/$name.events.jsonl" 2>/dev/null
}
train a train_a
train b train_b
train a train_a2

python3 - "$WORK" "$FINAL_OUT/ab.json" "$GPU" "${A_COMMIT:-unknown}" "${B_COMMIT:-unknown}" <<'PY'
import json, os, statistics, sys
work, dst, gpu, a_commit, b_commit = sys.argv[1:6]

def load(path):
    try:
        return json.load(open(path))
    except Exception:
        return None

rows = []
for side in "ab":
    for rnd in (1, 2):
        r = load(f"{work}/throughput_{side}{rnd}.json")
        for row in (r or {}).get("rows", []):
            rows.append((side, rnd, row))
table = []
keys = sorted({(row["batch"], row["precision"]) for _, _, row in rows}, key=lambda k: (k[0], k[1]))
for batch, prec in keys:
    def runs(side):
        return [row for s, _, row in rows if s == side and row["batch"] == batch and row["precision"] == prec]
    a, b = runs("a"), runs("b")
    if not a or not b:
        continue
    ia = statistics.median(r["images_per_s"] for r in a)
    ib = statistics.median(r["images_per_s"] for r in b)
    table.append({"batch": batch, "precision": prec, "a_images_per_s": [r["images_per_s"] for r in a],
                  "b_images_per_s": [r["images_per_s"] for r in b], "b_over_a": ib / ia,
                  "a_peak_gb": a[0]["peak_allocated_gb"], "b_peak_gb": b[0]["peak_allocated_gb"]})

def epochs(name):
    try:
        ev = [json.loads(l) for l in open(f"{work}/{name}.events.jsonl")]
    except Exception:
        return []
    return [{k: e.get(k) for k in ("epoch", "train_loss", "test_loss", "test_acc", "epoch_s", "peak_vram_gb")}
            for e in ev if e["event"] == "epoch"]

train = {name: epochs(name) for name in ("train_a", "train_b", "train_a2")}
out = {"bench": "ab", "gpu": gpu, "a_commit": a_commit, "b_commit": b_commit,
       "command": f"A_COMMIT={a_commit} B_COMMIT={b_commit} bash bench/run_ab.sh",
       "throughput": table, "training": train}
json.dump(out, open(dst, "w"), indent=2)

print(f"\nthroughput, {gpu}: B/A from the medians of two runs each (A {a_commit}, B {b_commit})")
print(f"{'batch':>5} {'precision':>9} {'A img/s':>18} {'B img/s':>18} {'B/A':>6} {'peak A/B GB':>14}")
for t in table:
    fa = "/".join(f"{x:,.0f}" for x in t["a_images_per_s"])
    fb = "/".join(f"{x:,.0f}" for x in t["b_images_per_s"])
    print(f"{t['batch']:>5} {t['precision']:>9} {fa:>18} {fb:>18} {t['b_over_a']:6.3f} "
          f"{t['a_peak_gb']:.3f}/{t['b_peak_gb']:.3f}")
print("\ntraining (ResNet-18, amp-bf16, b512, 2 epochs, heuristics): per epoch train loss / test loss / test acc")
for name, ep in train.items():
    print(f"{name:9s} " + "  ".join(f"e{e['epoch']}: {e['train_loss']:.6f} / {e['test_loss']:.6f} / {e['test_acc']:.2f}%"
                                   for e in ep))
PY
tar -C "$WORK" -czf "$FINAL_OUT/ab_logs.tgz" . 2>/dev/null
cp "$WORK/unit_tests_gpu.log" "$FINAL_OUT/" 2>/dev/null
