#!/usr/bin/env bash
# Which GPUs each process of a run holds memory on, and from when: nvidia-smi's compute apps sampled every 0.25 s
# beside a run of ours, with the run's own output lines timestamped on the same clock. Finds CUDA contexts a rank makes
# on a GPU not its own (each costs ~518 MiB on an H100). Variants: "two" (--nproc 2 backprop), "one_gpu1" (one
# process on GPU 1 through LOCAL_RANK=1, WORLD_SIZE=1).
# Usage: OUT=$OUT VARIANTS="two one_gpu1" bash dev/probe_rank_contexts.sh
set -uo pipefail
FINAL_OUT=${OUT:-out}
mkdir -p "$FINAL_OUT"
source "$(dirname "$0")/../bench/device_env.sh"
cifar10_bin >/dev/null 2>&1
BIN=${BIN:-.device/bin/triaccel}
args=(train --dataset cifar10 --data "$DATA" --model resnet18 --method backprop --epochs 3 --batch-size 96
      --vram-budget 0.5GB --precision amp-bf16 --progress lines --log-every 50)
for variant in ${VARIANTS:-two one_gpu1}; do
  log=$FINAL_OUT/contexts_$variant.txt
  t0=$(date +%s.%N)
  since() { awk -v a="$(date +%s.%N)" -v b="$t0" 'BEGIN { printf "%7.2f", a - b }'; }
  stamp() { while IFS= read -r line; do printf '%s run %s\n' "$(since)" "$line"; done; }
  case $variant in
    two) "$BIN" "${args[@]}" --nproc 2 --out "/tmp/ctx_$variant" 2>&1 | stamp >"$log.run" & ;;
    one_gpu1) LOCAL_RANK=1 WORLD_SIZE=1 "$BIN" "${args[@]}" --out "/tmp/ctx_$variant" 2>&1 | stamp >"$log.run" & ;;
  esac
  runner=$!
  while kill -0 "$runner" 2>/dev/null; do
    now=$(since)
    nvidia-smi --query-compute-apps=gpu_bus_id,pid,used_memory --format=csv,noheader 2>/dev/null |
      sed "s/^/$now smi /" >>"$log.smi"
    sleep 0.25
  done
  sort -n "$log.run" "$log.smi" 2>/dev/null >"$log"
  rm -f "$log.run" "$log.smi"
  echo "== $variant: first sighting of each (GPU, pid), then the run's lines around them"
  awk '$2 == "smi" { key = $3 " " $4; if (!(key in seen)) { seen[key] = 1; print } }' "$log"
  grep -E ' run ' "$log" | head -8
done
nvidia-smi --query-gpu=index,pci.bus_id --format=csv,noheader
