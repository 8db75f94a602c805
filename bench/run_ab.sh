#!/usr/bin/env bash
# A/B of two builds on one GPU in one device call: is the behaviour unchanged (a refactor), or by how much did it move?
#   A: .device/a/{triaccel,bench_train_throughput}    B: .device/b/{triaccel,bench_train_throughput[,triaccel_tests]}
#      (built on the CPU machine and carried, `carry: [".device"]`, or built here: AB_BUILD below)
#   1. (AB_STAGES tests) B's unit tests on the GPU (GPU tests skip on a CPU machine, so this is where they run)
#   2. (throughput) bench_train_throughput of A, B, A, B interleaved (ResNet-18, batch 96 and 512, fp32 / amp-bf16 /
#      amp-fp16 unless AB_THROUGHPUT_ARGS says otherwise, synthetic input, median of 5 x 50 steps); each row's B/A
#      from the two medians of each build
#   3. (train) ResNet-18 on the CIFAR-10 copy, amp-bf16, batch 512, 2 epochs, seed 0, cuDNN heuristics (autotuning
#      picks algorithms by timing, so two runs of one binary may differ): A, B, A again (A vs A is the run-to-run floor)
#   4. (behaviour) issue 55's runs, A then B: Tri-Accel's 15-epoch protocol at seed 0, NeuroFlux ResNet-18 at 0.3 GB,
#      backprop ResNet-18 b96 at 0.4 GB; each pair's events compared apart from their timings
# AB_BUILD=a, b or "a b": build that side here first (A from .device/a_src, the tree of A_COMMIT made on the CPU
# machine with `git archive A_COMMIT | tar -x -C .device/a_src`; B from this checkout), the same flags for both, into
# .device/a|b; AB_PACK=1 also writes them xz-compressed to $OUT (carry them back as .device/a|b/NAME.xz).
# Results in $OUT: ab.json (every row) and ab_logs.tgz; a short table last. Set A_COMMIT / B_COMMIT (the device copy
# has no .git). Usage: A_COMMIT=... B_COMMIT=... [AB_STAGES=throughput,train,behaviour] bash bench/run_ab.sh
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
STAGES=${AB_STAGES:-tests,throughput,train}
stage() { [[ ",$STAGES," == *",$1,"* ]]; }

