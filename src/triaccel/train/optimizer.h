// The optimizer interface the training step drives: Sgd (train/sgd.h) and BaocOptimizer (optim/baoc_optimizer.h)
// implement it. Invariants every implementation keeps: step() reads lr and found_inf from 1-element float32 tensors
// on the parameters' device and never synchronizes with the device on CUDA (so the step can be captured in a CUDA
// graph); state tensors keep their addresses between steps (a conversion of state, e.g. a BAOC re-plan, changes
// them, and the caller then drops its captured graph); a step with found_inf != 0 changes nothing.
#pragma once

#include <ATen/Tensor.h>

#include <string>
#include <utility>
#include <vector>

namespace triaccel {

class Optimizer {
 public:
  using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

  virtual ~Optimizer() = default;

  // One update from the current .grad() of every parameter.
  virtual void step(const at::Tensor& lr, const at::Tensor& found_inf) = 0;

  virtual const std::vector<std::string>& names() const = 0;
  virtual const std::vector<at::Tensor>& params() const = 0;
  // Per-parameter learning-rate multipliers (Tri-Accel's curvature scaling); values travel into fused kernels by
  // value, so a captured CUDA graph must be re-captured after a change.
  virtual void set_lr_scales(std::vector<float> scales) = 0;
  virtual const std::vector<float>& lr_scales() const = 0;

  // Checkpoints: the live state tensors by name (created first if the first step has not run yet).
  virtual NamedTensors state_tensors() = 0;
  // Restores state written from state_tensors(); UserError naming `path` on a mismatch. Default: copies by name.
  virtual void state_load(const NamedTensors& stored, const std::string& path);

  // The current gradients, in params() order (undefined where a parameter has none).
  std::vector<at::Tensor> grads() const;
};

}  // namespace triaccel
