#!/usr/bin/env bash
# Data parallelism on the GPUs of one host (docs/distributed.md): ours at 1 and NPROC GPUs and PyTorch DDP (torchrun,
# eager) at 1 and NPROC GPUs, same model and per-GPU batch, side by side in one device call. Stages (STAGES,
# comma-separated; default "scale"):
#   check  the data-parallel unit tests on the GPUs (NCCL, the captured step; $OUT/dp_tests.log)
#   scale  ResNet-18 CIFAR-10 b512/GPU, ViT-Tiny b512/GPU (AdamW), EfficientNet-B0 at 224 b96/GPU; amp-bf16; ours:
#          EPOCHS (2) epochs, the last epoch's images/s (global); PyTorch: bench/pytorch_ddp.py, synthetic resident
#          input, the median of 3 timings of 40 steps; ResNet-18 on NPROC GPUs also with --grad-compression bf16
#          and with --sync-bn, under --vram-budget DP_BUDGET (1GB), Tri-Accel under the same budget, and with
#          --shard-optimizer on (ZeRO-1; ViT-Tiny's AdamW too); every model on NPROC GPUs also with --grad-bucket-mb 0
#          (one collective after backward, against the default overlapped buckets). VARIANTS=buckets runs, of those
#          rows, only the bucket sizes (ResNet-18 on NPROC GPUs with --grad-bucket-mb 4 and 0): a call for the scaling
#          figures alone
#   steady ResNet-18 and ViT-Tiny (MODELS) as in scale, 3 epochs, a progress line every 10 steps: the median images/s
#          of the windows inside an epoch (no epoch boundary, evaluation or short last batch in them), at 1 and NPROC
#          GPUs: the steps' own scaling, as PyTorch's timed steps measure it
#   pair   ResNet-18 and ViT-Tiny (MODELS) as in steady, NPROC independent one-GPU runs at once, one per GPU: what
#          the GPUs and the host lose when they all train side by side, without any communication
#   methods NeuroFlux (ResNet-18, batch 96, under NF_BUDGET (0.35GB) on each GPU, EPOCHS epochs) at 1 and NPROC GPUs:
#          s/epoch (training and cache passes), accuracy, each block's rank peaks and CUDA graph; BAOC (ResNet-18
#          b512/GPU) on NPROC GPUs with its state whole and sharded (--shard-optimizer on): each rank's state bytes
#   auto   --method auto on NPROC GPUs, ResNet-18 batch 96, 1 epoch, at each of AUTO_BUDGETS ("0.5GB 0.15GB") per GPU:
#          the method every rank chose (backprop where its plan fits, else NeuroFlux), s/epoch, accuracy, rank peaks
#   nfoom  NeuroFlux (ResNet-18, batch 96, 1 epoch) on NPROC GPUs at each of NFOOM_BUDGETS ("0.22GB 0.15GB") per
#          GPU, where a rank's out-of-memory error stopped the run before every rank retried it: the oom events (which
#          ranks, the retry batches), s/epoch, accuracy; then at NFOOM_FIT (0.5GB), NFOOM_REPEATS (2) times
#          alternately, with this binary and with .device/bin/triaccel_base where present (the build before): the
#          blocks' training seconds, the cost of each step's agreement. NFOOM_EXPANDABLE=1: each budget also with the
#          allocator's expandable segments from the process's start (PYTORCH_CUDA_ALLOC_CONF). NFOOM_PLAIN=1: each
#          run at NFOOM_FIT also with this binary under PYTORCH_ALLOC_CONF=expandable_segments:False (plain segments:
#          what the session's expandable segments cost)
#   bpoom  backprop, ResNet-18 batch BPOOM_BATCH (1024: 512/GPU), 1 epoch, on NPROC GPUs, its steps captured: with
#          --inject-faults oom@BPOOM_AT (20: every rank's step runs out of memory before its input, each replays its
#          graph with a NaN loss); then BPOOM_REPEATS (2) times alternately without faults, 2 epochs with a progress
#          line every 10 steps, this binary and .device/bin/triaccel_base where present (the build before): the oom
#          events (ranks, retry batch), skipped steps, accuracy, images/s (the last epoch's, and the median of the
#          progress windows inside an epoch, as in steady)
#   profile ResNet-18 and ViT-Tiny (MODELS) as in steady, 2 epochs, at 1 and NPROC GPUs with --profile-steps over
#          PROFILE_STEPS (20) steps a quarter into the second epoch: each rank's timeline (Chrome trace, kept in
#          $OUT/traces.tar.gz) summed up per step by bench/trace_summary.py (GPU busy, compute, NCCL alone and
#          overlapped, idle; host ranges), and the kernels whose time per step differs most between one GPU and rank 0;
#          ResNet-18 on NPROC GPUs also with --grad-bucket-mb 0 (one collective after backward)
#   nccl   ResNet-18 as in steady (2 epochs) at 1 GPU, then on NPROC GPUs under each of NCCL_VARIANTS ("default
#          NCCL_PROTO=Simple NCCL_PROTO=LL128"; an environment assignment, or default): the steady images/s of each,
#          and 20 traced steps of each (rank 0's) summed up by bench/trace_summary.py
#   acc    ResNet-18 CIFAR-10, global batch 512, ACC_EPOCHS (30) epochs, on 1 GPU (b512) and NPROC GPUs (NPROC x
#          512/NPROC): test accuracy and wall time
# Binaries: .device/bin (`make gpu-binaries`, carried: carry [".device"]); data: .device/data. Writes
# $OUT/data_parallel.json ({"bench","gpu","commit","rows"}) and $OUT/dp_runs.tar.gz (every run's events and log),
# and prints a short table last.
# Usage: COMMIT=$(git rev-parse --short HEAD) STAGES=scale,acc bash bench/run_data_parallel.sh
set -uo pipefail
STAGES=${STAGES:-scale}
EPOCHS=${EPOCHS:-2}
ACC_EPOCHS=${ACC_EPOCHS:-30}
NPROC=${NPROC:-2}
MODELS=${MODELS:-resnet18 vit-tiny efficientnet-b0}
VARIANTS=${VARIANTS:-all}
FINAL_OUT=${OUT:-out}
WORK=/tmp/dp_out
rm -rf "$WORK"
mkdir -p "$WORK/runs" "$FINAL_OUT"
source "$(dirname "$0")/device_env.sh"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "gpu: $GPU x $(nvidia-smi -L | wc -l); commit ${COMMIT:-?}; stages $STAGES"
device_binaries "$WORK" triaccel_tests
cifar10_bin
has() { case ",$STAGES," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

# ours TAG WORLD ARGS...: one run of ours on WORLD GPUs; events in $WORK/runs/TAG.
ours() {
  local tag=$1 world=$2
  shift 2
  local n=()
  [ "$world" -gt 1 ] && n=(--nproc "$world")
  timeout "${RUN_TIMEOUT:-400}" "${OURS_BIN:-$BIN/triaccel}" train "${n[@]}" --dataset cifar10 --data "$DATA" --precision amp-bf16 \
    --progress lines --log-every 100000 --out "$WORK/runs/$tag" "$@" >"$WORK/runs/$tag.log" 2>&1
  echo "$tag: exit $? $(grep -E '^(done|triaccel: error)' "$WORK/runs/$tag.log" | tr '\n' ' ' | cut -c1-200)"
}

if has check; then
  timeout 300 "$BIN/triaccel_tests" --gtest_filter='DataParallel*:GradBuckets*:ParamShards*:ShardOwners*:ShardBuckets*:DistTest*' \
    >"$FINAL_OUT/dp_tests.log" 2>&1
  echo "unit tests: exit $? $(grep -E '^\[  (PASSED|FAILED)' "$FINAL_OUT/dp_tests.log" | tr '\n' ' ')"
fi
if has scale; then
  for model in $MODELS; do
    case $model in
      resnet18) per=512; args=(--model resnet18) ;;
      vit-tiny) per=512; args=(--model vit-tiny --optimizer adamw) ;;
      efficientnet-b0) per=96; args=(--model efficientnet-b0 --image-size 224) ;;
    esac
    for world in $(printf "1\n%s\n" "$NPROC" | sort -un); do
      ours "scale_${model}_w$world" "$world" "${args[@]}" --batch-size $((per * world)) --epochs "$EPOCHS"
      if [ "$VARIANTS" = buckets ]; then
        if [ "$world" -gt 1 ] && [ "$model" = resnet18 ]; then  # smaller buckets; one collective after backward
          ours "scale_${model}-bucket4_w$world" "$world" "${args[@]}" --batch-size $((per * world)) \
            --epochs "$EPOCHS" --grad-bucket-mb 4
          ours "scale_${model}-nobucket_w$world" "$world" "${args[@]}" --batch-size $((per * world)) \
            --epochs "$EPOCHS" --grad-bucket-mb 0
        fi
      else
        if [ "$world" -gt 1 ] && [ "$model" = resnet18 ]; then  # gradients in bf16 on the wire
          ours "scale_${model}-bf16grad_w$world" "$world" "${args[@]}" --batch-size $((per * world)) \
            --epochs "$EPOCHS" --grad-compression bf16
          ours "scale_${model}-syncbn_w$world" "$world" "${args[@]}" --batch-size $((per * world)) \
            --epochs "$EPOCHS" --sync-bn true
        fi
        if [ "$world" -gt 1 ]; then  # one collective after backward: what the overlapped buckets are measured against
          ours "scale_${model}-nobucket_w$world" "$world" "${args[@]}" --batch-size $((per * world)) \
            --epochs "$EPOCHS" --grad-bucket-mb 0
        fi
        if [ "$world" -gt 1 ] && [ "$model" = resnet18 ]; then  # a budget on every GPU: each rank's peak under it
          ours "scale_${model}-budget_w$world" "$world" "${args[@]}" --batch-size $((per * world)) \
            --epochs "$EPOCHS" --vram-budget "${DP_BUDGET:-1GB}"
          ours "scale_${model}-tribudget_w$world" "$world" "${args[@]}" --batch-size $((per * world)) \
            --epochs "$EPOCHS" --vram-budget "${DP_BUDGET:-1GB}" --method tri-accel
        fi
        if [ "$world" -gt 1 ] && [ "$model" != efficientnet-b0 ]; then  # ZeRO-1: each rank keeps 1/N of the state
          ours "scale_${model}-zero_w$world" "$world" "${args[@]}" --batch-size $((per * world)) \
            --epochs "$EPOCHS" --shard-optimizer on
        fi
      fi
      torchrun --standalone --nproc_per_node "$world" bench/pytorch_ddp.py --model "$model" --batch "$per" \
        --out "$WORK/pytorch_ddp.jsonl" >"$WORK/pytorch_${model}_w$world.log" 2>&1
      echo "pytorch ${model} x$world: exit $? $(tail -1 "$WORK/pytorch_${model}_w$world.log" | cut -c1-160)"
    done
  done
