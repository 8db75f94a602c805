#include "triaccel/control/batch/elastic_batch_controller.h"
#include "triaccel/core/bytes.h"

#include <algorithm>

namespace triaccel {

ElasticBatchController::ElasticBatchController(const BatchPolicyOptions& rules, int64_t ctrl_every,
                                               int64_t base_batch,
                                               std::function<MemorySignal(int64_t, int64_t)> signal_override)
    : rules_(rules), ctrl_every_(ctrl_every), base_batch_(base_batch), signal_override_(std::move(signal_override)) {}

Events ElasticBatchController::after_step(StepContext& ctx) {
  Events events;
  if (ctx.step % ctrl_every_ != 0) return events;
  MemorySignal signal;
  double reserved_gb = 0;
  if (signal_override_) {
    signal = signal_override_(ctx.step, ctx.batch);
  } else {
    const MemoryStats m = ctx.memory->window();
    int64_t& seen = peak_at_batch_[ctx.batch];
    seen = std::max(seen, m.peak_allocated_bytes);
    signal.peak_bytes = seen;
    signal.static_bytes = m.allocated_bytes;
    reserved_gb = static_cast<double>(m.reserved_bytes) / kGB;
  }
  const int64_t before = ctx.batch;
  const BatchDecision d = batch_policy_step(rules_, before, signal);
  if (d.changed) ctx.batch = d.batch;
  events.push_back({event::kBatch, Json{{"batch", ctx.batch},
                                        {"previous", before},
                                        {"changed", d.changed},
                                        {"reason", d.reason},
                                        {"peak_gb", static_cast<double>(signal.peak_bytes) / kGB},
                                        {"static_gb", static_cast<double>(signal.static_bytes) / kGB},
                                        {"predicted_peak_gb", d.predicted_peak_bytes / kGB},
                                        {"reserved_gb", reserved_gb},
                                        {"budget_gb", static_cast<double>(rules_.budget_bytes) / kGB},
                                        {"lr_scale", lr_scale_for_batch(rules_.lr_rule, ctx.batch, base_batch_)}}});
  return events;
}

}  // namespace triaccel
