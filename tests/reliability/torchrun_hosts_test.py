#!/usr/bin/env python3
"""Several hosts through torchrun (docs/distributed.md, "Launching"): two torchrun agents on this machine, each a
"host" of one process, meet in torchrun's c10d rendezvous and run the CLI itself (`--no-python triaccel train`); the
ranks join through the store torchrun's agent serves (TORCHELASTIC_USE_AGENT_STORE) and reduce with Gloo. The run must
end with the weights of one process at the same global batch (`--batch-size` is the global batch).

small-cnn on a tiny MNIST-layout set, 2 epochs of 4 steps at batch 32, `--sync-bn` (without it each rank normalizes
with its own half-batch's statistics and the weights leave one process's by far more than the tolerance). Every
floating tensor of model.pt (weights and BatchNorm running statistics) must be within 1e-3 of one process's, relative
to the tensor's largest magnitude (the gradients are summed over the ranks, so fp32 summation order differs), and the
counters equal; the run's config event must say world_size 2. The two agents run until they exit (no clock: a timeout
only ends a hung run). Exit 77 (skipped) where torch, and with it torchrun, is not installed.

Usage: torchrun_hosts_test.py path/to/triaccel
"""
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from crash_resume_test import write_dataset  # noqa: E402

SKIP = 77
HUNG_S = 300  # a run still going after this long is hung, not slow


def torchrun_argv():
    """torchrun as this interpreter runs it, or None where torch is not installed."""
    if importlib.util.find_spec("torch") is None:
        return None
    return [sys.executable, "-m", "torch.distributed.run"]


def free_port():
    """A TCP port free on 127.0.0.1 now (the rendezvous endpoint both agents are told)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quiet_env():
    # One thread per process (two processes share two cores), the same in every run compared.
    return dict(os.environ, OMP_NUM_THREADS="1")


def events(out):
    with open(os.path.join(out, "events.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def state_differences(path, ref_path, rtol):
    """The entries of model.pt at `path` that differ from `ref_path`'s: floating tensors by more than rtol of the
    reference tensor's largest magnitude, other tensors (counters) at all; [] when they agree."""
    import torch
    a = torch.load(path, map_location="cpu", weights_only=True)
    b = torch.load(ref_path, map_location="cpu", weights_only=True)
    if sorted(a) != sorted(b):
        return [f"keys differ: {sorted(set(a) ^ set(b))}"]
    out = []
    for k in sorted(a):
        x, y = a[k], b[k]
        if x.shape != y.shape or x.dtype != y.dtype:
            out.append(f"{k}: {x.dtype}{list(x.shape)} against {y.dtype}{list(y.shape)}")
        elif x.is_floating_point():
            diff = (x - y).abs().max().item() if x.numel() else 0.0
            scale = y.abs().max().item() if y.numel() else 0.0
            if diff > rtol * max(scale, 1e-12):
                out.append(f"{k}: {diff:.3g} apart (largest value {scale:.3g})")
        elif not torch.equal(x, y):
            out.append(f"{k}: {x.tolist()} against {y.tolist()}")
    return out


def main():
    cli = os.path.abspath(sys.argv[1])
    torchrun = torchrun_argv()
    if torchrun is None:
        print("SKIP: torch (and torchrun) is not installed for", sys.executable)
        return SKIP
    env = quiet_env()
    with tempfile.TemporaryDirectory() as work:
        data = os.path.join(work, "mnist")
        write_dataset(data, 128, 32)
        train = ["train", "--dataset", "mnist", "--data", data, "--model", "small-cnn", "--device", "cpu",
                 "--batch-size", "32", "--epochs", "2", "--sync-bn", "true", "--progress", "off"]
        one, two = os.path.join(work, "one"), os.path.join(work, "two")
        r = subprocess.run([cli] + train + ["--out", one], env=env, capture_output=True, text=True, timeout=HUNG_S)
        if r.returncode != 0:
            print(f"FAIL: the one-process run exited {r.returncode}:\n{r.stdout[-1500:]}{r.stderr[-1500:]}")
            return 1
        endpoint = f"127.0.0.1:{free_port()}"
        agent = torchrun + ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                            endpoint, "--rdzv-id", "triaccel-hosts", "--max-restarts", "0", "--no-python", cli]
        agents = [subprocess.Popen(agent + train + ["--out", two], env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True) for _ in range(2)]
        said = []
        for p in agents:
            try:
                said.append(p.communicate(timeout=HUNG_S)[0])
            except subprocess.TimeoutExpired:
                for q in agents:
                    q.kill()
                print(f"FAIL: a torchrun agent still ran after {HUNG_S} s")
                return 1
        if any(p.returncode != 0 for p in agents):
            print(f"FAIL: the torchrun agents exited {[p.returncode for p in agents]}:")
            for i, text in enumerate(said):
                print(f"--- agent {i}:\n{text[-3000:]}")
            return 1
        failures = []
        config = events(two)[0]
        if config.get("event") != "config" or config.get("world_size") != 2:
            failures.append(f"the two-host run's first event is not a config event of world_size 2: "
                            f"{json.dumps(config)[:300]}")
        differences = state_differences(os.path.join(two, "model.pt"), os.path.join(one, "model.pt"), 1e-3)
        if differences:
            failures.append("model.pt differs from one process's: " + "; ".join(differences[:8]))
        if failures:
            print("FAIL:", "\n".join(failures))
            return 1
        print("torchrun_hosts: passed; two torchrun agents of one process each trained one process's weights "
              "(every tensor within 1e-3 relative)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
