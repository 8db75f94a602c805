#!/usr/bin/env python3
"""Stopping by signal through the real CLI: SIGINT or SIGTERM at a random step ends the run with a checkpoint, and
--resume ends bit-exactly where an uninterrupted run ends; a second SIGINT during that checkpoint's write aborts at
once and the previous checkpoint resumes.

A reference run trains small-cnn for 2 epochs on a tiny MNIST-layout set. Each trial starts the same run with a
progress line per step on stderr, reads a seeded random number of step lines, and sends the signal:
  - SIGINT / SIGTERM: the run must exit 3, print one line naming the signal and how to resume, end events.jsonl with
    a stop event (the reason, the step) right after a checkpoint event of that step, and leave checkpoint.pt at that
    step and no model.pt; `--resume OUT` then ends with model.pt equal to the reference byte for byte.
  - SIGINT twice: the second arrives while the stop's checkpoint is being written (its temporary file exists; a
    test-only hook, TRIACCEL_TEST_WRITE_DELAY_MS, widens that window): the run dies of SIGINT at once, the temporary
    file is the only trace, and the checkpoint written before (--checkpoint-every 2) resumes to the reference.
No assertion depends on how fast the machine is: the signal's step is whatever step the run had reached.

Usage: signal_stop_test.py path/to/triaccel [--trials N] [--seed S]
"""
import argparse
import glob
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from crash_resume_test import write_dataset  # noqa: E402


def events_of(out):
    with open(f"{out}/events.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cli")
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    work = tempfile.mkdtemp(prefix="triaccel_signal_")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    failures = []
    try:
        data = f"{work}/mnist"
        write_dataset(data, 96, 16)
        base = [args.cli, "train", "--dataset", "mnist", "--data", data, "--model", "small-cnn", "--device", "cpu",
                "--batch-size", "8", "--epochs", "2", "--checkpoint-every", "2", "--eval-batch-size", "16"]
        steps_total = 2 * 96 // 8
        ref = subprocess.run(base + ["--progress", "off", "--out", f"{work}/ref"], env=env, capture_output=True,
                             text=True)
        if ref.returncode != 0:
            sys.exit(f"reference run failed: {ref.stderr}")
        ref_model = open(f"{work}/ref/model.pt", "rb").read()

        kinds = ["SIGINT", "SIGTERM", "SIGINT twice"]
        for trial in range(args.trials):
            kind = kinds[trial % len(kinds)]
            out = f"{work}/t{trial}"
            after = rng.randrange(1, steps_total - 2)  # step lines to read before signalling
            twice = kind == "SIGINT twice"
            sig = signal.SIGTERM if kind == "SIGTERM" else signal.SIGINT
            trial_env = dict(env, TRIACCEL_TEST_WRITE_DELAY_MS="300") if twice else env
            proc = subprocess.Popen(base + ["--progress", "lines", "--log-every", "1", "--out", out], env=trial_env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            seen, lines = 0, []
            for line in proc.stderr:
                lines.append(line)
                if " step " in line:
                    seen += 1
                    if seen >= after:
                        break
            proc.send_signal(sig)
            in_write = False
            if twice:
                # The stop's checkpoint write: a temporary file appears after the step in flight finishes. A periodic
                # write (--checkpoint-every 2) may already be under way when the first SIGINT is sent: its file is
                # waited out first. Sent at once beside it, the second SIGINT could reach a process that had not yet
                # taken the first, and two pending SIGINTs are one (a loaded machine: exit 3, a normal stop).
                deadline = time.monotonic() + 60
                busy = bool(glob.glob(f"{out}/checkpoint.pt.tmp.*"))
                while proc.poll() is None and time.monotonic() < deadline:
                    writing = bool(glob.glob(f"{out}/checkpoint.pt.tmp.*"))
                    if busy:
                        busy = writing
                    elif writing:
                        in_write = True
                        proc.send_signal(signal.SIGINT)
                        break
                    time.sleep(0.001)
            lines += proc.stderr.readlines()
            proc.wait()
            where = f"trial {trial} ({kind} after {after} step lines)"
            events = events_of(out)
            if twice:
                if not in_write or proc.returncode != -signal.SIGINT:
                    failures.append(f"{where}: want death by SIGINT during the write, got exit {proc.returncode}, "
                                    f"write seen: {in_write}")
                if events[-1]["event"] == "stop":
                    failures.append(f"{where}: a stop event was written although the run was aborted")
            else:
                stop = events[-1]
                want_reason = "sigterm" if sig == signal.SIGTERM else "sigint"
                if proc.returncode != 3:
                    failures.append(f"{where}: exit {proc.returncode}, want 3: {''.join(lines[-3:])}")
                if stop["event"] != "stop" or stop.get("reason") != want_reason:
                    failures.append(f"{where}: last event {stop}, want a stop event with reason {want_reason}")
                elif events[-2]["event"] != "checkpoint" or events[-2]["step"] != stop["step"]:
                    failures.append(f"{where}: no checkpoint event at the stop's step before it: {events[-2]}")
                said = [ln for ln in lines if "stopped at step" in ln]
                if len(said) != 1 or "--resume " + out not in said[0] or kind.split()[0] not in said[0]:
                    failures.append(f"{where}: want one line naming the signal and --resume OUT, got {said}")
                if os.path.exists(f"{out}/model.pt"):
                    failures.append(f"{where}: model.pt written by a stopped run")
            r = subprocess.run([args.cli, "train", "--resume", out, "--progress", "off"], env=env,
                               capture_output=True, text=True)
            ok = r.returncode == 0 and open(f"{out}/model.pt", "rb").read() == ref_model
            if r.returncode != 0:
                failures.append(f"{where}: resume exited {r.returncode}: {r.stderr.strip()[-300:]}")
            elif not ok:
                failures.append(f"{where}: model.pt after resume differs from the uninterrupted run")
            if glob.glob(f"{out}/*.tmp.*"):
                failures.append(f"{where}: temporary files left after the resume")
            stopped_at = [e["step"] for e in events if e["event"] == "stop"]
            print(f"{where}: exit {proc.returncode}, stop at {stopped_at}, resume {'ok' if ok else 'MISMATCH'}")
            shutil.rmtree(out, ignore_errors=True)
        for f in failures:
            print("FAIL", f)
        sys.exit(1 if failures else 0)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
