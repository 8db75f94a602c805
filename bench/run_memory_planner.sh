#!/usr/bin/env bash
# The memory planner under --vram-budget (docs/memory-planner.md), ours and PyTorch's best recipe side by side in one
# device call. Stages (STAGES, comma-separated; default "tests,r18,pytorch"):
#   tests    the GPU unit tests of the planner's levers, the loader and FP8 (gtest filter; TESTS_FILTER), as a log
#   mutant   .device/bin/triaccel_tests_mutant (a build with deliberate bugs) on MUTANT_FILTER: the tests that fail
#   r18      ResNet-18 / CIFAR-10 copy, batch 96, amp-bf16, cuDNN heuristics, EPOCHS epochs per budget in BUDGETS
#            (default: none 0.8GB 0.62GB 0.5GB 0.4GB 0.3GB 0.25GB); s/epoch of the last epoch, the plan, the
#            last plan's measured peak (allocated, over its eager and capturing steps) against its prediction (ratio).
#            ALLOC_CONFS (e.g. "default expandable_segments:True"): each budget again under each PYTORCH_ALLOC_CONF
#            ("default": unset), tagged with the setting's first letters
#   peak     the Tri-Accel protocol (ResNet-18 b96, 15 epochs, seed 0) unbudgeted: AMP bf16, Tri-Accel precision
#            only, Tri-Accel; TRIACCEL_TRACE_PEAK=1 prints the steps and phases that raised the allocator's peak
#            (the precision-only run's lines from epoch 10 on are shown)
#   pytorch  bench/pytorch_budget.py at PT_CAP (0.5): PyTorch's best recipe at batch 96 under the same cap, with the
#            data streamed and with CIFAR-10 resident on the GPU (PT_RESIDENT)
#   models   EfficientNet-B0 224 b96 (EFFB0_BUDGETS: none 2GB), ViT-Tiny b512 (VIT_BUDGETS: none 1GB), GPT-char b64
#            (GPT_BUDGETS: none 0.5GB): 1 epoch
#   tri      Tri-Accel, ResNet-18 b96, unbudgeted and under 0.5GB, EPOCHS epochs
#   acc      the accuracy protocol: ResNet-18 b96 amp-bf16, ACC_EPOCHS (15) epochs, seeds ACC_SEEDS (0 1 2),
#            unbudgeted and under ACC_BUDGET (0.5GB)
#   grid     GRID ("model:budget[:method] ...", method default backprop; CIFAR-10 at its native size, ViT-Tiny b512
#            and GPT-char b64 with AdamW, the others b96), 1 epoch each: zero crashes, peak ≤ budget, every sample.
#            GRID_BINS ("triaccel" by default; e.g. "triaccel_base triaccel"): every entry under each binary of
#            .device/bin, tagged with the binary's name when it is not triaccel (an A/B in one call). NeuroFlux rows
#            list their blocks: planned and used batch, predicted and measured peak, out-of-memory retries, seconds
#   corners  CORNERS ("model:budget:method:precision:optimizer[:saved[:uib]] ...", CIFAR-10 b96, CORNER_EPOCHS (2)
#            epochs; `saved`: --saved-activations auto|keep|fp8, `uib`: --update-in-backward auto|on|off, each in the
#            tag when given (saved may be left empty: "...:sgd::off"); the
#            last is the steady one): issue 56's corners. A budget "0.8x" is 0.8 of the peak of the same entry with
#            budget "none", which must come earlier in CORNERS. Rows carry the plan's method, its reason and
#            predicted_epoch_s beside the measured epoch
#   shards   bench/budget_grid.py (the seeded grid of issue 56), shards GRID_SHARDS (default "0/5 1/5 2/5 3/5 4/5") run
#            side by side (one process each: the grid counts crashes, peaks and predictions, not speed; its img/s
#            columns are of concurrent runs), each starting no run after GRID_DEADLINE (300) s, GRID_TIMEOUT (150) s a
#            run; $OUT/grid_I_of_N.json each (rewritten after every run), and the shards' table merged;
#            GRID_ONLY ("5,17,...": those combinations alone, a re-run of some rows); SHARD_BINS ("triaccel_base
#            triaccel"): the shards under each binary of .device/bin in turn, tagged (an A/B in one call). The models
#            defined in Python run through the module built here (GRID_PYTHON=1, the default: target `python` in
#            build-gpu, this machine's python3 and torch); GRID_PYTHON=0 lists them as not run
#   micro    ResNet-18 b96 unbudgeted at each micro-batch of MICROS (default "0 48 32": 0 the whole batch), recompute
#            none, EPOCHS epochs: the speed ceiling of any budget's plan at that micro-batch (issue 56's 0.25 GB)
#   history  HISTORY ("model:budget[:method] ...", CIFAR-10 b96, 1 epoch) with the allocator's history recorded: what
#            the eager steps' peak and each capture that ran out of memory hold (bench/memory_peak.py)
# Binaries: .device/bin (built here with `make gpu-binaries`, carried: carry [".device"]); data: .device/data.
# Writes $OUT/memory_planner.json ({"bench","gpu","command","commit","rows"}) and $OUT/memory_planner_logs.tgz, and
# prints a short table last. Usage: COMMIT=$(git rev-parse --short HEAD) STAGES=... bash bench/run_memory_planner.sh
set -uo pipefail
STAGES=${STAGES:-tests,r18,pytorch}
EPOCHS=${EPOCHS:-2}
BUDGETS=${BUDGETS:-none 0.8GB 0.62GB 0.5GB 0.4GB 0.3GB 0.25GB}
PT_CAP=${PT_CAP:-0.5}
PT_RESIDENT=${PT_RESIDENT:-0 0.185}  # GB the PyTorch baseline holds as a resident dataset (0: streamed from the host)
GRID=${GRID:-}
FINAL_OUT=${OUT:-out}
WORK=/tmp/mp_out
rm -rf "$WORK"
mkdir -p "$WORK/runs" "$FINAL_OUT"
source "$(dirname "$0")/device_env.sh"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "gpu: $GPU; commit ${COMMIT:-?}; stages $STAGES"
has() { case ",$STAGES," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
if has tests || has mutant; then device_binaries "$WORK" triaccel_tests; else device_binaries "$WORK"; fi

if has tests; then
  TRIACCEL_SOURCE_DIR=$(pwd) "$BIN/triaccel_tests" --gtest_brief=1 \
    --gtest_filter="${TESTS_FILTER:-NeuroFluxTest.Probe*:NeuroFluxRunTest.*Gpu*:MemoryLever*:MemoryPlanner*:MemoryModel*:MemoryGpu*:MemoryPlanController*:Loader*:StepGraph*:Trainer*Gpu*:TrainerTest.UnderABudget*:TrainerTest.TheShortBatch*:*Cuda*:Fp8*:CurvatureController*:CurvatureRound*}" \
    >"$WORK/unit_tests_gpu.log" 2>&1
  echo "gpu unit tests: exit $?; $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$WORK/unit_tests_gpu.log" | tr '\n' ' ')"
  grep -B12 -E '^\[  FAILED  \] [A-Za-z]+\.[A-Za-z]+ \(' "$WORK/unit_tests_gpu.log" | grep -vE '^(frame #|\[ RUN|\[       OK)' | head -40
