#!/usr/bin/env bash
# Tri-Accel's GPU acceptance job (issue 3), in one call on a device machine with one or more GPUs: the runs are
# queued longest first and each GPU takes the next one, so every run has a GPU to itself (timings are comparable
# within one call on one kind of GPU; see docs/measuring.md).
#   stage check: the unit tests on the GPU + short Tri-Accel runs (loop, elastic batch under a budget, probe share)
#   stage table: the paper's protocol (CIFAR-10 copy, batch 96, SGD momentum 0.9, 15 epochs = 5 warm-up + 10
#                cosine): ResNet-18 FP32 / AMP bf16 / AMP fp16 / Tri-Accel over 3 seeds, EfficientNet-B0 at 224×224
#                over 1 seed, the Table-2 ablation (each component alone, all combined) and the budget runs
#                (ResNet-18 --vram-budget 1GB, EfficientNet-B0 --vram-budget 3GB).
# Usage: bash bench/run_tri_accel.sh check|table|extra|r18|r18abl|effb0|signals|signals_effb0 (signals: issue 19's
# ablation on ResNet-18, 3 seeds; signals_effb0: EfficientNet-B0's AMP bf16 and Tri-Accel, seed 0, and ResNet-18's
# curvature-only rows; signals_tri: the signals stage's Tri-Accel and AMP bf16 rows alone; r18: ResNet-18's 12 Table-1 runs only, no
# unit tests beside them; r18abl: its Table-2 ablation and 1 GB budget run only; effb0: EfficientNet-B0's Tri-Accel
# and AMP bf16 rows, seed 0, EXTRA flags last; lockstep: ResNet-18's Tri-Accel with lockstep rounds and with per-unit probes beside AMP
# bf16, seeds SEEDS (0); chunks: lockstep rounds at each --curv-chunk in CHUNKS; fisher: the Fisher estimator, see
# its stage; costs: precision-only's levers one at a time, seed 0; peak: what is alive at the peak of AMP bf16,
# precision-only (not with SKIP_PREC) and Tri-Accel (seeds SEEDS, 0; TRIACCEL_MEMORY_HISTORY, bench/memory_peak.py); curv: curvature-lr-only beside AMP bf16, SEEDS; effb0_abl: EfficientNet-B0's single-signal rows beside AMP bf16;
# runs: the runs RUNS names, see its stage). Results: $OUT/tri_accel_out.tar.gz (every events.jsonl) and
# $OUT/tri_accel_table.{json,md} (bench/tri_accel_table.py). Set COMMIT=<hash> (the device copy has no .git).
# Every stage but runs takes the binaries' default curvature estimator: the Hessian before 9f79024, the Fisher since.
set -uo pipefail
STAGE=${1:-table}
FINAL_OUT=${OUT:-out}
OUT=/tmp/tri_accel_out
rm -rf "$OUT" /tmp/runs  # a machine kept warm between calls still holds the last call's runs
mkdir -p "$OUT" "$FINAL_OUT"
source "$(dirname "$0")/device_env.sh"  # LD_LIBRARY_PATH for the carried binaries
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
NGPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
echo "gpu: $NGPU x $GPU; torch: $(python3 -c 'import torch; print(torch.__version__)')"
device_binaries "$OUT" triaccel_tests

cifar10_bin

# The protocol's recipe for every method (bench/device_env.sh).
PROTO=$(tri_accel_protocol)
QUEUE=$OUT/queue
: >"$QUEUE"
job() { echo "$*" >>"$QUEUE"; }  # name, then train flags

if [ "$STAGE" = check ]; then
  job r18_tri_check --model resnet18 --method tri-accel $PROTO --epochs 2 --warmup-epochs 1
  job r18_tri_1GB_check --model resnet18 --method tri-accel $PROTO --epochs 2 --warmup-epochs 1 --vram-budget 1GB
  job effb0_tri_3GB_check --model efficientnet-b0 --image-size 224 --method tri-accel $PROTO --epochs 1 --warmup-epochs 0 --vram-budget 3GB
