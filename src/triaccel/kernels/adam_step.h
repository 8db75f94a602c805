// Fused multi-tensor step for the element-wise update rules (kernels/update_rule.h): kAdamW, kNoMomentum,
// kSgdMomentum, kSgd, with float32 or bfloat16 moments. One call updates every tensor of one rule and one storage
// type (one launch per TensorPack of tensors, kernels/multi_tensor_apply.cuh). lr, found_inf and the per-tensor step
// counts are read on the device (no host sync; capturable in a CUDA graph). The reference for the math is baoc_tensor_step_reference.
#pragma once

#include "triaccel/kernels/update_rule.h"

#include <ATen/Tensor.h>

#include <cstdint>
#include <vector>

namespace triaccel {

struct AdamStepHyper {
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
};

// params, grads: float32, dense, same layout. ms / vs: the state of each tensor, of `state_dtype` (kFloat or
// kBFloat16; undefined where the rule has none), same layout as the param. counts: (T, 2) float64 contiguous;
// count_rows[i] is tensor i's row. lr_scales: (T) float32 on the device, row count_rows[i] tensor i's learning-rate
// multiplier, read at every launch (a captured graph replays with the scales as they are then). sgd_scales: k of
// the SGD rules (ignored otherwise).
void adam_step_cuda(UpdateRule rule, at::ScalarType state_dtype, const std::vector<at::Tensor>& params,
                    const std::vector<at::Tensor>& grads,
                    const std::vector<at::Tensor>& ms, const std::vector<at::Tensor>& vs,
                    const std::vector<float>& weight_decays, const at::Tensor& lr_scales,
                    const std::vector<float>& sgd_scales, const at::Tensor& counts,
                    const std::vector<int64_t>& count_rows, const at::Tensor& lr, const at::Tensor& found_inf,
                    const AdamStepHyper& hyper);

}  // namespace triaccel
