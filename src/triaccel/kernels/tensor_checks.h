// Host-side checks shared by the fused multi-tensor optimizer kernels (sgd_step, adam_step, adam8_step,
// factored_step): what a launch may assume about the tensors it is handed.
#pragma once

#include <ATen/Tensor.h>
#include <c10/util/Exception.h>

namespace triaccel {

// Same element → address map: equal sizes, and equal strides in every dimension of size > 1 (a 1×1 conv weight has
// different channels_last and contiguous strides but the same layout in memory).
inline bool same_dense_layout(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes()) return false;
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) > 1 && a.stride(d) != b.stride(d)) return false;
  }
  return true;
}

// `t` is defined, on `device`, of `dtype`, and dense; errors name the op and the argument.
inline void tensor_check_cuda(const char* op, const at::Tensor& t, const char* what, const at::Device& device,
                              at::ScalarType dtype) {
  TORCH_CHECK(t.defined() && t.is_cuda() && t.device() == device, op, ": ", what, " must be on ", device);
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", what, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_non_overlapping_and_dense(), op, ": ", what, " must be dense");
}

// The per-tensor learning-rate scales a kernel reads on the device: (T) float32, contiguous, on `device`; `rows` is
// T when the kernel's row indices are checked against another table's (the step counts), < 0 when they are checked
// against lr_scales itself.
inline void lr_scales_check(const char* op, const at::Tensor& lr_scales, const at::Device& device, int64_t rows) {
  tensor_check_cuda(op, lr_scales, "lr_scales", device, at::kFloat);
  TORCH_CHECK(lr_scales.dim() == 1 && lr_scales.is_contiguous() && (rows < 0 || lr_scales.size(0) == rows), op,
              ": lr_scales must be a contiguous (T) vector, a row per tensor");
}

}  // namespace triaccel
