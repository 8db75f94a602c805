#!/usr/bin/env bash
# The issue-7 bad-input corpus through the real CLI (tests/cli/run_cli_tests.sh holds the older cases; none is
# repeated here): truncated and corrupt dataset files (plain and gzip), wrong magic numbers, labels out of range,
# image folders (a test class missing from train/, a corrupt JPEG, an empty class folder),
# empty files, a full disk during a checkpoint write (simulated), invalid flag values, and a --vram-budget below the
# model's minimum. Each case asserts the exit code, a phrase of the message, and that the message is one line
# `triaccel: error: ...`; the full-disk case also asserts that the previous checkpoint is byte-identical afterwards
# and still resumes. Usage: bad_input_test.sh path/to/triaccel
set -u
CLI=${1:?usage: bad_input_test.sh path/to/triaccel}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
passed=0
failed=0

# expect NAME EXIT_CODE PHRASE -- ARGS... (tests/lib/expect.sh); strict: an error is the only line of the output,
# and it starts with "triaccel: error: ".
EXPECT_STRICT=1
source "$(dirname "$0")/../lib/expect.sh"
check() {  # check NAME COMMAND...: a condition that must hold
  local name=$1
  shift
  if "$@"; then passed=$((passed + 1)); else failed=$((failed + 1)); echo "FAIL $name"; fi
}

# Datasets: a good MNIST-layout set (plain and gzip), a good CIFAR-10 set, then one broken copy per case.
python3 - "$WORK" <<'PY'
import gzip, os, random, struct, sys, zlib
w = sys.argv[1]
rng = random.Random(0)
def idx(d, prefix, n, label=None, magic_images=0x803, magic_labels=0x801, gz=False):
    os.makedirs(d, exist_ok=True)
    labels = bytes((rng.randrange(10) if label is None else label) for _ in range(n))
    pixels = bytes(rng.randrange(256) for _ in range(n * 784))
    img = struct.pack(">IIII", magic_images, n, 28, 28) + pixels
    lab = struct.pack(">II", magic_labels, n) + labels
    op = (lambda p: gzip.open(p + ".gz", "wb")) if gz else (lambda p: open(p, "wb"))
    with op(f"{d}/{prefix}-images-idx3-ubyte") as f: f.write(img)
    with op(f"{d}/{prefix}-labels-idx1-ubyte") as f: f.write(lab)
def mnist(d, **kw):
    idx(d, "train", 64, **kw); idx(d, "t10k", 16)
mnist(f"{w}/good")
mnist(f"{w}/gz", gz=True)
mnist(f"{w}/magic_images", magic_images=0x804)
mnist(f"{w}/magic_labels", magic_labels=0x803)
mnist(f"{w}/label_range", label=10)
def cifar(d, n=20, label=None):
    os.makedirs(d, exist_ok=True)
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        recs = b"".join(bytes([rng.randrange(10) if label is None else label]) + bytes(rng.randrange(256) for _ in range(3072)) for _ in range(n))
        open(f"{d}/{name}", "wb").write(recs)
