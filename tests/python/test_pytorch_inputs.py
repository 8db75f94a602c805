#!/usr/bin/env python3
"""Any PyTorch model and data through triaccel.train (issue 54), on the CPU: a torch Dataset and a DataLoader (also
with a worker) give the weights the same data as tensors gives, in the engine's order; a loss of the user's own
(regression: no accuracy reported); a character model defined in Python with tied embeddings trains them once; a
model fx splits into units (torchvision's ResNet-18 with the CIFAR stem), and one it cannot trace, trained whole with
the reason said. Run by ctest `python_inputs` with PYTHONPATH=BUILD/python.
"""
import contextlib
import copy
import io
import math
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import unittest
import unittest.mock

import torch
import torchvision
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import triaccel


def quiet(**options):
    options.setdefault("device", "cpu")
    options.setdefault("progress", "off")
    return options


def regression_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    w = torch.arange(8, dtype=torch.float32).view(8, 1) / 8
    return x, x @ w + 0.5


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


class Doubled(Dataset):
    """A map-style dataset whose transform runs at each access (here: a fixed scaling, so results are comparable)."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] * 2.0, self.y[i]


class Broken(Doubled):
    """Sample 37 raises in the worker that reads it."""

    def __getitem__(self, i):
        if i == 37:
            raise ValueError("sample 37 is corrupt")
        return super().__getitem__(i)


def collate_triples(samples):
    """Batches of (inputs, targets, extra), but one sample (the engine's look at the data's dtypes) as a pair."""
    x, y = torch.utils.data.default_collate(samples)
    return (x, y) if len(samples) == 1 else (x, y, torch.zeros(len(samples)))


class PythonData(unittest.TestCase):
    def train_on(self, train, test, out, **extra):
        model = mlp()
        extra.setdefault("epochs", 2)
        triaccel.train(model, train=train, test=test, loss=nn.functional.mse_loss,
                       **quiet(batch_size=32, optimizer="adamw", lr=1e-2, out=out, **extra))
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    def test_dataset_and_dataloader_give_the_weights_of_the_same_tensors(self):
        x, y = regression_data(200, 1)
        xt, yt = regression_data(64, 2)
        with tempfile.TemporaryDirectory() as d:
            ref = self.train_on((x * 2.0, y), (xt * 2.0, yt), os.path.join(d, "t"))
            ds = self.train_on(Doubled(x, y), Doubled(xt, yt), os.path.join(d, "ds"))
            dl = self.train_on(DataLoader(Doubled(x, y), batch_size=32), DataLoader(Doubled(xt, yt), batch_size=64),
                               os.path.join(d, "dl"))
            workers = self.train_on(DataLoader(Doubled(x, y), batch_size=32, num_workers=1),
                                    (xt * 2.0, yt), os.path.join(d, "w"))
            untrained = torch.cat([p.detach().flatten() for p in mlp().parameters()])
        self.assertFalse(torch.equal(ref, untrained))
        self.assertTrue(torch.equal(ds, ref), "a Dataset trained other weights than its tensors")
        self.assertTrue(torch.equal(dl, ref), "a DataLoader trained other weights than its tensors")
        self.assertTrue(torch.equal(workers, ref), "a DataLoader with a worker trained other weights")

    def test_a_run_stopped_mid_epoch_leaves_no_loader_running(self):
        # The workers' batches are read ahead by a thread of the source; a run that stops mid-epoch (max_steps here)
        # must stop it and its workers, or every such run leaves them waiting on a full queue.
        x, y = regression_data(640, 5)
        loader = DataLoader(Doubled(x, y), batch_size=32, num_workers=1)
        with tempfile.TemporaryDirectory() as d:
            self.train_on(loader, (x[:64] * 2.0, y[:64]), d, max_steps=3)
        ahead = [t.name for t in threading.enumerate() if t.name in ("triaccel-fetch-ahead", "triaccel-copy-ahead")]
        self.assertEqual(ahead, [], "a thread reading a DataLoader outlived its run")

    def test_the_engine_tells_the_source_each_next_epochs_order(self):
        # After each epoch's last batch the engine gives the train source the next epoch's order (epoch_ahead), the
        # one its epoch_begin then gives: the workers start on it during the evaluation, and the epoch takes it
        # (one start of the workers for the first epoch, one for each epoch_ahead).
        x, y = regression_data(200, 4)
        calls, starts = [], []
        begin, ahead, close = (triaccel._data.Served.epoch_begin, triaccel._data.Served.epoch_ahead,
                               triaccel._data.Served.close)

        def recorded(kind, fn):
            def call(served, order):
                calls.append((served.split, kind, list(order)))
                return fn(served, order)
            return call

        def closing(served):
            starts.append((served.split, served.starts))
            close(served)
        with unittest.mock.patch.object(triaccel._data.Served, "epoch_begin", recorded("begin", begin)), \
                unittest.mock.patch.object(triaccel._data.Served, "epoch_ahead", recorded("ahead", ahead)), \
                unittest.mock.patch.object(triaccel._data.Served, "close", closing), \
                tempfile.TemporaryDirectory() as d:
            self.train_on(DataLoader(Doubled(x, y), batch_size=32, num_workers=1), (x * 2.0, y), d, epochs=3)
        train = [(kind, order) for split, kind, order in calls if split == "train"]
        aheads = [i for i, (kind, _) in enumerate(train) if kind == "ahead"]
        self.assertEqual(len(aheads), 3)
        for i in aheads[:2]:  # the order the next epoch began with
            self.assertEqual(train[i][1], train[i + 1][1])
            self.assertNotEqual(train[i - 1][1], train[i + 1][1])
        self.assertIn(("train", 1 + 3), starts)

    def test_what_goes_wrong_in_the_loader_reaches_the_caller(self):
        # A worker's exception, and a batch that is not (inputs, targets), each cross both read-ahead threads (the
        # one reading the loader, the one copying its batches) to the run, which names it.
        x, y = regression_data(200, 10)
        for loader, expected in (
                (DataLoader(Broken(x, y), batch_size=32, num_workers=1),
                 "the train data failed: ValueError: Caught ValueError in DataLoader worker process 0. "
                 "ValueError: sample 37 is corrupt"),
                (DataLoader(Doubled(x, y), batch_size=32, num_workers=1, collate_fn=collate_triples),
                 "the train data failed: TypeError: train data: a batch must collate to (inputs, targets), two "
                 "tensors; got tuple of 3")):
            with self.subTest(expected=expected), tempfile.TemporaryDirectory() as d:
                with self.assertRaises(ValueError) as caught:
                    self.train_on(loader, (x * 2.0, y), d)
                self.assertEqual(str(caught.exception).splitlines()[0], expected)

    def test_workers_feeding_a_gpu_run_leave_the_cores_to_them(self):
        # 16 cores, 12 workers: the process's intra-op threads (8 here) go down to the 2 cores the workers leave,
        # and come back after the run, also one that raised; a CPU run or one without workers keeps its 8 threads.
        ds = TensorDataset(*regression_data(8, 9))
        twelve, three, none = (triaccel._data.Served(ds, num_workers=n) for n in (12, 3, 0))
        threads = torch.get_num_threads()
        seen = {}
        torch.set_num_threads(8)
        try:
            with unittest.mock.patch.object(triaccel._data.os, "sched_getaffinity", return_value=set(range(16))):
                for name, sources, cuda in (("gpu", [twelve, (ds.tensors[0], ds.tensors[1])], True),
                                            ("cpu", [twelve], False), ("no workers", [none], True),
                                            ("few workers", [three], True)):
                    with triaccel._data.host_threads_for(sources, cuda):
                        seen[name] = torch.get_num_threads()
                    seen[name + " after"] = torch.get_num_threads()
                with self.assertRaises(RuntimeError):
                    with triaccel._data.host_threads_for([twelve], True):
                        raise RuntimeError("a failed run")
                seen["after a failure"] = torch.get_num_threads()
        finally:
            torch.set_num_threads(threads)
        self.assertEqual(seen, {"gpu": 2, "gpu after": 8, "cpu": 8, "cpu after": 8, "no workers": 8,
                                "no workers after": 8, "few workers": 8, "few workers after": 8,
                                "after a failure": 8})

    def test_train_runs_inside_the_host_threads_of_its_sources(self):
        calls = []
        real = triaccel._data.host_threads_for

        def recorded(sources, cuda):
            calls.append(([getattr(s, "num_workers", None) for s in sources], cuda))
            return real(sources, cuda)
        x, y = regression_data(64, 8)
        with tempfile.TemporaryDirectory() as d, \
                unittest.mock.patch.object(triaccel._data, "host_threads_for", side_effect=recorded):
            self.train_on(DataLoader(Doubled(x, y), batch_size=32, num_workers=1), (x * 2.0, y), d, max_steps=1)
        self.assertEqual(calls, [([1, None], False)])

    def test_two_processes_under_torchrun_end_with_one_process_weights(self):
        # The recipe docs/python.md gives for several GPUs, on the CPU with Gloo: the same script under torchrun with
        # two processes trains each one's half of every batch, and both end with the weights one process reaches
        # (to fp32 summation order: the gradients are summed over the processes).
        script = textwrap.dedent("""
            import os, sys, torch
            from torch import nn
            import triaccel
            torch.manual_seed(0)
            model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 4))
            g = torch.Generator().manual_seed(1)
            x, y = torch.randn(512, 1, 8, 8, generator=g), torch.randint(0, 4, (512,), generator=g)
            s = triaccel.train(model, train=(x, y), test=(x[:128], y[:128]), epochs=2, batch_size=64,
                               device="cpu", progress="off", out=sys.argv[1], lr=float(sys.argv[3]))
            w = torch.cat([p.detach().flatten() for p in model.parameters()])
            torch.save({"weights": w, "world": s["world_size"]}, sys.argv[2] % os.environ.get("RANK", "solo"))
            """)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "train.py")
            with open(path, "w") as f:
                f.write(script)
            env = dict(os.environ, OMP_NUM_THREADS="1")
            out = os.path.join(d, "w_%s.pt")
            for argv in ([sys.executable, path, os.path.join(d, "one"), out, "0.05"],
                         [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          path, os.path.join(d, "two"), out, "0.05"],
                         [sys.executable, path, os.path.join(d, "other"), os.path.join(d, "lr_%s.pt"), "0.02"]):
                p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240)
                self.assertEqual(p.returncode, 0, p.stderr[-2000:])
            solo, r0, r1 = (torch.load(out % k) for k in ("solo", "0", "1"))
            other = torch.load(os.path.join(d, "lr_solo.pt"))
        self.assertEqual((solo["world"], r0["world"], r1["world"]), (1, 2, 2))
        self.assertTrue(torch.equal(r0["weights"], r1["weights"]), "the two processes hold different weights")
        self.assertLess((r0["weights"] - solo["weights"]).abs().max().item(), 1e-5)
        self.assertGreater((other["weights"] - solo["weights"]).abs().max().item(), 1e-3)  # the tolerance is tight

    def test_nproc_from_python_points_to_torchrun(self):
        x, y = regression_data(64, 6)
        with self.assertRaises(ValueError) as caught:
            triaccel.train(mlp(), train=(x, y), test=(x, y), loss=nn.functional.mse_loss, **quiet(nproc=2))
        self.assertIn("torchrun --nproc-per-node 2", str(caught.exception))

    def test_own_loss_learns_a_regression_and_reports_no_accuracy(self):
        x, y = regression_data(512, 3)
        xt, yt = regression_data(128, 4)
        model = mlp()
        before = nn.functional.mse_loss(model(xt), yt).item()
        with tempfile.TemporaryDirectory() as d:
            s = triaccel.train(model, train=(x, y), test=(xt, yt), loss=nn.functional.mse_loss,
                               **quiet(epochs=8, batch_size=32, optimizer="adamw", lr=1e-2, out=d))
        after = nn.functional.mse_loss(model(xt), yt).item()
        self.assertLess(after, before / 10)
        self.assertAlmostEqual(s["test_loss"], after, delta=1e-3 + after * 1e-3)  # the engine's loss is the user's
        self.assertIsNone(s["test_acc"])

    def test_a_failing_loss_names_itself(self):
        x, y = regression_data(64, 5)
        with tempfile.TemporaryDirectory() as d, self.assertRaisesRegex(ValueError, "loss= failed: IndexError"):
            triaccel.train(mlp(), train=(x, y), test=(x, y), loss=lambda out, t: out.sum() + torch.zeros(3)[5],
                           **quiet(out=d))

    def test_out_of_memory_in_a_unit_is_retried_not_raised(self):
        # A unit's out-of-memory error reaches the engine's recovery (a smaller batch here, on the CPU), whether
        # PyTorch raised it (torch.OutOfMemoryError) or a C++ extension's allocation failure did (a RuntimeError that
        # says so): the run trains on, and says it retried.
        for error in (torch.OutOfMemoryError, RuntimeError):
            class FailsOnce(nn.Module):
                calls = 0

                def forward(self, x):
                    FailsOnce.calls += 1
                    if FailsOnce.calls == 2:
                        raise error("CUDA out of memory. Tried to allocate 20.00 MiB.")
                    return x

            with self.subTest(error=error.__name__), tempfile.TemporaryDirectory() as d:
                model = nn.Sequential(nn.Linear(8, 16), FailsOnce(), nn.ReLU(), nn.Linear(16, 1))
                x, y = regression_data(64, 7)
                s = triaccel.train(model, train=(x, y), test=(x, y), loss=nn.functional.mse_loss,
                                   **quiet(batch_size=32, out=d))
                self.assertGreaterEqual(s["oom_retries"], 1)
                self.assertTrue(math.isfinite(s["test_loss"]))

    def test_an_iterable_dataset_is_refused_with_the_reason(self):
        class Stream(torch.utils.data.IterableDataset):
            def __iter__(self):
                return iter([])
        with self.assertRaisesRegex(TypeError, "IterableDataset has no order"):
            triaccel.train(mlp(), train=Stream(), test=Stream(), **quiet())


class Indexed(Dataset):
    """Sample i is (a 3 x 4 tensor of i, i); the samples in `slow` take 20 ms (their workers finish out of turn)."""

    def __init__(self, n, slow=()):
        self.n, self.slow = n, set(slow)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i in self.slow:
            time.sleep(0.02)
        return torch.full((3, 4), float(i)), i


def padded(samples):
    """A collate of the user's own: inputs padded to the longest of the batch (sample i is i % 5 + 1 long)."""
    n = max(len(x) for x, _ in samples)
    return (torch.stack([nn.functional.pad(x, (0, n - len(x))) for x, _ in samples]),
            torch.tensor([y for _, y in samples]))


