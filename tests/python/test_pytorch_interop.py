#!/usr/bin/env python3
"""PyTorch interop check: a model.pt exported by triaccel must load into torchvision with strict=True.

Usage:
  test_pytorch_interop.py [TRIACCEL_CLI] [--model-pt PATH --arch {resnet18,efficientnet-b0,small-cnn}]

With only the CLI path (how ctest calls it) the script writes a tiny CIFAR-10-layout dataset, trains ResNet-18
on it for one epoch on the CPU with the CLI, and checks the run's model.pt (loads into torchvision strict, and the
loaded model reproduces the run's reported test accuracy) and checkpoint.pt (torch.load reads it with
weights_only=True; its "model" entry equals model.pt). It then trains gpt-char for one epoch on a small text and
checks that its model.pt holds the documented keys and that a plain-PyTorch GPT built from those tensors
reproduces the run's reported validation loss and token accuracy. With --model-pt it loads
the file with torch.load(weights_only=True), checks that it is a dict of tensors, builds the torchvision model
(ResNet-18 with the CIFAR stem, EfficientNet-B0; small-cnn has no torchvision twin, so only the dict is checked)
with the class count and input channels read from the file, and loads it with strict=True.
Exit status: 0 on success or skip, 1 on a failed check (one line saying what failed).
"""

import argparse
import sys

ARCHS = ("resnet18", "efficientnet-b0", "small-cnn")


class InteropError(Exception):
    """A check failed; the message says which and why."""


def torchvision_model(arch, num_classes, in_channels):
    """The torchvision twin of a triaccel architecture, or None when there is none (small-cnn)."""
    import torch
    import torchvision

    if arch == "resnet18":
        model = torchvision.models.resnet18(num_classes=num_classes)
        model.conv1 = torch.nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = torch.nn.Identity()
        return model
    if arch == "efficientnet-b0":
        model = torchvision.models.efficientnet_b0(num_classes=num_classes)
        if in_channels != 3:
            model.features[0][0] = torch.nn.Conv2d(in_channels, 32, kernel_size=3, stride=2, padding=1, bias=False)
        return model
    if arch == "small-cnn":
        return None
    raise InteropError(f"unknown --arch '{arch}'; known: {', '.join(ARCHS)}")


def check_state_dict(path, arch):
    """Loads path as a state_dict and, where torchvision has the architecture, into it with strict=True.

    Returns the loaded torchvision model in eval mode (None for small-cnn). Raises InteropError on failure.
    """
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any load failure is the finding
        raise InteropError(f"torch.load({path!r}, weights_only=True) failed: {e}") from e
    if not isinstance(state, dict) or not state:
        raise InteropError(f"{path}: expected a non-empty dict of tensors, got {type(state).__name__}")
    for name, value in state.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise InteropError(f"{path}: entry {name!r} is {type(value).__name__}, expected a tensor")

    first_weight = {"resnet18": "conv1.weight", "efficientnet-b0": "features.0.0.weight"}.get(arch)
    last_weight = {"resnet18": "fc.weight", "efficientnet-b0": "classifier.1.weight"}.get(arch)
    if first_weight is None:
        torchvision_model(arch, 0, 0)  # rejects unknown names
        return None
    for key in (first_weight, last_weight):
        if key not in state:
            raise InteropError(f"{path}: no '{key}' entry; is --arch {arch} right?")
    num_classes = state[last_weight].shape[0]
    in_channels = state[first_weight].shape[1]

    model = torchvision_model(arch, num_classes, in_channels)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise InteropError(f"{path} does not load into torchvision {arch} (strict): {e}") from e
    model.eval()
    return model