ab_build() {  # ab_build SIDE: the CLI and the throughput bench, the same flags on either side (device_env.sh)
  local side=$1 src=. t0=$SECONDS
  [ "$side" = a ] && src=.device/a_src
  device_cmake_build "$src" "build-ab-$side" "$WORK" "-DTRIACCEL_BUILD_TESTS=OFF" triaccel_cli bench_train_throughput ||
    { echo "build $side failed"; return 1; }
  mkdir -p ".device/$side"
  cp "build-ab-$side/triaccel" "build-ab-$side/bench_train_throughput" ".device/$side/"
  echo "built $side in $((SECONDS - t0)) s"
  if [ -n "${AB_PACK:-}" ]; then
    for f in triaccel bench_train_throughput; do xz -T0 -6 -c ".device/$side/$f" >"$FINAL_OUT/${side}_$f.xz"; done
  fi
}
for side in ${AB_BUILD:-}; do ab_build "$side" || exit 1; done
for packed in .device/a/*.xz .device/b/*.xz; do  # carried back compressed
  [ -e "$packed" ] && [ ! -x "${packed%.xz}" ] && xz -dc "$packed" >"${packed%.xz}" && chmod +x "${packed%.xz}"
done
[ -z "${AB_RUN_AFTER_BUILD-1}" ] && exit 0
need=("$A/triaccel" "$B/triaccel")
stage throughput && need+=("$A/bench_train_throughput" "$B/bench_train_throughput")
stage tests && need+=("$B/triaccel_tests")
for bin in "${need[@]}"; do
  "$bin" --help >/dev/null 2>&1 || { echo "missing or not runnable here: $bin"; exit 1; }
done

if stage tests; then
  TRIACCEL_SOURCE_DIR=$(pwd) "$B/triaccel_tests" --gtest_brief=1 >"$WORK/unit_tests_gpu.log" 2>&1
  echo "unit tests (B) on the GPU: exit $?; $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$WORK/unit_tests_gpu.log" | tr '\n' ' ')"
fi

if stage throughput; then
  for round in 1 2; do
    for side in a b; do
      bin=.device/$side/bench_train_throughput
      # shellcheck disable=SC2086  # AB_THROUGHPUT_ARGS is a list of flags
      "$bin" ${AB_THROUGHPUT_ARGS:-} --out "$WORK/throughput_${side}${round}.json" >"$WORK/throughput_${side}${round}.log" 2>&1 ||
        echo "bench $side round $round failed: $(tail -2 "$WORK/throughput_${side}${round}.log")"
    done
  done
fi

cifar10_bin
train() {  # train SIDE NAME
  local side=$1 name=$2
  rm -rf "/tmp/ab_runs/$name"
  ".device/$side/triaccel" train --model resnet18 --dataset cifar10 --data "$DATA" --epochs 2 --batch-size 512 \
    --precision amp-bf16 --cudnn-autotune off --seed 0 --progress lines --log-every 100000 --out "/tmp/ab_runs/$name" \
    >"$WORK/$name.log" 2>&1 || echo "training $name failed: $(tail -2 "$WORK/$name.log")"
  cp "/tmp/ab_runs/$name/events.jsonl" "$WORK/$name.events.jsonl" 2>/dev/null
}
if stage train; then
  train a train_a
  train b train_b
  train a train_a2
fi

behave() {  # behave SIDE NAME FLAGS...: one of issue 55's runs
  local side=$1 name=$2
  shift 2
  rm -rf "/tmp/ab_runs/$name"
  timeout "${AB_RUN_TIMEOUT:-120}" ".device/$side/triaccel" train --dataset cifar10 --data "$DATA" --cudnn-autotune off --progress lines \
    --log-every 100000 --out "/tmp/ab_runs/$name" "$@" >"$WORK/$name.log" 2>&1 ||
    echo "$name failed: $(tail -2 "$WORK/$name.log")"
  cp "/tmp/ab_runs/$name/events.jsonl" "$WORK/$name.events.jsonl" 2>/dev/null
}
if stage behaviour; then
  for side in a b; do
    # shellcheck disable=SC2046  # the protocol's flags
    behave $side "tri15_$side" --model resnet18 $(tri_accel_protocol) --method tri-accel --seed 0
    behave $side "nf03_$side" --model resnet18 --method neuroflux --vram-budget 0.3GB --batch-size 96 --epochs 1 --seed 0
    behave $side "bud04_$side" --model resnet18 --vram-budget 0.4GB --batch-size 96 --precision amp-bf16 --epochs 2 --seed 0
  done
fi

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

TIMING = ("time", "_s", "per_s", "wall", "elapsed", "speed", "throughput", "ms")


def timing(key):
    return any(t in key for t in TIMING)


def flat(e, prefix=""):
    for k, v in (e.items() if isinstance(e, dict) else enumerate(e)):
        key = f"{prefix}{k}"
        if isinstance(v, (dict, list)):
            yield from flat(v, key + ".")
        else:
            yield key, v


def compare(a_name, b_name):
    """Events of two runs apart from their timings: the names in order, and every other field."""
    def load_events(name):
        try:
            return [json.loads(l) for l in open(f"{work}/{name}.events.jsonl") if l.strip()]
        except OSError:
            return None
    ea, eb = load_events(a_name), load_events(b_name)
    if ea is None or eb is None:
        return {"a": a_name, "b": b_name, "error": "missing events"}
    names_equal = [e["event"] for e in ea] == [e["event"] for e in eb]
    differ, worst = {}, 0.0
    for x, y in zip(ea, eb):
        fx, fy = dict(flat(x)), dict(flat(y))
        for k in sorted(set(fx) | set(fy)):
            if timing(k.split(".")[-1]) or k in ("config.commit", "config.out", "commit", "out"):
                continue
            u, v = fx.get(k), fy.get(k)
            if u == v:
                continue
            if isinstance(u, (int, float)) and isinstance(v, (int, float)) and not isinstance(u, bool):
                rel = abs(u - v) / max(abs(u), abs(v), 1e-12)
                worst = max(worst, rel)
                differ.setdefault(f"{x['event']}.{k}", rel)
            else:
                differ.setdefault(f"{x['event']}.{k}", f"{u!r} vs {v!r}"[:120])
    summary = lambda ev: next((e for e in reversed(ev) if e["event"] == "summary"), {})  # noqa: E731
    sa, sb = summary(ea), summary(eb)
    return {"a": a_name, "b": b_name, "events": [len(ea), len(eb)], "names_equal": names_equal,
            "fields_differing": len(differ), "worst_relative": worst, "differ": dict(list(differ.items())[:20]),
            "a_epoch_s": sa.get("epoch_s"), "b_epoch_s": sb.get("epoch_s"), "a_test_acc": sa.get("test_acc"),
            "b_test_acc": sb.get("test_acc")}


pairs = [("train_a", "train_a2"), ("train_a", "train_b")] + [(f"{r}_a", f"{r}_b") for r in ("tri15", "nf03", "bud04")]
behaviour = [compare(a, b) for a, b in pairs if os.path.exists(f"{work}/{a}.events.jsonl")]
out = {"bench": "ab", "gpu": gpu, "a_commit": a_commit, "b_commit": b_commit,
       "command": f"A_COMMIT={a_commit} B_COMMIT={b_commit} bash bench/run_ab.sh",
       "throughput": table, "training": train, "behaviour": behaviour}
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
print("\nevents apart from timings (A vs A again is the run-to-run floor)")
print(f"{'pair':22s} {'events':>9} {'names':>6} {'fields':>6} {'worst rel':>9} {'epoch_s A/B':>14} {'acc A/B':>14}")
for c in behaviour:
    if "error" in c:
        print(f"{c['a'] + '/' + c['b']:22s} {c['error']}")
        continue
    ep = "/".join(f"{x:.3f}" if isinstance(x, (int, float)) else "-" for x in (c["a_epoch_s"], c["b_epoch_s"]))
    acc = "/".join(f"{x:.2f}" if isinstance(x, (int, float)) else "-" for x in (c["a_test_acc"], c["b_test_acc"]))
    print(f"{c['a'] + '/' + c['b']:22s} {c['events'][0]:>4}/{c['events'][1]:<4} {str(c['names_equal']):>6} "
          f"{c['fields_differing']:>6} {c['worst_relative']:9.2e} {ep:>14} {acc:>14}")
PY
tar -C "$WORK" -czf "$FINAL_OUT/ab_logs.tgz" . 2>/dev/null
cp "$WORK/unit_tests_gpu.log" "$FINAL_OUT/" 2>/dev/null