fi

# A mutant test binary (built here with a deliberate bug, docs/measuring.md): the GPU tests must fail with it.
if has mutant && [ -x "$BIN/triaccel_tests_mutant" ]; then
  TRIACCEL_SOURCE_DIR=$(pwd) "$BIN/triaccel_tests_mutant" --gtest_brief=1 --gtest_filter="${MUTANT_FILTER:-MemoryGpu*}" \
    >"$WORK/unit_tests_gpu_mutant.log" 2>&1
  echo "mutant gpu unit tests (must fail): exit $?; failed: $(grep -E '^\[  FAILED  \] [A-Za-z]+\.[A-Za-z]+ \(' \
    "$WORK/unit_tests_gpu_mutant.log" | awk '{print $4}' | tr '\n' ' ')"
fi

# train TAG MODEL BUDGET ARGS...: one run; its events stay in $WORK/runs/TAG.
train() {
  local tag=$1 model=$2 budget=$3
  shift 3
  if [ "$SECONDS" -gt "${DEADLINE:-1000000}" ]; then echo "$tag: skipped (DEADLINE ${DEADLINE} s passed)"; return; fi
  local b=()
  [ "$budget" != none ] && b=(--vram-budget "$budget")
  timeout "${RUN_TIMEOUT:-300}" "$BIN/${TRIACCEL_BIN:-triaccel}" train --model "$model" "${b[@]}" \
    --precision "${PRECISION:-amp-bf16}" --cudnn-autotune off \
    --seed "${SEED:-0}" \
    --progress lines --log-every 100000 --out "$WORK/runs/$tag" "$@" >"$WORK/runs/$tag.log" 2>&1
  echo "$tag: exit $? $(grep -E '^(memory plan|method auto|done)' "$WORK/runs/$tag.log" | tr '\n' ' ' | cut -c1-220)"
}

