// The memory planner in the training loop (docs/memory-planner.md): holds the run's cost model and plan, applies the
// plan's levers to the step engine (micro-batch, recompute, FP8 storage; the data placement is the loaders', fixed at
// the start),
// and plans again when the model changes:
//   - calibration: after each of the first steps that allocate (eager warm-up, the capture; not a session's first
//     step, whose optimizer state appears only at its end) the allocator's peak is one reading; a line through the
//     readings corrects the model's activation scale and its fixed bytes, and the plan is recomputed;
//   - Tri-Accel's precision decisions: units promoted to fp32 keep bigger activations (the model is rebuilt for
//     the new precisions and the plan recomputed);
//   - BAOC's format plan: the optimizer state shrinks after the warm-up (set_optimizer_freed); the model's optimizer
//     bytes follow, the plan is recomputed (the room goes to the activations) and its steps are measured anew;
//   - out of memory: a planning error. The scale grows by kOomScaleStep, the plan is recomputed, and the trainer
//     retries the same samples at the same batch; on a plan that stores units in FP8, FP8 storage is left as well
//     (fp8_give_up), and instead of the share's step after a capture that ran out of memory. Out of memory in the
//     warm-up step routed into the capture's pool (StepFailure::in_pool_warmup, agreed with the step) is the pool's,
//     not the model's: on_pool_out_of_memory takes the share's step as after a capture (reason "pool_oom",
//     "pool_oom_eager"), the scale kept;
//   - a CUDA-graph capture that ran out of memory (the graph's private pool beside the live tensors: the allocator
//     reserves more than it allocates): the share of the budget a plan may fill shrinks by kCaptureShareStep, the
//     plan is recomputed and the step captured again — a budget that fits must not leave the step eager. When the
//     smaller share leaves no plan (a budget near the floor), the graph is given up instead: eager steps at the
//     share that fits.
// Data parallelism (set_agree): each rank measures its own allocator, and every step the ranks agree on the worst
// reading (the largest peak; a capture that ran out of memory on any rank), so every rank's controller sees the same
// readings and, from the same model (memory_model_agree), makes the same plans: one micro-batch, one set of
// recomputed units, each rank's peak within the budget.
// Every plan is logged as a `memory_plan` event (reason, the levers, predicted and, where measured, measured peak).
// After calibration, steps that allocate under the current plan keep measuring it (plan_measured_peak_bytes).
#pragma once

