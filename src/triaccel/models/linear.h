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
  // The layer's output for x, or an undefined tensor for the layer's own forward.
  virtual at::Tensor forward(torch::nn::LinearImpl& layer, const at::Tensor& x) = 0;
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

}  // namespace triaccel