if has r18 || has tri || has grid || has shards || has models || has acc || has history || has corners || has micro; then
  cifar10_bin
fi
if has micro; then
  for m in ${MICROS:-0 48 32}; do
    train "micro_b96_m$m" resnet18 none --dataset cifar10 --data "$DATA" --epochs "$EPOCHS" --batch-size 96 \
      --micro-batch "$m" --recompute none
  done
fi
if has r18; then
  for conf in ${ALLOC_CONFS:-default}; do
    suffix=""
    [ "$conf" != default ] && suffix="_${conf:0:6}"
    for budget in $BUDGETS; do
      if [ "$conf" = default ]; then
        train "r18_b96_$budget$suffix" resnet18 "$budget" --dataset cifar10 --data "$DATA" --epochs "$EPOCHS" --batch-size 96
      else
        PYTORCH_ALLOC_CONF=$conf train "r18_b96_$budget$suffix" resnet18 "$budget" --dataset cifar10 --data "$DATA" \
          --epochs "$EPOCHS" --batch-size 96
      fi
    done
  done
fi
if has peak; then
  read -ra PROTO <<<"$(tri_accel_protocol) --seed 0 --progress lines --log-every 100000"
  for run in amp_bf16 tri_prec tri; do
    case $run in
      amp_bf16) flags=(--precision amp-bf16) ;;
      tri_prec) flags=(--method tri-accel --ta-curvature false) ;;
      tri) flags=(--method tri-accel) ;;
    esac
    TRIACCEL_TRACE_PEAK=1 timeout 300 "$BIN/triaccel" train --model resnet18 "${flags[@]}" "${PROTO[@]}" \
      --out "$WORK/runs/peak_$run" >"$WORK/runs/peak_$run.log" 2>&1
    echo "peak_$run: exit $?; $(grep -E '^done' "$WORK/runs/peak_$run.log" | cut -c1-160)"
  done
  grep '^peak trace' "$WORK/runs/peak_tri_prec.log" | awk '$6 >= 10' | head -30
fi
if has pytorch; then
  for resident in $PT_RESIDENT; do
    python3 bench/pytorch_budget.py --cap-gb "$PT_CAP" --batch 96 --resident-gb "$resident" --steps "${PT_STEPS:-60}" \
      --out "$WORK/pytorch_budget_$resident.json" >"$WORK/pytorch_budget_$resident.log" 2>&1
    echo "pytorch under ${PT_CAP} GB, ${resident} GB resident: $(tail -1 "$WORK/pytorch_budget_$resident.log" | cut -c1-300)"
  done