class Ragged(Dataset):
    def __len__(self):
        return 96

    def __getitem__(self, i):
        return torch.full((i % 5 + 1,), float(i)), i


def served_epochs(served, orders, batch, start=0):
    """Every batch the source serves over epochs of these orders (the first from offset `start`)."""
    got = []
    for order in orders:
        served.epoch_begin(order)
        for offset in range(start, len(order), batch):
            x, y = served.fetch(offset, order[offset:offset + batch])
            got.append((order[offset:offset + batch], x.clone(), y.clone()))
        start = 0
    return got


class LoaderRing(unittest.TestCase):
    """The workers collate into a ring of shared-memory slots and send back the slot's number (_data._Ring)."""

    def orders(self, n, epochs):
        g = torch.Generator().manual_seed(3)
        return [torch.randperm(n, generator=g).tolist() for _ in range(epochs)]

    def test_every_batch_comes_through_a_slot_and_is_its_own(self):
        # 2 workers, prefetch 3: batches 0-5 dispatched ahead, so 8 slots; slow samples make the workers finish out
        # of turn. Two epochs of another order each, the first from offset 48 (a resumed run), batch 16, 203 samples.
        served = triaccel._data.Served(Indexed(203, slow={5, 40, 41, 150}), num_workers=2, prefetch_factor=3)
        try:
            got = served_epochs(served, self.orders(203, 2), 16, start=48)
            ring = served._ring
        finally:
            served.close()
        self.assertEqual(ring.count, 3 * 2 + 2)
        self.assertEqual(len(got), 10 + 13)
        for ids, x, y in got:
            self.assertEqual(y.tolist(), ids)
            self.assertTrue(torch.equal(x, torch.tensor(ids, dtype=torch.float32).view(-1, 1, 1).expand(-1, 3, 4)))
        self.assertEqual(served.came, {"slot": 23, "batch": 0})

    def test_a_users_collate_fills_slots_where_its_batch_fits_and_comes_as_it_is_where_not(self):
        served = triaccel._data.Served(Ragged(), collate_fn=padded, num_workers=2)
        try:
            served.fetch(0, [4])  # the first look at the data: 5 long, so the slots hold (batch, 5)
            got = served_epochs(served, self.orders(96, 1), 4)
        finally:
            served.close()
        fits = sum(1 for ids, _, _ in got if max(i % 5 for i in ids) == 4)
        self.assertTrue(0 < fits < len(got))
        self.assertEqual(served.came, {"slot": fits, "batch": len(got) - fits})
        for ids, x, y in got:
            self.assertEqual(y.tolist(), ids)
            self.assertTrue(torch.equal(x, padded([Ragged()[i] for i in ids])[0]))

    def test_no_ring_where_shared_memory_is_short_the_loaders_batches_then(self):
        served = triaccel._data.Served(Indexed(64), num_workers=2)
        try:
            with unittest.mock.patch.object(triaccel._data, "RING_SHM_SHARE", 0.0):
                got = served_epochs(served, self.orders(64, 1), 16)
        finally:
            served.close()
        self.assertIsNone(served._ring)
        self.assertEqual(served.came, {"slot": 0, "batch": 0})  # the two read-ahead threads served them
        self.assertEqual([y.tolist() for _, _, y in got], [ids for ids, _, _ in got])

    def test_the_next_epoch_is_fetched_from_the_last_batch_on_and_the_short_end_restarts_nothing(self):
        # 203 samples in batches of 16: the epoch ends on 11 samples, which the running iteration serves (one start
        # an epoch); epoch_ahead after the last batch starts the next epoch's, which epoch_begin of that order keeps;
        # an epoch_begin of another order starts over.
        served = triaccel._data.Served(Indexed(203), num_workers=2)
        orders = self.orders(203, 3)
        try:
            first = served_epochs(served, orders[:1], 16)
            self.assertEqual(served.starts, 1)
            served.epoch_ahead(orders[1])
            self.assertEqual(served.starts, 2)
            second = served_epochs(served, orders[1:2], 16)
            self.assertEqual(served.starts, 2)
            served.epoch_ahead(orders[0])  # not the order that comes
            third = served_epochs(served, orders[2:3], 16)
            self.assertEqual(served.starts, 4)
        finally:
            served.close()
        for ids, _, y in first + second + third:
            self.assertEqual(y.tolist(), ids)
        self.assertEqual([ids for ids, _, _ in second], [orders[1][o:o + 16] for o in range(0, 203, 16)])

    def test_a_larger_batch_makes_a_larger_ring(self):
        served = triaccel._data.Served(Indexed(64), num_workers=1)
        try:
            served_epochs(served, self.orders(64, 1), 8)
            first = served._ring
            got = served_epochs(served, self.orders(64, 1), 16)
            second = served._ring
        finally:
            served.close()
        self.assertEqual((first.batch, second.batch), (8, 16))
        self.assertEqual([y.tolist() for _, _, y in got], [ids for ids, _, _ in got])


