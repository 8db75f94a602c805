#include "triaccel/train/sgd.h"

#include "triaccel/core/errors.h"
#ifdef TRIACCEL_WITH_CUDA
#include "triaccel/kernels/sgd_step.h"
#endif

#include <ATen/ATen.h>
#include <torch/autograd.h>

namespace triaccel {

void SgdOptions::validate() const {
  TRIACCEL_CHECK_INPUT(momentum >= 0 && momentum < 1, "--momentum must be in [0, 1), got ", momentum);
  TRIACCEL_CHECK_INPUT(weight_decay >= 0, "--weight-decay must be >= 0, got ", weight_decay);
  TRIACCEL_CHECK_INPUT(!nesterov || momentum > 0, "--nesterov needs --momentum > 0");
}

Sgd::Sgd(const std::vector<std::pair<std::string, at::Tensor>>& named_params, SgdOptions options)
    : options_(options) {
  options_.validate();
  for (const auto& [name, p] : named_params) {
    TORCH_CHECK(p.scalar_type() == at::kFloat, "Sgd: parameter ", name, " must be float32 (master weights)");
    names_.push_back(name);
    params_.push_back(p);
    weight_decays_.push_back(p.dim() <= 1 ? 0.f : static_cast<float>(options_.weight_decay));
    lr_scales_.push_back(1.f);
  }
}

void Sgd::set_lr_scales(std::vector<float> scales) {
  TORCH_CHECK(scales.size() == params_.size(), "Sgd::set_lr_scales: ", scales.size(), " scales for ",
              params_.size(), " parameters");
  lr_scales_ = std::move(scales);
}

void Sgd::state_init() {
  if (!momenta_.empty()) return;
  const torch::NoGradGuard no_grad;
  for (const auto& p : params_) momenta_.push_back(at::zeros_like(p));  // keeps p's memory format
}

Optimizer::NamedTensors Sgd::state_tensors() {
  state_init();
  NamedTensors out;
  for (size_t i = 0; i < names_.size(); ++i) out.emplace_back(names_[i] + ".momentum", momenta_[i]);
  return out;
}

void Sgd::step(const at::Tensor& lr, const at::Tensor& found_inf) {
  const auto g = grads();
  for (size_t i = 0; i < g.size(); ++i) {
    TORCH_CHECK(g[i].defined(), "Sgd::step: parameter ", names_[i], " has no gradient");
  }
  state_init();
  const torch::NoGradGuard no_grad;
#ifdef TRIACCEL_WITH_CUDA
  if (!params_.empty() && params_[0].is_cuda()) {
    sgd_step_cuda(params_, g, momenta_, weight_decays_, lr_scales_, lr, found_inf,
                  static_cast<float>(options_.momentum), options_.nesterov);
    return;
  }
#endif
  sgd_step_reference(params_, g, momenta_, weight_decays_, lr_scales_, lr, found_inf,
                     static_cast<float>(options_.momentum), options_.nesterov);
}

void sgd_step_reference(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                        const std::vector<at::Tensor>& momenta, const std::vector<float>& weight_decays,
                        const std::vector<float>& lr_scales, const at::Tensor& lr, const at::Tensor& found_inf,
                        float momentum, bool nesterov) {
  const torch::NoGradGuard no_grad;
  // The reference syncs on found_inf; the CUDA kernel reads it on the device instead.
  if (found_inf.item<float>() != 0.f) return;
  const float lr_value = lr.item<float>();
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor d = grads[i].to(at::kFloat);
    if (weight_decays[i] != 0.f) d = d.add(params[i], weight_decays[i]);
    momenta[i].mul_(momentum).add_(d);
    d = nesterov ? d.add(momenta[i], momentum) : momenta[i];
    params[i].sub_(d, lr_value * lr_scales[i]);
  }
}

}  // namespace triaccel