elif [ "$STAGE" = extra ]; then  # what a 10-minute table call leaves out: EfficientNet seed 1, ablation, budgets
  E="--model efficientnet-b0 --image-size 224"
  R="--model resnet18"
  job effb0_fp32_s1 $E --precision fp32 $PROTO --seed 1
  job effb0_bf16_s1 $E --precision amp-bf16 $PROTO --seed 1
  job effb0_tri_s1 $E --method tri-accel $PROTO --seed 1
  job effb0_fp16_s1 $E --precision amp-fp16 $PROTO --seed 1
  job effb0_tri_3GB_s0 $E --method tri-accel $PROTO --seed 0 --vram-budget 3GB --epochs 3 --warmup-epochs 1
  job r18_abl_batch_s0 $R --method tri-accel --ta-precision false --ta-curvature false --vram-budget 1GB $PROTO --seed 0
  job r18_abl_curv_s0 $R --method tri-accel --ta-precision false --ta-batch false $PROTO --seed 0
  job r18_abl_prec_s0 $R --method tri-accel --ta-curvature false --ta-batch false $PROTO --seed 0
  job r18_tri_1GB_s0 $R --method tri-accel --vram-budget 1GB $PROTO --seed 0
elif [ "$STAGE" = effb0 ]; then  # EfficientNet-B0 at 224: Tri-Accel and AMP bf16, seed 0, e.g. on one GPU
  E="--model efficientnet-b0 --image-size 224"
  [ -n "${SKIP_EFFB0:-}" ] || job effb0_tri_s0 $E --method tri-accel $PROTO --seed 0 ${EXTRA:-}
  [ -n "${SKIP_EFFB0:-}" ] || job effb0_bf16_s0 $E --precision amp-bf16 $PROTO --seed 0 ${EXTRA:-}
elif [ "$STAGE" = r18abl ]; then  # ResNet-18's Table-2 ablation and its budget run alone (seed 0), e.g. on one GPU
  R="--model resnet18"
  job r18_abl_batch_s0 $R --method tri-accel --ta-precision false --ta-curvature false --vram-budget 1GB $PROTO --seed 0
  job r18_tri_1GB_s0 $R --method tri-accel --vram-budget 1GB $PROTO --seed 0
  job r18_abl_curv_s0 $R --method tri-accel --ta-precision false --ta-batch false $PROTO --seed 0
  job r18_abl_prec_s0 $R --method tri-accel --ta-curvature false --ta-batch false $PROTO --seed 0
elif [ "$STAGE" = signals ]; then  # issue 19's ablation on ResNet-18: AMP bf16, each signal alone, both; 3 seeds
  R="--model resnet18"
  for s in 0 1 2; do
    job r18_tri_s$s $R --method tri-accel $PROTO --seed $s
    job r18_prec_s$s $R --method tri-accel --ta-curvature false $PROTO --seed $s
    job r18_curv_s$s $R --method tri-accel --ta-precision false --precision amp-bf16 $PROTO --seed $s
    job r18_bf16_s$s $R --precision amp-bf16 $PROTO --seed $s
  done
elif [ "$STAGE" = signals_tri ]; then  # ResNet-18's Tri-Accel and AMP bf16 rows of the signals stage alone
  for s in 0 1 2; do
    job r18_tri_s$s --model resnet18 --method tri-accel $PROTO --seed $s
    job r18_bf16_s$s --model resnet18 --precision amp-bf16 $PROTO --seed $s
  done
elif [ "$STAGE" = signals_effb0 ]; then  # EfficientNet-B0 at 224, seed 0: AMP bf16 and Tri-Accel; then ResNet-18's
  # curvature-only rows again (3 seeds) where a call had them run without AMP
  E="--model efficientnet-b0 --image-size 224"
  [ -n "${SKIP_EFFB0:-}" ] || job effb0_tri_s0 $E --method tri-accel $PROTO --seed 0
  [ -n "${SKIP_EFFB0:-}" ] || job effb0_bf16_s0 $E --precision amp-bf16 $PROTO --seed 0
  for s in 0 1 2; do
    job r18_curv_s$s --model resnet18 --method tri-accel --ta-precision false --precision amp-bf16 $PROTO --seed $s
  done
elif [ "$STAGE" = effb0_abl ]; then  # EfficientNet-B0 at 224, seed 0: AMP bf16 and each signal alone
  E="--model efficientnet-b0 --image-size 224"
  job effb0_prec_s0 $E --method tri-accel --ta-curvature false $PROTO --seed 0
  job effb0_curv_s0 $E --method tri-accel --ta-precision false --precision amp-bf16 $PROTO --seed 0
  job effb0_bf16_s0 $E --precision amp-bf16 $PROTO --seed 0
