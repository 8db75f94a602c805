#!/usr/bin/env bash
# The BAOC and NeuroFlux GPU jobs side by side on a machine with 4 GPUs, one stage per GPU, in one device call:
#   GPU 0: BAOC unit tests, bench_optim_step, ResNet-18 (run_baoc.sh tests,bench,train)
#   GPU 1: BAOC ViT-Tiny, then char-GPT (run_baoc.sh vit, then gpt)
#   GPU 2: NeuroFlux vs backprop under 0.5 GB / 1 GB budgets (run_neuroflux.sh)
#   GPU 3: every unit test on the GPU, then the grad-statistics cost (bench_train_throughput --grad-stats both)
# Results under $OUT/{baoc_r18,baoc_vit,baoc_gpt,neuroflux,gpu3}/ (events and JSON only; checkpoints stay behind).
set -uo pipefail
FINAL=${OUT:-out}
mkdir -p "$FINAL"
source "$(dirname "$0")/device_env.sh"  # LD_LIBRARY_PATH for the carried binaries
cifar10_bin  # once, before the stages that need it start side by side
(CUDA_VISIBLE_DEVICES=0 BAOC_WORK=/tmp/baoc_r18 OUT=$FINAL/baoc_r18 bash bench/run_baoc.sh tests,bench,train \
  >"$FINAL/baoc_r18.log" 2>&1; echo "baoc r18: exit $?") &
(CUDA_VISIBLE_DEVICES=1 BAOC_WORK=/tmp/baoc_vit OUT=$FINAL/baoc_vit bash bench/run_baoc.sh vit >"$FINAL/baoc_vit.log" 2>&1;
 CUDA_VISIBLE_DEVICES=1 BAOC_WORK=/tmp/baoc_gpt OUT=$FINAL/baoc_gpt bash bench/run_baoc.sh gpt >"$FINAL/baoc_gpt.log" 2>&1;
 echo "baoc vit+gpt: exit $?") &
(CUDA_VISIBLE_DEVICES=2 OUT=/tmp/nf bash bench/run_neuroflux.sh >"$FINAL/neuroflux.log" 2>&1; rc=$?
 mkdir -p "$FINAL/neuroflux"; cp /tmp/nf/*.json "$FINAL/neuroflux/" 2>/dev/null
 for d in /tmp/nf/runs/*/; do
   n=$(basename "$d"); cp "$d/events.jsonl" "$FINAL/neuroflux/$n.events.jsonl" 2>/dev/null
   cp "$d/exit.json" "$FINAL/neuroflux/$n.exit.json" 2>/dev/null
 done
 echo "neuroflux: exit $rc") &
(mkdir -p "$FINAL/gpu3"; CUDA_VISIBLE_DEVICES=3 .device/bin/triaccel_tests --gtest_brief=1 >"$FINAL/gpu3/unit_tests_gpu.log" 2>&1
 echo "unit tests on GPU: exit $? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$FINAL/gpu3/unit_tests_gpu.log" | tr '\n' ' ')"
 CUDA_VISIBLE_DEVICES=3 .device/bin/bench_train_throughput --batch-sizes 96,512 --precisions amp-bf16,amp-fp16 \
   --grad-stats both --out "$FINAL/gpu3/grad_stats_cost.json" >"$FINAL/gpu3/grad_stats.log" 2>&1
 cat "$FINAL/gpu3/grad_stats.log") &
wait
for f in baoc_r18 baoc_vit baoc_gpt; do echo "== $f"; tail -15 "$FINAL/$f.log"; done
echo "== neuroflux"; tail -15 "$FINAL/neuroflux.log"
grep -B2 -A12 "FAILED\|Failure" "$FINAL/gpu3/unit_tests_gpu.log" | head -40