fi
if has models; then
  shakespeare_text
  for budget in ${EFFB0_BUDGETS:-none 2GB}; do
    train "effb0_b96_$budget" efficientnet-b0 "$budget" --dataset cifar10 --data "$DATA" --image-size 224 \
      --epochs 1 --batch-size 96
  done
  for budget in ${VIT_BUDGETS:-none 1GB}; do
    train "vit_b512_$budget" vit-tiny "$budget" --dataset cifar10 --data "$DATA" --epochs 1 --batch-size 512 \
      --optimizer adamw
  done
  for budget in ${GPT_BUDGETS:-none 0.5GB}; do
    train "gpt_b64_$budget" gpt-char "$budget" --dataset tinyshakespeare --data /tmp/shakespeare --epochs 1 \
      --batch-size 64 --optimizer adamw
  done
fi
if has tri; then
  for budget in none 0.5GB; do
    train "tri_r18_b96_$budget" resnet18 "$budget" --method tri-accel --dataset cifar10 --data "$DATA" \
      --epochs "$EPOCHS" --batch-size 96
  done
fi
if has acc; then
  for seed in ${ACC_SEEDS:-0 1 2}; do
    for budget in none "${ACC_BUDGET:-0.5GB}"; do
      SEED=$seed train "acc_r18_b96_${budget}_s$seed" resnet18 "$budget" --dataset cifar10 --data "$DATA" \
        --epochs "${ACC_EPOCHS:-15}" --batch-size 96
    done
  done
fi
if has grid; then
  shakespeare_text
  for entry in $GRID; do
    IFS=: read -r model budget method <<<"$entry"
    method=${method:-backprop}
    case $model in
      vit-tiny) extra=(--dataset cifar10 --data "$DATA" --batch-size 512 --optimizer adamw) ;;
      gpt-char) extra=(--dataset tinyshakespeare --data /tmp/shakespeare --batch-size 64 --optimizer adamw) ;;
      *) extra=(--dataset cifar10 --data "$DATA" --batch-size 96) ;;
    esac
    for bin in ${GRID_BINS:-triaccel}; do
      suffix=""
      [ "$bin" != triaccel ] && suffix="_${bin#triaccel_}"
      TRIACCEL_BIN=$bin train "grid_${model}_${budget}_$method$suffix" "$model" "$budget" --method "$method" \
        "${extra[@]}" --epochs 1
    done
  done
fi

