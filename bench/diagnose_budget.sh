#!/usr/bin/env bash
# Diagnosis, not a benchmark: why runs under a small --vram-budget are slow (bench/results/h200/neuroflux: a NeuroFlux
# block epoch of 174 s, backprop at batch 76 under 0.5 GB at 1.7k img/s) and why amp-bf16 steps are slower than
# amp-fp16 ones (bench/profile_kernels.py). Prints, per variant of the allocator settings, the NeuroFlux plan and blocks
# (seconds, allocator retries, cache placement) and backprop's epoch rate. Usage: bash bench/diagnose_budget.sh
# env: BUDGET (0.5GB), MODEL (resnet18), VARIANTS ("default expandable"), T_NF (150 s per NeuroFlux run)
set -uo pipefail
FINAL_OUT=${OUT:-out}
mkdir -p "$FINAL_OUT/runs"
source "$(dirname "$0")/device_env.sh"
device_binaries "$FINAL_OUT"
cifar10_bin
BUDGET=${BUDGET:-0.5GB}
MODEL=${MODEL:-resnet18}
T_NF=${T_NF:-150}
if [ -n "${PROFILE:-}" ]; then
  (cd bench && python3 profile_kernels.py --out "$FINAL_OUT/profile_kernels.json" 2>&1 | tail -32) || true
fi
(cd bench && python3 check_bn_bf16.py --out "$FINAL_OUT/check_bn_bf16.json" 2>&1 | tail -8) || true
COMMON=(--dataset cifar10 --data "$DATA" --epochs 1 --precision amp-bf16 --progress lines --log-every 100000
        --model "$MODEL" --vram-budget "$BUDGET")
show_nf() {
  python3 - "$1/events.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    e = json.loads(l)
    if e["event"] == "plan":
        print("plan:", [(b["units"][0] + ".." + b["units"][-1], b["batch"], round(b["predicted_gb"], 3)) for b in e["blocks"]],
              "backprop_max_batch", e["backprop_max_batch"], "resident_gb", round(e["resident_gb"], 3))
    elif e["event"] == "block":
        print(f"block {e['block']}: batch {e['batch']}->{e['final_batch']} train {e['train_s']:.2f}s cache {e['cache_s']:.2f}s "
              f"peak {e['peak_vram_gb']:.3f}/{e['predicted_gb']:.3f} GB retries {e.get('alloc_retries')} in {e['input_cache_place']} out {e['output_cache_place']}")
    elif e["event"] == "oom":
        print("oom", {k: e.get(k) for k in ("block", "batch", "retry_batch")})
    elif e["event"] == "summary":
        print("summary", {k: e.get(k) for k in ("test_acc", "train_s", "peak_vram_gb", "block_batches")})
PY
}
for v in ${VARIANTS:-default expandable}; do
  case $v in
    default) unset PYTORCH_ALLOC_CONF ;;
    expandable) export PYTORCH_ALLOC_CONF=expandable_segments:True ;;
  esac
  echo "== $v: neuroflux $MODEL $BUDGET"
  timeout "$T_NF" "$BIN/triaccel" train --method neuroflux "${COMMON[@]}" --out "$FINAL_OUT/runs/nf_$v" 2>&1 | grep -E "^(block|done)" | tail -12
  show_nf "$FINAL_OUT/runs/nf_$v"
  batch=$(python3 -c "import json,sys; print([json.loads(l) for l in open(sys.argv[1])][1]['backprop_max_batch'])" "$FINAL_OUT/runs/nf_$v/events.jsonl")
  lr=$(python3 -c "print(0.1 * ($batch / 128) ** 0.5)")
  echo "== $v: backprop $MODEL $BUDGET batch $batch"
  timeout 120 "$BIN/triaccel" train "${COMMON[@]}" --batch-size "$batch" --lr "$lr" --out "$FINAL_OUT/runs/bp_$v" 2>&1 | grep -E "^(epoch|done)" | tail -3
  python3 -c "
import collections, json, sys
ooms = collections.Counter()
for l in open(sys.argv[1]):
    e = json.loads(l)
    if e['event'] == 'oom': ooms[(e.get('phase', 'train'), e['batch'])] += 1
    if e['event'] == 'epoch': print('epoch', {k: e.get(k) for k in ('epoch_s', 'images_per_s', 'peak_vram_gb', 'alloc_retries', 'cuda_graph', 'graph_captures', 'batch')})
print('oom events by (phase, batch):', dict(ooms))
" "$FINAL_OUT/runs/bp_$v/events.jsonl"
done
unset PYTORCH_ALLOC_CONF
for d in "$FINAL_OUT"/runs/*; do gzip -c "$d/events.jsonl" > "$FINAL_OUT/$(basename "$d").events.jsonl.gz"; done
rm -rf "$FINAL_OUT/runs"
