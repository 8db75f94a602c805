// The clock every time-dependent decision reads (the curvature probe's time budget, BAOC's and the memory planner's
// time models) and every measured period (epoch times, events' time_s). Injectable: tests pass a clock that advances a
// fixed amount per reading, so a decision that depends on time depends only on the work done, not on how loaded the
// machine is.
#pragma once

namespace triaccel {

class Clock {
 public:
  virtual ~Clock() = default;
  // Seconds since an arbitrary fixed origin; never decreases.
  virtual double now_s() const = 0;
};

// The process's steady clock (seconds since its first reading; core/io.h time_since_start_s).
const Clock& steady_clock();

// A clock for tests: each reading returns the previous one plus `step_s`.
class FixedStepClock : public Clock {
 public:
  explicit FixedStepClock(double step_s) : step_s_(step_s) {}
  double now_s() const override { return t_ += step_s_; }

 private:
  double step_s_;
  mutable double t_ = 0;
};

}  // namespace triaccel
