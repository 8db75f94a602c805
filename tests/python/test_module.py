#!/usr/bin/env python3
"""The Python module (docs/python.md), on the CPU: a user's own nn.Sequential CNN trained one epoch on Fashion-MNIST
through triaccel.train, its model.pt reloaded into a fresh module with the same predictions; a units() model on
tensors the test makes; Ctrl-C and resume; plan and report; and the errors a user meets, each by its name.

Run by ctest `python_module` with PYTHONPATH=BUILD/python. Exit status 0 when every check passes.
"""
import copy
import gzip
import os
import signal
import struct
import sys
import tempfile
import unittest

import numpy as np
import torch
from torch import nn

import triaccel

FASHION = "/usr/share/datasets/fashion-mnist"


def idx_read(path):
    """An IDX file (gzip or plain) as a numpy array."""
    with open(path, "rb") as f:
        opener = gzip.open if f.read(2) == b"\x1f\x8b" else open
    with opener(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = struct.unpack(">" + "I" * dims, data[4:4 + 4 * dims])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def fashion_test_split():
    names = os.listdir(FASHION)
    images = next(n for n in names if n.startswith("t10k-images"))
    labels = next(n for n in names if n.startswith("t10k-labels"))
    return (torch.from_numpy(idx_read(os.path.join(FASHION, images)).copy()),
            torch.from_numpy(idx_read(os.path.join(FASHION, labels)).astype(np.int64)))


def small_cnn(in_channels=1, classes=10, side=28):
    return nn.Sequential(
        nn.Conv2d(in_channels, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * (side // 4) ** 2, classes))


def normalize(images, summary):
    x = images.float().div(255.0)
    if x.dim() == 3:
        x = x.unsqueeze(1)
    mean = torch.tensor(summary["input_mean"]).view(1, -1, 1, 1)
    std = torch.tensor(summary["input_std"]).view(1, -1, 1, 1)
    return (x - mean) / std


def quadrant_tensors(n, seed, side=16):
    """Four classes of 3-channel images: a bright square in quadrant `label`, on noise."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 4, (n,), generator=g)
    images = torch.randint(0, 90, (n, 3, side, side), generator=g, dtype=torch.uint8)
    h = side // 2
    for i, c in enumerate(labels.tolist()):
        r, q = divmod(c, 2)
        images[i, :, r * h:(r + 1) * h, q * h:(q + 1) * h] += 140
    return images, labels


class Net(nn.Module):
    """Not a Sequential: its units() say what the units are."""

    def __init__(self, classes=4):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.body = nn.Sequential(nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(2), nn.Flatten())
        self.head = nn.Linear(32, classes)

    def units(self):
        return [self.stem, self.body, self.head]

    def forward(self, x):
        return self.head(self.body(self.stem(x)))


class StopAtCall(nn.Module):
    """Sends SIGINT to this process on its n-th call in training mode, like Ctrl-C during the run."""

    def __init__(self, n):
        super().__init__()
        self.n = n
        self.calls = 0

    def forward(self, x):
        if self.training:
            self.calls += 1
            if self.calls == self.n:
                os.kill(os.getpid(), signal.SIGINT)
        return x


def quiet(**options):
    options.setdefault("device", "cpu")
    options.setdefault("progress", "off")
    return options


class FashionMnist(unittest.TestCase):
    @unittest.skipUnless(os.path.isdir(FASHION), "Debian's dataset-fashion-mnist is not installed")
    def test_own_cnn_one_epoch_and_model_pt(self):
        torch.manual_seed(0)
        model = small_cnn()
        before = copy.deepcopy(model.state_dict())
        with tempfile.TemporaryDirectory() as out:
            summary = triaccel.train(model, dataset="fashion-mnist", **quiet(epochs=1, batch_size=128, out=out))
            self.assertGreaterEqual(summary["test_acc"], 80.0, summary)
            self.assertEqual(summary["model"], "python")
            # Trained in place: the module's own weights moved, and model.pt holds exactly them.
            self.assertFalse(torch.equal(before["0.weight"], model[0].weight.detach()))
            saved = torch.load(os.path.join(out, "model.pt"), weights_only=True)
            self.assertEqual(list(saved.keys()), list(model.state_dict().keys()))
            fresh = small_cnn()
            fresh.load_state_dict(saved, strict=True)
        images, labels = fashion_test_split()
        x = normalize(images, summary)
        model.eval()
        fresh.eval()
        with torch.no_grad():
            ours = model(x).argmax(1)
            theirs = fresh(x).argmax(1)
        self.assertTrue(torch.equal(ours, theirs))
        acc = 100.0 * (theirs == labels).float().mean().item()
        self.assertAlmostEqual(acc, summary["test_acc"], delta=0.05)


class TinyLm(nn.Module):
    """A bigram language model with its embedding and output layer tied: reads token ids (B, T)."""

    def __init__(self, vocab, width=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Sequential(nn.Linear(width, width), nn.GELU())
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx):
        return self.head(self.mix(self.embed(idx)))


class NamedText(unittest.TestCase):
    def test_a_module_trains_on_a_named_text_dataset(self):
        # A Module from Python reads what the dataset holds: the engine's text reader gives it token ids (it was
        # refused as "reads images" before). On a repeated sentence a bigram model's loss falls below the text's
        # unigram entropy, which a model that does not train, or sees shuffled targets, cannot reach.
        text = "to be, or not to be: that is the question. " * 50
        vocab = sorted(set(text))
        counts = torch.tensor([text.count(c) for c in vocab], dtype=torch.float64)
        p = counts / counts.sum()
        unigram = float(-(p * p.log()).sum())
        torch.manual_seed(0)
        model = TinyLm(len(vocab))
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "input.txt"), "w") as f:
                f.write(text)
            summary = triaccel.train(model, dataset="tinyshakespeare", **quiet(
                data_dir=d, block_size=8, batch_size=16, epochs=6, optimizer="adamw", lr=0.01, warmup_epochs=0,
                out=os.path.join(d, "out")))
        self.assertEqual(summary["model"], "python")
        self.assertLess(summary["test_loss"], unigram - 0.3, (summary["test_loss"], unigram))


class Tensors(unittest.TestCase):
    def setUp(self):
        self.train_data = quadrant_tensors(512, seed=1)
        self.test_data = quadrant_tensors(128, seed=2)

    def test_units_model_learns_and_float_images_match_uint8(self):
        torch.manual_seed(0)
        net = Net()
        start = copy.deepcopy(net)
        with tempfile.TemporaryDirectory() as out:
            summary = triaccel.train(net, train=self.train_data, test=self.test_data,
                                     **quiet(epochs=3, batch_size=32, lr=0.05, out=out))
            self.assertGreaterEqual(summary["test_acc"], 90.0, summary)
            saved = torch.load(os.path.join(out, "model.pt"), weights_only=True)
            self.assertIn("body.1.running_mean", saved)
            self.assertIn("head.weight", saved)
        images, labels = self.train_data
        floats = (images.float() / 255.0, labels)
        with tempfile.TemporaryDirectory() as out:
            again = triaccel.train(start, train=floats, test=(self.test_data[0].float() / 255.0, self.test_data[1]),
                                   **quiet(epochs=3, batch_size=32, lr=0.05, out=out))
        self.assertEqual(summary["test_loss"], again["test_loss"])

    def test_ctrl_c_stops_with_a_checkpoint_and_resume_finishes(self):
        torch.manual_seed(0)
        model = nn.Sequential(StopAtCall(3), nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                              nn.Linear(4 * 16 * 16, 4))
        with tempfile.TemporaryDirectory() as out:
            stopped = triaccel.train(model, train=self.train_data, test=self.test_data,
                                     **quiet(epochs=2, batch_size=64, out=out))
            self.assertEqual(stopped.get("reason"), "sigint", stopped)
            self.assertEqual(stopped["epoch_offset"], 3 * 64, stopped)  # stopped after the third step
            self.assertTrue(os.path.exists(os.path.join(out, "checkpoint.pt")))
            # Python's own SIGINT handler is back once the run has returned.
            self.assertIs(signal.getsignal(signal.SIGINT), signal.default_int_handler)
            done = triaccel.train(model, train=self.train_data, test=self.test_data, **quiet(resume=out))
            self.assertEqual(done["steps"], 2 * 512 // 64, done)

    def test_plan_leaves_the_weights_and_report_writes_the_page(self):
        torch.manual_seed(0)
        model = small_cnn(in_channels=3, classes=4, side=16)
        before = copy.deepcopy(model.state_dict())
        p = triaccel.plan(model, train=self.train_data, test=self.test_data, **quiet(batch_size=32, optimizer="sgd"))
        self.assertEqual([u["unit"] for u in p["units"]], ["0", "1", "4", "5", "9"])
        self.assertEqual(p["params"], sum(t.numel() for t in model.parameters()))
        for k, v in model.state_dict().items():
            self.assertTrue(torch.equal(v, before[k]), k)
        with tempfile.TemporaryDirectory() as out:
            triaccel.train(model, train=self.train_data, test=self.test_data, **quiet(epochs=1, out=out))
            page = os.path.join(out, "report.html")
            r = triaccel.report([out], output=page)
            self.assertEqual(r["runs"], 1)
            self.assertTrue(os.path.getsize(page) > 0 and os.path.exists(r["csv"]))


def regression_task(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 32, generator=g)
    y = torch.sin(x[:, :4].sum(1, keepdim=True)) + 0.1 * torch.randn(256, 1, generator=g)
    return x, y


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 300), nn.LayerNorm(300), nn.ReLU(), nn.Linear(300, 300), nn.ReLU(),
                         nn.Linear(300, 1))


def loop(model, opt, x, y, steps, step=None):
    """A plain PyTorch loop: full batches, MSE; `step` replaces opt.step (a compiled one); returns the losses."""
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        (step or opt.step)()
        losses.append(loss.item())
    return losses


def flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


class Optim(unittest.TestCase):
    def test_adamw_fp32_is_torch_adamw_without_decay_on_norms_and_biases(self):
        x, y = regression_task()
        ours, theirs = mlp(), mlp()
        opt = triaccel.optim.AdamW(ours.named_parameters(), lr=3e-3, weight_decay=0.1)
        decay = [p for p in theirs.parameters() if p.dim() >= 2]
        no_decay = [p for p in theirs.parameters() if p.dim() < 2]
        ref = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=3e-3)
        loop(ours, opt, x, y, 15)
        loop(theirs, ref, x, y, 15)
        self.assertLess((flat(ours) - flat(theirs)).abs().max().item(), 1e-5)
        self.assertEqual(opt.state_bytes, opt.adamw_fp32_bytes)

    def test_adamw8bit_follows_fp32_adamw_in_a_quarter_of_the_state(self):
        x, y = regression_task()
        eight, full = mlp(), mlp()
        start = flat(full)
        opt8 = triaccel.optim.AdamW8bit(eight.named_parameters(), lr=1e-3)
        opt32 = triaccel.optim.AdamW(full.named_parameters(), lr=1e-3)
        losses8 = loop(eight, opt8, x, y, 30)
        losses32 = loop(full, opt32, x, y, 30)
        moved8, moved32 = flat(eight) - start, flat(full) - start
        cos = torch.nn.functional.cosine_similarity(moved8, moved32, dim=0).item()
        self.assertGreater(cos, 0.98)
        self.assertLess(losses8[-1], 0.5 * losses8[0])
        self.assertLess(abs(losses8[-1] - losses32[-1]), 0.1 * losses32[-1] + 1e-3)
        self.assertLessEqual(opt8.state_bytes, 0.27 * opt8.adamw_fp32_bytes)
        self.assertEqual(set(opt8.formats.values()), {"adamw-8bit"})

    def test_baoc_plans_under_its_budget_and_resumes_exactly(self):
        x, y = regression_task()
        model = mlp()
        opt = triaccel.optim.BAOC(model.named_parameters(), memory_budget="25%", lr=1e-3, plan_warmup=5)
        self.assertIsNone(opt.plan)
        first = loop(model, opt, x, y, 8)
        self.assertIsNotNone(opt.plan)
        self.assertEqual([u["unit"] for u in opt.plan["units"]], ["0", "1", "3", "5"])
        self.assertLessEqual(opt.state_bytes, 0.25 * opt.adamw_fp32_bytes)
        self.assertNotEqual(set(opt.formats.values()), {"adamw-fp32"})
        saved_model = copy.deepcopy(model.state_dict())
        saved_opt = copy.deepcopy(opt.state_dict())
        saved_formats = opt.formats
        after = loop(model, opt, x, y, 12)
        self.assertLess(after[-1], first[0])
        again = mlp(seed=1)
        again.load_state_dict(saved_model)
        opt2 = triaccel.optim.BAOC(again.named_parameters(), memory_budget="25%", lr=1e-3, plan_warmup=5)
        opt2.load_state_dict(saved_opt)
        self.assertEqual(opt2.formats, saved_formats)
        loop(again, opt2, x, y, 12)
        self.assertTrue(torch.equal(flat(again), flat(model)))

    def test_bad_arguments(self):
        model = mlp()
        with self.assertRaises(ValueError) as caught:
            triaccel.optim.BAOC(model.named_parameters(), memory_budget="25%", formats="adamw-fp32", plan_warmup=5)
        self.assertIn("budget", str(caught.exception))
        with self.assertRaises(ValueError):
            triaccel.optim.AdamW(model.named_parameters(), state_format="adamw-4bit")
        with self.assertRaises(TypeError):
            triaccel.optim.AdamW([{"params": list(model.parameters())}])


def compiled_step(opt, graphs, fullgraph=True):
    """opt.step under torch.compile, through AOTAutograd's functionalization (aot_eager: no code generation, quick on
    the CPU); fullgraph: a graph break raises. Each graph's code is appended to `graphs`."""
    def backend(gm, inputs):
        graphs.append(str(gm.graph))
        return torch._dynamo.lookup_backend("aot_eager")(gm, inputs)
    return torch.compile(opt.step, backend=backend, fullgraph=fullgraph)


class TorchOp(unittest.TestCase):
    """triaccel.optim's step is one torch op (triaccel::loop_optimizer_step): torch.compile traces it into its graph,
    and a CUDA graph captures it (the CudaGraph tests, on a GPU)."""

    def setUp(self):
        torch._dynamo.reset()

    def test_compiled_step_is_the_eager_step_in_one_graph(self):
        x, y = regression_task()
        makers = {"adamw-8bit": lambda m: triaccel.optim.AdamW8bit(m.named_parameters(), lr=1e-3),
                  "baoc": lambda m: triaccel.optim.BAOC(m.named_parameters(), memory_budget="25%", lr=1e-3,
                                                        plan_warmup=3)}
        for name, make in makers.items():
            with self.subTest(name):
                torch._dynamo.reset()
                eager, comp = mlp(), mlp()
                eager_opt, comp_opt = make(eager), make(comp)
                graphs = []
                loop(eager, eager_opt, x, y, 6)
                loop(comp, comp_opt, x, y, 6, step=compiled_step(comp_opt, graphs))
                self.assertTrue(torch.equal(flat(eager), flat(comp)))
                self.assertEqual(comp_opt.formats, eager_opt.formats)  # BAOC planned inside the op, at step 3
                self.assertEqual(len(graphs), 1)
                self.assertIn("triaccel.loop_optimizer_step", graphs[0])

    def test_tensor_lr_follows_a_scheduler_without_recompiling(self):
        x, y = regression_task()
        a, b = mlp(), mlp()
        opt_a = triaccel.optim.AdamW(a.named_parameters(), lr=1e-2)
        opt_b = triaccel.optim.AdamW(b.named_parameters(), lr=torch.tensor(1e-2))
        sched_a = torch.optim.lr_scheduler.StepLR(opt_a, 1, gamma=0.5)
        sched_b = torch.optim.lr_scheduler.StepLR(opt_b, 1, gamma=0.5)
        graphs = []
        # An LR scheduler wraps opt.step in a function Dynamo does not trace (so for torch.optim's own optimizers
        # too): the graph is the step's own frame.
        step_b = compiled_step(opt_b, graphs, fullgraph=False)
        for _ in range(4):
            loop(a, opt_a, x, y, 1)
            sched_a.step()
            loop(b, opt_b, x, y, 1, step=step_b)
            sched_b.step()
        self.assertTrue(torch.equal(flat(a), flat(b)))
        self.assertEqual(len(graphs), 1)
        self.assertIn("triaccel.loop_optimizer_step", graphs[0])

    def test_op_takes_copies_in_and_writes_the_update_back(self):
        # torch.compile's functionalization may hand the op copies of the parameters instead of the parameters.
        x, y = regression_task()
        a, b = mlp(), mlp()
        opt_a = triaccel.optim.AdamW(a.named_parameters(), lr=1e-2)
        opt_b = triaccel.optim.AdamW(b.named_parameters(), lr=1e-2)
        for model in (a, b):
            nn.functional.mse_loss(model(x), y).backward()
        with torch.no_grad():
            for p in a.parameters():
                p.add_(0.5)
        opt_a.step()
        params = list(b.parameters())
        copies = [p.detach() + 0.5 for p in params]
        torch.ops.triaccel.loop_optimizer_step(opt_b._handle, copies, [p.grad for p in params], torch.tensor(1e-2))
        self.assertTrue(torch.equal(torch.cat([c.flatten() for c in copies]), flat(a)))
        self.assertTrue(torch.equal(flat(b), flat(a)))

    def test_op_refuses_what_is_not_its_optimizers(self):
        model = mlp()
        opt = triaccel.optim.AdamW(model.named_parameters())
        params = list(model.parameters())
        with self.assertRaises(ValueError) as caught:
            torch.ops.triaccel.loop_optimizer_step(opt._handle, params[:-1], [None] * (len(params) - 1),
                                                   torch.tensor(1e-3))
        self.assertIn("built over 8", str(caught.exception))
        with self.assertRaises(ValueError) as caught:
            torch.ops.triaccel.loop_optimizer_step(opt._handle, params[::-1], [None] * len(params), torch.tensor(1e-3))
        self.assertIn("is not like it", str(caught.exception))
        handle = opt._handle
        del opt
        with self.assertRaises(ValueError) as caught:
            torch.ops.triaccel.loop_optimizer_step(handle, params, [None] * len(params), torch.tensor(1e-3))
        self.assertIn("no live optimizer", str(caught.exception))


@unittest.skipUnless(torch.cuda.is_available(), "needs a GPU")
class CudaRuns(unittest.TestCase):
    def test_runs_in_one_process_leave_nothing_allocated(self):
        # Each run takes a stream from the pool and cuBLAS keeps a workspace per stream (32 MiB on Hopper): without
        # their release every train() call left ~64 MB allocated (the H200's 15-epoch protocol grew its peak per run).
        g = torch.Generator().manual_seed(0)
        images = torch.randint(0, 256, (512, 1, 28, 28), dtype=torch.uint8, generator=g)
        labels = torch.randint(0, 10, (512,), generator=g)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with tempfile.TemporaryDirectory() as out:
            for _ in range(3):
                triaccel.train("small-cnn", train=(images, labels), test=(images[:128], labels[:128]), epochs=1,
                               batch_size=64, precision="amp-bf16", progress="off", out=out, device="cuda")
        self.assertLess(torch.cuda.memory_allocated() - before, 1 << 20)


@unittest.skipUnless(torch.cuda.is_available(), "needs a GPU")
class CudaGraph(unittest.TestCase):
    def test_captured_step_replays_the_eager_steps(self):
        x, y = (t.cuda() for t in regression_task())
        makers = {"adamw": triaccel.optim.AdamW, "adamw-8bit": triaccel.optim.AdamW8bit,
                  "baoc": lambda params, lr: triaccel.optim.BAOC(params, memory_budget="25%", lr=lr, plan_warmup=3)}
        for name, make in makers.items():
            with self.subTest(name):
                models, opts = [mlp().cuda(), mlp().cuda()], []
                for m in models:
                    opts.append(make(m.named_parameters(), lr=torch.tensor(1e-3, device="cuda")))
                    loop(m, opts[-1], x, y, 3)  # BAOC plans at step 3: before it a capture is refused
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    opts[1].step()
                for i in range(4):
                    for m, opt in zip(models, opts):
                        opt.param_groups[0]["lr"].fill_(1e-3 / (i + 1))  # read by the replay
                        opt.zero_grad(set_to_none=False)  # the captured step reads these gradient tensors
                        nn.functional.mse_loss(m(x), y).backward()
                    opts[0].step()
                    graph.replay()
                torch.cuda.synchronize()
                self.assertTrue(torch.equal(flat(models[0]), flat(models[1])))

    def test_baoc_capture_before_its_plan_is_refused(self):
        x, y = (t.cuda() for t in regression_task())
        model = mlp().cuda()
        opt = triaccel.optim.BAOC(model.named_parameters(), memory_budget="25%", lr=1e-3, plan_warmup=3)
        loop(model, opt, x, y, 1)
        with self.assertRaises(ValueError) as caught:
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                opt.step()
        self.assertIn("capture after it", str(caught.exception))


class Errors(unittest.TestCase):
    def setUp(self):
        self.data = dict(train=quadrant_tensors(64, seed=1), test=quadrant_tensors(16, seed=2))

    def error(self, kind, model, **kwargs):
        with self.assertRaises(kind) as caught:
            triaccel.train(model, **quiet(**kwargs))
        return str(caught.exception)

    def test_unknown_option_is_a_type_error(self):
        self.assertIn("'batchsize'", self.error(TypeError, small_cnn(3, 4, 16), batchsize=3, **self.data))

    def test_bad_value_names_the_option(self):
        self.assertIn("batch_size", self.error(ValueError, small_cnn(3, 4, 16), batch_size=0, **self.data))

    def test_units_that_do_not_compose_name_the_unit(self):
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(10, 4))
        message = self.error(ValueError, model, epochs=1, **self.data)
        self.assertIn("unit '2'", message)
        self.assertIn("shape", message)

    def test_a_module_that_is_no_sequential_and_has_no_units_is_split_and_its_fault_named(self):
        message = self.error(ValueError, nn.Linear(3, 4), **self.data)  # split automatically, then fails on images
        self.assertIn("failed on an input of shape [64, 3, 16, 16]", message)

    def test_a_parameter_outside_the_units(self):
        class Partial(Net):
            def units(self):
                return [self.stem, self.body]
        self.assertIn("'head.weight'", self.error(ValueError, Partial(), **self.data))

    def test_bad_tensors(self):
        images, labels = self.data["train"]
        # Floats outside [0, 1] are not pixels: passed as they are, so the uint8 test split does not match them.
        message = self.error(ValueError, small_cnn(3, 4, 16), train=(images.float(), labels), test=self.data["test"])
        self.assertIn("one shape and dtype", message)
        test_images, test_labels = self.data["test"]
        message = self.error(ValueError, small_cnn(3, 4, 16), train=self.data["train"],
                             test=(test_images, test_labels + 4))
        self.assertIn("never sees", message)
        self.assertIn("not both", self.error(TypeError, small_cnn(3, 4, 16), dataset="cifar10", **self.data))


if __name__ == "__main__":
    sys.exit(0 if unittest.main(exit=False, verbosity=2).result.wasSuccessful() else 1)