#include "triaccel/control/controller.h"
#include "triaccel/control/memory/memory_planner.h"
#include "triaccel/train/step.h"

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace triaccel {

// Growth of the activation scale after an out-of-memory error, the least: with no reading of the failed attempt, or
// one under what the plan may fill (the pool's fragmentation, a consumer the model does not hold: the cap's margin
// went first, not the model's price).
constexpr double kOomScaleStep = 1.25;
// A failed attempt that allocated past what the plan may fill shows the model's error: the scale rises at least to
// the one at which the failed plan's prediction is kOomReadingMargin above that reading (what the refused
// allocation would have added is not read), at most by kOomScaleMaxStep. The blind step alone took EfficientNet-B0
// two to four errors in a row where the first one's reading asked for more (H100 grid at f33deac). A smaller step
// than the blind one, for a reading just past the prediction, ran out of memory again (H100 at 934576b: gpt-char
// amp-fp16 at 0.448 GB read just above its 385 MB prediction under a 448 MB cap and failed twice).
constexpr double kOomReadingMargin = 0.02;
constexpr double kOomScaleMaxStep = 2.0;
// Shrinking of the plan's share of the budget after a CUDA-graph capture ran out of memory, and its least value.
constexpr double kCaptureShareStep = 0.9;
constexpr double kCaptureShareMin = 0.5;
// Steps after the start whose measured peak calibrates the model (the warm-up's eager steps and the capture).
constexpr int64_t kCalibrationSteps = 5;
// Calibration fits measured = modelled base + offset + scale · modelled activations through the readings: both
// unknowns once the readings' activations differ by kCalibrationSpread, else the scale alone. Bounds of each.
constexpr double kCalibrationSpread = 1.25;
constexpr double kCalibrationMin = 0.2;
constexpr double kCalibrationMax = 5;
// One reading lowers the scale by this factor at most, and never below a scale that ran out of memory (after its
// kOomScaleStep): a reading from a plan that recomputes many units at a small micro-batch can come in far under its
// prediction, and a scale fitted to it lets the next, bolder plan run out of memory, again and again as the scale
// climbs back (measured: docs/results/memory-planner.md).
constexpr double kCalibrationDownStep = 0.8;
// After calibration: a plan whose own peak is off its prediction by more than this share has the scale refit on that
// reading, at most kRecalibrations times in a run.
constexpr double kPredictionTolerance = 0.05;
constexpr int64_t kRecalibrations = 3;
constexpr double kOffsetMin = -64e6;
constexpr double kOffsetMax = 256e6;

struct MemoryPlanLimits {
  int64_t batch = 0;
  int64_t budget_bytes = 0;        // what the plan may reach (the cap minus the allocator's margin)
  int64_t cap_bytes = 0;           // the vram_budget itself (0: none)
  double cap_share = 0.9;          // budget_bytes = cap_share · cap_bytes (when cap_bytes > 0)
  double initial_share = 0.9;      // cap_share before any capture shrank it
  PlanConstraints constraints;     // the user's levers; the placement is fixed once the loaders hold the data
  EpochSamples samples;            // one epoch's samples of this process (the events' predicted_epoch_s)
  // Tri-Accel without a budget: the limit is the peak the first plan's precisions predict (all 16-bit: AMP's), so
  // that a unit promoted to fp32 pays for its bigger activations with recompute or micro-batches instead of
  // raising the peak. Kept equal to that prediction at the scale the calibration steps measured (and an
  // out-of-memory error raised), not at a scale refit on a later plan's reading: a promoted plan that peaks above
  // its prediction would move the limit above the AMP peak the calibration measured, and the run's peak would follow
  // (measured: docs/results/memory-planner.md). When the corrected model leaves no plan under it, the plan at the
  // floor.
  bool limit_from_first_model = false;
};

class MemoryPlanController final : public StepController {
 public:
  using Rebuild = std::function<MemoryModel(const std::vector<Precision>& unit_precisions)>;

  // `model` and `plan` as planned before the loaders were built; `rebuild` traces the model again for new
  // precisions. Applies the plan to `step` and logs it (the first event comes from initial_event()).
  MemoryPlanController(MemoryModel model, MemoryPlan plan, MemoryPlanLimits limits, TrainStep& step, Rebuild rebuild);

  const char* state_key() const override { return "memory_plan"; }
  Events after_step(StepContext& ctx) override;
  Json state() const override;
  void restore(const Json& state) override;

  // The plan's event fields with this reason ("start", "calibrated", "precision", "oom").
  Json plan_fields(const std::string& reason) const;
  // After an out-of-memory error: a new plan with a larger activation scale (kOomScaleStep, or more from
  // `failed_peak_bytes`: the allocator's peak over the failed attempt, 0 when none was read, e.g. an injected error;
  // with several ranks, called on every rank alike: the largest rank's). UserError when none fits.
  Event on_out_of_memory(double failed_peak_bytes = 0);
  // After an out-of-memory error in a warm-up step routed into the capture's pool, on every rank that ran out
  // (StepOutcome::in_pool_warmup): a new plan at a smaller share of the budget, the scale kept.
  Event on_pool_out_of_memory();
  // Whether a plan would fit these unit precisions under the current limit and corrections (Tri-Accel asks before
  // promoting units, so that a promotion no plan can pay for is refused instead of ending the run).
  bool fits(const std::vector<Precision>& unit_precisions) const;

  // Data parallelism: each number's largest value over the ranks (Dist::all_reduce_max), called once after every
  // step on every rank. Unset: one process.
  using Agree = std::function<std::vector<double>(std::vector<double>)>;
  void set_agree(Agree max_over_ranks) { agree_ = std::move(max_over_ranks); }

  // Called when a step's capture ran out of memory, before the plan takes a smaller share of the budget: true when
  // it undid what made the step bigger (Tri-Accel: PrecisionController::revert_raise). The plan is then made for
  // the step as it is again and the step captures again, the share kept. Unset: the share shrinks.
  using Undo = std::function<bool()>;
  void set_capture_oom_undo(Undo undo) { capture_oom_undo_ = std::move(undo); }

  // Bytes of the optimizer consumer the run was planned with that its state no longer holds
  // (BaocController::state_bytes_freed), read after every step. When it changes, the model's optimizer bytes become
  // the first model's less it (with several ranks, the largest over the ranks) and the plan is made again: a
  // `memory_plan` event with reason "optimizer_state"; the step it was read after gives no reading (it ran with the
  // state before). Unset: the optimizer's bytes stay as planned.
  using OptimizerFreed = std::function<double()>;
  void set_optimizer_freed(OptimizerFreed freed) { optimizer_freed_ = std::move(freed); }

  const MemoryPlan& plan() const { return plan_; }
  // What a plan may reach now: the budget, or without one the first model's peak at the calibrated scale.
  int64_t limit_bytes() const;
  // The allocator's peak over the steps that allocated (eager, capturing; not replays, not a step beside a graph,
  // not one whose capture failed) while the current plan was in force; 0 before one did. What its prediction is
  // checked against.
  double plan_measured_peak_bytes() const { return plan_measured_peak_bytes_; }
  const MemoryModel& model() const { return model_; }

 private:
  void apply();
  // Adds a reading (the plan the step ran with, the allocator's peak) and refits the scale and the offset; true when
  // the fit came out under the scale the last out-of-memory error left (the scale is held there).
  bool calibrate(const MemoryPlan& ran, double measured);
  // The activation scale's growth after an out-of-memory error of the current plan whose attempt peaked at
  // `failed_peak` (kOomScaleStep and the reading's bounds above).
  double oom_scale_step(double failed_peak) const;
  // Plans again on the current model; UserError naming the floor when nothing fits.
  void replan();
  // after_step's parts, in the order it runs them.
  struct StepReading {
    bool capture_failed = false;
    double measured = 0;         // the allocator's peak over the step (0: no reading)
    double optimizer_bytes = 0;  // what the optimizer's state holds now, as the model prices it
  };
  StepReading step_reading(const StepContext& ctx);
  bool capture_oom_handle(Events& events);
  // The plan's share of the budget shrinks by kCaptureShareStep and the plan is made again (a pool's fragmentation,
  // not the model's error); when the smaller share leaves no plan, the graph is given up instead: eager steps at the
  // current share (`reason` + "_eager").
  Event share_shrink(const std::string& reason);
  // The optimizer's bytes changed (set_optimizer_freed): the model follows and the plan is made again; false when
  // they did not.
  bool optimizer_bytes_handle(double bytes, Events& events);
  // An out-of-memory error (of a step or of a capture) on a plan that stores units in FP8 the planner chose: the
  // lever's memory is the cost model's least sure term (its passes' allocations beside the kept tensors, the graph
  // pool's blocks), so the run plans without it from then on (the constraint set; the caller plans again, a step's
  // error with the scale raised as for any other). False when the plan had none or the user fixed
  // saved_activations.
  bool fp8_give_up();
  void calibrated_reading(const MemoryPlan& ran, double measured, Events& events);
  void calibration_reading(const MemoryPlan& ran, double measured, Events& events);
  // The model traced for these precisions with the corrections measured so far (activation scale, fixed offset).
  MemoryModel corrected_model(const std::vector<Precision>& unit_precisions) const;
  // The model plans are priced with (replan): the model, or at the limit's scale for a 16-bit step without a budget.
  MemoryModel priced_model() const;

  MemoryModel model_;
  MemoryModel first_model_;            // limit_from_first_model: the model the limit comes from
  MemoryPlan plan_;
  MemoryPlanLimits limits_;
  TrainStep& step_;
  Rebuild rebuild_;
  Agree agree_;
  Undo capture_oom_undo_;
  OptimizerFreed optimizer_freed_;
  double optimizer_start_bytes_;       // the first model's optimizer bytes
  std::vector<Precision> precisions_;  // the step's unit precisions the model was built for
  double limit_scale_;                 // limit_from_first_model: the activation scale the limit is priced at
  double oom_scale_ = 0;               // the scale after the last out-of-memory error: calibration stays above it
  double measured_peak_bytes_ = 0;     // the last calibration reading
  double plan_measured_peak_bytes_ = 0;  // plan_measured_peak_bytes()
  int64_t calibrations_ = 0;           // readings taken (eager or capturing steps; replays allocate nothing)
  int64_t recalibrations_ = 0;         // readings added after calibration (a plan off its prediction)
  std::vector<std::pair<double, double>> readings_;  // (modelled activations, measured − modelled base)
  double offset_ = 0;                  // fixed bytes the model missed (added to model_.fixed_bytes)
  bool seen_step_ = false;
  int64_t capture_ooms_seen_ = 0;      // the step graph's capture_ooms() when last looked at
};

}  // namespace triaccel