if has corners; then
  declare -A corner_peak
  for entry in ${CORNERS:-}; do
    IFS=: read -r model budget method precision optimizer saved uib <<<"$entry"
    key="$model:$method:$precision:$optimizer:${saved:-}:${uib:-}"
    saved_args=()
    [ -n "${saved:-}" ] && saved_args=(--saved-activations "$saved")
    [ -n "${uib:-}" ] && saved_args+=(--update-in-backward "$uib")
    if [[ "$budget" == *x ]]; then
      [ -n "${corner_peak[$key]:-}" ] || { echo "$entry: no unbudgeted run of $key before it"; continue; }
      budget=$(python3 -c "print(f'{float(\"${budget%x}\") * ${corner_peak[$key]}:.4f}GB')")
    fi
    tag="c_${model}_${method}_${precision}_${optimizer}_$budget${saved:+_$saved}${uib:+_uib-$uib}"
    PRECISION=$precision train "$tag" "$model" "$budget" --method "$method" --optimizer "$optimizer" \
      --dataset cifar10 --data "$DATA" --batch-size 96 --epochs "${CORNER_EPOCHS:-2}" "${saved_args[@]}"
    if [ "$budget" = none ]; then
      corner_peak[$key]=$(python3 -c "import json,sys
ev=[json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(next((e['peak_vram_gb'] for e in ev if e['event']=='summary'), 0))" "$WORK/runs/$tag/events.jsonl" 2>/dev/null)
    fi
  done
fi

if has shards; then
  shakespeare_text
  python_models=(--no-python-models)
  if [ "${GRID_PYTHON:-1}" = 1 ]; then
    t0=$SECONDS
    if device_cmake_build . build-gpu "$WORK" "-DTRIACCEL_PYTHON=ON -DTRIACCEL_BUILD_BENCH=OFF" python &&
      PYTHONPATH=$(pwd)/build-gpu/python python3 -c "import triaccel" 2>"$WORK/python_import.log"; then
      export PYTHONPATH=$(pwd)/build-gpu/python
      python_models=()
      echo "python module built in $((SECONDS - t0)) s"
    else
      echo "python module: build or import FAILED; its models not run"; tail -5 "$WORK/python_import.log"
    fi
  fi
  # SHARD_BINS ("triaccel" by default; e.g. "triaccel_base triaccel"): the shards under each binary of $BIN in turn (an
  # A/B at one call: the same rows, the same machine), the files and logs of one not named triaccel tagged with it.
  for shard_bin in ${SHARD_BINS:-triaccel}; do
    [ -x "$BIN/$shard_bin" ] || { echo "shards: no binary $BIN/$shard_bin (carry it in .device/bin)"; continue; }
    tag=""
    [ "$shard_bin" != triaccel ] && tag="${shard_bin}_"
    shard_files=()
    for shard in ${GRID_SHARDS:-0/5 1/5 2/5 3/5 4/5}; do
      f="$FINAL_OUT/grid_${tag}${shard%/*}_of_${shard#*/}.json"
      shard_files+=("$f")
      python3 bench/budget_grid.py --bin "$BIN/$shard_bin" --data-cifar "$DATA" --data-text /tmp/shakespeare \
        --shard "$shard" --work "/tmp/budget_grid_${shard%/*}" --deadline-s "${GRID_DEADLINE:-300}" \
        --timeout "${GRID_TIMEOUT:-150}" --only "${GRID_ONLY:-}" "${python_models[@]}" --json "$f" \
        >"$WORK/grid_${tag}${shard%/*}.log" 2>&1 &
    done
    wait
    cat "$WORK"/grid_"${tag}"[0-9]*.log >"$FINAL_OUT/grid${tag:+_${tag%_}}.log"
    grep -hE '^ *[0-9]+ (internal_error|crash|timeout|over_budget|samples_dropped|wrong_floor)' \
      "$WORK"/grid_"${tag}"[0-9]*.log | cut -c1-300
    echo "shards under $shard_bin:"
    python3 bench/budget_grid.py --merge "${shard_files[@]}" --rows >"$FINAL_OUT/grid_${tag}rows.md"
    python3 bench/budget_grid.py --merge "${shard_files[@]}"
  done
fi

# What a capture that runs out of memory holds beyond its eager step: each HISTORY entry (model:budget[:method], as
# GRID) recorded by the allocator (TRIACCEL_MEMORY_HISTORY); bench/memory_peak.py on the eager steps' peak and on
# each failed capture (its refused allocations, then its peak against the eager step's), as $OUT/history_TAG.txt.
# HISTORY_RUNS ("TAG MODEL BUDGET ARGS...; ..."): runs of any arguments (--data cifar10 and tinyshakespeare are the
# copies here: DATA and SHAKESPEARE), for HISTORY's entries; a run that stops on an out-of-memory error no step took
# also writes its events up to the refused allocation (FILE.fatal: who asked for it).
history_run() {
  local tag=$1 model=$2 budget=$3
  shift 3
  hist="$WORK/runs/$tag.mem"
  TRIACCEL_MEMORY_HISTORY=$hist TRIACCEL_MEMORY_HISTORY_ENTRIES=${HISTORY_ENTRIES:-100000} \
    TORCH_SYMBOLIZE_MODE=dladdr train "$tag" "$model" "$budget" "$@"
  tail -2 "$WORK/runs/$tag.log" | cut -c1-300
}
if has history; then
  SHAKESPEARE=$(pwd)/.device/data/tinyshakespeare
  entries=()
  if [ -n "${HISTORY_RUNS:-}" ]; then
    IFS=';' read -ra entries <<<"$HISTORY_RUNS"
  else
    for entry in ${HISTORY:-resnet18:0.3GB:backprop}; do
      IFS=: read -r model budget method <<<"$entry"
      entries+=("hist_${model}_${budget}_${method:-backprop} $model $budget --method ${method:-backprop} --dataset cifar10 --data cifar10 --batch-size 96 --epochs 1")
    done
  fi
  for entry in "${entries[@]}"; do
    read -ra a <<<"$entry"
    for i in "${!a[@]}"; do
      case ${a[$i]} in cifar10) [ "${a[$((i - 1))]}" = --data ] && a[i]=$DATA ;; tinyshakespeare)
        [ "${a[$((i - 1))]}" = --data ] && a[i]=$SHAKESPEARE ;; esac
    done
    tag=${a[0]}
    history_run "${a[@]}"
    {
      echo "== $tag: eager steps' peak ($hist.step)"
      [ -e "$hist.step" ] && python3 bench/memory_peak.py "$hist.step" --top 15 2>&1
      if [ -e "$hist.fatal" ]; then
        echo "== $hist.fatal (the run's last allocation, refused)"
        python3 bench/memory_peak.py "$hist.fatal" --ooms --top 25 2>&1
      fi
      for f in "$hist".capture_oom.* "$hist".oom.*; do
        [ -e "$f" ] || continue
        echo "== $f"
        python3 bench/memory_peak.py "$f" --ooms --top 20 2>&1
        python3 bench/memory_peak.py "$f" --compare "$hist.step" --top 20 2>&1
      done
    } >"$FINAL_OUT/history_$tag.txt"
    grep -E '^(==|oom at|  asked by|events|peak|.*: peak)' "$FINAL_OUT/history_$tag.txt" | head -30
  done
