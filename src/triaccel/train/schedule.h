// Learning-rate schedule: linear warm-up from lr/warmup_steps to lr over warmup_steps, then cosine (or linear) decay
// to min_lr_ratio·lr at total_steps. A pure function of the step, so a resumed run gets the same rate.
#pragma once

#include "triaccel/core/enum_names.h"

#include <cstdint>

namespace triaccel {

// The `lr_decay` option.
enum class LrDecay { kCosine, kLinear };

template <>
struct EnumNames<LrDecay> {
  static constexpr EnumName<LrDecay> kNames[] = {{LrDecay::kCosine, "cosine"}, {LrDecay::kLinear, "linear"}};
};

struct ScheduleOptions {
  double base_lr = 0.1;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  double min_lr_ratio = 0.0;
  LrDecay decay = LrDecay::kCosine;  // after the warm-up: half a cosine, or a straight line

  void validate() const;
};

// The learning rate for optimizer step `step` (0-based). Steps past total_steps keep the final rate. The step may be
// fractional: when the batch size changes during a run the trainer passes the position in units of the initial
// batch (samples seen / initial batch), so the schedule still ends where the data does.
double schedule_lr(const ScheduleOptions& options, double step);

}  // namespace triaccel
