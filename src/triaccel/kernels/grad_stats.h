// Fused multi-tensor per-unit gradient statistics for CUDA (the Tri-Accel precision signal). The layout and the
// meaning of the four columns are those of core/grad_stats.h; grad_stats_reference there is the spec.
// No host synchronization, no data-dependent allocation: safe inside CUDA graph capture.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <vector>

namespace triaccel {

// grads[i]: undefined (skipped, counts as zeros) or float32/bfloat16/float16, dense (any memory format), on
// out's device. tensor_unit[i]: the unit of grads[i], in [0, U). unit_numel[u]: the element count n of unit u.
// out: (U, 4) float32, contiguous, CUDA; overwritten with [l2 norm, mean, variance, max |g|] per unit.
// Runs on the current stream of out's device.
void grad_stats_cuda(const std::vector<at::Tensor>& grads, const std::vector<int64_t>& tensor_unit,
                     const std::vector<int64_t>& unit_numel, const at::Tensor& out);

}  // namespace triaccel
