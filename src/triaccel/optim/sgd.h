// SGD with momentum (optionally nesterov) and decoupled-from-norms weight decay: tensors of dimension ≤ 1
// (BatchNorm weights and biases, every bias) get no weight decay. Same math as torch.optim.SGD (dampening 0).
// The step reads lr and found_inf from 1-element device tensors and skips the update when found_inf ≠ 0, so
// it needs no host sync and can be captured in a CUDA graph. On CUDA: the fused kernel (kernels/sgd_step.cu);
// elsewhere: sgd_step_reference, which is also the spec the kernel is tested against.
#pragma once

#include "triaccel/optim/optimizer.h"

#include <ATen/Tensor.h>

#include <string>
#include <utility>
#include <vector>

namespace triaccel {

struct SgdOptions {
  double momentum = 0.9;
  bool nesterov = true;
  double weight_decay = 5e-4;

  void validate() const;
};

class Sgd final : public Optimizer {
 public:
  // named_params: the model's parameters (float32, requires_grad). Momentum buffers are created (zero) at the first
  // step, after the first backward, as torch.optim.SGD does: they do not exist during the first forward/backward,
  // where cuDNN autotuning sets the run's memory peak.
  Sgd(const std::vector<std::pair<std::string, at::Tensor>>& named_params, SgdOptions options);

  // One update from the current .grad() of every parameter. lr, found_inf: float32 scalars on the params' device.
  void step(const at::Tensor& lr, const at::Tensor& found_inf) override;
  // Each parameter's update is its own (momentum, weight decay and lr scale per tensor).
  bool steps_one() const override { return true; }
  void step_one(size_t i, const at::Tensor& grad, const at::Tensor& lr, const at::Tensor& found_inf) override;

  const SgdOptions& options() const { return options_; }
  // Creates the momentum buffers if the first step has not yet (a checkpoint load needs them).
  void state_init() override;
  // Same order as names(); empty before state_init, undefined for a parameter this process does not own.
  const std::vector<at::Tensor>& momenta() const { return momenta_; }
  // 4 bytes per owned parameter: the momentum buffers (whether or not they exist yet).
  int64_t state_bytes() const override;
  // "<param name>.momentum" for every parameter.
  NamedTensors state_tensors() override;

 private:
  // The update of parameters `indices` (owned ones) from `grads` (theirs, in that order).
  void step_of(const std::vector<size_t>& indices, const std::vector<at::Tensor>& grads, const at::Tensor& lr,
               const at::Tensor& found_inf);

  SgdOptions options_;
  std::vector<at::Tensor> momenta_;
  bool initialized_ = false;
};

// The math of one step in plain ATen ops (the reference for the CUDA kernel).
void sgd_step_reference(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                        const std::vector<at::Tensor>& momenta, const std::vector<float>& weight_decays,
                        const std::vector<float>& lr_scales, const at::Tensor& lr, const at::Tensor& found_inf,
                        float momentum, bool nesterov);

}  // namespace triaccel