fi
# steady_args MODEL: the steady and pair stages' flags for MODEL in `args` (ResNet-18 and ViT-Tiny); 1 for the others.
steady_args() {
  case $1 in
    resnet18) args=(--model resnet18) ;;
    vit-tiny) args=(--model vit-tiny --optimizer adamw) ;;
    *) return 1 ;;
  esac
}
if has steady; then
  for model in $MODELS; do
    steady_args "$model" || continue
    for world in $(printf "1\n%s\n" "$NPROC" | sort -un); do
      ours "steady_${model}_w$world" "$world" "${args[@]}" --batch-size $((512 * world)) --epochs 3 --log-every 10
    done
  done
fi
if has profile; then
  for model in $MODELS; do
    steady_args "$model" || continue
    for world in $(printf "1\n%s\n" "$NPROC" | sort -un); do
      spe=$(( (50000 + 512 * world - 1) / (512 * world) ))
      first=$(( spe + spe / 4 ))
      ours "profile_${model}_w$world" "$world" "${args[@]}" --batch-size $((512 * world)) --epochs 2 --log-every 10 \
        --profile-steps "$first:$((first + ${PROFILE_STEPS:-20}))"
    done
    w1=$WORK/runs/profile_${model}_w1/profile.json
    wn=$WORK/runs/profile_${model}_w$NPROC
    nb=()
    if [ "$model" = resnet18 ]; then  # one collective after backward: the reduction's cost without overlap
      ours "profile_${model}-nobucket_w$NPROC" "$NPROC" "${args[@]}" --batch-size $((512 * NPROC)) --epochs 2 \
        --log-every 10 --profile-steps "$first:$((first + ${PROFILE_STEPS:-20}))" --grad-bucket-mb 0
      nb=("$WORK/runs/profile_${model}-nobucket_w$NPROC"/profile_rank*.json)
    fi
    python3 bench/trace_summary.py "$w1" "$wn"/profile_rank*.json "${nb[@]}" >"$WORK/profile_${model}.jsonl" \
      2>"$WORK/profile_${model}.txt"
    python3 bench/trace_summary.py --compare "$w1" "$wn/profile_rank0.json" >"$WORK/profile_${model}_kernels.txt" 2>&1
  done
  (cd "$WORK" && tar czf "$FINAL_OUT/traces.tar.gz" runs/profile_*/profile*.json profile_*.jsonl profile_*.txt)
