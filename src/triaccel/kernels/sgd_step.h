// Fused multi-tensor SGD step (momentum, nesterov, per-tensor weight decay) for CUDA.
// lr and found_inf are read on the device, so the step needs no host sync and can live inside a CUDA graph.
// The reference for the math is sgd_step_reference.
#pragma once

#include <ATen/Tensor.h>

#include <vector>

namespace triaccel {

// params, grads, momenta: float32, contiguous (any memory format, dense), same device, same length lists.
// lr, found_inf: float32 scalars (0-dim or 1 element) on the same device. If found_inf != 0 nothing changes.
// lr_scales: (T) float32 on the device, tensor i's learning-rate multiplier at row scale_rows[i]; read at every
// launch, so a captured graph replays with the scales as they are then (Optimizer::set_lr_scales writes them).
void sgd_step_cuda(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                   const std::vector<at::Tensor>& momenta, const std::vector<float>& weight_decays,
                   const at::Tensor& lr_scales, const std::vector<int64_t>& scale_rows, const at::Tensor& lr,
                   const at::Tensor& found_inf, float momentum, bool nesterov);

}  // namespace triaccel
