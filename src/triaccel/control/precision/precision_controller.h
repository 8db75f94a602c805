// Tri-Accel's precision component (paper §3.1; docs/tri-accel.md), as a StepController: every ctrl_every steps the
// per-unit gradient variance the step accumulated (train/grad_stats.h) and any λ_max a curvature probe left in the
// context this step go into the pure policy (control/precision/precision_policy.h); its decision becomes the step's
// per-unit autocast precision. Memory: with a memory check (the memory planner's, set by the trainer whenever it
// plans), a decision that raises units' precision is applied only if a plan fits it; otherwise those units stay where
// they were; under a --vram-budget a promotion by curvature is not asked for (its price was wrong whenever measured).
// The event says why each unit is where it is: "calibrating", "low variance" (fp16), "variance" (bf16), "high variance"
// (fp32), "curvature" (promoted by λ_max), "memory" (a promotion no plan could pay for). A promotion the check let
// through whose step then ran out of memory is put back by the trainer (revert_raise) instead of the plan shrinking for
// it.
#pragma once

#include "triaccel/control/controller.h"
#include "triaccel/control/precision/precision_policy.h"
#include "triaccel/models/model.h"
#include "triaccel/optim/optimizer.h"
#include "triaccel/train/step.h"

#include <functional>
#include <string>
#include <vector>

namespace triaccel {

// Whether a plan fits these unit precisions (the memory planner's answer).
using PrecisionMemoryCheck = std::function<bool(const std::vector<Precision>&)>;

// Why the policy put unit u where it is (the reasons above, except "memory", which only the controller knows).
std::string precision_reason(const PrecisionState& state, size_t u);

class PrecisionController final : public StepController {
 public:
  PrecisionController(PrecisionPolicyOptions policy, int64_t ctrl_every, const Model& model, Optimizer& optimizer,
                      TrainStep& step, const c10::Device& device);

  const char* state_key() const override { return "tri_accel"; }
  Events after_step(StepContext& ctx) override;
  Json state() const override;
  void restore(const Json& state) override;

  // `hold_curvature`: promotions by curvature are not asked for, held where they were (a --vram-budget's plan).
  void set_memory_check(PrecisionMemoryCheck fits, bool hold_curvature = false) {
    fits_ = std::move(fits);
    hold_curvature_ = hold_curvature;
  }
  // The last window's raise, after a step at it ran out of memory under a plan that priced it (the trainer calls this
  // before re-planning): the raised units go back where they were, the decision counts as refused (not tried again;
  // the next event names them "memory" when the policy asks for it again). The plan in force before the raise ran,
  // so keeping it is the cheaper answer: re-planning for curvature promotions that did not fit left the run in
  // micro-batches for epochs (measured: docs/results/memory-planner.md). False when the last window raised nothing
  // or it was put back already.
  bool revert_raise();

 private:
  // The policy's decision with the raised units the memory check refuses, and with hold_curvature_ those promoted by
  // curvature, put back where they were (marked in memory_refused_). A decision refused once is refused again
  // without asking (the check traces the model).
  std::vector<Precision> affordable(const std::vector<Precision>& before, const std::vector<Precision>& wanted);

  PrecisionPolicyOptions policy_;
  int64_t ctrl_every_;
  const Model& model_;
  TrainStep& step_;
  c10::Device device_;
  PrecisionState state_;
  PrecisionMemoryCheck fits_;
  bool hold_curvature_ = false;
  std::vector<bool> memory_refused_;              // per unit: held below the policy's decision for memory
  std::vector<std::vector<Precision>> refused_;   // decisions the check refused, or revert_raise put back
  std::vector<Precision> raised_from_;            // the last window raised units from these (empty: it did not)
};

}  // namespace triaccel
