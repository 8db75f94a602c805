#include "triaccel/optim/sgd.h"

#include "triaccel/core/errors.h"
#ifdef TRIACCEL_WITH_CUDA
#include "triaccel/kernels/sgd_step.h"
#endif

#include <ATen/ATen.h>
#include <torch/utils.h>
#include <torch/autograd.h>

namespace triaccel {

void SgdOptions::validate() const {
  TRIACCEL_CHECK_INPUT(momentum >= 0 && momentum < 1, option_ref("momentum"), " must be in [0, 1), got ", momentum);
  TRIACCEL_CHECK_INPUT(weight_decay >= 0, option_ref("weight_decay"), " must be >= 0, got ", weight_decay);
  TRIACCEL_CHECK_INPUT(!nesterov || momentum > 0, option_ref("nesterov"), " needs ", option_ref("momentum"), " > 0");
}

Sgd::Sgd(const std::vector<std::pair<std::string, at::Tensor>>& named_params, SgdOptions options)
    : Optimizer(named_params, options.weight_decay, "Sgd"), options_(options) {
  options_.validate();
}

int64_t Sgd::state_bytes() const {
  int64_t n = 0;
  for (size_t i = 0; i < params().size(); ++i) n += owned(i) ? params()[i].numel() : 0;
  return 4 * n;  // the momentum buffers (allocated before the first step, whatever the momentum)
}

void Sgd::state_init() {
  if (initialized_) return;
  const torch::NoGradGuard no_grad;
  momenta_.clear();
  for (size_t i = 0; i < params().size(); ++i) {
    momenta_.push_back(owned(i) ? at::zeros_like(params()[i]) : at::Tensor());  // keeps p's memory format
  }
  initialized_ = true;
}

Optimizer::NamedTensors Sgd::state_tensors() {
  state_init();
  NamedTensors out;
  for (size_t i = 0; i < names().size(); ++i) {
    // Another process's parameter: a host temporary its owner's values are gathered into (train/param_shards.h).
    const at::Tensor m = owned(i) ? momenta_[i] : at::zeros(params()[i].sizes(), at::kFloat);
    out.emplace_back(names()[i] + ".momentum", m);
  }
  return out;
}

void Sgd::step(const at::Tensor& lr, const at::Tensor& found_inf) {
  const auto [indices, grads] = owned_of(grads_required());
  step_of(indices, grads, lr, found_inf);
}

void Sgd::step_one(size_t i, const at::Tensor& grad, const at::Tensor& lr, const at::Tensor& found_inf) {
  TORCH_CHECK(i < params().size() && grad.defined(), "Sgd::step_one: parameter ", i, " of ", params().size(),
              grad.defined() ? "" : " without a gradient");
  if (owned(i)) step_of({i}, {grad}, lr, found_inf);
}

void Sgd::step_of(const std::vector<size_t>& indices, const std::vector<at::Tensor>& grads, const at::Tensor& lr,
                  const at::Tensor& found_inf) {
  state_init();
  const torch::NoGradGuard no_grad;
  std::vector<at::Tensor> p, m;
  std::vector<float> wd, scale;
  std::vector<int64_t> rows;
  for (size_t i : indices) {
    p.push_back(params()[i]);
    m.push_back(momenta_[i]);
    wd.push_back(weight_decays()[i]);
    scale.push_back(lr_scales()[i]);
    rows.push_back(static_cast<int64_t>(i));
  }
  if (p.empty()) return;
#ifdef TRIACCEL_WITH_CUDA
  if (p[0].is_cuda()) {
    sgd_step_cuda(p, grads, m, wd, lr_scales_device(), rows, lr, found_inf, static_cast<float>(options_.momentum),
                  options_.nesterov);
    return;
  }
#endif
  sgd_step_reference(p, grads, m, wd, scale, lr, found_inf, static_cast<float>(options_.momentum), options_.nesterov);
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