fi

# KEEP_EVENTS=1: every run's events.jsonl as $OUT/events_TAG.jsonl (the plans, oom events and precisions behind a row).
if [ -n "${KEEP_EVENTS:-}" ]; then
  for d in "$WORK"/runs/*/; do [ -f "$d/events.jsonl" ] && cp "$d/events.jsonl" "$FINAL_OUT/events_$(basename "$d").jsonl"; done
fi
python3 - "$WORK" "$FINAL_OUT/memory_planner.json" "$GPU" "${COMMIT:-unknown}" "$STAGES" <<'PY'
import glob, json, os, sys
work, dst, gpu, commit, stages = sys.argv[1:6]
rows = []
for ev in sorted(glob.glob(f"{work}/runs/*/events.jsonl")):
    tag = os.path.basename(os.path.dirname(ev))
    events = [json.loads(l) for l in open(ev) if l.strip()]
    cfg = next((e for e in events if e["event"] == "config"), {}).get("options", {})
    epochs = [e for e in events if e["event"] == "epoch"]
    plans = [e for e in events if e["event"] == "memory_plan"]
    summ = next((e for e in events if e["event"] == "summary"), None)
    samples = [e["samples"] for e in epochs]
    rows.append({
        "run": tag, "model": cfg.get("model"), "method": cfg.get("method"), "batch": cfg.get("batch_size"),
        "vram_budget": cfg.get("vram_budget") or None, "finished": summ is not None,
        "epoch_s_first": epochs[0]["epoch_s"] if epochs else None,
        "epoch_s_last": epochs[-1]["epoch_s"] if epochs else None,
        "eval_s_last": epochs[-1].get("eval_s") if epochs else None,
        "images_per_s_last": epochs[-1]["images_per_s"] if epochs else None,
        "test_acc": epochs[-1]["test_acc"] if epochs else None,
        "peak_vram_gb": summ["peak_vram_gb"] if summ else (epochs[-1]["peak_vram_gb"] if epochs else None),
        # The last epoch's own training peak: what the last plan (in force for that whole epoch) predicted.
        "epoch_peak_vram_gb_last": epochs[-1].get("epoch_peak_vram_gb") if epochs else None,
        "samples_per_epoch": samples, "train_samples": next((e.get("train_samples") for e in events
                                                             if e["event"] == "summary"), None),
        "oom_events": sum(e["event"] == "oom" for e in events),
        "eval_oom_events": sum(e["event"] == "oom" and e.get("phase") == "eval" for e in events),
        "eval_batch": epochs[-1].get("eval_batch") if epochs else None,
        "alloc_retries": epochs[-1].get("alloc_retries") if epochs else None,
        "graph_captures": epochs[-1].get("graph_captures") if epochs else None,
        "graph_capture_ooms": epochs[-1].get("graph_capture_ooms") if epochs else None,
        "graph_capture_error": epochs[-1].get("graph_capture_error") if epochs else None,
        "cuda_graph": epochs[-1].get("cuda_graph") if epochs else None,
        "plan": plans[-1] if plans else None, "plans": len(plans),
        "epoch_plan": epochs[-1].get("memory_plan") if epochs else None,
    })
    blocks = [e for e in events if e["event"] == "block"]
    if blocks:  # NeuroFlux: per block, what was planned and what ran
        rows[-1].update({
            "train_s": summ.get("train_s") if summ else None, "test_acc": summ.get("test_acc") if summ else None,
            "blocks": [{"batch": b["batch"], "planned_batch": (b.get("replan") or {}).get("planned_batch", b["batch"]),
                        "final_batch": b["final_batch"], "pass_batch": b.get("pass_batch"),
                        "predicted_gb": b["predicted_gb"], "peak_vram_gb": b["peak_vram_gb"],
                        "train_peak_gb": b.get("train_peak_gb"), "calibration": b.get("calibration"),
                        "train_s": b["train_s"], "cache_s": b["cache_s"], "cuda_graph": b["cuda_graph"],
                        "alloc_retries": b["alloc_retries"]} for b in blocks],
            "oom": [{k: e.get(k) for k in ("block", "pass", "batch", "retry_batch", "allocated_gb", "reserved_gb",
                                           "error")} for e in events if e["event"] == "oom"],
        })
