#!/usr/bin/env python3
"""Crash safety through the real CLI: SIGKILL at seeded random points, then --resume, must end bit-exactly where an
uninterrupted run ends.

A reference run trains small-cnn for 2 epochs on a tiny MNIST-layout set with a checkpoint after every step. Each
trial starts the same run, kills it with SIGKILL, and resumes (`--resume OUT`) until it finishes (a trial whose kill
came before the first checkpoint starts afresh, as a user would). Half the trials kill at a random time; the other
half wait a random time and then kill as soon as a checkpoint write is in flight (its temporary file exists), so those
kills verifiably land inside a write. A test-only hook (TRIACCEL_TEST_WRITE_DELAY_MS) pauses each write halfway to
widen that window (a kill counts as inside a write when it left a temporary file behind). Every resume must succeed
(a half-written checkpoint.pt would fail its checksum and exit 2). At the end of each trial: model.pt equals the
reference byte for byte, no temporary file survives the resume, and events.jsonl is valid JSON line by line and
ends with the summary. At least a quarter of the trials must have been killed inside a checkpoint write.

Usage: crash_resume_test.py path/to/triaccel [--trials N] [--seed S]
"""
import argparse
import glob
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time


def write_dataset(d, n_train, n_test):
    os.makedirs(d)
    rng = random.Random(0)

    def write(prefix, n):
        labels = bytes(rng.randrange(10) for _ in range(n))
        pixels = bytes(rng.randrange(256) for _ in range(n * 784))
        with open(f"{d}/{prefix}-images-idx3-ubyte", "wb") as f:
            f.write(struct.pack(">IIII", 0x803, n, 28, 28) + pixels)
        with open(f"{d}/{prefix}-labels-idx1-ubyte", "wb") as f:
            f.write(struct.pack(">II", 0x801, n) + labels)

    write("train", n_train)
    write("t10k", n_test)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cli")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    work = tempfile.mkdtemp(prefix="triaccel_crash_")
    env = dict(os.environ, TRIACCEL_TEST_WRITE_DELAY_MS="40", OMP_NUM_THREADS="1")
    failures = []
    try:
        data = f"{work}/mnist"
        write_dataset(data, 96, 16)
        base = [args.cli, "train", "--dataset", "mnist", "--data", data, "--model", "small-cnn", "--device", "cpu",
                "--batch-size", "8", "--epochs", "2", "--checkpoint-every", "1", "--eval-batch-size", "16",
                "--progress", "off"]

        def run(cmd, out):
            return subprocess.run(cmd + ["--out", out], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)

        t0 = time.monotonic()
        ref = run(base, f"{work}/ref")
        ref_s = time.monotonic() - t0
        if ref.returncode != 0:
            print(ref.stdout)
            sys.exit("reference run failed")
        ref_model = open(f"{work}/ref/model.pt", "rb").read()
        print(f"reference run: {ref_s:.2f} s")

        in_write = 0
        kills = 0
        for trial in range(args.trials):
            out = f"{work}/t{trial}"
            wait_for_write = trial % 2 == 1
            kill_at = rng.uniform(0.15, 0.95) * ref_s
            proc = subprocess.Popen(base + ["--out", out], env=env, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
            time.sleep(kill_at)
            killed_in_write = False
            if wait_for_write:
                deadline = time.monotonic() + ref_s
                while proc.poll() is None and time.monotonic() < deadline:
                    if glob.glob(f"{out}/checkpoint.pt.tmp.*"):
                        break
                    time.sleep(0.002)
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                kills += 1
            proc.wait()
            temps = glob.glob(f"{out}/*.tmp.*")
            killed_in_write = proc.returncode == -signal.SIGKILL and bool(temps)
            in_write += killed_in_write
            # Resume until done; a kill before the first checkpoint means starting afresh.
            for _ in range(3):
                if os.path.exists(f"{out}/checkpoint.pt"):
                    r = run([args.cli, "train", "--resume", out, "--progress", "off"], out)
                else:
                    r = run(base, out)
                if r.returncode == 0:
                    break
                failures.append(f"trial {trial}: resume exited {r.returncode}: {r.stdout.strip()[-400:]}")
                break
            model_path = f"{out}/model.pt"
            ok = os.path.exists(model_path) and open(model_path, "rb").read() == ref_model
            if not ok:
                failures.append(f"trial {trial}: model.pt differs from the uninterrupted run")
            if glob.glob(f"{out}/*.tmp.*"):
                failures.append(f"trial {trial}: temporary files left after resume: {glob.glob(out + '/*.tmp.*')}")
            try:
                with open(f"{out}/events.jsonl") as f:
                    events = [json.loads(line) for line in f if line.strip()]
                if events[-1]["event"] != "summary":
                    failures.append(f"trial {trial}: events.jsonl does not end with the summary")
            except (OSError, ValueError, KeyError, IndexError) as e:
                failures.append(f"trial {trial}: events.jsonl unreadable: {e}")
            print(f"trial {trial:2d}: {'wait-for-write' if wait_for_write else 'random-time   '} kill at "
                  f"{kill_at:5.2f} s, {'inside a checkpoint write' if killed_in_write else 'outside a write'}: "
                  f"{'ok' if ok else 'MISMATCH'}")
            shutil.rmtree(out, ignore_errors=True)
        print(f"crash_resume: {args.trials} trials, {kills} killed, {in_write} inside a checkpoint write, "
              f"{len(failures)} failures, {time.monotonic() - t0:.1f} s")
        if in_write < args.trials // 4:
            failures.append(f"only {in_write} kills landed inside a checkpoint write (want >= {args.trials // 4})")
        for f in failures:
            print("FAIL", f)
        sys.exit(1 if failures else 0)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
