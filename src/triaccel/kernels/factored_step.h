// Fused multi-tensor step for factored second moments (kFactored on tensors of dim ≥ 2, optim/state_format.h):
// four launches per pack of tensors (as many as the byte budget of kernels/multi_tensor_apply.cuh allows), whatever
// their number of rows — row sums of g², column sums of g², the EMA of r and c with mean(r), and the element-wise
// update. Rows are the first dimension after any leading 1s (outermost in memory), columns in memory order within a
// row (the layout the CPU reference uses). lr, found_inf and step counts are read on the device; nothing changes
// when found_inf != 0. The reference for the math is baoc_tensor_step_reference.
#pragma once

#include "triaccel/kernels/adam_step.h"

#include <ATen/Tensor.h>

#include <cstdint>
#include <vector>

namespace triaccel {

// params, grads: float32, dense, same layout, size(0) outermost; v_rows: (R) float32; v_cols: (C) float32 with
// R = size(0), C = numel / R. counts: (T, 2) float64 and lr_scales: (T) float32 on the device, row count_rows[i]
// tensor i's (lr_scales read at every launch).
void factored_step_cuda(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                        const std::vector<at::Tensor>& v_rows, const std::vector<at::Tensor>& v_cols,
                        const std::vector<float>& weight_decays, const at::Tensor& lr_scales,
                        const at::Tensor& counts, const std::vector<int64_t>& count_rows, const at::Tensor& lr,
                        const at::Tensor& found_inf, const AdamStepHyper& hyper);

}  // namespace triaccel