class CharModel(nn.Module):
    """A small GPT-style character model; the output layer's weight is the embedding's (tied)."""

    def __init__(self, vocab=12, dim=16, block=8):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(block, dim))
        self.body = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU())
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx):
        h = self.tok(idx) + self.pos[: idx.shape[1]]
        h = h + self.body(h)
        return self.head(self.ln(h))


class TiedWeights(unittest.TestCase):
    def test_tied_embedding_is_one_tensor_trained_once(self):
        torch.manual_seed(0)
        text = torch.arange(12).repeat(60)  # a periodic sequence: next = (cur + 1) % 12
        x = text[:-1].unfold(0, 8, 8)[:80]
        y = text[1:].unfold(0, 8, 8)[:80]
        model = CharModel()
        unique = sum(p.numel() for p in model.parameters())
        plan = triaccel.plan(model, train=(x, y), test=(x, y), **quiet(optimizer="sgd"))
        self.assertEqual(plan["params"], unique)  # each tied tensor once (twice: + 12 x 16)
        with tempfile.TemporaryDirectory() as d:
            s = triaccel.train(model, train=(x, y), test=(x, y), **quiet(epochs=6, batch_size=16, optimizer="adamw",
                                                                          lr=3e-2, out=d))
            self.assertIs(model.head.weight, model.tok.weight)
            fresh = CharModel()
            fresh.load_state_dict(torch.load(os.path.join(d, "model.pt")))  # both tied names are in model.pt
            self.assertTrue(torch.equal(fresh.head.weight, model.tok.weight.detach().cpu()))
        self.assertGreater(s["test_acc"], 0.9)  # per-token accuracy of next-token prediction
        self.assertGreater(len(s["units"]), 1)
        self.assertEqual(s["units_found"], "auto")