elif [ "$STAGE" = runs ]; then  # the runs RUNS names, each <model>_<arm>_s<seed>: model r18 or effb0 (at 224); arm
  # bf16 (AMP bf16), prec (precision only, the Hessian), precf (precision only, the Fisher), curvf (curvature lr only,
  # Fisher), tri_fisher (both, Fisher), tri (both, the Hessian), tri_cudnnoff (the Hessian's probes without cuDNN),
  # tri_fisher_cudnnon (the Fisher's with it), default (--method tri-accel and nothing else); any arm with _<B>GB
  # after it runs under --vram-budget <B>GB (r18_default_0.5GB_s0). The estimator is spelled out in every arm but
  # default; mean: default with --curv-lr-mean true. Issue 19's EfficientNet-B0 ablation: a 10-minute call holds two EfficientNet-B0 runs. A run named
  # base_<run> runs <run> with $BIN/triaccel_base (an A/B of two builds in one call).
  F="--curv-estimator fisher"
  H="--curv-estimator hessian"
  for r0 in ${RUNS:-effb0_tri_fisher_s0 effb0_bf16_s0}; do
    r=${r0#base_}
    s=${r##*_s}
    arm=${r#*_}
    arm=${arm%_s*}
    B=""
    case $arm in *GB) B="--vram-budget ${arm##*_}"; arm=${arm%_*} ;; esac
    case ${r%%_*} in
      r18) M="--model resnet18" ;;
      effb0) M="--model efficientnet-b0 --image-size 224" ;;
      *) echo "unknown model in $r (r18|effb0)"; exit 2 ;;
    esac
    case $arm in
      bf16) A="--precision amp-bf16" ;;
      prec) A="--method tri-accel --ta-curvature false $H" ;;
      precf) A="--method tri-accel --ta-curvature false $F" ;;
      curvf) A="--method tri-accel --ta-precision false --precision amp-bf16 $F" ;;
      tri_fisher) A="--method tri-accel $F" ;;
      tri) A="--method tri-accel $H" ;;
      tri_cudnnoff) A="--method tri-accel $H --curv-cudnn off" ;;
      tri_fisher_cudnnon) A="--method tri-accel $F --curv-cudnn on" ;;
      default) A="--method tri-accel" ;;
      mean) A="--method tri-accel --curv-lr-mean true" ;;
      *) echo "unknown arm in $r"; exit 2 ;;
    esac
    job "$r0" $M $A $B $PROTO --seed "$s"
  done
elif [ "$STAGE" = lockstep ]; then  # issue 19: lockstep probe rounds against per-unit probes (the default then)
  for s in ${SEEDS:-0}; do
    job r18_tri_lockstep_s$s --model resnet18 --method tri-accel --curv-lockstep true $PROTO --seed $s
    job r18_tri_s$s --model resnet18 --method tri-accel $PROTO --seed $s
    job r18_bf16_s$s --model resnet18 --precision amp-bf16 $PROTO --seed $s
  done
elif [ "$STAGE" = fisher ]; then  # issue 19: the Fisher estimator (--curv-estimator fisher), ResNet-18, seeds SEEDS
  # (0 1 2): Tri-Accel, the curvature lr alone under AMP bf16, AMP bf16; FISHER_EFFB0=1 adds EfficientNet-B0 at 224
  # (seed 0: Tri-Accel with the Fisher and AMP bf16, queued first)
  F="--curv-estimator fisher"
  if [ -n "${FISHER_EFFB0:-}" ]; then
    job effb0_tri_fisher_s0 --model efficientnet-b0 --image-size 224 --method tri-accel $F $PROTO --seed 0
    job effb0_bf16_s0 --model efficientnet-b0 --image-size 224 --precision amp-bf16 $PROTO --seed 0
  fi
  for s in ${SEEDS:-0 1 2}; do
    job r18_tri_fisher_s$s --model resnet18 --method tri-accel $F $PROTO --seed $s ${EXTRA:-}
    job r18_curvf_s$s --model resnet18 --method tri-accel --ta-precision false --precision amp-bf16 $F $PROTO --seed $s ${EXTRA:-}
    job r18_bf16_s$s --model resnet18 --precision amp-bf16 $PROTO --seed $s ${EXTRA:-}
  done
elif [ "$STAGE" = curv ]; then  # ResNet-18's curvature-lr-only rows beside AMP bf16, seeds SEEDS (0): no planner
  for s in ${SEEDS:-0}; do
    job r18_curv_s$s --model resnet18 --method tri-accel --ta-precision false --precision amp-bf16 $PROTO --seed $s
    job r18_bf16_s$s --model resnet18 --precision amp-bf16 $PROTO --seed $s
  done
