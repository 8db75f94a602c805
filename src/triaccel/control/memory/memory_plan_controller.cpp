#include "triaccel/control/memory/memory_plan_controller.h"

#include "triaccel/core/errors.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

namespace triaccel {
namespace {

// The part of a plan's price its activation scale sets (the price is linear in the scale: this is scale · x).
double scaled_activation_bytes(MemoryModel m, const MemoryPlan& p) {
  const double all = memory_plan_peak(m, p);
  m.activation_scale = 0;
  return all - memory_plan_peak(m, p);
}

}  // namespace

MemoryPlanController::MemoryPlanController(MemoryModel model, MemoryPlan plan, MemoryPlanLimits limits,
                                           TrainStep& step, Rebuild rebuild)
    : model_(std::move(model)),
      first_model_(model_),
      plan_(std::move(plan)),
      limits_(std::move(limits)),
      step_(step),
      rebuild_(std::move(rebuild)),
      optimizer_start_bytes_(model_.optimizer_bytes),
      precisions_(step.unit_precisions()),
      limit_scale_(model_.activation_scale) {
  limits_.constraints.placement_fixed = true;  // the loaders hold the data where the first plan put it
  limits_.constraints.placement = plan_.data_placement;
  apply();
}

void MemoryPlanController::apply() {
  step_.set_micro_batch(plan_.micro_batch < plan_.batch ? plan_.micro_batch : 0);
  step_.set_recompute(plan_.recompute);
  step_.set_fp8_saved(plan_.fp8_saved);
  step_.set_update_in_backward(plan_.update_in_backward);
  step_.graph_allow();  // the step's memory changed: a size refused before may fit now (a disabled graph stays off)
}

int64_t MemoryPlanController::limit_bytes() const {
  if (!limits_.limit_from_first_model) return limits_.budget_bytes;
  MemoryModel first = first_model_;
  first.activation_scale = limit_scale_;
  const std::vector<bool> none(first.units.size(), false);
  return static_cast<int64_t>(
      std::ceil(memory_plan_peak(first, limits_.batch, limits_.batch, none, limits_.constraints.placement)));
}

MemoryModel MemoryPlanController::corrected_model(const std::vector<Precision>& unit_precisions) const {
  MemoryModel m = rebuild_(unit_precisions);
  m.activation_scale = model_.activation_scale;
  m.fixed_bytes += offset_;
  m.optimizer_bytes = model_.optimizer_bytes;  // the state as it is now (a format plan's), not as first priced
  return m;
}

bool MemoryPlanController::fits(const std::vector<Precision>& unit_precisions) const {
  try {
    return memory_plan_solve(corrected_model(unit_precisions), limits_.batch, limit_bytes(), limits_.constraints)
        .feasible;
  } catch (const c10::OutOfMemoryError&) {
    return false;  // not even the trace of the promoted model fit beside the run: no room to pay for it
  }
}

MemoryModel MemoryPlanController::priced_model() const {
  // No budget and no unit in fp32: a 16-bit step, priced at the scale the 16-bit calibration steps measured (the
  // limit's), not at one a promoted plan's reading refit the model to. At that scale the units back in 16 bits come
  // out above the limit and stay recomputed for the rest of the run, every step slower for no memory saved. A 16-bit
  // mix still pays for its casts between fp16 and bf16 units (the rebuilt model prices them): without that, the peak
  // rises above AMP bf16's (measured: docs/results/memory-planner.md).
  const bool step16 = limits_.limit_from_first_model &&
                      std::none_of(precisions_.begin(), precisions_.end(),
                                   [](Precision p) { return p == Precision::kFP32; });
  MemoryModel priced = model_;
  if (step16) priced.activation_scale = limit_scale_;
  return priced;
}

void MemoryPlanController::replan() {
  if (limits_.limit_from_first_model) limits_.budget_bytes = limit_bytes();
  const MemoryModel priced = priced_model();
  MemoryPlan next = memory_plan_solve(priced, limits_.batch, limits_.budget_bytes, limits_.constraints);
  if (!next.feasible && limits_.cap_bytes > 0 && limits_.cap_share < limits_.initial_share) {
    // Captures shrank the share and a correction now leaves no plan: give the share back, give the graph up.
    limits_.cap_share = limits_.initial_share;
    limits_.budget_bytes = static_cast<int64_t>(limits_.cap_share * static_cast<double>(limits_.cap_bytes));
    step_.graph_disable();
    next = memory_plan_solve(model_, limits_.batch, limits_.budget_bytes, limits_.constraints);
  }
  if (!next.feasible && limits_.limit_from_first_model) {
    // No budget, only AMP's peak as the limit (a model corrected past it): the plan at the floor, the nearest to it.
    next = memory_plan_solve(priced, limits_.batch, static_cast<int64_t>(std::ceil(next.floor_bytes)),
                             limits_.constraints);
  }
  TRIACCEL_CHECK_INPUT(next.feasible, "no way to train batch ", limits_.batch, " within ", option_ref("vram_budget"),
                       ": after measuring, the run needs at least ", static_cast<int64_t>(std::ceil(next.floor_bytes)),
                       " bytes (", next.floor_bytes / 1e9, " GB) of the ", limits_.budget_bytes,
                       " it may plan with; raise ", option_ref("vram_budget"), " or use ", option_ref("method"),
                       " neuroflux");
  if (!(next == plan_)) plan_measured_peak_bytes_ = 0;  // a new plan: nothing measured of it yet
  plan_ = std::move(next);
  apply();
}

Json MemoryPlanController::plan_fields(const std::string& reason) const {
  Json f = plan_.to_json(model_);
  f["reason"] = reason;
  f["method"] = "backprop";
  f["predicted_epoch_s"] =
      limits_.samples.train > 0 && plan_.feasible ? Json(memory_plan_epoch_s(model_, plan_, limits_.samples)) : Json();
  f["budget_bytes"] = limits_.cap_bytes > 0 ? Json(limits_.cap_bytes) : Json();
  f["cap_share"] = limits_.cap_share;
  f["fixed_offset_bytes"] = offset_;
  f["graph_captures"] = step_.graph().captures();
  f["graph_capture_ooms"] = step_.graph().capture_ooms();
  f["measured_peak_bytes"] = measured_peak_bytes_ > 0 ? Json(static_cast<int64_t>(measured_peak_bytes_)) : Json();
  f["plan_measured_peak_bytes"] =
      plan_measured_peak_bytes_ > 0 ? Json(static_cast<int64_t>(plan_measured_peak_bytes_)) : Json();
  return f;
}

// This rank's observations of the step that just ran (with several ranks, the worst rank's, so that every rank
// decides alike): whether a capture ran out of memory, and the allocator's peak over an eager or capturing step (a
// replay allocates nothing: its window shows only the live tensors). An eager step beside a captured graph (an
// epoch's short last batch) reads the graph's pool as well: no reading (0).
MemoryPlanController::StepReading MemoryPlanController::step_reading(const StepContext& ctx) {
  const int64_t capture_ooms = step_.graph().capture_ooms();
  bool capture_failed = capture_ooms > capture_ooms_seen_;
  capture_ooms_seen_ = capture_ooms;
  const StepGraph::Ran ran_as = step_.graph().last_ran();
  const bool allocated = ran_as != StepGraph::Ran::kReplayed;
  const bool beside_graph = ran_as == StepGraph::Ran::kEager && step_.graph().captured();
  double measured = 0;
  if (ctx.memory != nullptr && allocated && !beside_graph) {
    measured = static_cast<double>(ctx.memory->window().peak_allocated_bytes);
  }
  double optimizer = optimizer_freed_ ? optimizer_start_bytes_ - optimizer_freed_() : model_.optimizer_bytes;
  if (agree_) {
    const std::vector<double> worst = agree_({capture_failed ? 1.0 : 0.0, measured, optimizer});
    capture_failed = worst.at(0) > 0;
    measured = worst.at(1);
    optimizer = worst.at(2);
  }
  return {capture_failed, measured, optimizer};
}

bool MemoryPlanController::optimizer_bytes_handle(double bytes, Events& events) {
  if (std::abs(bytes - model_.optimizer_bytes) < 1) return false;
  // What the plan's own steps read below the model's price for it (a scale an out-of-memory error floored, fixed
  // bytes fit to other plans' readings): the new plan is priced as the model's difference from that reading. The
  // gap is taken in full where the new plan keeps at least the old one's activations and in their proportion where
  // it keeps fewer, so that a plan keeping less is not priced below what it can read. The plan chosen is the
  // model's, as before; only its prediction is corrected. Measured (H100 grid at 7b857ba): gpt-char BAOC amp-bf16 at
  // 1.253 GB read 876 MB under a 964 MB price, and the plan after the format plan, priced 1,071 MB, read 971.
  const MemoryPlan before = plan_;
  const MemoryModel priced = priced_model();
  const double over =
      plan_measured_peak_bytes_ > 0 ? memory_plan_peak(priced, before) - plan_measured_peak_bytes_ : 0.0;
  const double before_activations = scaled_activation_bytes(priced, before);
  model_.optimizer_bytes = bytes;
  replan();
  if (over > 0 && before_activations > 0) {
    const double share = std::min(1.0, scaled_activation_bytes(priced_model(), plan_) / before_activations);
    plan_.predicted_peak_bytes -= over * share;
  }
  plan_measured_peak_bytes_ = 0;  // its steps hold another state: what the prediction is checked against starts anew
  events.push_back({event::kMemoryPlan, plan_fields("optimizer_state")});
  return true;
}

// A capture that ran out of memory; true when the step is done with (no calibration reading).
bool MemoryPlanController::capture_oom_handle(Events& events) {
  // A capture that ran out of memory right after a precision raise: the raise is put back (refused) and the plan for
  // the precisions before it stands, instead of a smaller share of the budget for every later plan (the limit would
  // shrink for a raise whose cost the later plans then pay anyway).
  if (capture_oom_undo_ && capture_oom_undo_()) {
    precisions_ = step_.unit_precisions();
    model_ = corrected_model(precisions_);
    replan();
    step_.graph_allow();
    events.push_back({event::kMemoryPlan, plan_fields("capture_oom_undone")});
    return true;  // a failed capture's peak is no calibration reading
  }
  if (fp8_give_up()) {
    replan();
    step_.graph_allow();
    events.push_back({event::kMemoryPlan, plan_fields("capture_oom_fp8_off")});
    return false;
  }
  // A capture that ran out of memory: the plan may fill less of the budget; the step captures again.
  if (limits_.cap_bytes > 0) events.push_back(share_shrink("capture_oom"));  // a disabled graph captures no more
  return false;
}

Event MemoryPlanController::share_shrink(const std::string& reason) {
  const double share = limits_.cap_share * kCaptureShareStep;
  const auto bytes = static_cast<int64_t>(share * static_cast<double>(limits_.cap_bytes));
  if (share >= kCaptureShareMin && memory_plan_solve(model_, limits_.batch, bytes, limits_.constraints).feasible) {
    limits_.cap_share = share;
    limits_.budget_bytes = bytes;
    replan();
    step_.graph_allow();
    return {event::kMemoryPlan, plan_fields(reason)};
  }
  step_.graph_disable();
  return {event::kMemoryPlan, plan_fields(reason + "_eager")};
}

// A reading once calibrated: the steps that allocate under the plan measure it; a reading off the prediction by more
// than kPredictionTolerance corrects the prediction (below it) or refits the scale on it alone (above it).
void MemoryPlanController::calibrated_reading(const MemoryPlan& ran, double measured, Events& events) {
  if (!(ran == plan_)) return;
  plan_measured_peak_bytes_ = std::max(plan_measured_peak_bytes_, measured);
  // A plan chosen after calibration may recompute units the readings never did (the cost model's recompute term
  // is the least sure: such a plan can peak well under its prediction). When its own reading is off by more than
  // kPredictionTolerance: above it (a few times at most), the scale is refit on it alone; below it, only this plan's
  // prediction is corrected. A scale refit down on a recompute plan's low reading under-predicts the plans without
  // recompute after it, which then peak above their predictions (measured: docs/results/memory-planner.md).
  const double predicted = plan_.predicted_peak_bytes;
  if (predicted <= 0 || std::abs(measured - predicted) <= kPredictionTolerance * predicted) return;
  if (measured < predicted) {
    plan_.predicted_peak_bytes = measured;
    events.push_back({event::kMemoryPlan, plan_fields("remeasured")});
    return;
  }
  if (recalibrations_ >= kRecalibrations) return;
  ++recalibrations_;
  measured_peak_bytes_ = measured;
  // The scale refit on this plan's reading alone, the fixed bytes kept: the line through the earlier plans'
  // readings is what missed it.
  readings_.clear();
  calibrate(ran, measured);
  // The plan stays while it still fits: a plan the correction would make look cheaper was left before for a
  // reason (replanning here can flip a run between two plans for good, one of them a plan whose capture fails).
  const double corrected = memory_plan_peak(model_, plan_);
  if (corrected <= static_cast<double>(limit_bytes())) {
    plan_.predicted_peak_bytes = corrected;
    events.push_back({event::kMemoryPlan, plan_fields("remeasured")});
    return;
  }
  replan();
  events.push_back({event::kMemoryPlan, plan_fields("recalibrated")});
}

// One of the first kCalibrationSteps readings: the scale and the offset refit, the plan made again.
void MemoryPlanController::calibration_reading(const MemoryPlan& ran, double measured, Events& events) {
  ++calibrations_;
  measured_peak_bytes_ = measured;
  const bool oom_floored = calibrate(ran, measured);
  limit_scale_ = model_.activation_scale;
  const MemoryPlan before = plan_;
  replan();
  bool corrected = false;
  if (ran == plan_) {
    plan_measured_peak_bytes_ = std::max(plan_measured_peak_bytes_, measured);
    // The scale an out-of-memory error left holds the model above what this plan's steps read (it keeps the plan
    // that failed out of reach): this plan's prediction is its own reading, as a calibrated plan's is when its peak
    // comes in under the prediction (calibrated_reading). Else the floor keeps the held plan's prediction above its
    // peak for the rest of the run (measured: docs/results/memory-planner.md).
    const double predicted = plan_.predicted_peak_bytes;
    if (oom_floored && predicted > 0 && plan_measured_peak_bytes_ < (1 - kPredictionTolerance) * predicted) {
      plan_.predicted_peak_bytes = plan_measured_peak_bytes_;
      corrected = true;
    }
  }
  if (!(plan_ == before)) {
    events.push_back({event::kMemoryPlan, plan_fields("recalibrated")});
  } else if (corrected) {  // logged: a run whose later steps are replays reads no more (the last event is the plan)
    events.push_back({event::kMemoryPlan, plan_fields("remeasured")});
  } else if (calibrations_ == kCalibrationSteps) {
    events.push_back({event::kMemoryPlan, plan_fields("measured")});
  }
}

Events MemoryPlanController::after_step(StepContext& ctx) {
  Events events;
  const MemoryPlan ran = plan_;  // the plan the step just ran with
  const bool first_step = !seen_step_;
  seen_step_ = true;
  // Tri-Accel changed a unit's precision: its activations change size.
  if (step_.unit_precisions() != precisions_) {
    precisions_ = step_.unit_precisions();
    model_ = corrected_model(precisions_);
    const MemoryPlan before = plan_;
    replan();
    if (!(plan_ == before)) events.push_back({event::kMemoryPlan, plan_fields("precision")});
    return events;  // this step ran with the old precisions: no calibration reading from it
  }
  const StepReading reading = step_reading(ctx);
  if (reading.capture_failed && capture_oom_handle(events)) return events;
  if (optimizer_bytes_handle(reading.optimizer_bytes, events)) return events;  // this step held the state before
  // Calibration reads the peak. The first step of a session is not read: it makes what later steps reuse (cuDNN's
  // and cuBLAS's handles and workspaces; before the step engine made the optimizer state first, SGD's momentum
  // too). A capture that ran out of memory allocated up to the cap before it failed: not the plan's peak (read, it
  // would pull the calibration toward the cap, far above what the plan needs).
  if (reading.measured <= 0 || first_step || reading.capture_failed) return events;
  if (calibrations_ >= kCalibrationSteps) {
    calibrated_reading(ran, reading.measured, events);
  } else {
    calibration_reading(ran, reading.measured, events);
  }
  return events;
}

bool MemoryPlanController::calibrate(const MemoryPlan& ran, double measured) {
  // measured = base (modelled) + offset + scale · x, with x the plan's modelled activation bytes at scale 1.
  MemoryModel unscaled = model_;
  unscaled.activation_scale = 1;
  unscaled.fixed_bytes = model_.fixed_bytes - offset_;
  const double base = memory_plan_peak(unscaled, ran.batch, 0, ran.recompute, ran.data_placement, ran.fp8_saved,
                                       ran.update_in_backward);
  const double x = memory_plan_peak(unscaled, ran) - base;
  readings_.emplace_back(x, measured - base);
  // A least-squares line through the readings when their activations differ enough, else the scale alone.
  double sx = 0, sy = 0, xmin = readings_[0].first, xmax = xmin;
  for (const auto& [xi, yi] : readings_) {
    sx += xi;
    sy += yi;
    xmin = std::min(xmin, xi);
    xmax = std::max(xmax, xi);
  }
  const double n = static_cast<double>(readings_.size()), mx = sx / n, my = sy / n;
  double scale = 0, offset = offset_;
  if (readings_.size() >= 2 && xmax > kCalibrationSpread * xmin) {
    double sxy = 0, sxx = 0;
    for (const auto& [xi, yi] : readings_) {
      sxy += (xi - mx) * (yi - my);
      sxx += (xi - mx) * (xi - mx);
    }
    scale = sxy / sxx;
  } else {
    scale = mx > 0 ? (my - offset) / mx : 1;
  }
  scale = std::clamp(scale, kCalibrationMin, kCalibrationMax);
  offset = std::clamp(my - scale * mx, kOffsetMin, kOffsetMax);
  const bool oom_floored = scale < oom_scale_;
  const double least = std::max(model_.activation_scale * kCalibrationDownStep, oom_scale_);
  if (scale < least) {  // a step down, not the fit: the fixed bytes stay as they were
    scale = least;
    offset = offset_;
  }
  model_.activation_scale = scale;
  offset_ = offset;
  model_.fixed_bytes = unscaled.fixed_bytes + offset_;
  return oom_floored;
}

bool MemoryPlanController::fp8_give_up() {
  const bool any = std::find(plan_.fp8_saved.begin(), plan_.fp8_saved.end(), true) != plan_.fp8_saved.end();
  if (!any || !limits_.constraints.fp8_saved.empty()) return false;  // none, or the user's saved_activations
  limits_.constraints.fp8_saved.assign(model_.units.size(), false);
  return true;
}

Event MemoryPlanController::on_pool_out_of_memory() {
  // The pool's fragmentation, not the model's error (what the step had allocated and asked for came to the plan's
  // prediction): a smaller share of the budget, the scale kept. A scale raised for it priced every later plan too
  // high (H100 grid at 62ac2b7: 17-21 % above their steps' peaks).
  if (limits_.cap_bytes > 0) return share_shrink("pool_oom");
  return on_out_of_memory();  // no cap to take a share of
}

double MemoryPlanController::oom_scale_step(double failed_peak) const {
  const double limit = static_cast<double>(limit_bytes());
  if (failed_peak <= 0 || limit <= 0 || failed_peak < limit) return kOomScaleStep;
  // The failed plan's price is base + activations, the activations in proportion to the scale.
  const double activations = scaled_activation_bytes(model_, plan_);
  if (activations <= 0) return kOomScaleStep;
  const double base = memory_plan_peak(model_, plan_) - activations;
  const double step = (failed_peak * (1 + kOomReadingMargin) - base) / activations;
  return std::clamp(step, kOomScaleStep, kOomScaleMaxStep);
}

Event MemoryPlanController::on_out_of_memory(double failed_peak_bytes) {
  if (agree_) failed_peak_bytes = agree_({failed_peak_bytes}).at(0);  // every rank calls it: one step for all
  const double step = oom_scale_step(failed_peak_bytes);
  const bool fp8_off = fp8_give_up();
  model_.activation_scale *= step;
  limit_scale_ *= step;
  oom_scale_ = model_.activation_scale;
  replan();
  return {event::kMemoryPlan, plan_fields(fp8_off ? "oom_fp8_off" : "oom")};
}

Json MemoryPlanController::state() const {
  return Json{{"activation_scale", model_.activation_scale}, {"fixed_offset_bytes", offset_},
              {"cap_share", limits_.cap_share}, {"limit_scale", limit_scale_}};
}

void MemoryPlanController::restore(const Json& state) {
  const double scale = state.value("activation_scale", 1.0);
  const double share = state.value("cap_share", limits_.cap_share);
  const double offset = state.value("fixed_offset_bytes", 0.0);
  const double limit_scale = state.value("limit_scale", scale);  // checkpoints before it: the limit followed the scale
  if (scale == model_.activation_scale && share == limits_.cap_share && offset == offset_ &&
      limit_scale == limit_scale_) {
    return;
  }
  model_.activation_scale = scale;
  limit_scale_ = limit_scale;
  model_.fixed_bytes += offset - offset_;
  offset_ = offset;
  if (limits_.cap_bytes > 0) {
    limits_.cap_share = share;
    limits_.budget_bytes = static_cast<int64_t>(share * static_cast<double>(limits_.cap_bytes));
  }
  calibrations_ = kCalibrationSteps;  // a resumed run keeps its measured model
  replan();
}

}  // namespace triaccel
