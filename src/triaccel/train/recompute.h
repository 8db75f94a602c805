// Activation recompute for one unit (the memory planner's lever, docs/memory-planner.md): the unit's forward runs
// without recording an autograd graph, keeping only its input; its backward runs the forward again from that input,
// with autograd on, and back-propagates through it. Its gradients (input and parameters) equal those of the plain
// forward; what it saves is the unit's activations between the two passes, what it costs is a second forward.
//
// Invariants: the second forward sees the same input, weights and autocast state as the first (`forward` sets its
// own autocast: backward runs on autograd's thread, where the caller's is not set), and leaves the unit's buffers
// as the first forward left them (BatchNorm's running statistics are updated once per step, not twice). A unit whose
// forward draws random numbers (dropout) must not be recomputed: its second pass would draw others.
// Works inside a CUDA-graph capture: the second forward and its backward are recorded with the rest of backward.
#pragma once

#include <ATen/Tensor.h>

#include <functional>
#include <vector>

namespace triaccel {

using UnitForward = std::function<at::Tensor(const at::Tensor&)>;

// forward(x) whose activations are recomputed in backward. `params`: the unit's parameters (their gradients flow
// through the recompute); `buffers`: its buffers (restored after the second forward).
at::Tensor recompute_forward(const UnitForward& forward, const at::Tensor& x, const std::vector<at::Tensor>& params,
                             const std::vector<at::Tensor>& buffers);

// The inputs the recompute nodes in the autograd graph behind `output` keep for backward, in the order the graph is
// walked from `output` (what recomputed units hold between the passes). Exposed for tests.
std::vector<at::Tensor> recompute_kept_inputs(const at::Tensor& output);

}  // namespace triaccel