elif [ "$STAGE" = costs ]; then  # issue 19: where precision-only's time goes, seed 0 (each lever alone against AMP)
  R="--model resnet18"
  job r18_bf16_s0 $R --precision amp-bf16 $PROTO --seed 0
  job r18_prec_s0 $R --method tri-accel --ta-curvature false $PROTO --seed 0
  job r18_prec_norecompute_s0 $R --method tri-accel --ta-curvature false --recompute none $PROTO --seed 0
  job r18_prec_autotune_s0 $R --method tri-accel --ta-curvature false --cudnn-autotune on $PROTO --seed 0
  job r18_tri_fisher_budget2_s0 $R --method tri-accel --curv-estimator fisher --curv-budget 0.02 $PROTO --seed 0
elif [ "$STAGE" = peak ]; then  # issue 19: what is alive at each run's peak, AMP bf16 beside Tri-Accel, seed 0: each run
  # records its allocator's history (TRIACCEL_MEMORY_HISTORY) and bench/memory_peak.py lists its training steps' peak
  # ($OUT/NAME.peak.txt) and what differs from AMP bf16's ($OUT/NAME.vs_bf16.txt); EXTRA flags last
  R="--model resnet18"
  for s in ${SEEDS:-0}; do  # AMP bf16 at the first seed only
    [ -n "${bf16_done:-}" ] || job r18_bf16_s$s $R --precision amp-bf16 $PROTO --seed $s ${EXTRA:-}
    bf16_done=1
    [ -n "${SKIP_PREC:-}" ] || job r18_prec_s$s $R --method tri-accel --ta-curvature false $PROTO --seed $s ${EXTRA:-}
    job r18_tri_s$s $R --method tri-accel $PROTO --seed $s ${EXTRA:-}
  done
elif [ "$STAGE" = chunks ]; then  # lockstep rounds at each --curv-chunk in CHUNKS (8 16 32) beside AMP bf16, seed 0;
  # EXTRA flags last (e.g. "--epochs 3 --warmup-epochs 1")
  for c in ${CHUNKS:-8 16 32}; do
    job r18_tri_chunk${c}_s0 --model resnet18 --method tri-accel --curv-lockstep true $PROTO --seed 0 --curv-chunk $c \
      ${EXTRA:-}
  done
  job r18_bf16_s0 --model resnet18 --precision amp-bf16 $PROTO --seed 0 ${EXTRA:-}
elif [ "$STAGE" = r18 ]; then  # ResNet-18's Table-1 rows alone (3 seeds x 4 methods), e.g. on one GPU
  for s in 0 1 2; do
    job r18_bf16_s$s --model resnet18 --precision amp-bf16 $PROTO --seed $s
    job r18_fp16_s$s --model resnet18 --precision amp-fp16 $PROTO --seed $s
    job r18_tri_s$s --model resnet18 --method tri-accel $PROTO --seed $s
    job r18_fp32_s$s --model resnet18 --precision fp32 $PROTO --seed $s
  done
else
  E="--model efficientnet-b0 --image-size 224"
  R="--model resnet18"
  job effb0_fp32_s0 $E --precision fp32 $PROTO --seed 0
  job effb0_tri_3GB_s0 $E --method tri-accel $PROTO --seed 0 --vram-budget 3GB
  [ -n "${SKIP_EFFB0:-}" ] || job effb0_tri_s0 $E --method tri-accel $PROTO --seed 0
  [ -n "${SKIP_EFFB0:-}" ] || job effb0_bf16_s0 $E --precision amp-bf16 $PROTO --seed 0
  job effb0_fp16_s0 $E --precision amp-fp16 $PROTO --seed 0
  for s in 0 1 2; do
    job r18_fp32_s$s $R --precision fp32 $PROTO --seed $s
    job r18_tri_s$s $R --method tri-accel $PROTO --seed $s
    job r18_bf16_s$s $R --precision amp-bf16 $PROTO --seed $s
    job r18_fp16_s$s $R --precision amp-fp16 $PROTO --seed $s
  done
  # Table 2: each component alone (the others off) and all combined, seed 0. The batch component needs a budget.
  job r18_abl_batch_s0 $R --method tri-accel --ta-precision false --ta-curvature false --vram-budget 1GB $PROTO --seed 0
  job r18_abl_curv_s0 $R --method tri-accel --ta-precision false --ta-batch false $PROTO --seed 0
  job r18_abl_prec_s0 $R --method tri-accel --ta-curvature false --ta-batch false $PROTO --seed 0
  job r18_tri_1GB_s0 $R --method tri-accel --vram-budget 1GB $PROTO --seed 0
