// Tri-Accel's precision component (paper §3.1; docs/tri-accel.md), as a StepController: every ctrl_every steps the
// per-unit gradient variance the step accumulated (train/grad_stats.h) and any λ_max a curvature probe left in the
// context this step go into the pure policy (control/precision_policy.h); its decision becomes the step's per-unit
// autocast precision.
#pragma once

#include "triaccel/control/controller.h"
#include "triaccel/control/precision_policy.h"
#include "triaccel/models/model.h"
#include "triaccel/optim/optimizer.h"
#include "triaccel/train/step.h"

namespace triaccel {

class PrecisionController final : public StepController {
 public:
  PrecisionController(PrecisionPolicyOptions policy, int64_t ctrl_every, const Model& model, Optimizer& optimizer,
                      TrainStep& step, const c10::Device& device);

  const char* state_key() const override { return "tri_accel"; }
  Events after_step(StepContext& ctx) override;
  Json state() const override;
  void restore(const Json& state) override;

 private:
  PrecisionPolicyOptions policy_;
  int64_t ctrl_every_;
  const Model& model_;
  TrainStep& step_;
  c10::Device device_;
  PrecisionState state_;
};

}  // namespace triaccel
