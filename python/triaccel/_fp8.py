"""A Python model's nn.Linear layers as the engine computes linear layers, for the duration of a run.

Under precision amp-fp8 the engine's step computes the built-in models' linear layers in FP8 (delayed scaling, E4M3
forward, E5M2 gradients: src/triaccel/train/fp8_linear.h), and under Tri-Accel's FP8 ladder those of the units at
fp8. A Python model's nn.Linear runs PyTorch's own forward, which the engine cannot see; engine_linears gives each
nn.Linear of the model (exactly that type: a subclass may compute something else) a forward that asks the engine
first (_triaccel.linear, which answers where the step has installed its FP8 layers and the shapes allow) and runs
torch's linear otherwise, and puts the layers back as they were when the run ends, also after an error.
"""
import contextlib

import torch
from torch import nn

from . import _triaccel


def _engine_forward(layer):
    def forward(x):
        y = _triaccel.linear(x, layer.weight, layer.bias)
        return y if y is not None else nn.functional.linear(x, layer.weight, layer.bias)
    return forward


@contextlib.contextmanager
def engine_linears(model):
    """Within the scope, every nn.Linear of `model` (a torch.nn.Module, or None: nothing) goes through the engine."""
    layers = [m for m in model.modules() if type(m) is nn.Linear] if isinstance(model, torch.nn.Module) else []
    for layer in layers:
        layer.forward = _engine_forward(layer)  # an instance attribute: nn.Module.__call__ runs it
    try:
        yield len(layers)
    finally:
        for layer in layers:
            del layer.forward
