#!/usr/bin/env python3
"""Where the DataLoader path's CPU goes while the engine trains (issue 54: resnet50 b96 16,065 img/s through a
DataLoader of 12 workers against 25,642 with tensors; the loader alone 33,133). Each variant runs in a fresh process
(so environment variables such as OMP_WAIT_POLICY take effect), trains 2 epochs and reports epoch 2's img/s, the CPU
seconds per second of the main process's threads (the busiest ones named by kind) and of the workers, sampled from
/proc every 0.25 s over epoch 2's wall time.
Usage: python_loader_threads.py CIFAR_BIN_DIR OUT_DIR [--models resnet50:96,resnet18:512] [--variants ...]
Variants: default (the library as it is); ahead (the library without the workers' ring of slots: the DataLoader's
own shared memory, read by two threads); ring_alone (the library's source over the loader, pinned, no engine);
prefetch4 (default with the DataLoader's prefetch_factor 4); untuned (without host_threads_for: all intra-op
threads); threads1
(untuned, torch.set_num_threads(1) before train); passive (untuned with OMP_WAIT_POLICY=PASSIVE); tensors (the tensors
path, for the ratio); alone (the loader iterated alone, no engine)."""
import contextlib
import argparse
import json
import os
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def proc_cpu(pid, tid=None):
    path = f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat"
    try:
        f = open(path).read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def children(pid):
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(p))
            except (OSError, IndexError, ValueError):
                pass
    return out


class Sampler:
    """Per-thread CPU of this process and the CPU of its children, every 0.25 s."""

    def __init__(self):
        self.samples, self._stop = [], threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        me = os.getpid()
        while not self._stop.is_set():
            threads = {int(t): proc_cpu(me, t) for t in os.listdir(f"/proc/{me}/task")}
            kids = sum(proc_cpu(c) for c in children(me))
            self.samples.append((time.time(), threads, kids))
            time.sleep(0.25)

    def rates(self, t0, t1):
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2:
            return None
        (a_t, a_th, a_k), (b_t, b_th, b_k) = inside[0], inside[-1]
        dt = b_t - a_t
        per_thread = sorted(((b_th[t] - a_th.get(t, 0.0)) / dt for t in b_th), reverse=True)
        return {"main_cpu_per_s": round(sum(per_thread), 2), "busiest_threads": [round(x, 2) for x in per_thread[:6]],
                "threads_over_10pct": sum(1 for x in per_thread if x > 0.1),
                "workers_cpu_per_s": round((b_k - a_k) / dt, 2), "window_s": round(dt, 2)}


