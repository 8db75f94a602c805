#!/usr/bin/env python3
"""PyTorch interop check: a model.pt exported by triaccel must load into torchvision with strict=True.

Usage:
  test_pytorch_interop.py [TRIACCEL_CLI] [--model-pt PATH --arch {resnet18,efficientnet-b0,small-cnn}]

With only the CLI path (how ctest calls it today) the script prints "skipped: no model.pt given" and exits 0;
wiring it to `triaccel` so that it trains and exports a model first is still to do. With --model-pt it loads
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


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cli", nargs="?", help="path to the triaccel CLI (not used yet)")
    parser.add_argument("--model-pt", help="state_dict file written by triaccel")
    parser.add_argument("--arch", choices=ARCHS, help="architecture of --model-pt")
    args = parser.parse_args(argv)

    if args.model_pt is None:
        print("skipped: no model.pt given")
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
