// One training step with its out-of-memory recovery, the part every method shares (the backprop trainer's
// step_with_recovery, NeuroFlux's BlockTrainer::step_at): the step's body in a try; a c10::OutOfMemoryError caught
// with the allocator's reading at the failure and what the method makes of it (StepFailure); with several ranks, the
// failed rank's part of the step's collectives (so that every rank's update is skipped) and every rank's outcome
// agreed (step_agreement.h) in the round trip of the stop request. The method acts on the StepOutcome: what it retries
// with (the same batch after releasing the CUDA graph, a new plan, a smaller batch) is its own; a step that ran out
// after its update had begun, or that no batch fits, ends every rank with the oom event and one line (stop()).
#pragma once

#include "triaccel/core/json.h"
#include "triaccel/run/session.h"

#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>

namespace triaccel {

// The allocator at an out-of-memory error, and the error's first line (what was asked for, what was free).
struct OomReading {
  double allocated_gb = 0;
  double reserved_gb = 0;
  std::string error;

  Json fields() const;  // {allocated_gb, reserved_gb, error}: an oom event's first fields
};
OomReading oom_reading(const c10::OutOfMemoryError& e, const c10::Device& device);

// What the method makes of its step's out-of-memory error on this rank, at the error.
struct StepFailure {
  bool beside_pool = false;  // an eager step beside the captured graph's pool ran out (not the memory plan's error)
  int64_t batch = 0;         // the batch this rank proposes for the retry (0: none fits, or the method takes none)
  // A warm-up step routed into the capture's pool ran out (StepGraph::ran_out_in_pool): the pool's blocks cut for
  // other sizes, not the memory plan's model.
  bool in_pool_warmup = false;
};

// One step as the method hands it to StepRecovery::run.
struct RecoverableStep {
  std::function<void()> body;  // the step; an out-of-memory error in it is caught
  // On this rank, after the reading and before any collective: what the error means to the method.
  std::function<StepFailure()> failure;
  // Data parallel, on a rank whose step ran out: its part of the step's collectives, so that every rank's update is
  // skipped; false when its update had begun (every rank must stop).
  std::function<bool()> failed_collectives;
};

// How a step ended: on this rank in one process; as every rank agreed with several.
struct StepOutcome {
  bool out_of_memory = false;  // here, or on some rank: nothing trained, the method retries the samples (or stops)
  bool must_stop = false;      // a rank ran out after its update had begun: the ranks' weights may differ
  bool beside_pool = false;    // a rank ran out beside the captured graph's pool
  bool in_pool_warmup = false;  // a rank ran out in a warm-up step routed into the capture's pool
  int64_t batch = 0;           // the smallest batch a rank that ran out proposes
  std::optional<OomReading> own;  // this rank's reading, when its step ran out
  Json ranks;       // data parallel: the ranks that ran out, as the oom event lists them (null: one process)
  std::string who;  // data parallel: the same ranks as a line names them ("rank 1 of 2")
};

class StepRecovery {
 public:
  explicit StepRecovery(Session& session) : session_(session) {}

  // Runs `step`; with several ranks, agrees its outcome after step `count` (the step the caller is about to count).
  StepOutcome run(int64_t count, const RecoverableStep& step);
  // Data parallel: the stop request and whether a checkpoint is due after the last step, agreed with it; empty in one
  // process and after a step that ran out of memory (a stop or a checkpoint waits for a step that ran).
  const std::optional<std::pair<StopRequest, bool>>& agreed() const { return agreed_; }
  // Ends the run, called on every rank alike: the oom event of `fields` with action "stopped" at `step` (rank 0
  // writes it), then a UserError of `message`.
  [[noreturn]] void stop(int64_t step, Json fields, const std::string& message);

 private:
  Session& session_;
  std::optional<std::pair<StopRequest, bool>> agreed_;
};

}  // namespace triaccel