def child(a):
    import torch
    sys.path.insert(0, os.path.join(HERE, "..", "bench"))
    import python_models as pm
    import triaccel
    if a.variant in ("untuned", "passive", "threads1"):
        triaccel._data.host_threads_for = lambda *_: contextlib.nullcontext()
    if a.variant == "threads1":
        torch.set_num_threads(1)
    if a.variant == "ahead":
        triaccel._data.RING_SHM_SHARE = 0.0  # no ring: the workers' batches the DataLoader's way, two threads
    came, close = [], triaccel._data.Served.close

    def closing(served):  # how the workers' batches came, per source
        came.append(dict(served.came))
        close(served)
    triaccel._data.Served.close = closing
    train_set, test_set = pm.cifar_read(a.data)
    if a.repeat > 1:  # a longer epoch: the batches the workers fetched during the last evaluation weigh less
        train_set = (train_set[0].repeat(a.repeat, 1, 1, 1), train_set[1].repeat(a.repeat))
    test = (test_set[0][:2048], test_set[1][:2048])
    name, batch = a.model.split(":")
    batch = int(batch)
    sampler = Sampler()
    loader = torch.utils.data.DataLoader(pm.CifarTransformed(*train_set, True), batch_size=batch,
                                         num_workers=a.workers, pin_memory=True,
                                         prefetch_factor=4 if a.variant == "prefetch4" else None)
    if a.variant == "alone":
        n, t0 = 0, None
        for k, (x, _) in enumerate(loader):
            if k == 5:
                t0, n = time.time(), 0
            n += len(x)
        t1 = time.time()
        row = {"images_per_s": round(n / (t1 - t0))}
    elif a.variant == "ring_alone":  # the engine's source over the same loader, pinned, no engine
        served, _ = triaccel._data.served_from(loader, "train", True, False)
        order = torch.randperm(len(loader.dataset)).tolist()
        served.epoch_begin(order)
        n, t0 = 0, None
        with triaccel._data.host_threads_for([served], True):
            for k, offset in enumerate(range(0, len(order) - batch + 1, batch)):
                if k == 5:
                    t0, n = time.time(), 0
                n += len(served.fetch(offset, order[offset:offset + batch])[0])
        t1 = time.time()
        row = {"images_per_s": round(n / (t1 - t0)), "came": served.came}
        served.close()
    else:
        out = os.path.join(a.out, f"{name}_{batch}_{a.variant}")
        common = dict(epochs=2, batch_size=batch, precision="amp-bf16", seed=0, channels_last=True, progress="off",
                      device="cuda", out=out)
        torch.manual_seed(0)
        if a.variant == "tensors":
            s = triaccel.train(pm.MODELS[name](), train=train_set, test=test, augment="on", **common)
        else:
            s = triaccel.train(pm.MODELS[name](), train=loader, test=pm.CifarTransformed(*test, False),
                               augment="off", **common)
        t1 = time.time()
        events = [json.loads(line) for line in open(os.path.join(out, "events.jsonl")) if line.strip()]
        e2 = [e for e in events if e["event"] == "epoch"][-1]
        t0 = t1 - (events[-1]["time_s"] - e2["time_s"]) - e2["epoch_s"]  # epoch 2's start, on this clock
        row = {"images_per_s": e2.get("images_per_s"), "epoch_s": e2.get("epoch_s"), "test_acc": s.get("test_acc"),
               "eval_s": e2.get("eval_s"), "came": came}
        t1 = t0 + e2["epoch_s"]
    row.update(sampler.rates(t0, t1) or {})
    print("ROW " + json.dumps(row), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("data")
    ap.add_argument("out")
    ap.add_argument("--models", default="resnet50:96,resnet18:512")
    ap.add_argument("--variants", default="tensors,alone,untuned,threads_only,default")
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--repeat", type=int, default=1, help="the training set this many times over (a longer epoch)")
    ap.add_argument("--json")
    ap.add_argument("--model")
    ap.add_argument("--variant")
    a = ap.parse_args()
    if a.variant:
        return child(a)
    rows = []
    for model in a.models.split(","):
        for variant in a.variants.split(","):
            env = dict(os.environ)
            if variant == "passive":
                env["OMP_WAIT_POLICY"] = "PASSIVE"
            t = time.time()
            p = subprocess.run([sys.executable, __file__, a.data, a.out, "--model", model, "--variant", variant,
                                "--workers", str(a.workers), "--repeat", str(a.repeat)], env=env, capture_output=True, text=True, timeout=300)
            got = [json.loads(line[4:]) for line in p.stdout.splitlines() if line.startswith("ROW ")]
            row = {"model": model, "variant": variant, "wall_s": round(time.time() - t, 1), **(got[0] if got else {
                "error": (p.stderr.strip().splitlines() or ["exit %d" % p.returncode])[-1][:300]})}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.json:
        json.dump({"bench": "python_loader_threads", "workers": a.workers, "rows": rows}, open(a.json, "w"), indent=1)
    print("\n| model | variant | img/s | main CPU/s | threads > 10 % | busiest | workers CPU/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        rate = r.get("images_per_s", r.get("error"))
        print(f"| {r['model']} | {r['variant']} | {rate} | {r.get('main_cpu_per_s')} | "
              f"{r.get('threads_over_10pct')} | {r.get('busiest_threads')} | {r.get('workers_cpu_per_s')} |")


if __name__ == "__main__":
    main()