class Fp8OfPythonLayers(unittest.TestCase):
    def test_amp_fp8_computes_a_python_models_linears_in_fp8_and_gives_them_back(self):
        torch.manual_seed(0)
        text = torch.arange(16).repeat(40)
        x = text[:-1].unfold(0, 8, 8)[:64]
        y = text[1:].unfold(0, 8, 8)[:64]
        start = CharModel(vocab=16)
        runs = {}
        for precision in ("amp-bf16", "amp-fp8"):
            model = copy.deepcopy(start)
            with tempfile.TemporaryDirectory() as d:
                runs[precision] = (model, triaccel.train(model, train=(x, y), test=(x, y), **quiet(
                    epochs=6, batch_size=16, optimizer="adamw", lr=3e-2, precision=precision, out=d)))
            for layer in (model.body[1], model.head):
                self.assertNotIn("forward", vars(layer))  # the layer's own forward again after the run
        (bf16, s16), (fp8, s8) = runs["amp-bf16"], runs["amp-fp8"]
        self.assertEqual(s8["fp8_layers"], 2, s8)  # body.1 and the tied head
        self.assertIsNone(s16["fp8_layers"])
        self.assertTrue(math.isfinite(s8["test_loss"]))
        self.assertLess(s8["test_loss"], math.log(16))  # it learned, as amp-bf16 did
        self.assertLess(abs(s8["test_loss"] - s16["test_loss"]), 0.25 * s16["test_loss"], (s8, s16))
        # Through FP8: the same steps from the same weights end elsewhere than amp-bf16's.
        self.assertGreater((fp8.body[1].weight - bf16.body[1].weight).abs().max().item(), 1e-4)
        self.assertIs(fp8.head.weight, fp8.tok.weight)


