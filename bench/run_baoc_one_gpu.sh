#!/usr/bin/env bash
# BAOC's training workloads side by side on ONE GPU, in one device call: ResNet-18, ViT-Tiny and char-GPT
# (bench/run_baoc.sh train / vit / gpt) run as three concurrent processes. Quality, state bytes and peak VRAM are
# per process and unaffected; s/epoch is not comparable with a GPU to itself (use run_baoc.sh alone for times).
# Environment passed through: RISK_FLOORS, SEEDS, EPOCHS, VIT_EPOCHS, GPT_EPOCHS, COMMIT. WORKLOADS picks a subset
# (default "r18 vit gpt").
# Results: $OUT/baoc_{r18,vit,gpt}/ (baoc.tgz with every events file, baoc_acceptance.json) and the tables last.
set -uo pipefail
FINAL=${OUT:-out}
mkdir -p "$FINAL"
source "$(dirname "$0")/device_env.sh"
cifar10_bin  # once, before the stages start side by side
WORKLOADS=${WORKLOADS:-r18 vit gpt}
for name in $WORKLOADS; do
  stage=$([ "$name" = r18 ] && echo train || echo "$name")
  (BAOC_WORK=/tmp/baoc_$name OUT=$FINAL/baoc_$name bash bench/run_baoc.sh "$stage" >"/tmp/baoc_$name.log" 2>&1
   echo "baoc $name: exit $?") &
done
wait
for name in $WORKLOADS; do
  cp "/tmp/baoc_$name.log" "$FINAL/baoc_$name/" 2>/dev/null
  echo "== $name"; grep -A40 "^run " "/tmp/baoc_$name.log"
done