fi
if has nccl; then
  steady_args resnet18
  ours "nccl_resnet18_default_w1" 1 "${args[@]}" --batch-size 512 --epochs 2 --log-every 10 --profile-steps 122:142
  i=0
  for v in ${NCCL_VARIANTS:-default NCCL_PROTO=Simple NCCL_PROTO=LL128}; do
    env_v=()
    [ "$v" != default ] && env_v=("$v")
    i=$((i + 1))
    tag=$(echo "$v" | tr '=' '-')_$i
    (if [ ${#env_v[@]} -gt 0 ]; then export "${env_v[@]}"; fi
     ours "nccl_resnet18_${tag}_w$NPROC" "$NPROC" "${args[@]}" --batch-size $((512 * NPROC)) --epochs 2 --log-every 10 \
       --profile-steps 61:81)
  done
  python3 bench/trace_summary.py "$WORK"/runs/nccl_*/profile.json "$WORK"/runs/nccl_*/profile_rank0.json \
    >"$WORK/profile_nccl.jsonl" 2>"$WORK/profile_nccl.txt"
fi
if has pair; then
  for model in $MODELS; do
    steady_args "$model" || continue
    for gpu in $(seq 0 $((NPROC - 1))); do
      CUDA_VISIBLE_DEVICES=$gpu ours "pair_${model}_gpu${gpu}_w1" 1 "${args[@]}" --batch-size 512 --epochs 3 \
        --log-every 10 &
    done
    wait
  done
fi
if has methods; then
  for world in $(printf "1\n%s\n" "$NPROC" | sort -un); do
    ours "nf_resnet18_w$world" "$world" --model resnet18 --method neuroflux --batch-size 96 --epochs "$EPOCHS" \
      --vram-budget "${NF_BUDGET:-0.35GB}"
  done
  ours "baoc_resnet18_w$NPROC" "$NPROC" --model resnet18 --optimizer baoc --batch-size $((512 * NPROC)) \
    --epochs "$EPOCHS"
  ours "baoc_resnet18-zero_w$NPROC" "$NPROC" --model resnet18 --optimizer baoc --batch-size $((512 * NPROC)) \
    --epochs "$EPOCHS" --shard-optimizer on
fi
if has auto; then
  for budget in ${AUTO_BUDGETS:-0.5GB 0.15GB}; do
    ours "auto_resnet18-$budget""_w$NPROC" "$NPROC" --model resnet18 --method auto --batch-size 96 --epochs 1 \
      --vram-budget "$budget"
    grep -E '^method auto' "$WORK/runs/auto_resnet18-$budget""_w$NPROC.log"
  done
fi
if has nfoom; then
  for budget in ${NFOOM_BUDGETS:-0.22GB 0.15GB}; do
    ours "nfoom_resnet18-$budget""_w$NPROC" "$NPROC" --model resnet18 --method neuroflux --batch-size 96 --epochs 1 \
      --vram-budget "$budget"
    if [ -n "${NFOOM_EXPANDABLE:-}" ]; then  # the allocator's expandable segments from the process's start
      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True ours "nfoom_resnet18-$budget-expandable_w$NPROC" "$NPROC" \
        --model resnet18 --method neuroflux --batch-size 96 --epochs 1 --vram-budget "$budget"
    fi
  done
  for i in $(seq "${NFOOM_REPEATS:-2}"); do
    if [ -x "$BIN/triaccel_base" ]; then
      OURS_BIN="$BIN/triaccel_base" ours "nfoom_resnet18-fit-base$i""_w$NPROC" "$NPROC" --model resnet18 \
        --method neuroflux --batch-size 96 --epochs 1 --vram-budget "${NFOOM_FIT:-0.5GB}"
    fi
    ours "nfoom_resnet18-fit-new$i""_w$NPROC" "$NPROC" --model resnet18 --method neuroflux --batch-size 96 \
      --epochs 1 --vram-budget "${NFOOM_FIT:-0.5GB}"
    if [ -n "${NFOOM_PLAIN:-}" ]; then
      PYTORCH_ALLOC_CONF=expandable_segments:False ours "nfoom_resnet18-fit-plain$i""_w$NPROC" "$NPROC" \
        --model resnet18 --method neuroflux --batch-size 96 --epochs 1 --vram-budget "${NFOOM_FIT:-0.5GB}"
    fi
  done
fi
if has bpoom; then
  bp=(--model resnet18 --batch-size "${BPOOM_BATCH:-1024}")
  ours "bpoom_resnet18-faulted_w$NPROC" "$NPROC" "${bp[@]}" --epochs 1 --inject-faults "oom@${BPOOM_AT:-20}"
  for i in $(seq "${BPOOM_REPEATS:-2}"); do
    if [ -x "$BIN/triaccel_base" ]; then
      OURS_BIN="$BIN/triaccel_base" ours "bpoom_resnet18-base$i""_w$NPROC" "$NPROC" "${bp[@]}" --epochs 2 \
        --log-every 10
    fi
    ours "bpoom_resnet18-new$i""_w$NPROC" "$NPROC" "${bp[@]}" --epochs 2 --log-every 10
  done
fi
if has acc; then
  # ACC_ARGS: extra flags for both runs (e.g. "--checkpoint-every 100000": one checkpoint at the end instead of one
  # per epoch, 0.4 s each for ResNet-18, which neither run can share between GPUs).
  recipe=(--model resnet18 --epochs "$ACC_EPOCHS" --batch-size 512 --lr 0.4 --warmup-epochs 2 --label-smoothing 0.1
          ${ACC_ARGS:-})
  ours acc_r18_w1 1 "${recipe[@]}"
  ours "acc_r18_w$NPROC" "$NPROC" "${recipe[@]}"
fi

python3 - "$WORK" "$FINAL_OUT" "$GPU" "${COMMIT:-?}" "$NPROC" <<'PY'
import glob, json, os, sys, tarfile
work, out, gpu, commit, nproc = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
rows = []
for d in sorted(glob.glob(f"{work}/runs/*/")):
    tag = os.path.basename(d.rstrip("/"))
    ev = [json.loads(l) for l in open(f"{d}/events.jsonl")] if os.path.exists(f"{d}/events.jsonl") else []
    epochs = [e for e in ev if e["event"] == "epoch"]
    summ = [e for e in ev if e["event"] == "summary"]
    blocks = [e for e in ev if e["event"] == "block"]
    world = int(tag.rsplit("_w", 1)[1])
    summary = summ[0] if summ else {}
    config = next((e for e in ev if e["event"] == "config"), {})
    rows.append({"system": "triaccel", "tag": tag, "model": tag.split("_")[1], "world_size": world,
                 "method": config.get("options", {}).get("method"),
                 "optim_state_bytes": summary.get("optim_state_bytes"),
                 "optim_state_sharded": summary.get("optim_state_sharded"),
                 "images_per_s": epochs[-1]["images_per_s"] if epochs else None,
                 "test_acc": summ[0]["test_acc"] if summ else None, "total_s": summ[0]["total_s"] if summ else None,
                 "epochs": len(epochs), "cuda_graph": epochs[-1].get("cuda_graph") if epochs else None,
                 "peak_vram_gb": summ[0]["peak_vram_gb"] if summ else None,
                 "rank_peak_vram_gb": epochs[-1].get("rank_peak_vram_gb") if epochs else None,
                 "epoch_s": summary.get("epoch_s"), "skipped_steps": summary.get("skipped_steps"),
                 "oom_retries": summary.get("oom_retries"),
                 "blocks": [{k: b.get(k) for k in ("units", "batch", "final_batch", "steps", "train_s", "cache_s",
                                                   "cuda_graph", "peak_vram_gb", "rank_peak_vram_gb")} for b in blocks]
                           or None,
                 "ooms": [{k: e.get(k) for k in ("block", "batch", "retry_batch", "ranks", "action", "reason")}
                          for e in ev if e["event"] == "oom"]})
if os.path.exists(f"{work}/pytorch_ddp.jsonl"):
    rows += [json.loads(l) for l in open(f"{work}/pytorch_ddp.jsonl")]
# Every run's events and log, and the PyTorch logs, in one file (the device returns at most 8).
with tarfile.open(f"{out}/dp_runs.tar.gz", "w:gz") as tar:
    for d in sorted(glob.glob(f"{work}/runs/*/")):
        tag = os.path.basename(d.rstrip("/"))
        if os.path.exists(f"{d}/events.jsonl"):
            tar.add(f"{d}/events.jsonl", arcname=f"{tag}.events.jsonl")
    for f in sorted(glob.glob(f"{work}/runs/*.log") + glob.glob(f"{work}/pytorch_*.log")):
        tar.add(f, arcname=os.path.basename(f))
# steady_*: the median images/s of the progress windows inside an epoch (the previous line in the same epoch, and
# not the epoch's last line, whose window holds the short last batch).
import re, statistics
for f in sorted(glob.glob(f"{work}/runs/steady_*.log") + glob.glob(f"{work}/runs/pair_*.log") +
                glob.glob(f"{work}/runs/bpoom_*.log") + glob.glob(f"{work}/runs/nccl_*.log")):
    tag = os.path.basename(f)[:-4]
    lines = [tuple(map(float, m.groups())) for m in
             re.finditer(r"epoch (\d+)/\d+ step (\d+)/(\d+) loss \S+ lr \S+ (\d+) img/s", open(f).read())]
    clean = [v for prev, (e, d, t, v) in zip(lines, lines[1:]) if prev[0] == e and d < t]
    for r in rows:
        if r.get("tag") == tag:
            r["steady_images_per_s"] = statistics.median(clean) if clean else None
            r["steady_windows"] = len(clean)
json.dump({"bench": "data_parallel", "gpu": gpu, "commit": commit, "rows": rows}, open(f"{out}/data_parallel.json", "w"),
          indent=1)
print(f"{'model':16s} {'ours x1':>9s} {'ours x%d' % nproc:>9s} {'scaling':>8s} {'ddp x1':>9s} {'ddp x%d' % nproc:>9s} {'ddp scal':>8s} {'ours/ddp':>8s}")
for model in ["resnet18", "vit-tiny", "efficientnet-b0"]:
    o1 = next((r["images_per_s"] for r in rows if r.get("tag") == f"scale_{model}_w1"), None)
    on = next((r["images_per_s"] for r in rows if r.get("tag") == f"scale_{model}_w{nproc}"), None)
    p1 = next((r["images_per_s"] for r in rows if r["system"] == "pytorch-ddp-eager" and r["model"] == model and r["world_size"] == 1), None)
    pn = next((r["images_per_s"] for r in rows if r["system"] == "pytorch-ddp-eager" and r["model"] == model and r["world_size"] == nproc), None)
    if not any([o1, on, p1, pn]):
        continue
    f = lambda v: f"{v:9.0f}" if v else "        -"
    q = lambda a, b: f"{a / b:8.2f}" if a and b else "       -"
    print(f"{model:16s} {f(o1)} {f(on)} {q(on, o1)} {f(p1)} {f(pn)} {q(pn, p1)} {q(on, pn)}")
for model in ["resnet18", "vit-tiny", "efficientnet-b0"]:
    on = next((r["images_per_s"] for r in rows if r.get("tag") == f"scale_{model}_w{nproc}"), None)
    for tag, what in (("nobucket", "one collective after backward"), ("bucket4", "4 MB buckets")):
        nb = next((r["images_per_s"] for r in rows if r.get("tag") == f"scale_{model}-{tag}_w{nproc}"), None)
        if on and nb:
            print(f"{model}: 25 MB buckets overlapped {on:.0f} img/s, {what} {nb:.0f} ({on / nb:.2f}x)")
for r in rows:
    if any(k in r.get("tag", "") for k in ("-budget_", "-tribudget_", "-zero_", "-syncbn_", "-bf16grad_")):
        print(f"{r['tag']}: {r['images_per_s']} img/s, rank peaks {r['rank_peak_vram_gb']} GB, "
              f"state {r['optim_state_bytes']} B (sharded {r['optim_state_sharded']}), graph {r['cuda_graph']}")
for model in ["resnet18", "vit-tiny"]:
    s1 = next((r.get("steady_images_per_s") for r in rows if r.get("tag") == f"steady_{model}_w1"), None)
    sn = next((r.get("steady_images_per_s") for r in rows if r.get("tag") == f"steady_{model}_w{nproc}"), None)
    if s1 and sn:
        print(f"{model} steady steps: {s1:.0f} img/s on 1 GPU, {sn:.0f} on {nproc} ({sn / s1:.2f}x)")
for r in rows:
    if r.get("tag", "").startswith("pair_"):
        s1 = next((q.get("steady_images_per_s") for q in rows if q.get("tag") == f"steady_{r['model']}_w1"), None)
        alone = f" ({r['steady_images_per_s'] / s1:.3f}x the run alone)" if s1 and r.get("steady_images_per_s") else ""
        print(f"{r['tag']}: steady {r.get('steady_images_per_s')} img/s beside the other GPUs' runs{alone}")
for r in rows:
    if r.get("tag", "").startswith("nf_"):
        b = r["blocks"] or []
        print(f"{r['tag']}: {r['epoch_s']} s/epoch, test acc {r['test_acc']} %, {len(b)} blocks, graphs "
              f"{[x['cuda_graph'] for x in b]}, rank peaks {[x['rank_peak_vram_gb'] or x['peak_vram_gb'] for x in b]}")
    if r.get("tag", "").startswith("baoc_"):
        print(f"{r['tag']}: {r['images_per_s']} img/s, state {r['optim_state_bytes']} B (sharded "
              f"{r['optim_state_sharded']}), rank peaks {r['rank_peak_vram_gb']} GB, graph {r['cuda_graph']}")
for r in rows:
    if r.get("tag", "").startswith("auto_"):
        print(f"{r['tag']}: method {r['method']}, {r['epoch_s']} s/epoch, test acc {r['test_acc']} %, rank peaks "
              f"{r['rank_peak_vram_gb']} GB, peak {r['peak_vram_gb']} GB")
for r in rows:
    if r.get("tag", "").startswith("nfoom_"):
        b = r["blocks"] or []
        o = r["ooms"]
        print(f"{r['tag']}: {r['epoch_s']} s/epoch, blocks' training {sum(x['train_s'] or 0 for x in b):.2f} s, test "
              f"acc {r['test_acc']} %, {len(b)} blocks, final batches {[x['final_batch'] for x in b]}, {len(o)} oom "
              f"(ranks {[[q['rank'] for q in x.get('ranks') or []] for x in o]}, retry batches "
              f"{[x['retry_batch'] for x in o]}, {[x['action'] for x in o if x.get('action')]})")
for r in rows:
    if r.get("tag", "").startswith("bpoom_"):
        o = r["ooms"]
        print(f"{r['tag']}: {r['images_per_s']} img/s (last epoch), {r.get('steady_images_per_s')} steady, "
              f"test acc {r['test_acc']} %, skipped steps "
              f"{r['skipped_steps']}, {len(o)} oom (ranks {[[q['rank'] for q in x.get('ranks') or []] for x in o]}, "
              f"retry batches {[x['retry_batch'] for x in o]}, {[x['action'] for x in o if x.get('action')]})")
s1 = next((r.get("steady_images_per_s") for r in rows if r.get("tag") == "nccl_resnet18_default_w1"), None)
for r in rows:
    if r.get("tag", "").startswith("nccl_") and s1 and r.get("steady_images_per_s"):
        print(f"{r['tag']}: steady {r['steady_images_per_s']:.0f} img/s ({r['steady_images_per_s'] / s1:.3f}x one GPU)")
for f in sorted(glob.glob(f"{work}/profile_*.txt")):
    print(f"--- {os.path.basename(f)}")
    print(open(f).read().rstrip())
for r in rows:
    if r.get("tag", "").startswith("acc_"):
        print(f"{r['tag']}: test acc {r['test_acc']} %, total {r['total_s']} s, {r['epochs']} epochs")
PY
