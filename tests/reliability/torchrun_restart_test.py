#!/usr/bin/env python3
"""A rank lost under `torchrun --max-restarts 1` (docs/distributed.md): torchrun restarts the group, the restarted
ranks resume from the last checkpoint in OUT by themselves, and the run ends with exactly the weights of an
uninterrupted run.

small-cnn on a tiny MNIST-layout set, 2 epochs of 16 steps at global batch 16 on two ranks, a checkpoint every 2 steps
and a progress line per step. The reference is the same run uninterrupted (`--nproc 2`, the launcher of our own: the
same two Gloo ranks). Under torchrun (one agent, two processes), once rank 0 has printed 4 steps and a checkpoint
exists, the test kills rank 1 (the agent's child whose environment holds RANK=1) with SIGKILL: rank 1 has passed the
checkpoint (the ranks step in lockstep), and the run is inside its first epoch. torchrun must then restart both ranks
and exit 0; the output must hold the line "torchrun restart 1: resuming from OUT/checkpoint.pt at step N" with N a
checkpoint's step, events.jsonl a `resume` event at that step, and model.pt must equal the reference byte for byte.
Nothing waits on the clock: the kill follows the run's own lines, whatever step it has reached (a timeout only ends
a hung run). Exit 77 (skipped) where torch, and with it torchrun, is not installed.

Usage: torchrun_restart_test.py path/to/triaccel
"""
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from crash_resume_test import write_dataset  # noqa: E402
from rank_death_test import kill_rank_after_checkpoint  # noqa: E402
from torchrun_hosts_test import HUNG_S, SKIP, events, quiet_env, state_differences, torchrun_argv  # noqa: E402


def main():
    cli = os.path.abspath(sys.argv[1])
    torchrun = torchrun_argv()
    if torchrun is None:
        print("SKIP: torch (and torchrun) is not installed for", sys.executable)
        return SKIP
    env = quiet_env()
    with tempfile.TemporaryDirectory() as work:
        data = os.path.join(work, "mnist")
        write_dataset(data, 256, 64)
        train = ["train", "--dataset", "mnist", "--data", data, "--model", "small-cnn", "--device", "cpu",
                 "--batch-size", "16", "--epochs", "2", "--checkpoint-every", "2"]
        ref, out = os.path.join(work, "ref"), os.path.join(work, "run")
        r = subprocess.run([cli] + train + ["--nproc", "2", "--progress", "off", "--out", ref], env=env,
                           capture_output=True, text=True, timeout=HUNG_S)
        if r.returncode != 0:
            print(f"FAIL: the uninterrupted run exited {r.returncode}:\n{r.stdout[-1500:]}{r.stderr[-1500:]}")
            return 1

        argv = torchrun + ["--standalone", "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "1",
                           "--no-python", cli] + train + ["--log-every", "1", "--progress", "lines", "--out", out]
        p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines, failed = kill_rank_after_checkpoint(p, out)
        if failed:
            print(f"FAIL: {failed}:\n{''.join(lines)[-3000:]}")
            return 1
        try:
            rest, _ = p.communicate(timeout=HUNG_S)
        except subprocess.TimeoutExpired:
            p.kill()
            print(f"FAIL: torchrun still ran {HUNG_S} s after rank 1's death")
            return 1
        text = "".join(lines) + rest
        failures = []
        if p.returncode != 0:
            failures.append(f"torchrun exited {p.returncode}")
        said = re.findall(r"torchrun restart 1: resuming from (\S+) at step (\d+)", text)
        if len(said) != 1 or said[0][0] != os.path.join(out, "checkpoint.pt") or int(said[0][1]) % 2 != 0 \
                or int(said[0][1]) < 2:
            failures.append(f"not one line 'torchrun restart 1: resuming from {out}/checkpoint.pt at step N' "
                            f"(N a checkpoint's step): {said}")
        try:
            resumes = [e for e in events(out) if e.get("event") == "resume"]
            if len(resumes) != 1 or (said and resumes[0].get("step") != int(said[0][1])):
                failures.append(f"events.jsonl holds no resume event at the step resumed: {resumes}")
        except (OSError, ValueError) as e:
            failures.append(f"events.jsonl unreadable: {e}")
        model, ref_model = os.path.join(out, "model.pt"), os.path.join(ref, "model.pt")
        if not os.path.exists(model):
            failures.append("no model.pt")
        elif open(model, "rb").read() != open(ref_model, "rb").read():
            failures.append("model.pt differs from the uninterrupted run's: "
                            + "; ".join(state_differences(model, ref_model, 0.0)[:8]))
        if failures:
            print("FAIL:", "\n".join(failures), "\n--- torchrun said:\n" + text[-4000:])
            return 1
        print(f"torchrun_restart: passed; rank 1 killed after step {said[0][1]}'s checkpoint, torchrun restarted the "
              "group, it resumed there and ended with the uninterrupted run's model.pt byte for byte")
    return 0


if __name__ == "__main__":
    sys.exit(main())
