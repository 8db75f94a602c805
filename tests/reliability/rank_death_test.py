#!/usr/bin/env python3
"""A data-parallel rank that dies ends the job with one line naming it (docs/distributed.md), and the last checkpoint
resumes.

`triaccel train --nproc 2` trains small-cnn on a tiny MNIST-layout set with a checkpoint every 2 steps and a progress
line per step. After rank 0 has printed a few steps, the test kills rank 1 (the child whose environment holds RANK=1)
with SIGKILL. The launcher must exit non-zero within a minute, print "rank 1 of 2 was killed by signal 9" with the
--resume hint, and `--resume OUT` in one process must then finish the run (cut to one epoch, so the test stays
short). Nothing depends on the machine's speed:
the kill comes after whatever step the run has reached.

Usage: rank_death_test.py path/to/triaccel
"""
import os
import signal
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from crash_resume_test import write_dataset  # noqa: E402


def rank_children(parent):
    """{rank: pid} of the launcher's children, read from their environments."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != parent:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
            out[int(env[b"RANK"])] = int(pid)
        except (OSError, KeyError, ValueError, IndexError):
            continue
    return out


def kill_rank_after_checkpoint(p, out, rank=1, steps=4):
    """Reads the launcher's output (p: a Popen with text stdout) until it has printed `steps` step lines and OUT holds
    a checkpoint, then kills rank `rank` among its children with SIGKILL. Returns (the lines read, None) or (the lines,
    why it could not: the launcher was killed then)."""
    lines = []
    for line in p.stdout:
        lines.append(line)
        if sum(" step " in l for l in lines) >= steps and os.path.exists(os.path.join(out, "checkpoint.pt")):
            break
    ranks = rank_children(p.pid)
    if rank not in ranks:
        p.kill()
        return lines, f"no rank {rank} among the launcher's children ({ranks})"
    os.kill(ranks[rank], signal.SIGKILL)
    return lines, None


def main():
    cli = sys.argv[1]
    with tempfile.TemporaryDirectory() as work:
        data = os.path.join(work, "mnist")
        write_dataset(data, 256, 64)
        out = os.path.join(work, "run")
        args = [cli, "train", "--dataset", "mnist", "--data", data, "--model", "small-cnn", "--device", "cpu",
                "--batch-size", "16", "--epochs", "40", "--log-every", "1", "--progress", "lines",
                "--checkpoint-every", "2", "--nproc", "2", "--out", out]
        p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines, failed = kill_rank_after_checkpoint(p, out)
        if failed:
            print("FAIL:", failed)
            return 1
        try:
            rest, _ = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            print("FAIL: the launcher did not end within 60 s of rank 1's death")
            return 1
        text = "".join(lines) + rest
        failures = []
        if p.returncode == 0:
            failures.append("the launcher exited 0")
        if "rank 1 of 2 was killed by signal 9" not in text or "--resume " + out not in text:
            failures.append("no line naming rank 1 and --resume")
        if failures:
            print("FAIL:", "; ".join(failures), "\n" + text[-2000:])
            return 1
        # One epoch in all (the kill came inside the first of 40): the resume finishes that epoch and writes model.pt.
        r = subprocess.run([cli, "train", "--resume", out, "--epochs", "1", "--progress", "off"], capture_output=True,
                           text=True)
        if r.returncode != 0 or not os.path.exists(os.path.join(out, "model.pt")):
            print(f"FAIL: the resume in one process exited {r.returncode}: {r.stderr[-1000:]}")
            return 1
        print("rank_death: passed; the launcher said:", [l for l in text.splitlines() if "error" in l])
    return 0


if __name__ == "__main__":
    sys.exit(main())
