// Per-unit gradient statistics: the Tri-Accel precision signal (docs/tri-accel.md: per-unit grad
// norm/mean/variance, one fused kernel for all units).
//
// A GradStatsLayout, built once from the model's units, maps each gradient tensor (in a fixed order) to its
// unit. grad_stats_compute reduces all gradients of a step into one (U, 4) float32 tensor on the gradients'
// device; row u holds unit u's statistics over every element of every parameter of the unit:
//   [kGradStatsNorm]   l2 norm            sqrt(Σ g²)
//   [kGradStatsMean]   mean               Σ g / n
//   [kGradStatsVar]    population variance Σ g² / n − (Σ g / n)², clamped at 0 (NaN stays NaN)
//   [kGradStatsMaxAbs] max |g|            (NaN if any g is NaN)
// n is the unit's parameter count from the layout. Undefined gradients count as zeros: they are not read, add
// nothing to the sums, but their elements are part of n. A unit with n = 0 has an all-zero row.
//
// Invariants of the CUDA path: no host synchronization (the result stays on the device and is read every
// T_ctrl steps only), no data-dependent allocation, and it can be captured in a CUDA graph (the gradients must
// then stay at fixed addresses, as they do in a captured training step).
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <vector>

namespace triaccel {

constexpr int64_t kGradStatsNorm = 0;
constexpr int64_t kGradStatsMean = 1;
constexpr int64_t kGradStatsVar = 2;
constexpr int64_t kGradStatsMaxAbs = 3;
constexpr int64_t kGradStatsColumns = 4;

// Which unit each gradient tensor belongs to. Gradients are passed in tensor order: for the per-unit
// constructor that is unit 0's parameters, then unit 1's, and so on.
struct GradStatsLayout {
  GradStatsLayout() = default;
  // unit_params[u]: the parameters of unit u (only their element counts are kept).
  explicit GradStatsLayout(const std::vector<std::vector<at::Tensor>>& unit_params);
  // tensors[i] belongs to unit unit_of_tensor[i], in [0, num_units); units may own no tensor.
  GradStatsLayout(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& unit_of_tensor,
                  int64_t num_units);

  int64_t num_units() const { return static_cast<int64_t>(unit_numel.size()); }
  size_t num_tensors() const { return tensor_unit.size(); }

  std::vector<int64_t> tensor_unit;   // unit of each tensor
  std::vector<int64_t> tensor_numel;  // elements of each tensor
  std::vector<int64_t> unit_numel;    // elements of each unit (n above)
};

// grads[i]: the gradient of the layout's tensor i (same element count) or undefined; float32, bfloat16 or
// float16. CUDA gradients (all on one device, each dense in any memory format) go to the fused kernel, others to
// grad_stats_reference. Returns (U, 4) float32 on the gradients' device (the CPU if none is defined).
at::Tensor grad_stats_compute(const std::vector<at::Tensor>& grads, const GradStatsLayout& layout);

// As grad_stats_compute, writing into out: (U, 4) float32, contiguous; its device picks the path and must be the
// gradients' device. Whatever out held before is overwritten.
void grad_stats_compute_out(const std::vector<at::Tensor>& grads, const GradStatsLayout& layout, at::Tensor& out);

// The spec: plain ATen, accumulating in float64 (reads each gradient in its dtype, then upcasts). Works on any
// device and synchronizes with it. Returns (U, 4) float32 on the gradients' device (the CPU if none is defined).
at::Tensor grad_stats_reference(const std::vector<at::Tensor>& grads, const GradStatsLayout& layout);

}  // namespace triaccel
