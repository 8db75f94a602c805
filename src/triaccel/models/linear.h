// The built-in models' linear layers run through linear_forward, which a higher layer may take over for a scope
// (the train layer's FP8 linears, train/fp8_linear.h: Fp8Linears) without the models depending on it. Outside any
// LinearOverrideScope, linear_forward is the layer's own forward. The override is per thread, as autocast is.
#pragma once

#include <ATen/Tensor.h>
#include <torch/nn/modules/linear.h>

namespace triaccel {

class LinearOverride {
 public:
  virtual ~LinearOverride() = default;
  // The output of the linear layer whose weight is `weight` (N, K) for x (..., K) — x·Wᵀ + bias (bias undefined: none)
  // —, or an undefined tensor for the layer's own forward. A layer is known by its weight (the same tensor at every
  // call: a built-in model's torch::nn::Linear or a Python nn.Linear, linear_override_forward).
  virtual at::Tensor forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) = 0;
};

// Installs `override` for this thread for the scope's lifetime (nullptr: none), and puts back the one before.
class LinearOverrideScope {
 public:
  explicit LinearOverrideScope(LinearOverride* override);
  ~LinearOverrideScope();
  LinearOverrideScope(const LinearOverrideScope&) = delete;
  LinearOverrideScope& operator=(const LinearOverrideScope&) = delete;

 private:
  LinearOverride* previous_;
};

// x (..., in) → (..., out): the override's output where one is installed and takes the layer, else layer.forward(x).
at::Tensor linear_forward(torch::nn::LinearImpl& layer, const at::Tensor& x);
// The installed override's output for this layer, or an undefined tensor (none installed on this thread, or it does
// not take the layer): a Python nn.Linear's forward asks this first (the module's `linear`).
at::Tensor linear_override_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);

}  // namespace triaccel
