#include "triaccel/train/loss_scaler.h"

#include "triaccel/core/errors.h"

#include <ATen/ATen.h>
#include <torch/utils.h>
#include <torch/autograd.h>

namespace triaccel {

void LossScalerOptions::validate() const {
  TRIACCEL_CHECK_INPUT(init_scale > 0, "loss scaler: init_scale must be > 0, got ", init_scale);
  TRIACCEL_CHECK_INPUT(growth_factor > 1, "loss scaler: growth_factor must be > 1, got ", growth_factor);
  TRIACCEL_CHECK_INPUT(backoff_factor > 0 && backoff_factor < 1,
                       "loss scaler: backoff_factor must be in (0, 1), got ", backoff_factor);
  TRIACCEL_CHECK_INPUT(growth_interval > 0, "loss scaler: growth_interval must be > 0, got ", growth_interval);
}

LossScaler::LossScaler(LossScalerOptions options, const c10::Device& device) : options_(options) {
  options_.validate();
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  scale_ = at::full({1}, options_.enabled ? options_.init_scale : 1.0, f32);
  inv_scale_ = at::ones({1}, f32);
  growth_tracker_ = at::zeros({1}, f32.dtype(at::kInt));
  found_inf_ = at::zeros({1}, f32);
  skipped_ = at::zeros({1}, f32);
  scale_before_ = scale_.clone();
  growth_before_ = growth_tracker_.clone();
}

at::Tensor LossScaler::scale(const at::Tensor& loss) const {
  if (!options_.enabled) return loss;
  return loss.to(at::kFloat) * scale_;
}

void LossScaler::unscale_and_check(const std::vector<at::Tensor>& grads) {
  const torch::NoGradGuard no_grad;
  found_inf_.zero_();
  if (options_.enabled) {
    at::reciprocal_out(inv_scale_, scale_);
  }
  // With scaling off inv_scale_ stays 1: the call only detects non-finite values.
  at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf_, inv_scale_);
}

void LossScaler::found_inf_reset() { found_inf_.zero_(); }

void LossScaler::check(const std::vector<at::Tensor>& tensors) {
  TORCH_CHECK(!options_.enabled, "LossScaler::check: the loss is scaled; unscale_and_check the gradients instead");
  const torch::NoGradGuard no_grad;
  at::_amp_foreach_non_finite_check_and_unscale_(tensors, found_inf_, inv_scale_);  // inv_scale_ is 1: a check only
}

void LossScaler::update() {
  const torch::NoGradGuard no_grad;
  skipped_.add_(found_inf_);
  if (!options_.enabled) return;
  scale_before_.copy_(scale_);
  growth_before_.copy_(growth_tracker_);
  at::_amp_update_scale_(scale_, growth_tracker_, found_inf_, options_.growth_factor, options_.backoff_factor,
                         options_.growth_interval);
}

void LossScaler::update_undo() {
  const torch::NoGradGuard no_grad;
  skipped_.sub_(found_inf_);
  if (!options_.enabled) return;
  scale_.copy_(scale_before_);
  growth_tracker_.copy_(growth_before_);
}

void LossScaler::load(const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& skipped) {
  const torch::NoGradGuard no_grad;
  scale_.copy_(scale.reshape({1}));
  growth_tracker_.copy_(growth_tracker.reshape({1}));
  skipped_.copy_(skipped.reshape({1}));
}

}  // namespace triaccel
