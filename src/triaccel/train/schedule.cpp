#include "triaccel/train/schedule.h"

#include "triaccel/core/errors.h"

#include <algorithm>
#include <cmath>

namespace triaccel {

void ScheduleOptions::validate() const {
  TRIACCEL_CHECK_INPUT(base_lr > 0 && std::isfinite(base_lr), option_ref("lr"), " must be a positive number, got ", base_lr);
  TRIACCEL_CHECK_INPUT(total_steps > 0, "schedule: total_steps must be > 0, got ", total_steps);
  TRIACCEL_CHECK_INPUT(warmup_steps >= 0 && warmup_steps <= total_steps,
                       "schedule: warm-up steps (", warmup_steps, ") must be in [0, total steps = ", total_steps,
                       "]; lower ", option_ref("warmup_epochs"));
  TRIACCEL_CHECK_INPUT(min_lr_ratio >= 0 && min_lr_ratio <= 1, "schedule: min_lr_ratio must be in [0, 1]");
}

double schedule_lr(const ScheduleOptions& o, double step) {
  step = std::max(step, 0.0);
  const auto warmup = static_cast<double>(o.warmup_steps);
  if (step < warmup) return o.base_lr * (step + 1.0) / warmup;
  const int64_t decay_steps = o.total_steps - o.warmup_steps;
  if (decay_steps <= 0) return o.base_lr;
  const double t = std::min(1.0, (step - warmup) / static_cast<double>(decay_steps));
  const double shape = o.decay == LrDecay::kLinear ? 1.0 - t : 0.5 * (1.0 + std::cos(M_PI * t));
  return o.base_lr * (o.min_lr_ratio + (1.0 - o.min_lr_ratio) * shape);
}

}  // namespace triaccel
