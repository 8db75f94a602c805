#include "triaccel/control/batch/batch_policy.h"

#include "triaccel/core/errors.h"

#include <algorithm>
#include <cmath>

namespace triaccel {

void BatchPolicyOptions::validate() const {
  TRIACCEL_CHECK_INPUT(budget_bytes > 0, option_ref("vram_budget") + " must be > 0");
  TRIACCEL_CHECK_INPUT(rho_low > 0 && rho_low < rho_high && rho_high <= 1,
                       "batch controller: need 0 < rho_low < rho_high <= 1, got ", rho_low, ", ", rho_high);
  TRIACCEL_CHECK_INPUT(delta_up > 0 && delta_down > 0, "batch controller: batch steps must be > 0");
  TRIACCEL_CHECK_INPUT(bucket > 0, "batch controller: bucket must be > 0");
  TRIACCEL_CHECK_INPUT(min_batch > 0 && min_batch <= max_batch, "batch controller: need 0 < min_batch <= max_batch");
}

int64_t batch_bucket(const BatchPolicyOptions& o, int64_t batch) {
  const int64_t rounded = (batch / o.bucket) * o.bucket;
  return std::clamp(rounded, o.min_batch, o.max_batch);
}

BatchDecision batch_policy_step(const BatchPolicyOptions& o, int64_t batch, const MemorySignal& m) {
  BatchDecision d;
  d.batch = batch;
  const double budget = static_cast<double>(o.budget_bytes);
  const double peak = static_cast<double>(m.peak_bytes);
  const double per_sample = std::max(0.0, (peak - static_cast<double>(m.static_bytes)) / static_cast<double>(batch));
  if (peak > o.rho_high * budget) {
    d.batch = batch_bucket(o, batch - o.delta_down);
    d.reason = "shrink";
  } else if (peak < o.rho_low * budget) {
    const int64_t grown = batch_bucket(o, batch + o.delta_up);
    d.predicted_peak_bytes = static_cast<double>(m.static_bytes) + per_sample * static_cast<double>(grown);
    if (d.predicted_peak_bytes <= o.rho_high * budget) {
      d.batch = grown;
      d.reason = "grow";
    } else {
      d.reason = "hold: growth would pass rho_high";
    }
  } else {
    d.reason = "hold";
  }
  d.changed = d.batch != batch;
  if (!d.changed && d.reason == "grow") d.reason = "hold: at max_batch";
  if (!d.changed && d.reason == "shrink") d.reason = "hold: at min_batch";
  return d;
}

int64_t batch_after_oom(const BatchPolicyOptions& o, int64_t batch) {
  TRIACCEL_CHECK_INPUT(batch > o.min_batch, "out of memory at batch ", batch, ", the smallest allowed (", o.min_batch,
                       "): the " + option_ref("vram_budget") + " is below what this model needs; raise it or choose a smaller model");
  return std::min(batch - 1, batch_bucket(o, batch / 2));
}

double lr_scale_for_batch(LrBatchRule rule, int64_t batch, int64_t base_batch) {
  const double r = static_cast<double>(batch) / static_cast<double>(base_batch);
  switch (rule) {
    case LrBatchRule::kNone: return 1.0;
    case LrBatchRule::kLinear: return r;
    case LrBatchRule::kSqrt: return std::sqrt(r);
  }
  return 1.0;
}

}  // namespace triaccel
