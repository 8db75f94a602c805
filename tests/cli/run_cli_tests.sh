#!/usr/bin/env bash
# Bad input through the real CLI: each case asserts the exit code and a phrase of the one-line error, and that no
# partial output that looks valid is left behind. Usage: run_cli_tests.sh path/to/triaccel
set -u
CLI=${1:?usage: run_cli_tests.sh path/to/triaccel}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
passed=0
failed=0

# expect NAME EXIT_CODE PHRASE -- ARGS... (tests/lib/expect.sh): an error is exactly one "triaccel: error" line.
source "$(dirname "$0")/../lib/expect.sh"

# A tiny MNIST-layout dataset (IDX) for the cases that need data.
python3 - "$WORK/mnist" <<'PY'
import os, struct, sys, random
d = sys.argv[1]; os.makedirs(d)
random.seed(0)
def write(prefix, n):
    labels = bytes(random.randrange(10) for _ in range(n))
    pixels = bytes(random.randrange(256) for _ in range(n * 784))
    open(f"{d}/{prefix}-images-idx3-ubyte", "wb").write(struct.pack(">IIII", 0x803, n, 28, 28) + pixels)
    open(f"{d}/{prefix}-labels-idx1-ubyte", "wb").write(struct.pack(">II", 0x801, n) + labels)
write("train", 96); write("t10k", 32)
PY
TINY=(--dataset mnist --data "$WORK/mnist" --model small-cnn --device cpu --batch-size 32 --progress off)

expect help_lists_flags 0 "--resume" -- train --help
expect unknown_flag 2 "--bogus" -- train --bogus 1
expect unknown_subcommand 2 "error" -- frobnicate
expect unknown_model 2 "--model must be one of" -- train "${TINY[@]}" --model resnet99
expect unknown_dataset 2 "--dataset must be one of" -- train --dataset imagenet
expect batch_zero 2 "--batch-size must be > 0, got 0" -- train "${TINY[@]}" --batch-size 0
expect batch_text 2 "--batch-size" -- train --batch-size many
expect bad_precision 2 "--precision must be fp32, amp-bf16, amp-fp16 or amp-fp8, got 'fp6'" -- train "${TINY[@]}" --precision fp6
expect fp8_no_linears 0 "note: amp-fp8 found no linear layer of small-cnn" -- train "${TINY[@]}" --precision fp8 --max-steps 1 --out "$WORK/fp8cnn" --progress lines
expect bad_lr 2 "--lr must be a positive number" -- train "${TINY[@]}" --lr -1
expect last_flag_wins 2 "--batch-size must be > 0, got 0" -- train "${TINY[@]}" --batch-size 8 --batch-size 0
expect bad_lr_rule 2 "--lr-batch-rule must be none, linear or sqrt, got 'cube'" -- train "${TINY[@]}" --lr-batch-rule cube
expect bad_curv_budget 2 "--curv-budget must be in [0, 1], got 2" -- train "${TINY[@]}" --method tri-accel --curv-budget 2
expect lockstep_top_k 2 "--curv-lockstep true needs --curv-top-k 1 (lockstep power iteration finds the top eigenvalue only), got 5" -- train "${TINY[@]}" --method tri-accel --curv-lockstep true --curv-top-k 5
expect fisher_top_k 2 "--curv-estimator fisher needs --curv-top-k 1 (its lockstep rounds find the top eigenvalue only), got 3" -- train "${TINY[@]}" --method tri-accel --curv-estimator fisher --curv-top-k 3
expect bad_estimator 2 "--curv-estimator must be hessian or fisher, got 'gauss'" -- train "${TINY[@]}" --method tri-accel --curv-estimator gauss
expect bad_device 2 "--device must be auto, cpu or cuda" -- train "${TINY[@]}" --device tpu
expect warmup_too_long 2 "--warmup-epochs must be -1 (auto) or in [0, --epochs = 1], got 3" -- train "${TINY[@]}" --warmup-epochs 3
expect bad_profile_steps 2 "--profile-steps must be FIRST:END with 0 <= FIRST < END (the steps FIRST to END-1 are traced, e.g. 200:220), got '5:5'" -- train "${TINY[@]}" --profile-steps 5:5
expect profile_trains 0 "timeline of steps 1 to 2 written" -- train "${TINY[@]}" --profile-steps 1:3 --max-steps 4 --out "$WORK/prof" --progress lines
expect bad_lr_decay 2 "--lr-decay must be cosine or linear, got 'step'" -- train "${TINY[@]}" --lr-decay step
expect cutout_negative 2 "--cutout must be >= 0 (0: off), got -1" -- train "${TINY[@]}" --cutout -1
expect cutout_too_large 2 "--cutout 29 is larger than the 28×28 images of dataset mnist; use at most 28" -- train "${TINY[@]}" --cutout 29 --out "$WORK/o_cut"
expect cutout_trains 0 "stopped at step 2" -- train "${TINY[@]}" --augment on --cutout 8 --max-steps 2 --out "$WORK/cut" --progress lines
expect missing_cifar_dir 2 "build_cifar10_bin.py" -- train --dataset cifar10 --data "$WORK/nothing-here" --out "$WORK/o1"
mkdir -p "$WORK/empty"
expect missing_cifar_file 2 "data_batch_1.bin" -- train --dataset cifar10 --data "$WORK/empty" --out "$WORK/o1"
expect unwritable_out 2 "--out" -- train "${TINY[@]}" --out /proc/triaccel-cannot-write
touch "$WORK/a-file"
expect out_is_file 2 "--out" -- train "${TINY[@]}" --out "$WORK/a-file/sub"

