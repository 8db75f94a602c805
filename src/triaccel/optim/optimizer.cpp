#include "triaccel/optim/optimizer.h"

#include "triaccel/optim/baoc_optimizer.h"
#include "triaccel/optim/sgd.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace triaccel {

Optimizer::Optimizer(const std::vector<std::pair<std::string, at::Tensor>>& named_params, double weight_decay,
                     const char* kind)
    : kind_(kind) {
  for (const auto& [name, p] : named_params) {
    TORCH_CHECK(p.scalar_type() == at::kFloat, kind_, ": parameter ", name, " must be float32 (master weights)");
    names_.push_back(name);
    params_.push_back(p);
    weight_decays_.push_back(p.dim() <= 1 ? 0.f : static_cast<float>(weight_decay));
    lr_scales_.push_back(1.f);
    owned_.push_back(true);
  }
  const c10::Device device = params_.empty() ? c10::Device(c10::kCPU) : params_.front().device();
  lr_scales_device_ =
      at::ones({static_cast<int64_t>(params_.size())}, at::TensorOptions().dtype(at::kFloat).device(device));
}

void Optimizer::set_owned(std::vector<bool> owned) {
  TORCH_CHECK(owned.size() == params_.size(), kind_, "::set_owned: ", owned.size(), " flags for ", params_.size(),
              " parameters");
  owned_ = std::move(owned);
  sharded_ = false;
  for (bool o : owned_) sharded_ = sharded_ || !o;
}

void Optimizer::set_lr_scales(std::vector<float> scales) {
  TORCH_CHECK(scales.size() == params_.size(), kind_, "::set_lr_scales: ", scales.size(), " scales for ",
              params_.size(), " parameters");
  lr_scales_ = std::move(scales);
  // In place, on the current stream: steps queued before read the old scales, later ones (and replays) the new.
  lr_scales_device_.copy_(at::tensor(lr_scales_, at::kFloat));
}

void Optimizer::state_load(const NamedTensors& stored, const std::string& path) {
  named_tensors_load(state_tensors(), stored, "optimizer", path);
}

void Optimizer::step_one(size_t /*i*/, const at::Tensor& /*grad*/, const at::Tensor& /*lr*/,
                         const at::Tensor& /*found_inf*/) {
  TORCH_CHECK(false, kind_, "::step_one: this optimizer updates its parameters together (steps_one() is false)");
}

std::vector<at::Tensor> Optimizer::grads() const {
  std::vector<at::Tensor> out;
  out.reserve(params_.size());
  for (const auto& p : params_) out.push_back(p.grad());
  return out;
}

std::vector<at::Tensor> Optimizer::grads_required() const {
  std::vector<at::Tensor> g = grads();
  for (size_t i = 0; i < g.size(); ++i) TORCH_CHECK(g[i].defined(), kind_, "::step: parameter ", names_[i], " has no gradient");
  return g;
}

std::pair<std::vector<size_t>, std::vector<at::Tensor>> Optimizer::owned_of(const std::vector<at::Tensor>& all) const {
  std::pair<std::vector<size_t>, std::vector<at::Tensor>> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!owned(i)) continue;
    out.first.push_back(i);
    out.second.push_back(all[i]);
  }
  return out;
}

std::unique_ptr<Optimizer> optimizer_create(OptimizerKind kind,
                                            const std::vector<std::pair<std::string, at::Tensor>>& named_params,
                                            const OptimizerOptions& options) {
  if (kind == OptimizerKind::kSgd) {
    SgdOptions so;
    so.momentum = options.momentum;
    so.nesterov = options.nesterov;
    so.weight_decay = options.weight_decay;
    return std::make_unique<Sgd>(named_params, so);
  }
  BaocOptions bo;
  bo.beta1 = options.beta1;
  bo.beta2 = options.beta2;
  bo.eps = options.eps;
  bo.weight_decay = options.weight_decay;
  return std::make_unique<BaocOptimizer>(named_params, bo, StateFormat::kAdamW32);
}

}  // namespace triaccel
