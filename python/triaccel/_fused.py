"""The engine's fused BatchNorm(+ReLU) CUDA kernel for the BatchNorm2d of an automatically split model's units.

The built-in models run every training-mode BatchNorm2d, and the ReLU after it, through one kernel
(src/triaccel/models/batch_norm.h): statistics, normalization and ReLU in two passes over the activation instead of
PyTorch's BatchNorm then a separate ReLU, and the backward recomputes the ReLU's mask instead of keeping the output.
An automatically split unit is a torch.fx GraphModule; fuse_batch_norms rewrites each call of a BatchNorm2d (with the
ReLU that alone consumes its output) into a FusedBatchNorm, which runs the kernel where it applies (training, CUDA,
bf16/fp16 channels_last activations, float32 parameters; not while the engine probes curvature, which needs a second
derivative) and the module's own forward everywhere else, so CPU runs are unchanged. The module's tensors stay the
model's, under their own names: FusedBatchNorm only refers to the BatchNorm2d.
"""
import torch
from torch import nn

from . import _triaccel

ENABLED = True  # off: the units keep PyTorch's BatchNorm (bench/python_resnet18.py's A/B arm)


class FusedBatchNorm(nn.Module):
    """bn(x), then ReLU when relu, through the engine's kernel where it applies."""

    def __init__(self, bn: nn.BatchNorm2d, relu: bool):
        super().__init__()
        object.__setattr__(self, "bn", bn)  # not a child: its tensors keep their one name, in the model
        self.relu = relu

    def forward(self, x):
        bn = self.bn
        if bn.training and bn.affine and bn.track_running_stats and bn.momentum is not None and x.is_cuda:
            y = _triaccel.batch_norm_kernel(x, bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.momentum,
                                            bn.eps, self.relu)
            if y is not None:
                with torch.no_grad():
                    bn.num_batches_tracked.add_(1)
                return y
        y = bn(x)
        return torch.relu(y) if self.relu else y

    def extra_repr(self):
        return f"{self.bn}, relu={self.relu}"


def _is_relu(gm, node):
    if node.op == "call_module":
        return type(gm.get_submodule(node.target)) is nn.ReLU
    if node.op == "call_function":
        return node.target in (torch.relu, torch.relu_, nn.functional.relu)
    return node.op == "call_method" and node.target in ("relu", "relu_")


def fuse_batch_norms(gm: torch.fx.GraphModule) -> int:
    """Rewrites gm's calls of a BatchNorm2d, with the ReLU that is the only user of its output, into FusedBatchNorm
    calls; returns how many. A BatchNorm2d subclass (its forward may differ) is left as it is."""
    if not ENABLED:
        return 0
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or type(gm.get_submodule(node.target)) is not nn.BatchNorm2d:
            continue
        if len(node.args) != 1 or node.kwargs:
            continue
        users = list(node.users)
        relu = users[0] if len(users) == 1 and _is_relu(gm, users[0]) and users[0].args[:1] == (node,) else None
        name = f"fused_bn{count}"
        gm.add_submodule(name, FusedBatchNorm(gm.get_submodule(node.target), relu is not None))
        last = relu or node
        with gm.graph.inserting_after(last):
            fused = gm.graph.call_module(name, (node.args[0],))
        last.replace_all_uses_with(fused)
        if relu is not None:
            gm.graph.erase_node(relu)
        gm.graph.erase_node(node)
        count += 1
    if count:
        gm.recompile()
    return count
