#include "triaccel/control/curvature/curvature_controller.h"

#include "triaccel/control/precision/precision_policy.h"
#include "triaccel/core/device.h"
#include "triaccel/core/errors.h"

#include <ATen/Context.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

namespace triaccel {
namespace {

// The dataset indices of the samples a probe used: the first `samples` of the probe batch's.
std::vector<int64_t> probe_samples_used(const std::vector<int64_t>& all, int64_t samples) {
  return {all.begin(), all.begin() + std::min<int64_t>(samples, static_cast<int64_t>(all.size()))};
}

Json unit_names_json(const Model& model) {
  Json names = Json::array();
  for (const auto& u : model.units()) names.push_back(u.name);
  return names;
}

// cuDNN autotuning off for the probe's scope: benchmarking the double-backward convolutions tries algorithms with
// workspaces of gigabytes, which then set the run's memory peak at several times the training's own (measured:
// docs/results/memory-planner.md).
class CudnnHeuristics {
 public:
  CudnnHeuristics() { at::globalContext().setBenchmarkCuDNN(false); }
  ~CudnnHeuristics() { at::globalContext().setBenchmarkCuDNN(saved_); }
  CudnnHeuristics(const CudnnHeuristics&) = delete;
  CudnnHeuristics& operator=(const CudnnHeuristics&) = delete;