cifar(f"{w}/cifar")
cifar(f"{w}/cifar_label", label=10)
def png(path, side, value):  # an RGB PNG of one colour (stdlib only: zlib and crc32)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    chunk = lambda t, d: struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))
    rows = b"".join(b"\0" + bytes([value, 255 - value, value // 2]) * side for _ in range(side))
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    open(path, "wb").write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))
def images(d):  # --dataset folder: 2 classes, 8 training and 2 test images each
    for k, cls in enumerate(["cat", "dog"]):
        for i in range(8): png(f"{d}/train/{cls}/{i}.png", 16, 40 + 120 * k + i)
        for i in range(2): png(f"{d}/test/{cls}/{i}.png", 16, 44 + 120 * k + i)
images(f"{w}/folder")
images(f"{w}/folder_extra_class"); png(f"{w}/folder_extra_class/test/yak/0.png", 16, 0)
images(f"{w}/folder_corrupt"); open(f"{w}/folder_corrupt/train/dog/bad.jpg", "wb").write(b"\xff\xd8\xff\xe0" + bytes(300))
images(f"{w}/folder_empty_class"); os.makedirs(f"{w}/folder_empty_class/train/moth")
PY
TINY=(--dataset mnist --model small-cnn --device cpu --batch-size 16 --progress off)
TR=train-images-idx3-ubyte
LB=train-labels-idx1-ubyte

# --- dataset files ---
mk() { rm -rf "$WORK/$1"; cp -r "$WORK/$2" "$WORK/$1"; }
mk gz_trunc gz; head -c 3000 "$WORK/gz/$TR.gz" > "$WORK/gz_trunc/$TR.gz"
expect idx_gzip_truncated 2 "$TR.gz: corrupt or truncated gzip data" -- train "${TINY[@]}" --data "$WORK/gz_trunc" --out "$WORK/o"
mk gz_corrupt gz
python3 - "$WORK/gz_corrupt/$TR.gz" <<'PY'
import sys
p = sys.argv[1]; b = bytearray(open(p, "rb").read()); b[len(b) // 2] ^= 0xff; open(p, "wb").write(bytes(b))
PY
expect idx_gzip_corrupt 2 "corrupt or truncated gzip data" -- train "${TINY[@]}" --data "$WORK/gz_corrupt" --out "$WORK/o"
expect idx_gzip_trains 0 "stopped at step 1" -- train "${TINY[@]}" --data "$WORK/gz" --max-steps 1 --out "$WORK/gzrun" --progress lines
mk lab_trunc good; head -c 40 "$WORK/good/$LB" > "$WORK/lab_trunc/$LB"
expect idx_labels_truncated 2 "header says 64 labels, found 32 label bytes" -- train "${TINY[@]}" --data "$WORK/lab_trunc" --out "$WORK/o"
mk hdr_trunc good; head -c 10 "$WORK/good/$TR" > "$WORK/hdr_trunc/$TR"
expect idx_header_truncated 2 "is shorter than the 16-byte images header" -- train "${TINY[@]}" --data "$WORK/hdr_trunc" --out "$WORK/o"
expect idx_images_magic 2 "magic 0x00000804, expected 0x00000803 (images file)" -- train "${TINY[@]}" --data "$WORK/magic_images" --out "$WORK/o"
expect idx_labels_magic 2 "magic 0x00000803, expected 0x00000801 (labels file)" -- train "${TINY[@]}" --data "$WORK/magic_labels" --out "$WORK/o"
expect idx_label_out_of_range 2 "has label 10, expected 0..9" -- train "${TINY[@]}" --data "$WORK/label_range" --out "$WORK/o"
mk empty_idx good; : > "$WORK/empty_idx/$LB"
expect idx_empty 2 "$LB: file is empty" -- train "${TINY[@]}" --data "$WORK/empty_idx" --out "$WORK/o"
mk cifar_trunc cifar; head -c 5000 "$WORK/cifar/data_batch_3.bin" > "$WORK/cifar_trunc/data_batch_3.bin"
expect cifar_truncated 2 "data_batch_3.bin: size 5000 is not a multiple of the record size 3073" -- train --dataset cifar10 --data "$WORK/cifar_trunc" --device cpu --out "$WORK/o"
expect cifar_label_out_of_range 2 "has label 10, expected 0..9" -- train --dataset cifar10 --data "$WORK/cifar_label" --device cpu --out "$WORK/o"
mk cifar_empty cifar; : > "$WORK/cifar_empty/test_batch.bin"
expect cifar_empty 2 "test_batch.bin: file is empty" -- train --dataset cifar10 --data "$WORK/cifar_empty" --device cpu --out "$WORK/o"
mkdir -p "$WORK/c100"; cp "$WORK/cifar/data_batch_1.bin" "$WORK/c100/train.bin"; cp "$WORK/cifar/test_batch.bin" "$WORK/c100/test.bin"
expect cifar10_files_as_cifar100 2 "train.bin: size 61460 is not a multiple of the record size 3074 (truncated or not CIFAR-100 binary)" -- train --dataset cifar100 --data "$WORK/c100" --device cpu --out "$WORK/o"
FOLDER=(--dataset folder --model small-cnn --device cpu --batch-size 4 --progress off)
expect folder_trains 0 "stopped at step 1" -- train "${FOLDER[@]}" --data "$WORK/folder" --max-steps 1 --out "$WORK/folderrun" --progress lines
expect folder_test_class_not_trained 2 "folder: class folder $WORK/folder_extra_class/test/yak is not a class of $WORK/folder_extra_class/train" -- train "${FOLDER[@]}" --data "$WORK/folder_extra_class" --out "$WORK/o"
expect folder_corrupt_jpeg 2 "folder: cannot decode $WORK/folder_corrupt/train/dog/bad.jpg (corrupt or truncated JPEG)" -- train "${FOLDER[@]}" --data "$WORK/folder_corrupt" --out "$WORK/o"
expect folder_empty_class 2 "folder: class folder $WORK/folder_empty_class/train/moth has no .jpg, .jpeg or .png images" -- train "${FOLDER[@]}" --data "$WORK/folder_empty_class" --out "$WORK/o"

# --- output ---
expect out_under_a_file 2 "--out $WORK/good/$TR/run: cannot create the folder" -- train "${TINY[@]}" --data "$WORK/good" --out "$WORK/good/$TR/run"

# --- full disk during a checkpoint write (TRIACCEL_TEST_WRITE_FAIL=ENOSPC makes the write fail halfway) ---
expect disk_full_setup 0 "stopped at step 2" -- train "${TINY[@]}" --data "$WORK/good" --epochs 2 --max-steps 2 --out "$WORK/full" --progress lines
cp "$WORK/full/checkpoint.pt" "$WORK/full-before.pt"
TRIACCEL_TEST_WRITE_FAIL=ENOSPC expect disk_full 2 "checkpoint.pt failed after" -- train --resume "$WORK/full" --checkpoint-every 1 --progress off
TRIACCEL_TEST_WRITE_FAIL=ENOSPC expect disk_full_says_why 2 "No space left on device; free disk space and resume (the previous file is intact)" -- train --resume "$WORK/full" --checkpoint-every 1 --progress off
check disk_full_checkpoint_intact cmp -s "$WORK/full/checkpoint.pt" "$WORK/full-before.pt"
check disk_full_no_temp_left test -z "$(ls "$WORK/full" | grep '\.tmp\.' || true)"
expect disk_full_then_resumes 0 "done: test acc" -- train --resume "$WORK/full" --progress lines

# --- invalid flag values ---
expect faults_unknown_kind 2 "--inject-faults: unknown fault 'segv' in 'segv@3'" -- train "${TINY[@]}" --data "$WORK/good" --inject-faults segv@3
expect faults_bad_step 2 "--inject-faults: 'oom@-1' needs an integer >= 0" -- train "${TINY[@]}" --data "$WORK/good" --inject-faults oom@-1
expect faults_bad_probability 2 "needs a probability in [0, 1], got '1.5'" -- train "${TINY[@]}" --data "$WORK/good" --inject-faults random:seed=1,oom=1.5
expect faults_neuroflux 2 "--inject-faults applies to --method backprop and tri-accel" -- train "${TINY[@]}" --data "$WORK/good" --method neuroflux --inject-faults oom@1
expect checkpoint_every_negative 2 "--checkpoint-every must be >= 0, got -1" -- train "${TINY[@]}" --data "$WORK/good" --checkpoint-every -1
expect checkpoint_minutes_negative 2 "--checkpoint-minutes must be >= 0, got -5" -- train "${TINY[@]}" --data "$WORK/good" --checkpoint-minutes -5
expect epochs_zero 2 "--epochs must be > 0, got 0" -- train "${TINY[@]}" --data "$WORK/good" --epochs 0
expect momentum_one 2 "--momentum must be in [0, 1), got 1" -- train "${TINY[@]}" --data "$WORK/good" --momentum 1
expect vram_budget_garbage 2 "--vram-budget" -- train "${TINY[@]}" --data "$WORK/good" --vram-budget lots
expect progress_bad 2 "--progress must be auto, bar, lines or off, got 'loud'" -- train "${TINY[@]}" --data "$WORK/good" --progress loud
expect max_steps_negative 2 "--max-steps must be >= 0" -- train "${TINY[@]}" --data "$WORK/good" --max-steps -3
expect micro_batch_negative 2 "--micro-batch must be >= 0 (0: planned), got -2" -- train "${TINY[@]}" --data "$WORK/good" --micro-batch -2
expect micro_batch_too_big 2 "--micro-batch 64 is larger than --batch-size 16" -- train "${TINY[@]}" --data "$WORK/good" --micro-batch 64
expect recompute_unknown_unit 2 "--recompute: model small-cnn has no unit 'layer9'; use auto, none, or some of: block1" -- train "${TINY[@]}" --data "$WORK/good" --recompute block1,layer9 --out "$WORK/o"
expect placement_bad 2 "--data-placement must be auto, device or host, got 'disk'" -- train "${TINY[@]}" --data "$WORK/good" --data-placement disk
expect batch_policy_backprop 2 "--batch-policy elastic is tri-accel's rule" -- train "${TINY[@]}" --data "$WORK/good" --batch-policy elastic
expect micro_batch_neuroflux 2 "--micro-batch applies to --method backprop and tri-accel" -- train "${TINY[@]}" --data "$WORK/good" --method neuroflux --micro-batch 8

# --- a budget below the model's minimum: the error states the minimum ---
expect vram_below_minimum 2 "--vram-budget 100KB is below this run's minimum of" -- train "${TINY[@]}" --data "$WORK/good" --vram-budget 100KB --out "$WORK/o"
expect vram_below_minimum_tri 2 "raise the budget" -- train "${TINY[@]}" --data "$WORK/good" --method tri-accel --vram-budget 100KB --out "$WORK/o"

# --- fault injection end to end through the CLI: training continues, skips/ooms are events and counters ---
expect faults_run 0 "done: test acc" -- train "${TINY[@]}" --data "$WORK/good" --inject-faults oom@1,nan-grad@2,nan-loss@3x2 --out "$WORK/faults" --progress lines
check faults_events python3 - "$WORK/faults/events.jsonl" <<'PY'
import json, sys
ev = [json.loads(l) for l in open(sys.argv[1])]
skips = [e for e in ev if e["event"] == "skip"]
ooms = [e for e in ev if e["event"] == "oom"]
s = ev[-1]
assert [e["reason"] for e in skips] == ["nan-grad", "nan-loss", "nan-loss"], skips
assert len(ooms) == 1 and ooms[0]["injected"] and ooms[0]["retry_batch"] <= ooms[0]["batch"], ooms
assert s["event"] == "summary" and s["skipped_steps"] == 3 and s["oom_retries"] == 1 and s["dropped_samples"] == 0, s
epoch = [e for e in ev if e["event"] == "epoch"][0]
assert epoch["samples"] == 64, epoch
PY

echo "bad_input: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