def budget_gb(r):
    b = (r.get("vram_budget") or "").upper().replace("GB", "")
    try:
        return float(b)
    except ValueError:
        return None
for r in rows:
    p, e = r["plan"] or {}, r["epoch_peak_vram_gb_last"]
    # The last plan's prediction at the model's latest calibration (the epoch event's; the plan event's may predate
    # calibration readings that changed no lever).
    brief = (r.get("epoch_plan") or {})
    pred = brief["predicted_peak_gb"] * 1e9 if brief.get("predicted_peak_gb") else p.get("predicted_peak_bytes")
    r["predicted_peak_gb"] = pred / 1e9 if pred else None
    # The plan's measured peak (its steps that allocated: eager, capturing; a replay allocates nothing, so an epoch's
    # own peak under a graph shows only its short last batch) over its prediction.
    m = brief.get("measured_peak_gb")
    r["plan_measured_peak_gb"] = m
    r["peak_over_predicted"] = m * 1e9 / pred if pred and m else None
    b = budget_gb(r)
    r["within_budget"] = None if b is None or r["peak_vram_gb"] is None else r["peak_vram_gb"] <= b
pt = [json.load(open(f)) for f in sorted(glob.glob(f"{work}/pytorch_budget_*.json"))]
out = {"bench": "memory_planner", "gpu": gpu, "commit": commit, "stages": stages,
       "command": f"COMMIT={commit} STAGES={stages} bash bench/run_memory_planner.sh", "rows": rows, "pytorch": pt}
