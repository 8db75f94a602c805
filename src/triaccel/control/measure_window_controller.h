// The measured period of an AdamW or BAOC run starts after the optimizer's warm-up (docs/baoc.md): both run fp32
// AdamW for plan_warmup steps (BAOC gathers its statistics there), so the peak of those steps is kept apart and the
// run's peak covers the steps after it, where BAOC runs its plan. At that step the captured graph is dropped too, so
// the peak after the restart holds a whole eager step's activations for both: replays of a graph captured before it
// would allocate nothing and show only the static bytes.
#pragma once

#include "triaccel/control/controller.h"
#include "triaccel/train/step.h"

namespace triaccel {

class MeasureWindowController final : public StepController {
 public:
  MeasureWindowController(int64_t restart_after_step, TrainStep& step) : at_(restart_after_step), step_(step) {}

  const char* state_key() const override { return "measure"; }
  Events after_step(StepContext& ctx) override {
    if (ctx.step == at_) {
      ctx.memory->restart();
      step_.invalidate_graph();
    }
    return {};
  }

 private:
  int64_t at_;
  TrainStep& step_;
};

}  // namespace triaccel