def write_tiny_cifar10(folder, n_train=64, n_test=32, seed=0):
    """CIFAR-10 binary files (1 label byte + 3072 planar RGB bytes per record) with random pixels."""
    import os
    import random

    rng = random.Random(seed)
    os.makedirs(folder, exist_ok=True)

    def records(n):
        return b"".join(bytes([rng.randrange(10)]) + rng.randbytes(3072) for _ in range(n))

    for i in range(1, 6):
        with open(os.path.join(folder, f"data_batch_{i}.bin"), "wb") as f:
            f.write(records(n_train // 5 if i < 5 else n_train - 4 * (n_train // 5)))
    with open(os.path.join(folder, "test_batch.bin"), "wb") as f:
        f.write(records(n_test))


def check_cli_run(cli):
    """Trains ResNet-18 for one epoch on a tiny dataset with the CLI and checks model.pt and checkpoint.pt."""
    import json
    import os
    import subprocess
    import tempfile

    import torch

    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "cifar")
        out = os.path.join(tmp, "run")
        write_tiny_cifar10(data)
        cmd = [cli, "train", "--model", "resnet18", "--dataset", "cifar10", "--data", data, "--epochs", "1",
               "--batch-size", "32", "--device", "cpu", "--progress", "off", "--out", out]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise InteropError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")
        model = check_state_dict(os.path.join(out, "model.pt"), "resnet18")

        # The loaded torchvision model reproduces the accuracy triaccel reported on the same (unaugmented) test set.
        raw = open(os.path.join(data, "test_batch.bin"), "rb").read()
        n = len(raw) // 3073
        rec = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(n, 3073)
        labels = rec[:, 0].long()
        images = rec[:, 1:].view(n, 3, 32, 32).float() / 255.0
        train = b"".join(open(os.path.join(data, f"data_batch_{i}.bin"), "rb").read() for i in range(1, 6))
        tr = torch.frombuffer(bytearray(train), dtype=torch.uint8).view(-1, 3073)[:, 1:].view(-1, 3, 32, 32).double()
        mean = (tr / 255.0).mean(dim=(0, 2, 3)).float()
        std = (tr / 255.0).std(dim=(0, 2, 3), unbiased=False).float()
        with torch.no_grad():
            logits = model((images - mean.view(1, 3, 1, 1)) / std.view(1, 3, 1, 1))
        acc = 100.0 * (logits.argmax(1) == labels).float().mean().item()
        summary = json.loads(open(os.path.join(out, "events.jsonl")).read().splitlines()[-1])
        if summary.get("event") != "summary" or abs(summary["test_acc"] - acc) > 1e-6:
            raise InteropError(f"torchvision accuracy {acc} != triaccel's reported {summary.get('test_acc')}")

        ckpt = torch.load(os.path.join(out, "checkpoint.pt"), map_location="cpu", weights_only=True)
        if ckpt.get("format") != "triaccel-checkpoint":
            raise InteropError(f"checkpoint.pt format is {ckpt.get('format')!r}")
        exported = torch.load(os.path.join(out, "model.pt"), map_location="cpu", weights_only=True)
        if set(ckpt["model"]) != set(exported):
            raise InteropError("checkpoint.pt's model entry and model.pt have different keys")
        for k, v in exported.items():
            if not torch.equal(ckpt["model"][k].to(v.dtype), v):
                raise InteropError(f"checkpoint.pt's model[{k!r}] differs from model.pt")
        return acc


def gpt_forward(state, tokens, heads=6):
    """Plain-PyTorch twin of triaccel's gpt-char (models/gpt.cpp): logits (B, T, V) from a model.pt state."""
    import torch
    import torch.nn.functional as F

    t = tokens.shape[1]
    x = state["tok_embed.weight"][tokens] + state["pos_embed"][:, :t]
    d = x.shape[-1]
    layers = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("blocks."))
    for i in range(layers):
        p = lambda name: state[f"blocks.{i}.{name}"]  # noqa: E731
        h = F.layer_norm(x, (d,), p("norm1.weight"), p("norm1.bias"), 1e-5)
        q, k, v = F.linear(h, p("attn.qkv.weight"), p("attn.qkv.bias")).view(x.shape[0], t, 3, heads, d // heads) \
            .permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(x.shape[0], t, d)
        x = x + F.linear(a, p("attn.proj.weight"), p("attn.proj.bias"))
        h = F.layer_norm(x, (d,), p("norm2.weight"), p("norm2.bias"), 1e-5)
        x = x + F.linear(F.gelu(F.linear(h, p("mlp.fc1.weight"), p("mlp.fc1.bias"))), p("mlp.fc2.weight"),
                         p("mlp.fc2.bias"))
    x = F.layer_norm(x, (d,), state["norm.weight"], state["norm.bias"], 1e-5)
    return F.linear(x, state["head.weight"])


def check_gpt_run(cli):
    """Trains gpt-char for one epoch on a small text with the CLI; checks model.pt's keys and its validation loss."""
    import json
    import os
    import subprocess
    import tempfile

    import torch
    import torch.nn.functional as F

    with tempfile.TemporaryDirectory() as tmp:
        text = "".join(f"{i} little pigs went to market, and {i % 7} stayed home.\n" for i in range(20)).encode()
        os.makedirs(os.path.join(tmp, "text"))
        with open(os.path.join(tmp, "text", "input.txt"), "wb") as f:
            f.write(text)
        out = os.path.join(tmp, "gpt")
        block = 8
        cmd = [cli, "train", "--model", "gpt-char", "--dataset", "tinyshakespeare", "--data", os.path.join(tmp, "text"),
               "--block-size", str(block), "--batch-size", "64", "--lr", "0.05", "--device", "cpu", "--progress",
               "off", "--out", out]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise InteropError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")
        state = torch.load(os.path.join(out, "model.pt"), map_location="cpu", weights_only=True)
        vocab = sorted(set(text))
        expected = {"pos_embed": (1, block, 384), "tok_embed.weight": (len(vocab), 384),
                    "blocks.5.attn.qkv.weight": (1152, 384), "norm.weight": (384,), "head.weight": (len(vocab), 384)}
        for key, shape in expected.items():
            if key not in state or tuple(state[key].shape) != shape:
                raise InteropError(f"gpt-char model.pt: want {key} of shape {shape}, got "
                                   f"{tuple(state[key].shape) if key in state else 'nothing'}")
        # Validation windows: the last 10 % of the characters, windows of block + 1 at stride block.
        ids = torch.tensor([vocab.index(c) for c in text])
        val = ids[int(len(ids) * 0.9):]
        n = (len(val) - 1) // block
        inputs = val[: n * block].view(n, block)
        targets = val[1 : n * block + 1].view(n, block)
        with torch.no_grad():
            logits = gpt_forward(state, inputs).flatten(0, 1)
        loss = F.cross_entropy(logits, targets.flatten()).item()
        acc = 100.0 * (logits.argmax(1) == targets.flatten()).float().mean().item()
        summary = json.loads(open(os.path.join(out, "events.jsonl")).read().splitlines()[-1])
        if abs(summary["test_loss"] - loss) > 1e-4 or abs(summary["test_acc"] - acc) > 1e-3:
            raise InteropError(f"PyTorch gpt-char twin: val loss {loss}, acc {acc}; triaccel reported "
                               f"{summary['test_loss']}, {summary['test_acc']}")
        return loss


def check_neuroflux_exit(cli):
    """NeuroFlux's early-exit model: exit_model.pt holds the kept units under torchvision names plus the head as
    exit.*; rebuilt in PyTorch (torchvision's ResNet-18 stem + the documented head) it reproduces the exit's test
    accuracy from exit.json. Tolerance 100 makes the smallest exit (after the stem) the exported one."""
    import json
    import os
    import subprocess
    import tempfile

    import torch
    import torch.nn.functional as F

    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "cifar")
        out = os.path.join(tmp, "nf")
        write_tiny_cifar10(data, n_train=80, n_test=32)
        cmd = [cli, "train", "--method", "neuroflux", "--model", "resnet18", "--dataset", "cifar10", "--data", data,
               "--epochs", "1", "--batch-size", "16", "--device", "cpu", "--progress", "off",
               "--nf-exit-tolerance", "100", "--out", out]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise InteropError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")
        info = json.load(open(os.path.join(out, "exit.json")))
        if info["units_kept"] != ["stem"]:
            raise InteropError(f"expected the stem exit with tolerance 100, got {info['units_kept']}")
        state = torch.load(os.path.join(out, "exit_model.pt"), map_location="cpu", weights_only=True)
        model = torchvision_model("resnet18", 10, 3)
        result = model.load_state_dict({k: v for k, v in state.items() if not k.startswith("exit.")}, strict=False)
        if result.unexpected_keys or any(k.startswith(("conv1.", "bn1.")) for k in result.missing_keys):
            raise InteropError(f"exit_model.pt prefix does not match torchvision names: {result}")
        params = sum(v.numel() for k, v in state.items() if not k.endswith(("running_mean", "running_var", "num_batches_tracked")))
        if params != info["params"]:
            raise InteropError(f"exit_model.pt has {params} parameters, exit.json says {info['params']}")
        model.eval()

        def head(h):
            if "exit.conv.weight" in state:
                h = F.conv2d(h, state["exit.conv.weight"], padding=1)
                h = F.batch_norm(h, state["exit.bn.running_mean"], state["exit.bn.running_var"],
                                 state["exit.bn.weight"], state["exit.bn.bias"], training=False, eps=1e-5)
                h = F.relu(h)
            h = F.adaptive_avg_pool2d(h, 2).flatten(1)
            return F.linear(h, state["exit.fc.weight"], state["exit.fc.bias"])

        raw = open(os.path.join(data, "test_batch.bin"), "rb").read()
        n = len(raw) // 3073
        rec = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(n, 3073)
        labels = rec[:, 0].long()
        images = rec[:, 1:].view(n, 3, 32, 32).float() / 255.0
        mean = torch.tensor(info["mean"]).view(1, 3, 1, 1)
        std = torch.tensor(info["std"]).view(1, 3, 1, 1)
        with torch.no_grad():
            logits = head(model.relu(model.bn1(model.conv1((images - mean) / std))))
        acc = 100.0 * (logits.argmax(1) == labels).float().mean().item()
        if abs(acc - info["test_acc"]) > 100.0 / n + 1e-6:  # at most one sample apart (float order of operations)
            raise InteropError(f"rebuilt exit model accuracy {acc} != exit.json's {info['test_acc']}")
        return acc


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cli", nargs="?", help="path to the triaccel CLI: train a tiny run and check its files")
    parser.add_argument("--model-pt", help="state_dict file written by triaccel")
    parser.add_argument("--arch", choices=ARCHS, help="architecture of --model-pt")
    args = parser.parse_args(argv)

    if args.model_pt is None:
        if args.cli is None:
            parser.error("give the triaccel CLI path or --model-pt")
        try:
            acc = check_cli_run(args.cli)
            gpt_loss = check_gpt_run(args.cli)
            exit_acc = check_neuroflux_exit(args.cli)
        except InteropError as e:
            print(f"FAIL: {e}".replace("\n", " "), file=sys.stderr)
            return 1
        print(f"ok: model.pt loads into torchvision resnet18 (strict) and reproduces test acc {acc:.2f} %; "
              "checkpoint.pt loads with weights_only=True; "
              f"gpt-char's model.pt reproduces its validation loss {gpt_loss:.4f} in plain PyTorch; "
              f"NeuroFlux's exit_model.pt rebuilt in PyTorch reproduces its exit's test acc {exit_acc:.2f} %")
        return 0
    if args.arch is None:
        parser.error("--model-pt needs --arch")
    try:
        check_state_dict(args.model_pt, args.arch)
    except InteropError as e:
        print(f"FAIL: {e}".replace("\n", " "), file=sys.stderr)
        return 1
    print(f"ok: {args.model_pt} loads into torchvision {args.arch} (strict)"
          if args.arch != "small-cnn" else f"ok: {args.model_pt} is a state_dict of tensors")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