json.dump(out, open(dst, "w"), indent=1)
print(f"{'run':28} {'s/ep1':>6} {'s/ep':>6} {'eval s':>6} {'ev.b':>5} {'ev.oom':>6} {'img/s':>7} {'peak GB':>8} {'pred GB':>8} {'meas GB':>8} {'ratio':>5} {'micro':>5} {'acc':>3} {'rcmp':>4} {'data':>6} {'oom':>3} {'graph':>5} {'c.oom':>5} {'ok':>3} {'<=bud':>5} {'retry':>5} samples")
for r in rows:
    p = r["plan"] or {}
    pred = (r["predicted_peak_gb"] or 0) * 1e9
    ratio = f"{r['peak_over_predicted']:5.3f}" if r['peak_over_predicted'] else '    -'
    print(f"{r['run']:28} {r['epoch_s_first'] or 0:6.2f} {r['epoch_s_last'] or 0:6.2f} {r['eval_s_last'] or 0:6.3f} {r['eval_batch'] or 0:5} {r['eval_oom_events']:6} {r['images_per_s_last'] or 0:7.0f} {r['peak_vram_gb'] or 0:8.3f} "
          f"{(pred or 0) / 1e9:8.3f} {r['plan_measured_peak_gb'] or 0:8.3f} {ratio} {p.get('micro_batch', '-')!s:>5} {p.get('accumulation', '-')!s:>3} "
          f"{len(p.get('recompute', [])):4} {p.get('data_placement', '-')!s:>6} {r['oom_events']:3} "
          f"{r['cuda_graph']!s:>5} {r['graph_capture_ooms']!s:>5} {'yes' if r['finished'] else 'NO':>3} "
          f"{r['within_budget']!s:>5} {r['alloc_retries']!s:>5} {','.join(str(n) for n in r['samples_per_epoch'])}")
for r in rows:
    if r.get("blocks"):
        bl = r["blocks"]
        print(f"{r['run']}: train {r['train_s'] or 0:.2f} s, acc {r['test_acc']}, oom {r['oom_events']}; blocks "
              "planned>used/final (pass) peak, training peak/pred GB (ratio): " + " ".join(
                  f"{b['planned_batch']}>{b['batch']}/{b['final_batch']}({b['pass_batch']}) "
                  f"{b['peak_vram_gb']:.3f}, {b['train_peak_gb'] or 0:.3f}/{b['predicted_gb']:.3f} "
                  f"({(b['train_peak_gb'] or 0) / b['predicted_gb']:.2f})" for b in bl))
for r in rows:
    if r["run"].startswith("c_"):
        p = r["plan"] or {}
        print(f"corner {r['run'][2:]:44} exit-ok {'yes' if r['finished'] else 'NO':>3} s/ep {r['epoch_s_last'] or 0:6.2f} "
              f"pred {p.get('predicted_epoch_s') or 0:6.2f} method {p.get('method', r['method'])} peak {r['peak_vram_gb'] or 0:.3f} "
              f"<=bud {r['within_budget']} oom {r['oom_events']} micro {p.get('micro_batch', '-')}x{p.get('accumulation', '-')} "
              f"rcmp {len(p.get('recompute', []))} fp8 {len(p.get('fp8_saved', []))} "
              f"uib {'yes' if p.get('update_in_backward') else 'no'} {p.get('method_reason', '')}")
for p in pt:
    b = p["best"]
    print(f"pytorch best under {p['cap_gb']} GB ({p['resident_gb']} GB resident): {b['recipe']} k={b['k']} {b['img_s']:.0f} img/s")
PY
tar czf "$FINAL_OUT/memory_planner_logs.tgz" --exclude='*.pt' -C "$WORK" . 2>/dev/null