# Truncated data file: the error names the file.
mkdir -p "$WORK/trunc" && cp "$WORK/mnist"/* "$WORK/trunc/"
head -c 5000 "$WORK/mnist/train-images-idx3-ubyte" > "$WORK/trunc/train-images-idx3-ubyte"
expect truncated_data 2 "train-images-idx3-ubyte" -- train "${TINY[@]}" --data "$WORK/trunc" --out "$WORK/o2"
if [ -e "$WORK/o2/events.jsonl" ] && grep -q '"summary"' "$WORK/o2/events.jsonl"; then
  failed=$((failed + 1)); echo "FAIL truncated_data left a summary behind"
fi

# A run stopped by --max-steps leaves a checkpoint and no model.pt; resuming it with another model is refused.
expect stop_early 0 "stopped at step 2" -- train "${TINY[@]}" --epochs 2 --max-steps 2 --out "$WORK/run" --progress lines
if [ -f "$WORK/run/checkpoint.pt" ] && [ ! -e "$WORK/run/model.pt" ]; then passed=$((passed + 1)); else
  failed=$((failed + 1)); echo "FAIL stop_early: want checkpoint.pt and no model.pt"; fi
expect resume_other_model 2 "differs from the checkpoint" -- train --resume "$WORK/run" --model resnet18 --progress off
expect resume_missing 2 "no checkpoint at" -- train --resume "$WORK/nowhere" --progress off
cp "$WORK/run/checkpoint.pt" "$WORK/good.pt"
head -c 3000 "$WORK/good.pt" > "$WORK/run/checkpoint.pt"
expect resume_truncated 2 "is corrupt or truncated" -- train --resume "$WORK/run" --progress off
cp "$WORK/good.pt" "$WORK/run/checkpoint.pt"
expect resume_finishes 0 "done: test acc" -- train --resume "$WORK/run" --progress lines
if [ -f "$WORK/run/model.pt" ] && tail -n 1 "$WORK/run/events.jsonl" | grep -q '"event":"summary"'; then
  passed=$((passed + 1)); else failed=$((failed + 1)); echo "FAIL resume_finishes: no model.pt or summary"; fi

# NeuroFlux: bad input, then a run that trains block by block from the cache and exports a smaller exit model.
expect nf_budget_too_small 2 "is below what NeuroFlux needs for this model: at least" -- train "${TINY[@]}" --method neuroflux --vram-budget 100KB --out "$WORK/nf0"
expect nf_fp16 2 "--method neuroflux supports --precision fp32 or amp-bf16" -- train "${TINY[@]}" --method neuroflux --precision amp-fp16 --out "$WORK/nf0"
expect nf_bad_tolerance 2 "--nf-exit-tolerance must be in [0, 100]" -- train "${TINY[@]}" --method neuroflux --nf-exit-tolerance -1
expect nf_not_a_cnn 2 "--method neuroflux trains CNNs (resnet18, efficientnet-b0, small-cnn), got --model vit-tiny" -- train "${TINY[@]}" --method neuroflux --model vit-tiny
expect nf_adamw 2 "--method neuroflux trains every block with the fused SGD" -- train "${TINY[@]}" --method neuroflux --optimizer adamw
expect nf_bad_profile 2 "--nf-profile must be auto, model or measured, got 'guess'" -- train "${TINY[@]}" --method neuroflux --nf-profile guess
# Data parallel (docs/distributed.md): --nproc 2 starts two ranks of the binary (Gloo on the CPU); rank 0 alone
# writes; the run resumes in one process; what it does not support yet is refused once, before any rank starts.
expect nproc_trains 0 "2 processes" -- train "${TINY[@]}" --nproc 2 --max-steps 2 --out "$WORK/dp" --progress lines
if [ "$(grep -c '"event":"config"' "$WORK/dp/events.jsonl" 2>/dev/null)" = 1 ] && grep -q '"world_size":2' "$WORK/dp/events.jsonl"; then
  passed=$((passed + 1)); else failed=$((failed + 1)); echo "FAIL nproc_trains: not one config event with world_size 2"; fi
expect nproc_resume_one 0 "done: test acc" -- train --resume "$WORK/dp" --progress lines
expect nproc_neuroflux 0 "2 processes" -- train "${TINY[@]}" --nproc 2 --method neuroflux --out "$WORK/dpnf" --progress lines
if [ -f "$WORK/dpnf/exit_model.pt" ] && grep -q '"event":"summary"' "$WORK/dpnf/events.jsonl"; then
  passed=$((passed + 1)); else failed=$((failed + 1)); echo "FAIL nproc_neuroflux: no summary or exit model"; fi
expect nproc_auto 0 "method auto: backprop (the memory plan fits)" -- train "${TINY[@]}" --nproc 2 --method auto --max-steps 2 --out "$WORK/dpauto" --progress lines
expect nproc_neuroflux_sync_bn 2 "--sync-bn applies to --method backprop and tri-accel; drop it with neuroflux" -- train "${TINY[@]}" --nproc 2 --method neuroflux --sync-bn true
expect nproc_budget_sync_bn 2 "--sync-bn runs each process's share in one forward, which a --vram-budget may split into micro-batches" -- train "${TINY[@]}" --nproc 2 --vram-budget 1GB --sync-bn true
expect nproc_elastic 2 "--batch-policy elastic follows one process's memory; with --nproc 2 use --batch-policy fixed" -- train "${TINY[@]}" --nproc 2 --method tri-accel --vram-budget 1GB --batch-policy elastic
expect nproc_zero 2 "--nproc must be in [1, 1024], got 0" -- train "${TINY[@]}" --nproc 0
expect bucket_negative 2 "--grad-bucket-mb must be in [0, 4096] MiB (0: one collective after backward), got -1" -- train "${TINY[@]}" --grad-bucket-mb -1
# Small gradient buckets (several per step, started during backward) and a budget (ignored on the CPU, with a note)
# on two ranks.
expect nproc_buckets 0 "2 processes" -- train "${TINY[@]}" --nproc 2 --max-steps 2 --grad-bucket-mb 0.01 --vram-budget 1GB --out "$WORK/dpb" --progress lines
# The same binary under torchrun (the cluster launcher's environment; its agent serves the store).
if python3 -c 'import torch.distributed.run' 2>/dev/null; then
  out=$(timeout 300 python3 -m torch.distributed.run --standalone --nproc_per_node 2 --no-python "$CLI" train "${TINY[@]}" \
    --max-steps 2 --out "$WORK/tr" --progress lines 2>&1)
  if [ $? -eq 0 ] && printf '%s' "$out" | grep -q "2 processes" && grep -q '"world_size":2' "$WORK/tr/events.jsonl"; then
    passed=$((passed + 1)); else failed=$((failed + 1)); echo "FAIL torchrun: $out"; fi
fi
WORLD_SIZE=3 RANK=0 expect nproc_not_world 2 "--nproc 2 but this process is one of 3" -- train "${TINY[@]}" --nproc 2 --out "$WORK/dpw"

if ! python3 -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  expect nf_measured_on_cpu 2 "--nf-profile measured needs a CUDA device" -- train "${TINY[@]}" --method neuroflux --nf-profile measured --out "$WORK/nf0"
fi
# The tiny set under the name fashion-mnist (the issue's command, small enough for CI); 8MB forces several blocks.
expect nf_trains 0 "done: test acc" -- train "${TINY[@]}" --dataset fashion-mnist --method neuroflux --epochs 1 --vram-budget 8MB --nf-exit-tolerance 100 --out "$WORK/nf" --progress lines
if python3 - "$WORK/nf" <<'PY'
import json, os, sys
d = sys.argv[1]
ev = [json.loads(l) for l in open(f"{d}/events.jsonl")]
blocks = [e for e in ev if e["event"] == "block"]
ex = [e for e in ev if e["event"] == "exit"]
assert len(blocks) >= 2 and blocks[0]["input"] == "data" and all(b["input"] == "cache" for b in blocks[1:]), blocks
assert len(ex) == 1 and ex[0]["chosen"]["params"] < ev[-1]["params"] and ex[0]["chosen"]["images_per_s"] > 0, ex
assert ev[-1]["event"] == "summary" and ev[-1]["method"] == "neuroflux"
assert os.path.getsize(f"{d}/exit_model.pt") < os.path.getsize(f"{d}/model.pt")
assert json.load(open(f"{d}/exit.json"))["params"] == ex[0]["chosen"]["params"]
PY
then passed=$((passed + 1)); else failed=$((failed + 1)); echo "FAIL nf_trains: events/exports not as expected"; fi
# The issue's command itself, on real Fashion-MNIST images where the package is installed: its first 6,000 training
# and 1,000 test images (the whole set took 173 s of this suite under the sanitizers; the blocks, the cache and the
# exit are the same at any size).
FM=/usr/share/datasets/fashion-mnist
if [ -f $FM/train-images-idx3-ubyte ] || [ -f $FM/train-images-idx3-ubyte.gz ]; then
  python3 - "$FM" "$WORK/fm_part" <<'PY'
import gzip, os, struct, sys
src, dst = sys.argv[1:3]
os.makedirs(dst)
def read(name):
    path = os.path.join(src, name)
    return open(path, "rb").read() if os.path.exists(path) else gzip.open(path + ".gz").read()
for split, n in (("train", 6000), ("t10k", 1000)):
    images, labels = read(f"{split}-images-idx3-ubyte"), read(f"{split}-labels-idx1-ubyte")
    open(f"{dst}/{split}-images-idx3-ubyte", "wb").write(struct.pack(">IIII", 0x803, n, 28, 28) + images[16:16 + n * 784])
    open(f"{dst}/{split}-labels-idx1-ubyte", "wb").write(struct.pack(">II", 0x801, n) + labels[8:8 + n])
PY
  expect nf_issue_command 0 "done: test acc" -- train --method neuroflux --model small-cnn --dataset fashion-mnist --data "$WORK/fm_part" --device cpu --out "$WORK/nf_fm" --progress lines
  if python3 - "$WORK/nf_fm" <<'PY'
import json, sys
ev = [json.loads(l) for l in open(f"{sys.argv[1]}/events.jsonl")]
blocks = [e for e in ev if e["event"] == "block"]
chosen = [e for e in ev if e["event"] == "exit"][0]["chosen"]
assert len(blocks) >= 2 and all(b["input"] == "cache" for b in blocks[1:]), blocks
assert chosen["params"] < ev[-1]["params"], chosen
PY
  then passed=$((passed + 1)); else failed=$((failed + 1)); echo "FAIL nf_issue_command: not block by block or no smaller exit"; fi
fi
expect nf_stop_after_block 0 "stopped after block 1" -- train "${TINY[@]}" --method neuroflux --epochs 1 --vram-budget 8MB --max-steps 1 --out "$WORK/nf2" --progress lines
expect nf_resume_finishes 0 "done: test acc" -- train --resume "$WORK/nf2" --progress lines
# BAOC: bad optimizer flags, a budget below the cheapest plan (one line naming the minimum), and a real plan.
expect bad_optimizer 2 "--optimizer must be sgd, adamw or baoc, got 'lion'" -- train "${TINY[@]}" --optimizer lion
expect bad_memory_budget 2 "--optim-memory-budget must be a percentage" -- plan "${TINY[@]}" --optim-memory-budget 120% --out "$WORK/p0"
expect bad_time_budget 2 "--optim-time-budget must be none or a multiple" -- plan "${TINY[@]}" --optim-time-budget fast --out "$WORK/p0"
expect bad_format 2 "--optim-formats: unknown optimizer-state format 'fp4'" -- plan "${TINY[@]}" --optim-formats adamw-fp32,fp4 --out "$WORK/p0"
expect budget_too_small 2 "raise it to at least" -- plan "${TINY[@]}" --optim-formats adamw-fp32,adamw-8bit --optim-memory-budget 10% --out "$WORK/p0"
expect bad_risk_floor 2 "--optim-risk-floor must be in [0, 1], got 2" -- plan "${TINY[@]}" --optim-risk-floor 2 --out "$WORK/p0"
expect missing_time_table 2 "--optim-time-table $WORK/none.json: no such file" -- plan "${TINY[@]}" --optim-time-table "$WORK/none.json" --out "$WORK/p0"
expect warmup_too_long 2 "raise --epochs or lower --plan-warmup" -- plan "${TINY[@]}" --plan-warmup 10 --out "$WORK/p1"
expect plan_json 0 '"adamw_fp32_bytes"' -- plan "${TINY[@]}" --plan-warmup 3 --optim-memory-budget 15% --json --out "$WORK/p2"
if "$CLI" plan "${TINY[@]}" --plan-warmup 3 --optim-memory-budget 15% --json --out "$WORK/p3" 2>/dev/null | python3 -c '
import json, sys
p = json.loads(sys.stdin.read())["optim_plan"]
assert p["total_bytes"] <= p["budget_bytes"] <= 0.15 * p["adamw_fp32_bytes"] + 1, p
assert len({u["format"] for u in p["units"]}) >= 2, "the plan does not mix formats"
assert all({"unit", "format", "bytes", "risk"} <= set(u) for u in p["units"])
' && [ ! -e "$WORK/p3" ]; then passed=$((passed + 1)); else failed=$((failed + 1)); echo "FAIL plan_json_contents (or plan wrote $WORK/p3)"; fi

# The memory plan: `plan --vram-budget` on the CPU plans for a GPU from the modelled profile; a tight budget makes it
# split the batch or recompute; a budget under the floor is reported with the floor, and `train` refuses it.
expect memory_plan_text 0 "memory: micro-batch" -- plan "${TINY[@]}" --vram-budget 1GB --out "$WORK/pm0"
expect saved_fp8_plan_text 0 "in FP8: block1, block2, block3" -- plan "${TINY[@]}" --saved-activations fp8 --out "$WORK/pm_fp8"
expect bad_saved_activations 2 "--saved-activations must be auto, keep or fp8, got 'half'" -- train "${TINY[@]}" --saved-activations half
expect update_in_backward_plan_text 0 "micro-batch 32 x 1, updated in backward" -- plan "${TINY[@]}" --update-in-backward on --out "$WORK/pm_uib"
expect update_in_backward_baoc 2 "--update-in-backward on is not for --optimizer baoc (its plan reads every gradient of a step together): use sgd or adamw; leave it auto or off" -- train "${TINY[@]}" --update-in-backward on --optimizer baoc --out "$WORK/uib_baoc"
expect update_in_backward_micro 2 "--update-in-backward on updates after one micro-batch, and --micro-batch 8 splits batch 32" -- train "${TINY[@]}" --update-in-backward on --micro-batch 8 --out "$WORK/uib_micro"
if "$CLI" plan "${TINY[@]}" --vram-budget 1GB --json --out "$WORK/pm1" 2>/dev/null | python3 -c '
import json, sys
p = json.loads(sys.stdin.read())
m = p["memory_plan"]
assert "optim_plan" not in p, "a vram budget plans memory, not BAOC"
keys = {"micro_batch", "accumulation", "recompute", "data_placement", "predicted_peak_bytes", "budget_bytes"}
assert keys <= set(m), m
assert m["feasible"] and m["micro_batch"] == 32 and m["accumulation"] == 1 and m["recompute"] == [], m
assert m["budget_bytes"] == 10**9 and m["predicted_peak_bytes"] <= 0.9 * 10**9, m
tight = 0.5 * (m["floor_bytes"] + m["predicted_peak_bytes"])
print(int(tight / 0.9))
' > "$WORK/tight.txt" && [ ! -e "$WORK/pm1" ]; then passed=$((passed + 1)); else failed=$((failed + 1)); echo "FAIL memory_plan_json"; fi
if "$CLI" plan "${TINY[@]}" --vram-budget "$(cat "$WORK/tight.txt")" --json 2>/dev/null | python3 -c '
import json, sys
m = json.loads(sys.stdin.read())["memory_plan"]
assert m["feasible"] and (m["micro_batch"] < 32 or m["recompute"] or m["data_placement"] == "host"), m
assert m["predicted_peak_bytes"] <= m["plan_limit_bytes"], m
'; then passed=$((passed + 1)); else failed=$((failed + 1)); echo "FAIL memory_plan_tight"; fi
expect memory_plan_below_floor 0 "memory: no plan fits; the floor is" -- plan "${TINY[@]}" --vram-budget 1MB --out "$WORK/pm2"

# Text: a small corpus, the character GPT with a short context. Mismatches and bad files are one-line errors.
mkdir -p "$WORK/text" "$WORK/text-empty" "$WORK/text-none"
python3 - "$WORK/text/input.txt" <<'PY'
import sys
line = "First Citizen:\nBefore we proceed any further, hear me speak.\n"
open(sys.argv[1], "w").write(line * 16)
PY
: > "$WORK/text-empty/input.txt"
TEXT=(--model gpt-char --dataset tinyshakespeare --data "$WORK/text" --block-size 8 --device cpu --progress off)
expect gpt_text_stop 0 "stopped at step 2" -- train "${TEXT[@]}" --batch-size 16 --max-steps 2 --out "$WORK/gpt" --progress lines
expect gpt_text_resume_other_block 2 "--block-size 16 differs from the checkpoint" -- train --resume "$WORK/gpt" --block-size 16 --progress off
expect gpt_text_resume 0 "done: test acc" -- train --resume "$WORK/gpt" --progress lines
expect gpt_fp8 0 "amp-fp8: 25 linear layers of gpt-char compute in FP8" -- train "${TEXT[@]}" --precision fp8 --batch-size 16 --max-steps 2 --out "$WORK/gpt_fp8" --progress lines
expect gpt_fp8_resume 0 "done: test acc" -- train --resume "$WORK/gpt_fp8" --progress lines
expect gpt_text_epoch 0 "done: test acc" -- train "${TEXT[@]}" --batch-size 64 --out "$WORK/gpt1" --progress lines
if [ -f "$WORK/gpt1/model.pt" ] && grep '"event":"epoch"' "$WORK/gpt1/events.jsonl" | grep '"val_loss":[0-9]' | grep -q '"tokens_per_s":[0-9]'; then
  passed=$((passed + 1)); else failed=$((failed + 1)); echo "FAIL gpt_text_epoch: no model.pt, val_loss or tokens_per_s"; fi
expect gpt_on_images 2 "reads text but --dataset mnist holds images" -- train "${TINY[@]}" --model gpt-char
expect resnet_on_text 2 "use --model gpt-char" -- train "${TEXT[@]}" --model resnet18
expect augment_on_text 2 "--augment on applies to images only" -- train "${TEXT[@]}" --augment on
expect cutout_on_text 2 "--cutout applies to images only" -- train "${TEXT[@]}" --cutout 4
expect text_missing 2 "input.txt not found in $WORK/text-none; pass --data" -- train "${TEXT[@]}" --data "$WORK/text-none"
expect text_empty 2 "is empty" -- train "${TEXT[@]}" --data "$WORK/text-empty" --out "$WORK/o3"
expect text_too_short 2 "smaller --block-size" -- train "${TEXT[@]}" --block-size 200 --out "$WORK/o3"
expect tri_accel_gpt_hessian 2 "--curv-estimator hessian needs double backward, which --model gpt-char (its fused attention) has not; use --curv-estimator fisher" -- train "${TEXT[@]}" --method tri-accel --curv-estimator hessian
# Tri-Accel on the GPT (the Fisher's rounds) with the FP8 ladder: units move to fp8, and a resume reads them back.
expect tri_accel_gpt_fp8 0 "tri-accel with amp-fp8: the ladder is fp8, bf16, fp32" -- train "${TEXT[@]}" --method tri-accel --precision fp8 --batch-size 16 --ctrl-every 2 --curv-every 4 --max-steps 6 --out "$WORK/ta_fp8" --progress lines
if grep '"event":"precision"' "$WORK/ta_fp8/events.jsonl" | tail -1 | grep -q '"precision":\[[^]]*"fp8"'; then
  passed=$((passed + 1)); else failed=$((failed + 1)); echo "FAIL tri_accel_gpt_fp8: no unit at fp8 in the last precision event"; fi
expect tri_accel_gpt_fp8_resume 0 "done: test acc" -- train --resume "$WORK/ta_fp8" --progress lines
expect vit_on_mnist 0 "stopped at step 1" -- train "${TINY[@]}" --model vit-tiny --max-steps 1 --batch-size 4 --out "$WORK/vit" --progress lines
# BAOC plans any unit-based model: the character GPT on text.
expect plan_gpt 0 '"unit":"blocks.0"' -- plan "${TEXT[@]}" --batch-size 16 --plan-warmup 2 --optim-memory-budget 25% --json --out "$WORK/pg"

if ! python3 -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  expect no_gpu 2 "no CUDA GPU is visible" -- train "${TINY[@]}" --device cuda
fi

echo "cli: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
