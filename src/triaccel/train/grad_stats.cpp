// Per-unit gradient statistics: layout construction, dispatch (CUDA kernel or ATen reference) and the reference.
#include "triaccel/train/grad_stats.h"

#ifdef TRIACCEL_WITH_CUDA
#include "triaccel/kernels/grad_stats.h"
#endif

#include <ATen/ATen.h>
#include <torch/utils.h>
#include <torch/autograd.h>

#include <cmath>

namespace triaccel {
namespace {

// The device of the first defined gradient, or the CPU when none is defined.
at::Device grads_device(const std::vector<at::Tensor>& grads) {
  for (const auto& g : grads) {
    if (g.defined()) return g.device();
  }
  return at::Device(at::kCPU);
}

void check_grads_match_layout(const std::vector<at::Tensor>& grads, const GradStatsLayout& layout,
                              const char* who) {
  TORCH_CHECK(grads.size() == layout.num_tensors(), who, ": got ", grads.size(), " gradients for a layout of ",
              layout.num_tensors(), " tensors");
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i].defined()) continue;
    TORCH_CHECK(grads[i].numel() == layout.tensor_numel[i], who, ": gradient ", i, " has ", grads[i].numel(),
                " elements, the layout expects ", layout.tensor_numel[i]);
    TORCH_CHECK(at::isFloatingType(grads[i].scalar_type()), who, ": gradient ", i, " must be floating point, got ",
                grads[i].scalar_type());
  }
}

}  // namespace

GradStatsLayout::GradStatsLayout(const std::vector<std::vector<at::Tensor>>& unit_params)
    : unit_numel(unit_params.size(), 0) {
  for (size_t u = 0; u < unit_params.size(); ++u) {
    for (const auto& p : unit_params[u]) {
      TORCH_CHECK(p.defined(), "GradStatsLayout: unit ", u, " has an undefined parameter");
      tensor_unit.push_back(static_cast<int64_t>(u));
      tensor_numel.push_back(p.numel());
      unit_numel[u] += p.numel();
    }
  }
}

GradStatsLayout::GradStatsLayout(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& unit_of_tensor,
                                 int64_t num_units) {
  TORCH_CHECK(num_units >= 0, "GradStatsLayout: num_units must be >= 0, got ", num_units);
  TORCH_CHECK(tensors.size() == unit_of_tensor.size(), "GradStatsLayout: ", tensors.size(), " tensors but ",
              unit_of_tensor.size(), " unit indices");
  unit_numel.assign(static_cast<size_t>(num_units), 0);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int64_t u = unit_of_tensor[i];
    TORCH_CHECK(u >= 0 && u < num_units, "GradStatsLayout: tensor ", i, " has unit index ", u, ", expected [0, ",
                num_units, ")");
    TORCH_CHECK(tensors[i].defined(), "GradStatsLayout: tensor ", i, " is undefined");
    tensor_unit.push_back(u);
    tensor_numel.push_back(tensors[i].numel());
    unit_numel[static_cast<size_t>(u)] += tensors[i].numel();
  }
}

at::Tensor grad_stats_compute(const std::vector<at::Tensor>& grads, const GradStatsLayout& layout) {
  at::Tensor out =
      at::empty({layout.num_units(), kGradStatsColumns}, at::TensorOptions(grads_device(grads)).dtype(at::kFloat));
  grad_stats_compute_out(grads, layout, out);
  return out;
}

void grad_stats_compute_out(const std::vector<at::Tensor>& grads, const GradStatsLayout& layout, at::Tensor& out) {
  check_grads_match_layout(grads, layout, "grad_stats_compute");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() &&
                  out.sizes() == at::IntArrayRef({layout.num_units(), kGradStatsColumns}),
              "grad_stats_compute: out must be a contiguous float32 (", layout.num_units(), ", ", kGradStatsColumns,
              ") tensor, got ", out.scalar_type(), " ", out.sizes());
  for (size_t i = 0; i < grads.size(); ++i) {
    TORCH_CHECK(!grads[i].defined() || grads[i].device() == out.device(), "grad_stats_compute: gradient ", i,
                " is on ", grads[i].device(), ", out on ", out.device());
  }
  const torch::NoGradGuard no_grad;
#ifdef TRIACCEL_WITH_CUDA
  if (out.is_cuda()) {
    grad_stats_cuda(grads, layout.tensor_unit, layout.unit_numel, out);
    return;
  }
#endif
  out.copy_(grad_stats_reference(grads, layout));
}

at::Tensor grad_stats_reference(const std::vector<at::Tensor>& grads, const GradStatsLayout& layout) {
  check_grads_match_layout(grads, layout, "grad_stats_reference");
  const torch::NoGradGuard no_grad;
  const int64_t num_units = layout.num_units();
  std::vector<double> sum_sq(num_units, 0.0), sum(num_units, 0.0), max_abs(num_units, 0.0);
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i].defined() || grads[i].numel() == 0) continue;
    const auto u = static_cast<size_t>(layout.tensor_unit[i]);
    const at::Tensor g = grads[i].to(at::kDouble);
    sum_sq[u] += g.square().sum().item<double>();
    sum[u] += g.sum().item<double>();
    const double m = g.abs().max().item<double>();
    if (std::isnan(m) || m > max_abs[u]) max_abs[u] = m;  // NaN wins, as in the kernel
  }
  at::Tensor out = at::zeros({num_units, kGradStatsColumns}, at::kDouble);  // (U, 4), float64 on the CPU
  auto o = out.accessor<double, 2>();
  for (int64_t u = 0; u < num_units; ++u) {
    const auto n = static_cast<double>(layout.unit_numel[static_cast<size_t>(u)]);
    o[u][kGradStatsNorm] = std::sqrt(sum_sq[u]);
    if (n > 0) {
      const double mean = sum[u] / n;
      const double var = sum_sq[u] / n - mean * mean;
      o[u][kGradStatsMean] = mean;
      o[u][kGradStatsVar] = var < 0 ? 0.0 : var;
    }
    o[u][kGradStatsMaxAbs] = max_abs[u];
  }
  return out.to(grads_device(grads), at::kFloat);
}

}  // namespace triaccel