fi
echo "host command: bash bench/run_tri_accel.sh $STAGE ($NGPU x $GPU)" >"$OUT/commands.txt"
while read -r name flags; do echo "$name: triaccel train --out runs/$name $flags"; done <"$QUEUE" >>"$OUT/commands.txt"

worker() {  # GPU index: takes queue lines until none are left
  local gpu=$1 line name
  while true; do
    line=$(flock "$QUEUE.lock" bash -c "head -1 '$QUEUE'; sed -i 1d '$QUEUE'")
    [ -z "$line" ] && break
    name=${line%% *}
    exe=$BIN/triaccel
    [[ $name == base_* ]] && exe=$BIN/triaccel_base
    hist=""
    [ "$STAGE" = peak ] && hist=/tmp/runs/$name.memory.pickle
    TRIACCEL_MEMORY_HISTORY=$hist TRIACCEL_MEMORY_HISTORY_ENTRIES=${HISTORY_ENTRIES:-50000} TORCH_SYMBOLIZE_MODE=dladdr \
      CUDA_VISIBLE_DEVICES=$gpu "$exe" train --progress lines --log-every 100000 --out "/tmp/runs/$name" \
      ${line#* } >"$OUT/$name.log" 2>&1
    echo "[gpu $gpu] $name: exit $? $(tail -1 "$OUT/$name.log")"
    cp "/tmp/runs/$name/events.jsonl" "$OUT/$name.events.jsonl" 2>/dev/null
    mkdir -p "$FINAL_OUT/runs" && cp "$OUT/$name.events.jsonl" "$FINAL_OUT/runs/" 2>/dev/null  # kept if the call is cut
    if (( SECONDS > ${START_BUDGET_S:-400} )); then echo "[gpu $gpu] stops taking jobs at ${SECONDS}s"; break; fi
  done
}

[[ "$STAGE" =~ ^(r18|r18abl|effb0|runs|signals|signals_effb0|signals_tri|lockstep|chunks|fisher|costs|peak)$ ]] || (CUDA_VISIBLE_DEVICES=$((NGPU - 1)) "$BIN/triaccel_tests" --gtest_brief=1 >"$OUT/unit_tests_gpu.log" 2>&1;
   echo "unit tests on GPU: exit $? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/unit_tests_gpu.log" | tr '\n' ' ')") &
# The unit tests take ~10 s on the last GPU; in the table stage its first job is long and only its last 5 epochs
# are timed. The check stage keeps that GPU for the tests.
WORKERS=$NGPU
[ "$STAGE" = check ] && WORKERS=$((NGPU > 1 ? NGPU - 1 : 1))
for ((g = 0; g < WORKERS; g++)); do worker $g & done
wait
grep -B2 -A20 "FAILED\|Failure" "$OUT/unit_tests_gpu.log" 2>/dev/null | head -60
for f in /tmp/runs/*.memory.pickle.step; do  # stage peak: the training steps' peak
  [ -f "$f" ] || continue
  name=$(basename "$f" .memory.pickle.step)
  python3 bench/memory_peak.py "$f" --top 20 >"$OUT/$name.peak.txt" 2>&1
  echo "== $name: $(grep -c 'peak trace' "$OUT/$name.log") peak rises; the last: $(grep 'peak trace' "$OUT/$name.log" | tail -1)"
  head -24 "$OUT/$name.peak.txt"
  bf16=$(ls /tmp/runs/r18_bf16_s*.memory.pickle.step 2>/dev/null | head -1)
  if [[ "$name" != r18_bf16_* ]] && [ -n "$bf16" ]; then
    python3 bench/memory_peak.py "$f" --compare "$bf16" | tee "$OUT/$name.vs_bf16.txt"
    python3 bench/memory_peak.py "$f" --at-end --compare "$bf16" >"$OUT/$name.vs_bf16_at_end.txt"
  fi
  cp "$f" "$OUT/"  # in the tar
done
python3 bench/tri_accel_table.py "$OUT" --gpu "$GPU" --commit "${COMMIT:-unknown}" \
  --command "bash bench/run_tri_accel.sh $STAGE" --out "$OUT/tri_accel_table"
tar czf "$FINAL_OUT/tri_accel_out.tar.gz" -C "$OUT" .
cp "$OUT"/tri_accel_table.* "$FINAL_OUT"/ 2>/dev/null
cat "$OUT/tri_accel_table.md" 2>/dev/null
