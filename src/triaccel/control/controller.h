// One interface for every controller of the training loop: Tri-Accel's precision policy and curvature probe, the
// elastic batch, BAOC's format plan, the measurement window after an optimizer warm-up. The trainer holds a list of
// them and, after every optimizer step, calls each in order with the step's context; a controller reads its signals
// (gradient statistics, memory, time, what an earlier controller found this step), decides through its pure policy
// function, applies the decision to what it was built on (the step engine, the optimizer) or asks the trainer for a
// new batch size, and returns the events to log. Controllers never run a training step themselves.
#pragma once

#include "triaccel/control/batch/batch_policy.h"
#include "triaccel/core/device.h"
#include "triaccel/core/events.h"
#include "triaccel/core/json.h"

#include <cstdint>
#include <functional>
#include <vector>

namespace triaccel {

// The run's memory measurement, which the trainer owns: controllers that read or restart it go through this.
class MemoryMeter {
 public:
  virtual ~MemoryMeter() = default;
  // The allocator's statistics since the last window, which starts the next one (the run's peak keeps this
  // window's peak). All zero on the CPU.
  virtual MemoryStats window() = 0;
  // Starts the run's measured period anew: the peak so far is kept apart as the warm-up's.
  virtual void restart() = 0;
  // Bytes a transient beside the training steps (a curvature probe) may allocate on top of what the run holds now
  // and stay inside the run's memory plan (the memory planner's limit), or without a planner inside the training
  // steps' own peak so far; < 0: no limit known (the CPU, or no step measured yet).
  virtual double room_bytes() { return -1; }
  // Runs `fn` (such a transient) and returns the most it allocated above what was allocated when it began (0 on the
  // CPU). Its peak counts for the run's and the epoch's peak, not for the current window (the steps' readings).
  virtual double measure(const std::function<void()>& fn) {
    fn();
    return 0;
  }
};

struct StepContext {
  int64_t step = 0;    // optimizer steps done (the step just finished is number `step`)
  int64_t batch = 0;   // the batch size in use; a controller may set another (the trainer applies it after all ran)
  double now_s = 0;    // the run's clock (core/clock.h) after the step
  // Signals one controller leaves for the later ones in the same step: per-unit λ_max from a curvature probe run
  // this step (empty: none), which the precision policy reads.
  std::vector<double> unit_lambda_max;
  MemoryMeter* memory = nullptr;
  // Data parallelism: every rank gets rank 0's values (the same count on every rank). A controller whose decision
  // reads a per-rank measurement (a clock, a probe's timing) takes rank 0's through it, so that every rank decides
  // alike. Null with one process.
  std::function<std::vector<double>(std::vector<double>)> agree;
};

class StepController {
 public:
  virtual ~StepController() = default;

  // The key its state has in a checkpoint's progress record. Controllers that share a key (Tri-Accel's precision and
  // curvature) write disjoint fields of one object.
  virtual const char* state_key() const = 0;
  // Runs whatever is due after the step.
  virtual Events after_step(StepContext& ctx) = 0;
  // Training stops until the next after_step (evaluation, a checkpoint): that time is not training time.
  virtual void pause() {}
  // Seconds it spent outside the training steps so far (the curvature probe's), reported against training time.
  virtual double overhead_s() const { return 0; }
  virtual Json state() const { return Json::object(); }
  // From a checkpoint (the object under state_key(); fields this controller did not write are ignored).
  virtual void restore(const Json& state) {}
};

}  // namespace triaccel
