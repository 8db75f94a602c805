#!/usr/bin/env bash
# FP8 on Hopper (issue 58), one call on the device machine:
#   1. binaries: the carried ones if they run here, else a fresh build (about 3-4 minutes on the H200 machine)
#   2. tests: the FP8 unit tests on the GPU (the kernel, the device scale, the layer and the step against the CPU;
#      TESTS_FILTER, default Fp8*)
#   3. gpt: a GPT of GPT_SHAPE (layers:heads:width; default 12:12:768, 85 M parameters) on tinyshakespeare, the ARMS
#      side by side per seed (SEEDS, default 0), GPT_EPOCHS epochs (default 3) at batch 64 x 256 tokens, AdamW; the
#      steady epochs' time (the mean over the epochs after the first) and the last validation loss. ARMS (default
#      "amp-bf16 amp-fp8"): amp-bf16, amp-fp8, ta-fp8 (--method tri-accel --precision amp-fp8: the FP8 ladder),
#      ta-bf16 (--method tri-accel --precision amp-bf16); TA_ARGS is added to the tri-accel arms.
# Results: $OUT/fp8_gpt.json (rows and the ratios), the runs' events, the test log, and a table printed last; copy
# them to bench/results/<gpu>/. Usage: COMMIT=<hash> bash bench/run_fp8.sh [stages], stages ⊆ {tests,gpt}.
set -uo pipefail
STAGES=${1:-tests,gpt}
FINAL_OUT=${OUT:-out}
WORK=/tmp/fp8_out
rm -rf "$WORK" && mkdir -p "$WORK" "$FINAL_OUT"
source "$(dirname "$0")/device_env.sh"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "gpu: $GPU; torch: $(python3 -c 'import torch; print(torch.__version__)')"
device_binaries "$WORK" triaccel_tests
echo "host command: COMMIT=${COMMIT:-unknown} SEEDS='${SEEDS:-0}' ARMS='${ARMS:-amp-bf16 amp-fp8}' TA_ARGS='${TA_ARGS:-}' GPT_SHAPE=${GPT_SHAPE:-12:12:768} GPT_EPOCHS=${GPT_EPOCHS:-3} bash bench/run_fp8.sh $STAGES" \
  >"$FINAL_OUT/commands.txt"

if [[ $STAGES == *tests* ]]; then
  "$BIN/triaccel_tests" --gtest_brief=1 --gtest_filter="${TESTS_FILTER:-Fp8*}" >"$FINAL_OUT/fp8_tests_gpu.log" 2>&1
  echo "FP8 unit tests on the GPU: exit $? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$FINAL_OUT/fp8_tests_gpu.log" | tr '\n' ' ')"
  grep -E "^\[  FAILED|Failure|Expected|Which is|error" "$FINAL_OUT/fp8_tests_gpu.log" | head -20
fi

if [[ $STAGES == *gpt* ]]; then
  mkdir -p /tmp/shakespeare && cp .device/data/tinyshakespeare/input.txt /tmp/shakespeare/
  IFS=: read -r layers heads width <<<"${GPT_SHAPE:-12:12:768}"
  COMMON=(--model gpt-char --dataset tinyshakespeare --data /tmp/shakespeare --gpt-layers "$layers" --gpt-heads "$heads"
          --gpt-embed "$width" --block-size 256 --batch-size 64 --epochs "${GPT_EPOCHS:-3}" --warmup-epochs 1
          --optimizer adamw --lr 6e-4 --weight-decay 0.1 --progress lines --log-every 100000)
  for seed in ${SEEDS:-0}; do
    for arm in ${ARMS:-amp-bf16 amp-fp8}; do
      case $arm in
        ta-fp8) flags=(--method tri-accel --precision amp-fp8 ${TA_ARGS:-}) ;;
        ta-bf16) flags=(--method tri-accel --precision amp-bf16 ${TA_ARGS:-}) ;;
        *) flags=(--precision "$arm") ;;
      esac
      name=gpt_${arm}_s$seed
      echo "== $name: triaccel train ${COMMON[*]} ${flags[*]} --seed $seed" | tee -a "$FINAL_OUT/commands.txt"
      timeout "${RUN_TIMEOUT:-240}" "$BIN/triaccel" train "${COMMON[@]}" "${flags[@]}" --seed "$seed" \
        --out "$WORK/$name" >"$WORK/$name.log" 2>&1
      echo "exit $?: $(grep -E 'amp-fp8|done:|error' "$WORK/$name.log" | tr '\n' ' ')"
      cp "$WORK/$name/events.jsonl" "$FINAL_OUT/$name.events.jsonl" 2>/dev/null
    done
  done
  python3 - "$FINAL_OUT" "$GPU" "${COMMIT:-unknown}" <<'PY'
import glob, json, os, sys
out, gpu, commit = sys.argv[1:4]
rows = {}
for f in sorted(glob.glob(f"{out}/gpt_*.events.jsonl")):
    ev = [json.loads(l) for l in open(f)]
    name = os.path.basename(f).split(".")[0]
    arm = name[len("gpt_"):].rsplit("_s", 1)[0]
    summary = [e for e in ev if e["event"] == "summary"]
    epochs = [e for e in ev if e["event"] == "epoch"]
    if not summary:
        print(f"{name}: no summary"); continue
    s = summary[-1]
    times = [e.get("epoch_s") for e in epochs]
    steady = times[1:] or times  # the first epoch holds the start-up (cuDNN's plans, the capture)
    last_precisions = [e["precision"] for e in ev if e["event"] == "precision"][-1:]
    rows[name] = {"run": name, "arm": arm, "precision": s["precision"], "seed": int(name.rsplit("_s", 1)[1]),
                  "unit_precisions": last_precisions[0] if last_precisions else None,
                  "probe_share": s.get("probe_share"),
                  "epoch_s": sum(steady) / len(steady), "val_loss": s["test_loss"], "peak_vram_gb": s["peak_vram_gb"],
                  "params": s["params"], "fp8_layers": s.get("fp8_layers"),
                  "tokens_per_s": epochs[-1].get("tokens_per_s") if epochs else None,
                  "epoch_times": times}
pairs = []
for n, r in rows.items():
    if r["arm"] == "amp-bf16":
        continue
    b = rows.get(f"gpt_amp-bf16_s{r['seed']}")
    if b:
        pairs.append({"arm": r["arm"], "seed": r["seed"], "speedup": b["epoch_s"] / r["epoch_s"],
                      "val_loss_change": r["val_loss"] / b["val_loss"] - 1})
json.dump({"gpu": gpu, "commit": commit, "rows": list(rows.values()), "pairs": pairs},
          open(f"{out}/fp8_gpt.json", "w"), indent=1)
print("\n| run | params | fp8 layers | units at fp8 (end) | s/epoch | tokens/s | val loss | peak GB |")
print("|---|---|---|---|---|---|---|---|")
for r in rows.values():
    tps = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-"
    up = r["unit_precisions"]
    units = f"{up.count('fp8')}/{len(up)}" if up else "-"
    print(f"| {r['run']} | {r['params'] / 1e6:.1f} M | {r['fp8_layers']} | {units} | {r['epoch_s']:.3f} | {tps} | "
          f"{r['val_loss']:.4f} | {r['peak_vram_gb']:.3f} |")
for p in pairs:
    print(f"seed {p['seed']}: {p['arm']} {p['speedup']:.3f}x amp-bf16's speed, validation loss {100 * p['val_loss_change']:+.2f} %")
PY
fi