 private:
  bool saved_ = at::globalContext().benchmarkCuDNN();
};

}  // namespace

CurvatureController::CurvatureController(CurvatureControllerOptions options, Model& model, Optimizer& optimizer,
                                         TrainStep& step, at::Tensor probe_images, at::Tensor probe_labels)
    : options_(std::move(options)),
      clock_(options_.probe.clock ? *options_.probe.clock : steady_clock()),
      model_(model),
      optimizer_(optimizer),
      step_(step),
      probe_images_(std::move(probe_images)),
      probe_labels_(std::move(probe_labels)) {
  options_.probe.validate();
  options_.lockstep = options_.lockstep_rounds();
  unit_of_param_ = model_unit_of_params(model_, optimizer_.params());
  const size_t n_units = model_.units().size();
  unit_lr_scale_.assign(n_units, 1.0);
  unit_cost_s_.assign(n_units, -1.0);
  unit_lambda_.assign(n_units, 0.0);
  unit_probed_.assign(n_units, false);
  unit_probe_fixed_.assign(n_units, -1.0);
  unit_probe_slope_.assign(n_units, -1.0);
}

int64_t probe_samples_fitting(double fixed_bytes, double slope_bytes, double room_bytes, int64_t full) {
  if (room_bytes < 0) return full;
  const double fit = slope_bytes > 0 ? std::floor((room_bytes - fixed_bytes) / slope_bytes)
                                     : (fixed_bytes <= room_bytes ? static_cast<double>(full) : 0.0);
  if (fit < static_cast<double>(kMinProbeSamples)) return 0;
  return std::min<int64_t>(full, static_cast<int64_t>(fit));
}

bool round_pace_due(const RoundPace& pace, int64_t step) {
  if (step <= 0 || step <= pace.last_round_step || step >= pace.total_steps || pace.round_cost_s <= 0) return false;
  const double step_s = pace.step_s > 0 ? pace.step_s : pace.training_s / static_cast<double>(step);
  const double projected_s = pace.training_s + step_s * static_cast<double>(pace.total_steps - step);
  const double rounds = std::floor((pace.budget * projected_s - pace.probe_s) / pace.round_cost_s);
  if (rounds < 1) return false;
  return static_cast<double>(step - pace.last_round_step) * (rounds + 1) >=
         static_cast<double>(pace.total_steps - pace.last_round_step);
}

bool CurvatureController::round_due(int64_t step) const {
  if (round_cost_s_ < 0) return true;  // the first round measures what one costs
  if (!paced()) return round_cost_s_ <= credit_s();
  RoundPace pace;
  pace.budget = options_.budget;
  pace.training_s = training_s_;
  if (step > last_round_step_ && last_round_step_ >= 0 && last_round_training_s_ >= 0) {
    pace.step_s = (training_s_ - last_round_training_s_) / static_cast<double>(step - last_round_step_);
  }
  pace.probe_s = probe_seconds_;
  pace.round_cost_s = round_cost_s_;
  pace.last_round_step = last_round_step_;
  pace.total_steps = options_.total_steps;
  return round_pace_due(pace, step);
}

int64_t CurvatureController::probe_samples_for(StepContext& ctx, const std::vector<size_t>& chosen,
                                               double* seconds) {
  const int64_t full = std::min(options_.probe.batch, probe_images_.size(0));
  last_room_bytes_ = -1;
  if (ctx.memory == nullptr || chosen.empty()) return full;
  const double room = ctx.memory->room_bytes();
  if (room < 0) return full;
  last_room_bytes_ = room;
  const size_t first = *std::min_element(chosen.begin(), chosen.end());
  if (unit_probe_slope_[first] < 0) {
    // Two small probes (no warm start) measure what this earliest unit costs a probe, run as the probe runs: its k
    // eigenvalues and its products' CUDA graph (captured at the second product, its pool part of the probe's
    // memory); two products per eigenvalue. One eager product each left the graph's pool and the deflation out.
    CurvatureOptions small = options_.probe;
    small.max_iters = std::min(small.max_iters, 2);
    small.tol = 0;  // both products, whatever the first one gives
    double bytes[2] = {0, 0};
    const int64_t sizes[2] = {kMinProbeSamples, 2 * kMinProbeSamples};
    for (int i = 0; i < 2; ++i) {
      small.batch = std::min(sizes[i], full);
      double s = 0;
      bytes[i] = ctx.memory->measure([&]() {
        (void)curvature_probe(model_, probe_images_, probe_labels_, small, &s, nullptr, &chosen);
      });
      *seconds += s;
    }
    const double slope = std::max(0.0, (bytes[1] - bytes[0]) / static_cast<double>(kMinProbeSamples));
    unit_probe_slope_[first] = slope;
    unit_probe_fixed_[first] = std::max(0.0, bytes[0] - slope * static_cast<double>(kMinProbeSamples));
  }
  return probe_samples_fitting(unit_probe_fixed_[first], unit_probe_slope_[first], room, full);
}

void lr_scales_mean_one(std::vector<double>* scales, const std::vector<int64_t>& unit_params) {
  TORCH_CHECK(scales->size() == unit_params.size(), "lr_scales_mean_one: ", scales->size(), " scales for ",
              unit_params.size(), " units");
  double weighted = 0, total = 0;
  for (size_t u = 0; u < scales->size(); ++u) {
    weighted += static_cast<double>(unit_params[u]) * (*scales)[u];
    total += static_cast<double>(unit_params[u]);
  }
  if (weighted <= 0 || total <= 0) return;
  for (double& s : *scales) s *= total / weighted;
}

void CurvatureController::lr_scales_update() {
  const bool all_known = std::all_of(unit_probed_.begin(), unit_probed_.end(), [](bool b) { return b; });
  if (alpha_ < 0 && options_.alpha >= 0) alpha_ = options_.alpha;
  if (alpha_ < 0 && all_known) {
    // No manual tuning: α so that the 0.9-quantile unit gets half its rate (flat units keep nearly all of theirs),
    // fixed once every unit has been probed.
    std::vector<double> positive;
    for (double l : unit_lambda_) {
      if (l > 0) positive.push_back(l);
    }
    alpha_ = positive.empty() ? 0.0 : 1.0 / quantile(positive, 0.9);
  }
  if (alpha_ < 0) return;
  for (size_t u = 0; u < unit_lr_scale_.size(); ++u) {
    if (unit_probed_[u]) unit_lr_scale_[u] = 1.0 / (1.0 + alpha_ * std::max(0.0, unit_lambda_[u]));
  }
  if (options_.lr_mean_one) {
    std::vector<int64_t> params;
    for (const Unit& unit : model_.units()) params.push_back(unit.parameter_count());
    lr_scales_mean_one(&unit_lr_scale_, params);
  }
  apply_lr_scales();
}

void CurvatureController::apply_lr_scales() {
  std::vector<float> scales;
  for (int64_t u : unit_of_param_) scales.push_back(static_cast<float>(unit_lr_scale_[static_cast<size_t>(u)]));
  if (scales == optimizer_.lr_scales()) return;
  optimizer_.set_lr_scales(std::move(scales));  // read on the device: a captured step replays with them
}

std::vector<size_t> CurvatureController::units_due(int64_t step) {
  // All units on the fixed schedule (budget 0); else the next ones, round-robin from the output end (their products
  // are the cheapest), while their cost fits the credit. A unit never probed is estimated at twice the dearest probed
  // one (the next unit in the order sits deeper, so its products backpropagate further and cost several times those
  // near the output; measured: docs/results/tri-accel.md); the very first round probes one unit to learn the cost.
  const size_t n_units = model_.units().size();
  std::vector<size_t> chosen;
  // Lockstep: a whole round when one is due (round_due).
  if (options_.budget <= 0 || (options_.lockstep && round_due(step))) {
    for (size_t u = 0; u < n_units; ++u) chosen.push_back(u);
    return chosen;
  }
  if (options_.lockstep) return chosen;
  double known_max = -1;
  for (double c : unit_cost_s_) known_max = std::max(known_max, c);
  double credit = credit_s();
  for (size_t n = 0; n < n_units; ++n) {
    const auto k = static_cast<int64_t>(n_units);
    const size_t u = n_units - 1 - static_cast<size_t>((next_unit_ + static_cast<int64_t>(n)) % k);
    const double est = unit_cost_s_[u] >= 0 ? unit_cost_s_[u] : 2 * known_max;
    if (!(est < 0 && chosen.empty()) && est > credit) break;
    chosen.push_back(u);
    credit -= std::max(est, 0.0);
    if (est < 0) break;  // bootstrap: one unit, to measure
  }
  return chosen;
}

void CurvatureController::agree_results(const StepContext& ctx, const std::vector<size_t>& chosen,
                                        std::vector<UnitCurvature>* curv, double* seconds) const {
  // Every rank probed the same weights on the same samples; rank 0's eigenvalues and timings for all, so that the lr
  // scales, the promotions and the schedule's costs are bit for bit the same on every rank.
  const auto k = static_cast<size_t>(options_.probe.top_k);
  std::vector<double> flat{*seconds};
  for (size_t u : chosen) {
    const UnitCurvature& c = (*curv)[u];
    flat.push_back(c.seconds);
    flat.push_back(static_cast<double>(c.iterations));
    flat.push_back(c.lambda_max);
    flat.push_back(static_cast<double>(c.eigenvalues.size()));
    for (size_t i = 0; i < k; ++i) flat.push_back(i < c.eigenvalues.size() ? c.eigenvalues[i] : 0.0);
  }
  flat = ctx.agree(std::move(flat));
  size_t at = 0;
  *seconds = flat[at++];
  for (size_t u : chosen) {
    UnitCurvature& c = (*curv)[u];
    c.seconds = flat[at++];
    c.iterations = static_cast<int>(flat[at++]);
    c.lambda_max = flat[at++];
    const auto n = static_cast<size_t>(flat[at++]);
    c.eigenvalues.assign(flat.begin() + static_cast<long>(at), flat.begin() + static_cast<long>(at + n));
    at += k;
  }
}

std::vector<UnitCurvature> CurvatureController::probe_sized(StepContext& ctx, const std::vector<size_t>& chosen,
                                                            int64_t* samples, double* probe_bytes, double* seconds) {
  *samples = std::min(options_.probe.batch, probe_images_.size(0));
  double sizing_s = 0;  // the measuring probes' seconds (a unit's first time as the earliest)
  if (!options_.lockstep) {
    *samples = probe_samples_for(ctx, chosen, &sizing_s);
    // Rank 0's size for every rank (each measured its own memory).
    if (ctx.agree) *samples = static_cast<int64_t>(ctx.agree({static_cast<double>(*samples)})[0]);
  }
  std::vector<UnitCurvature> curv;
  if (*samples == 0) {
    *seconds = sizing_s;
    return curv;
  }
  if (ctx.memory != nullptr && !options_.lockstep) {
    *probe_bytes = ctx.memory->measure([&]() { curv = probe(chosen, *samples, seconds); });
    // A probe above its prediction: its earliest unit's fixed bytes take the difference.
    const size_t first = *std::min_element(chosen.begin(), chosen.end());
    if (unit_probe_slope_[first] >= 0) {
      const double predicted = unit_probe_fixed_[first] + unit_probe_slope_[first] * static_cast<double>(*samples);
      if (*probe_bytes > predicted) unit_probe_fixed_[first] += *probe_bytes - predicted;
    }
  } else {
    curv = probe(chosen, *samples, seconds);
  }
  *seconds += sizing_s;
  return curv;
}

std::vector<UnitCurvature> CurvatureController::probe(const std::vector<size_t>& chosen, int64_t samples,
                                                      double* seconds) {
  const CudnnHeuristics heuristics;
  if (options_.lockstep) {
    if (!round_) {
      round_ = std::make_unique<CurvatureRound>(model_, probe_images_, probe_labels_, options_.probe);
      if (options_.share_step_pool) round_->share_pool(&step_.graph());
    }
    std::vector<UnitCurvature> curv = round_->run(seconds);
    // The schedule plans with what a round of replays costs: the round that captured the pass (and ran it eagerly
    // where the capture came second) is charged all of it but planned as if those had been replays too.
    const CurvatureRound::Timing& t = round_->timing();
    if (t.capture_s > 0 || t.eager_s > 0) {
      // The first round (cold, with the capture, its first replays paying for the graph's upload): plan the next as a
      // warm round of warm_passes passes at the fastest replay, plus this round's time outside its passes.
      const int warm = options_.probe.warm_round_passes();
      const double pass_s = t.fastest_replay_s > 0 ? t.fastest_replay_s : t.passes_s / std::max(t.passes, 1);
      round_cost_s_ = warm * pass_s + std::max(0.0, *seconds - t.passes_s - t.capture_s);
    } else {
      round_cost_s_ = *seconds;
    }
    return curv;
  }
  const bool bootstrap = std::all_of(unit_cost_s_.begin(), unit_cost_s_.end(), [](double c) { return c < 0; });
  CurvatureOptions sized = options_.probe;
  sized.batch = samples;
  std::vector<UnitCurvature> curv =
      curvature_probe(model_, probe_images_, probe_labels_, sized, seconds, &warm_start_, &chosen);
  if (bootstrap && options_.budget > 0) {
    // The first probe pays once for cuDNN's fp32 plans of every layer, so it costs many times a later one.
    // Estimating the other units from it starved the schedule: a few units probed in a whole run (measured:
    // docs/results/tri-accel.md). Probing the unit again from its warm start measures its steady cost (charged to
    // the credit too).
    double again_s = 0;
    const auto again = curvature_probe(model_, probe_images_, probe_labels_, sized, &again_s, &warm_start_, &chosen);
    *seconds += again_s;
    for (size_t u : chosen) {
      const int first_products = curv[u].iterations;
      curv[u] = again[u];
      curv[u].iterations += first_products;
      curv[u].seconds = again_s;  // the cost the schedule plans with
    }
  }
  return curv;
}

// This round's units (units_due); with several ranks, rank 0's choice for every rank (the credit follows each rank's
// clock).
std::vector<size_t> CurvatureController::units_agreed(StepContext& ctx) {
  std::vector<size_t> chosen = units_due(ctx.step);
  const size_t n_all = model_.units().size();
  if (ctx.agree) {
    std::vector<double> mask(n_all, 0.0);
    for (size_t u : chosen) mask[u] = 1.0;
    mask = ctx.agree(std::move(mask));
    chosen.clear();
    for (size_t u = 0; u < n_all; ++u) {
      if (mask[u] != 0) chosen.push_back(u);
    }
  }
  return chosen;
}

// A probe's results: each probed unit's λ_max, cost and lr scale kept, the step's per-unit λ_max for the other
// controllers, and the curvature event.
void CurvatureController::probe_record(StepContext& ctx, const std::vector<size_t>& chosen,
                                       const std::vector<UnitCurvature>& curv, double seconds, int64_t samples,
                                       double probe_bytes, Events& events) {
  const size_t n_units = model_.units().size();
  probe_seconds_ += seconds;
  if (options_.lockstep) {
    last_round_step_ = ctx.step;
    last_round_training_s_ = training_s_;
  }
  probes_ += 1;
  next_unit_ += static_cast<int64_t>(chosen.size());
  ctx.unit_lambda_max.assign(n_units, -1.0);
  Json probed = Json::array(), eigen = Json::array();
  Json unit_s = Json::array();  // per unit: its power iteration (the rest of probe_s: forward, first-order gradients)
  int64_t products = 0, graphed = 0;
  for (size_t u = 0; u < n_units; ++u) {
    const UnitCurvature& c = curv[u];
    if (!c.probed) {
      eigen.push_back(nullptr);
      unit_s.push_back(nullptr);
      continue;
    }
    unit_s.push_back(c.seconds);
    probed.push_back(c.unit);
    eigen.push_back(c.eigenvalues);
    products += c.iterations;
    graphed += c.graphed ? 1 : 0;
    unit_cost_s_[u] = c.seconds;
    unit_lambda_[u] = std::isfinite(c.lambda_max) ? c.lambda_max : 0.0;
    unit_probed_[u] = true;
    ctx.unit_lambda_max[u] = c.lambda_max;
  }
  if (options_.lr_scaling) lr_scales_update();
  Json lambda = Json::array();
  for (size_t u = 0; u < n_units; ++u) lambda.push_back(unit_probed_[u] ? Json(unit_lambda_[u]) : Json(nullptr));
  events.push_back({event::kCurvature, Json{{"units", unit_names_json(model_)},
                                            {"probed", probed},
                                            {"lambda_max", lambda},
                                            {"eigenvalues", eigen},
                                            {"lr_scale", unit_lr_scale_},
                                            {"alpha", alpha_},
                                            {"probe_s", seconds},
                                            {"unit_s", unit_s},
                                            {"hvp_products", products},
                                            {"hvp_graphed_units", graphed},
                                            {"probe_s_total", probe_seconds_},
                                            {"training_s", training_s_},
                                            {"credit_s", credit_s()},
                                            {"next_probe_step", next_probe_step_},
                                            {"probe_samples", probe_samples_used(options_.probe_samples, samples)},
                                            {"probe_bytes", probe_bytes >= 0 ? Json(probe_bytes) : Json()},
                                            {"room_bytes", last_room_bytes_ >= 0 ? Json(last_room_bytes_) : Json()},
                                            {"top_k", options_.probe.top_k},
                                            {"precision", enum_name(options_.probe.precision)},
                                            {"lr_scaling", options_.lr_scaling},
                                            {"lockstep", options_.lockstep},
                                            {"estimator", enum_name(options_.probe.estimator)},
                                            {"cudnn", options_.probe.cudnn},
                                            {"round_cost_s", round_cost_s_ >= 0 ? Json(round_cost_s_) : Json()},
                                            {"round", round_json()}}});
}

Events CurvatureController::after_step(StepContext& ctx) {
  Events events;
  if (last_call_s_ >= 0) {
    training_s_ += ctx.now_s - last_call_s_;
  }
  const bool window = ctx.step % options_.ctrl_every == 0;
  const bool due = window && (next_probe_step_ < 0 || ctx.step >= next_probe_step_);
  if (!due) {
    last_call_s_ = ctx.now_s;
    return events;
  }
  const std::vector<size_t> chosen = units_agreed(ctx);
  // Not enough credit yet: try again after the next T_curv; paced lockstep rounds, at the next window.
  if (chosen.empty()) {
    if (!paced()) next_probe_step_ = ctx.step + options_.probe.every_steps;
    last_call_s_ = ctx.now_s;
    return events;
  }
  next_probe_step_ = ctx.step + options_.probe.every_steps;
  if (options_.lockstep && options_.share_step_pool) {
    // The round is a side graph of the step's (rank 0's state for every rank: the skip must agree).
    double eager = step_.graph().captured() ? 0.0 : 1.0;
    if (ctx.agree) eager = ctx.agree({eager})[0];
    if (eager != 0) {
      events.push_back({event::kCurvature, Json{{"skipped", "no step graph"}, {"next_probe_step", next_probe_step_}}});
      last_call_s_ = ctx.now_s;
      return events;
    }
  }
  // The GPU finishes the steps queued before the probe first: that time is training's, not the probe's (a large
  // share of a warm round's time otherwise).
  device_synchronize(probe_images_.device());
  const double synced_s = clock_.now_s();
  training_s_ += synced_s - ctx.now_s;
  double seconds = 0;
  std::vector<UnitCurvature> curv;
  int64_t samples = 0;
  double probe_bytes = -1;  // what the probe allocated above what was held (< 0: not measured)
  try {
    curv = probe_sized(ctx, chosen, &samples, &probe_bytes, &seconds);
    if (samples == 0) {
      // Not even kMinProbeSamples fit beside what the run holds: no probe this time; the credit keeps accruing.
      events.push_back({event::kCurvature, Json{{"skipped", "no memory"}, {"room_bytes", last_room_bytes_},
                                                {"next_probe_step", next_probe_step_}}});
      probe_seconds_ += seconds;
      last_call_s_ = clock_.now_s();
      return events;
    }
    if (ctx.agree) agree_results(ctx, chosen, &curv, &seconds);
  } catch (const c10::OutOfMemoryError&) {
    // With several ranks a skip on one rank alone would put it out of step: the error ends the run (a rank that dies
    // ends the job; the last checkpoint resumes).
    if (ctx.agree) throw;
    // Under a tight --vram-budget the probe may not fit beside the captured step: skip it, train on.
    memory_cache_release(probe_images_.device());
    events.push_back({event::kCurvature, Json{{"skipped", "out of memory"}, {"next_probe_step", next_probe_step_}}});
    last_call_s_ = clock_.now_s();
    return events;
  }
  probe_record(ctx, chosen, curv, seconds, samples, probe_bytes, events);
  last_call_s_ = clock_.now_s();  // the probe's own time is not training time
  return events;
}

Json CurvatureController::round_json() const {
  if (!round_) return Json();
  const CurvatureRound::Timing& t = round_->timing();
  return Json{{"passes", t.passes},
              {"eager_s", t.eager_s},
              {"capture_s", t.capture_s},
              {"replay_s", t.replay_s >= 0 ? Json(t.replay_s) : Json()},
              {"graphed", round_->graphed()},
              {"graph_bytes", round_->graph_bytes()},
              {"chunk", round_->chunk()}};
}

Json CurvatureController::state() const {
  return Json{{"unit_lr_scale", unit_lr_scale_}, {"alpha", alpha_},
              {"probe_seconds", probe_seconds_}, {"probes", probes_},
              {"next_probe_step", next_probe_step_}, {"probe_credit_s", credit_s()},
              {"unit_cost_s", unit_cost_s_},     {"unit_lambda", unit_lambda_},
              {"unit_probed", unit_probed_},     {"next_unit", next_unit_},
              {"round_cost_s", round_cost_s_},   {"training_s", training_s_},
              {"last_round_step", last_round_step_}, {"last_round_training_s", last_round_training_s_}};
}

void CurvatureController::restore(const Json& j) {
  try {
    unit_lr_scale_ = j.at("unit_lr_scale").get<std::vector<double>>();
    alpha_ = j.at("alpha").get<double>();
    probe_seconds_ = j.at("probe_seconds").get<double>();
    probes_ = j.at("probes").get<int64_t>();
    next_probe_step_ = j.at("next_probe_step").get<int64_t>();
    if (j.contains("unit_cost_s")) {  // absent in checkpoints written before the time-budgeted schedule
      // Checkpoints before training_s: the training time their credit accrued over.
      if (!j.contains("training_s") && options_.budget > 0) {
        training_s_ = (j.at("probe_credit_s").get<double>() + probe_seconds_) / options_.budget;
      }
      unit_cost_s_ = j.at("unit_cost_s").get<std::vector<double>>();
      unit_lambda_ = j.at("unit_lambda").get<std::vector<double>>();
      unit_probed_ = j.at("unit_probed").get<std::vector<bool>>();
      next_unit_ = j.at("next_unit").get<int64_t>();
    }
    if (j.contains("round_cost_s")) round_cost_s_ = j.at("round_cost_s").get<double>();
    if (j.contains("training_s")) training_s_ = j.at("training_s").get<double>();
    if (j.contains("last_round_step")) {
      last_round_step_ = j.at("last_round_step").get<int64_t>();
      last_round_training_s_ = j.value("last_round_training_s", -1.0);
    } else if (probes_ > 0) {  // checkpoints before paced rounds: the last round was at most T_curv before this
      last_round_step_ = std::max<int64_t>(0, next_probe_step_ - options_.probe.every_steps);
    }
  } catch (const Json::exception&) {
    throw UserError(str_cat("checkpoint has an unreadable Tri-Accel state; resume with the same ",
                            option_ref("method"), " or start afresh"));
  }
  TRIACCEL_CHECK_INPUT(unit_lr_scale_.size() == model_.units().size(),
                       "checkpoint's Tri-Accel state is for another model");
  apply_lr_scales();
}

}  // namespace triaccel
