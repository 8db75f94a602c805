#!/usr/bin/env bash
# Faults on the GPU (issue 7), one call on a device machine with one GPU: ResNet-18 on CIFAR-10 for 2 epochs under
# amp-bf16 and amp-fp16, CUDA graphs on, with injected faults (--inject-faults; docs/reliability.md): two
# out-of-memory errors raised by the CUDA caching allocator itself, plus a seeded random plan of NaN and inf
# gradients and bursts of 3 NaN losses. Then checks, from each run's events.jsonl:
#   - training continued: the run ends with a summary and model.pt, test accuracy > 35 % after 2 epochs
#   - skips counted and logged: one skip event per skipped attempt, their number = summary skipped_steps; every
#     injected NaN/inf fault is among them (reason, injected); none dropped
#   - out of memory: one oom event per injected error (injected: true, retry at half the batch) = oom_retries
#   - no sample lost: every epoch event reports samples = 50000 and dropped_samples = 0
#   - CUDA graphs: on in the last epoch, re-captured after each batch change (graph_captures >= 2)
#   - amp-fp16: the loss scale follows GradScaler: each skip halves it (65536 / 2^k at the k-th skip, no growth
#     within 2000 steps); amp-bf16: the scale stays 1
# Writes $OUT/faults.json (commands, counters, checks) and $OUT/faults_events/<run>.jsonl; copy them to
# bench/results/<gpu>/. GPU time: about a minute (two 2-epoch runs). Usage: bash bench/run_faults.sh
set -uo pipefail
FINAL_OUT=${OUT:-out}
WORK=/tmp/faults_out
rm -rf "$WORK"
mkdir -p "$WORK" "$FINAL_OUT/faults_events"
source "$(dirname "$0")/device_env.sh"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "gpu: $GPU; torch: $(python3 -c 'import torch; print(torch.__version__)')"
device_binaries "$WORK"
cifar10_bin

FAULTS="oom@40,oom@250,random:seed=7,nan-grad=0.01,inf-grad=0.005,nan-loss=0.005,burst=3"
COMMON="--model resnet18 --dataset cifar10 --data $DATA --batch-size 256 --lr 0.2 --epochs 2 --warmup-epochs 0.5
        --label-smoothing 0.1 --cuda-graphs true --device cuda --progress lines --log-every 100"
: >"$WORK/commands.txt"
for prec in amp-bf16 amp-fp16; do
  cmd="$BIN/triaccel train $COMMON --precision $prec --inject-faults $FAULTS --out $WORK/$prec"
  echo "$cmd" | tr -s ' \n' '  ' >>"$WORK/commands.txt"; echo >>"$WORK/commands.txt"
  echo "== $prec"
  $cmd 2>&1 | tail -5
  cp "$WORK/$prec/events.jsonl" "$FINAL_OUT/faults_events/r18_$prec.jsonl" 2>/dev/null
done

python3 - "$WORK" "$FINAL_OUT/faults.json" "$GPU" <<'PY'
import json, os, sys
work, out_path, gpu = sys.argv[1], sys.argv[2], sys.argv[3]
commands = [l.strip() for l in open(f"{work}/commands.txt") if l.strip()]
result = {"gpu": gpu, "runs": [], "ok": True}
for prec, cmd in zip(["amp-bf16", "amp-fp16"], commands):
    run = {"precision": prec, "command": cmd, "checks": {}}
    checks = run["checks"]
    path = f"{work}/{prec}/events.jsonl"
    ev = [json.loads(l) for l in open(path)] if os.path.exists(path) else []
    s = ev[-1] if ev and ev[-1]["event"] == "summary" else None
    skips = [e for e in ev if e["event"] == "skip"]
    ooms = [e for e in ev if e["event"] == "oom"]
    epochs = [e for e in ev if e["event"] == "epoch"]
    checks["finished"] = s is not None and os.path.exists(f"{work}/{prec}/model.pt")
    checks["learned"] = s is not None and s["test_acc"] > 35
    checks["skips_logged_and_counted"] = s is not None and len(skips) == s["skipped_steps"] and len(skips) > 0
    injected_nan = [e for e in skips if e["injected"]]
    checks["injected_nan_faults_skipped"] = len(injected_nan) > 0 and all(
        e["reason"] in ("nan-grad", "inf-grad", "nan-loss") for e in injected_nan)
    checks["none_dropped"] = s is not None and s["dropped_samples"] == 0 and all(e["action"] == "retry" for e in skips)
    checks["oom_retried"] = (s is not None and len(ooms) == s["oom_retries"] >= 2 and
                             all(e["injected"] and e["retry_batch"] < e["batch"] for e in ooms))
    checks["every_sample_trained"] = len(epochs) == 2 and all(e["samples"] == 50000 for e in epochs)
    checks["cuda_graphs"] = bool(epochs) and epochs[-1]["cuda_graph"] and epochs[-1]["graph_captures"] >= 2
    scales = [e["loss_scale"] for e in skips]
    if prec == "amp-fp16":
        checks["grad_scaler_backoff"] = scales == [65536.0 / 2 ** (k + 1) for k in range(len(scales))]
    else:
        checks["scale_stays_1"] = all(x == 1.0 for x in scales)
    run["counters"] = {k: s.get(k) for k in ("steps", "skipped_steps", "skip_retries", "oom_retries",
                                              "dropped_samples", "injected_faults", "test_acc", "epoch_s")} if s else {}
    run["skips_by_reason"] = {r: sum(e["reason"] == r for e in skips) for r in sorted({e["reason"] for e in skips})}
    run["oom_events"] = [{k: e[k] for k in ("step", "batch", "retry_batch", "injected")} for e in ooms]
    run["samples_per_epoch"] = [e["samples"] for e in epochs]
    run["ok"] = all(checks.values())
    result["ok"] = result["ok"] and run["ok"]
    result["runs"].append(run)
    print(prec, "ok" if run["ok"] else "FAILED", json.dumps(checks), json.dumps(run["counters"]))
json.dump(result, open(out_path, "w"), indent=1)
print("faults:", "all checks passed" if result["ok"] else "SOME CHECKS FAILED", "->", out_path)
sys.exit(0 if result["ok"] else 1)
PY
