// The optimizer interface the training step drives, and the base every optimizer shares: its parameters by name,
// the weight-decay rule (tensors of dimension <= 1 — norms and biases — get none), and per-parameter learning-rate
// scales (Tri-Accel's curvature scaling). Sgd (optim/sgd.h) and BaocOptimizer (optim/baoc_optimizer.h) derive from it;
// optimizer_create builds one by kind.
//
// Invariants every implementation keeps: step() reads lr and found_inf from 1-element float32 tensors on the
// parameters' device and never synchronizes with the device on CUDA (so the step can be captured in a CUDA graph);
// state tensors keep their addresses between steps (a conversion of state, e.g. a BAOC re-plan, changes them, and the
// caller then drops its captured graph); a step with found_inf != 0 changes nothing.
// Sharded state (ZeRO stage 1, train/param_shards.h): a parameter this process does not own has no state here and
// step() leaves it alone (its owner's update reaches it by broadcast); state_tensors() still lists its entries, as
// host temporaries of the right shapes, so a checkpoint can gather them from their owners.
#pragma once

#include "triaccel/core/enum_names.h"
#include "triaccel/core/named_tensors.h"

#include <ATen/Tensor.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace triaccel {

class Optimizer {
 public:
  using NamedTensors = triaccel::NamedTensors;

  // named_params: float32 parameters (master weights); weight_decay applies to tensors of dimension >= 2 only.
  Optimizer(const std::vector<std::pair<std::string, at::Tensor>>& named_params, double weight_decay,
            const char* kind);
  virtual ~Optimizer() = default;

  // One update from the current .grad() of every parameter.
  virtual void step(const at::Tensor& lr, const at::Tensor& found_inf) = 0;
  // Whether step_one may update one parameter alone, the others' gradients not yet made (the update in backward:
  // train/step.h). False by default: a rule over all of them (BAOC's statistics, shared step counts).
  virtual bool steps_one() const { return false; }
  // Parameter i's part of step(), from `grad` (its gradient): the same values step() would give it. Needs steps_one().
  virtual void step_one(size_t i, const at::Tensor& grad, const at::Tensor& lr, const at::Tensor& found_inf);

  const std::vector<std::string>& names() const { return names_; }
  const std::vector<at::Tensor>& params() const { return params_; }
  const std::vector<float>& weight_decays() const { return weight_decays_; }
  // Per-parameter learning-rate multipliers (all 1 by default). The fused kernels read them on the device, from
  // lr_scales_device() (written here in stream order, its address fixed), so a captured CUDA graph replays with the
  // new scales: no re-capture after a change.
  void set_lr_scales(std::vector<float> scales);
  const std::vector<float>& lr_scales() const { return lr_scales_; }
  // (T) float32 on the parameters' device: lr_scales(), row i parameter i's.
  const at::Tensor& lr_scales_device() const { return lr_scales_device_; }
  // ZeRO stage 1: which parameters this process keeps state for and updates (all of them by default). Set before
  // the first step or state_init.
  void set_owned(std::vector<bool> owned);
  bool owned(size_t i) const { return owned_[i]; }
  bool sharded() const { return sharded_; }

  // Bytes of optimizer state (what the memory planner and the summary count).
  virtual int64_t state_bytes() const = 0;
  // Allocates the state (zeros, in the current formats) if the first step has not yet. The step engine calls it
  // before its first forward, so the state lands beside the weights in the caching allocator's segments, not in the
  // holes the first step's activations leave (train/step.h).
  virtual void state_init() = 0;
  // Checkpoints: the live state tensors by name (created first if the first step has not run yet).
  virtual NamedTensors state_tensors() = 0;
  // Restores state written from state_tensors(); UserError naming `path` on a mismatch. Default: copies by name.
  virtual void state_load(const NamedTensors& stored, const std::string& path);

  // The current gradients, in params() order (undefined where a parameter has none).
  std::vector<at::Tensor> grads() const;

 protected:
  // The gradients of every parameter; an internal error naming the parameter that has none.
  std::vector<at::Tensor> grads_required() const;
  // The parameters this process updates (all of them unless the state is sharded) and their gradients, from every
  // parameter's gradient `all`.
  std::pair<std::vector<size_t>, std::vector<at::Tensor>> owned_of(const std::vector<at::Tensor>& all) const;

 private:
  const char* kind_;
  std::vector<std::string> names_;
  std::vector<at::Tensor> params_;
  std::vector<float> weight_decays_;
  std::vector<float> lr_scales_;
  at::Tensor lr_scales_device_;
  std::vector<bool> owned_;
  bool sharded_ = false;
};

// The `optimizer` option.
enum class OptimizerKind { kSgd, kAdamW, kBaoc };

template <>
struct EnumNames<OptimizerKind> {
  static constexpr EnumName<OptimizerKind> kNames[] = {
      {OptimizerKind::kSgd, "sgd"}, {OptimizerKind::kAdamW, "adamw"}, {OptimizerKind::kBaoc, "baoc"}};
};

struct OptimizerOptions {
  double weight_decay = 5e-4;
  double momentum = 0.9;     // sgd
  bool nesterov = true;      // sgd
  double beta1 = 0.9;        // adamw, baoc
  double beta2 = 0.999;      // adamw, baoc
  double eps = 1e-8;         // adamw, baoc
};

// sgd: SGD with momentum; adamw: AdamW with fp32 states (BaocOptimizer in its fp32 format); baoc: the same until the
// BAOC's format plan (control/optimizer_state/baoc_controller.h) sets per-unit formats.
std::unique_ptr<Optimizer> optimizer_create(OptimizerKind kind,
                                            const std::vector<std::pair<std::string, at::Tensor>>& named_params,
                                            const OptimizerOptions& options);

}  // namespace triaccel