class AutomaticSplit(unittest.TestCase):
    def test_torchvision_resnet18_is_split_into_its_blocks(self):
        model = torchvision.models.resnet18(num_classes=10)
        model.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        model.maxpool = nn.Identity()
        x = torch.randint(0, 256, (16, 3, 32, 32), dtype=torch.uint8)
        y = torch.arange(16) % 10
        plan = triaccel.plan(model, train=(x, y), test=(x, y), **quiet(optimizer="sgd", batch_size=8))
        names = [u["unit"] for u in plan["units"]]
        blocks = [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)]
        self.assertEqual(names, ["conv1", *blocks, "fc"])
        self.assertEqual(plan["units_found"], "auto")
        self.assertEqual(sum(u["params"] for u in plan["units"]), sum(p.numel() for p in model.parameters()))

    def test_batch_norms_of_split_units_go_through_the_engine_kernel(self):
        # Every BatchNorm2d of torchvision's ResNet-18 is rewritten, with the ReLU that alone follows it (the stem's
        # and each block's first: 9 of 20); on the CPU the rewrite runs PyTorch's BatchNorm, so the units compose to
        # the model exactly and its running statistics move as PyTorch's.
        torch.manual_seed(0)
        model = torchvision.models.resnet18(num_classes=10)
        model.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        model.maxpool = nn.Identity()
        reference = copy.deepcopy(model).train()
        units = [m for _, ms in triaccel.units(model) for m in ms]
        fused = [m for u in units for m in u.modules() if isinstance(m, triaccel._fused.FusedBatchNorm)]
        self.assertEqual((len(fused), sum(m.relu for m in fused)), (20, 9))
        x = torch.randn(4, 3, 32, 32)
        h = x
        for u in units:
            h = u.train()(h)
        self.assertTrue(torch.equal(h, reference(x)))
        self.assertTrue(torch.equal(model.bn1.running_var, reference.bn1.running_var))
        self.assertEqual(int(model.layer4[1].bn2.num_batches_tracked), 1)

    @unittest.skipUnless(torch.cuda.is_available(), "the fused kernel runs on CUDA")
    def test_the_fused_kernel_is_pytorchs_batch_norm_and_relu_on_the_gpu(self):
        torch.manual_seed(0)
        bn = nn.BatchNorm2d(32).cuda()
        nn.init.uniform_(bn.weight, 0.5, 1.5)
        nn.init.uniform_(bn.bias, -0.5, 0.5)
        reference = copy.deepcopy(bn)
        x = torch.randn(8, 32, 16, 16, device="cuda").to(torch.bfloat16, memory_format=torch.channels_last)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        fused = triaccel._fused.FusedBatchNorm(bn, relu=True)
        self.assertIsNotNone(triaccel._triaccel.batch_norm_kernel(x, bn.weight, bn.bias, bn.running_mean.clone(),
                                                                  bn.running_var.clone(), 0.1, 1e-5, True))
        y, y_ref = fused(x1), torch.relu(reference(x2))
        torch.testing.assert_close(y.float(), y_ref.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(bn.running_mean, reference.running_mean, atol=1e-4, rtol=1e-3)
        torch.testing.assert_close(bn.running_var, reference.running_var, atol=1e-4, rtol=1e-3)
        self.assertEqual(int(bn.num_batches_tracked), 1)
        g = torch.randn_like(y)
        y.backward(g)
        y_ref.backward(g)
        torch.testing.assert_close(x1.grad.float(), x2.grad.float(), atol=5e-2, rtol=5e-2)
        torch.testing.assert_close(bn.weight.grad, reference.weight.grad, atol=5e-2, rtol=1e-2)

    def test_an_untraceable_model_trains_whole_and_says_why(self):
        class Branchy(nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 1)

            def forward(self, x):
                if x.sum() > 0:  # control flow on a value: fx cannot trace it
                    x = -x
                return self.b(torch.relu(self.a(x)))

        x, y = regression_data(64, 6)
        err = io.StringIO()
        with tempfile.TemporaryDirectory() as d, contextlib.redirect_stderr(err):
            s = triaccel.train(Branchy(), train=(x, y), test=(x, y), loss=nn.functional.mse_loss, **quiet(out=d))
        self.assertEqual(s["units"], ["model"])
        self.assertTrue(s["units_found"].startswith("whole model: "))
        self.assertIn("units()", err.getvalue())


if __name__ == "__main__":
    unittest.main()
