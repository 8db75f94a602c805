// Tri-Accel's memory-elastic batch (paper §3.3) as a StepController: at the end of every control window the
// window's memory signal goes into the pure rule (control/batch/batch_policy.h) and its decision becomes the batch the
// trainer uses from the next step (the trainer keeps every sample of the epoch; the lr follows the batch by the
// rule). The memory signal is the allocator's peak over the window; a window of CUDA-graph replays allocates nothing,
// so the highest peak measured while the batch size last ran eagerly stands in.
#pragma once

#include "triaccel/control/batch/batch_policy.h"
#include "triaccel/control/controller.h"

#include <cstdint>
#include <functional>
#include <map>

namespace triaccel {

class ElasticBatchController final : public StepController {
 public:
  // rules: shared with the trainer, whose out-of-memory retries lower rules.max_batch (the batch never grows back to
  // a size that ran out of memory). signal_override: tests (the CPU has no allocator statistics), else empty.
  ElasticBatchController(const BatchPolicyOptions& rules, int64_t ctrl_every, int64_t base_batch,
                         std::function<MemorySignal(int64_t step, int64_t batch)> signal_override);

  const char* state_key() const override { return "batch"; }
  Events after_step(StepContext& ctx) override;

 private:
  const BatchPolicyOptions& rules_;
  int64_t ctrl_every_;
  int64_t base_batch_;
  std::function<MemorySignal(int64_t, int64_t)> signal_override_;
  std::map<int64_t, int64_t> peak_at_batch_;  // the highest window peak measured at each batch size
};

}  // namespace triaccel
