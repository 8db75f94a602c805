// Tri-Accel memory-elastic batch controller (paper §3.3): grows the batch while measured peak allocation stays under
// ρ_low·budget and shrinks it above ρ_high·budget; an out-of-memory step is retried on the same samples at a smaller
// batch. A pure controller: the current batch and the memory signal in, the decision out; the trainer applies it.
//
//   B ← B + δ↑  if peak < ρ_low · budget  (and the predicted peak at B + δ↑ stays ≤ ρ_high · budget)
//   B ← B − δ↓  if peak > ρ_high · budget
//
// The prediction uses the linear model peak(B) = static + B · per_sample, with per_sample from this window's
// measurement, so growth never plans past ρ_high. Batch sizes are multiples of `bucket` (CUDA graphs are captured
// per batch size, so sizes are bucketed to keep captures rare). The learning rate follows the batch by `lr_rule`:
// linear (η ∝ B), sqrt (η ∝ √B) or none, relative to the batch the run started with.
#pragma once

#include "triaccel/core/enum_names.h"

#include <cstdint>
#include <string>

namespace triaccel {

// The `lr_batch_rule` option.
enum class LrBatchRule { kNone, kLinear, kSqrt };

template <>
struct EnumNames<LrBatchRule> {
  static constexpr EnumName<LrBatchRule> kNames[] = {
      {LrBatchRule::kNone, "none"}, {LrBatchRule::kLinear, "linear"}, {LrBatchRule::kSqrt, "sqrt"}};
};

struct BatchPolicyOptions {
  int64_t budget_bytes = 0;   // VRAM budget (allocator peak allocated bytes)
  double rho_low = 0.70;
  double rho_high = 0.90;
  int64_t delta_up = 32;
  int64_t delta_down = 32;
  int64_t bucket = 16;
  int64_t min_batch = 16;
  int64_t max_batch = 4096;
  LrBatchRule lr_rule = LrBatchRule::kSqrt;

  void validate() const;
};

struct MemorySignal {
  int64_t peak_bytes = 0;    // allocator peak allocated bytes over the window
  int64_t static_bytes = 0;  // allocated bytes that do not scale with the batch (weights, optimizer, dataset)
};

struct BatchDecision {
  int64_t batch = 0;
  bool changed = false;
  std::string reason;        // "grow", "shrink", "hold", "hold: growth would pass rho_high", "oom"
  double predicted_peak_bytes = 0;
};

BatchDecision batch_policy_step(const BatchPolicyOptions& options, int64_t batch, const MemorySignal& memory);

// After an out-of-memory error at `batch`: the next smaller size to retry the same samples with (halved, bucketed,
// at least min_batch). Throws UserError when batch is already min_batch: the budget is below the model's minimum.
int64_t batch_after_oom(const BatchPolicyOptions& options, int64_t batch);

// Learning-rate multiplier for `batch` relative to `base_batch` under the rule.
double lr_scale_for_batch(LrBatchRule rule, int64_t batch, int64_t base_batch);

// Rounds down to a multiple of the bucket, clamped to [min_batch, max_batch].
int64_t batch_bucket(const BatchPolicyOptions& options, int64_t batch);

}  // namespace triaccel
