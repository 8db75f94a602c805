#include "triaccel/train/tri_accel.h"

#include "triaccel/core/device.h"
#include "triaccel/core/errors.h"
#include "triaccel/core/grad_stats.h"
#include "triaccel/core/io.h"

#include <ATen/Context.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <unordered_map>

namespace triaccel {

TriAccelDriver::TriAccelDriver(const TrainOptions& options, Model& model, Optimizer& sgd, TrainStep& step,
                               at::Tensor probe_images, at::Tensor probe_labels)
    : options_(options),
      model_(model),
      sgd_(sgd),
      step_(step),
      probe_images_(std::move(probe_images)),
      probe_labels_(std::move(probe_labels)) {
  policy_options_.tau_low = options.tau_low;
  policy_options_.tau_high = options.tau_high;
  policy_options_.tau_curv = options.tau_curv;
  policy_options_.validate();
  curvature_options_.top_k = static_cast<int>(options.curv_top_k);
  curvature_options_.max_iters = static_cast<int>(options.curv_max_iters);
  curvature_options_.batch = options.curv_batch;
  curvature_options_.every_steps = options.curv_every;
  curvature_options_.seed = options.seed;
  curvature_options_.cuda_graphs = options.cuda_graphs;
  curvature_options_.validate();

  // Which unit owns each optimizer tensor.
  std::unordered_map<const c10::TensorImpl*, int64_t> owner;
  const auto& units = model_.units();
  for (size_t u = 0; u < units.size(); ++u) {
    for (const auto& p : units[u].parameters()) owner[p.unsafeGetTensorImpl()] = static_cast<int64_t>(u);
  }
  for (const auto& p : sgd_.params()) {
    const auto it = owner.find(p.unsafeGetTensorImpl());
    TORCH_CHECK(it != owner.end(), "TriAccelDriver: a parameter belongs to no unit");
    unit_of_param_.push_back(it->second);
  }
  unit_lr_scale_.assign(units.size(), 1.0);
  unit_cost_s_.assign(units.size(), -1.0);
  unit_lambda_.assign(units.size(), 0.0);
  unit_probed_.assign(units.size(), false);
  if (options_.ta_precision) {
    step_.grad_stats_enable(
        GradStatsLayout(sgd_.params(), unit_of_param_, static_cast<int64_t>(units.size())));
    step_.set_unit_precisions(std::vector<Precision>(units.size(), policy_options_.default_precision));
  }
}

Json TriAccelDriver::unit_names() const {
  Json names = Json::array();
  for (const auto& u : model_.units()) names.push_back(u.name);
  return names;
}

void TriAccelDriver::apply_lr_scales() {
  std::vector<float> scales;
  for (int64_t u : unit_of_param_) scales.push_back(static_cast<float>(unit_lr_scale_[static_cast<size_t>(u)]));
  if (scales == sgd_.lr_scales()) return;
  sgd_.set_lr_scales(std::move(scales));
  step_.invalidate_graph();  // the scales travel by value into the captured kernel
}

void TriAccelDriver::probe(int64_t step, std::vector<std::pair<std::string, Json>>& events) {
  const size_t n_units = model_.units().size();
  // Which units this round: all of them on the fixed schedule (curv_budget 0); else the next ones, round-robin from
  // the output end (their products are the cheapest), while their cost fits the credit. A unit never probed is
  // estimated at twice the dearest probed one (the next unit in the order sits deeper, so its products backpropagate
  // further: ResNet-18's layer4.1 cost 3.4x fc on the H100); the very first round probes one unit to learn the cost.
  std::vector<size_t> chosen;
  int64_t advance = 0;
  if (options_.curv_budget <= 0) {
    for (size_t u = 0; u < n_units; ++u) chosen.push_back(u);
  } else {
    double known_max = -1;
    for (double c : unit_cost_s_) known_max = std::max(known_max, c);
    double credit = probe_credit_s_;
    for (size_t n = 0; n < n_units; ++n) {
      const size_t u = n_units - 1 - static_cast<size_t>((next_unit_ + static_cast<int64_t>(n)) % static_cast<int64_t>(n_units));
      const double est = unit_cost_s_[u] >= 0 ? unit_cost_s_[u] : 2 * known_max;
      if (!(est < 0 && chosen.empty()) && est > credit) break;
      chosen.push_back(u);
      ++advance;
      credit -= std::max(est, 0.0);
      if (est < 0) break;  // bootstrap: one unit, to measure
    }
  }
  next_probe_step_ = step + options_.curv_every;
  if (chosen.empty()) return;  // not enough credit yet: try again after the next T_curv

  double seconds = 0;
  std::vector<UnitCurvature> curv;
  try {
    // cuDNN autotuning off for the probe: benchmarking the double-backward convolutions tries algorithms with
    // workspaces of gigabytes, which set the run's memory peak (3.05 GB instead of ~0.4 GB on the H100 smoke run).
    struct CudnnHeuristics {
      bool saved = at::globalContext().benchmarkCuDNN();
      CudnnHeuristics() { at::globalContext().setBenchmarkCuDNN(false); }
      ~CudnnHeuristics() { at::globalContext().setBenchmarkCuDNN(saved); }
    } heuristics;
    curv = curvature_probe(model_, probe_images_, probe_labels_, curvature_options_, &seconds, &warm_start_, &chosen);
  } catch (const c10::OutOfMemoryError&) {
    // Under a tight --vram-budget the probe may not fit beside the captured step: skip it, train on.
    memory_cache_release(probe_images_.device());
    events.emplace_back("curvature", Json{{"skipped", "out of memory"}, {"next_probe_step", next_probe_step_}});
    return;
  }
  probe_seconds_ += seconds;
  probe_credit_s_ -= seconds;
  probes_ += 1;
  next_unit_ += advance;
  std::vector<double> pending(n_units, -1.0);
  Json probed = Json::array();
  Json eigen = Json::array();
  Json unit_s = Json::array();  // per unit: its power iteration (the rest of probe_s: forward, first-order gradients)
  int64_t products = 0;
  int64_t graphed = 0;
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
    pending[u] = c.lambda_max;
  }
  const bool all_known = std::all_of(unit_probed_.begin(), unit_probed_.end(), [](bool b) { return b; });
  if (options_.ta_curvature) {
    if (alpha_ < 0 && options_.curv_alpha >= 0) alpha_ = options_.curv_alpha;
    if (alpha_ < 0 && all_known) {
      // No manual tuning: α so that the 0.9-quantile unit gets half its rate (flat units keep nearly all of theirs),
      // fixed once every unit has been probed.
      std::vector<double> positive;
      for (double l : unit_lambda_) {
        if (l > 0) positive.push_back(l);
      }
      alpha_ = positive.empty() ? 0.0 : 1.0 / quantile(positive, 0.9);
    }
    if (alpha_ >= 0) {
      for (size_t u = 0; u < n_units; ++u) {
        if (unit_probed_[u]) unit_lr_scale_[u] = 1.0 / (1.0 + alpha_ * std::max(0.0, unit_lambda_[u]));
      }
      apply_lr_scales();
    }
  }
  pending_lambda_ = pending;
  Json lambda = Json::array();
  for (size_t u = 0; u < n_units; ++u) lambda.push_back(unit_probed_[u] ? Json(unit_lambda_[u]) : Json(nullptr));
  events.emplace_back("curvature", Json{{"units", unit_names()},
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
                                        {"credit_s", probe_credit_s_},
                                        {"next_probe_step", next_probe_step_},
                                        {"lr_scaling", options_.ta_curvature}});
}

std::vector<std::pair<std::string, Json>> TriAccelDriver::after_step(int64_t step) {
  std::vector<std::pair<std::string, Json>> events;
  const double now = time_since_start_s();
  if (last_call_s_ >= 0) probe_credit_s_ += options_.curv_budget * (now - last_call_s_);
  const bool window = step % options_.ctrl_every == 0;
  const bool probe_due = window && (next_probe_step_ < 0 || step >= next_probe_step_);
  if ((options_.ta_curvature || options_.ta_precision) && probe_due) probe(step, events);
  if (options_.ta_precision && window) {
    const at::Tensor stats = step_.grad_stats_take();  // (U, columns) on the CPU
    std::vector<UnitPrecisionSignal> signals;
    for (int64_t u = 0; u < stats.size(0); ++u) {
      const double lambda = pending_lambda_.empty() ? -1.0 : pending_lambda_[static_cast<size_t>(u)];
      signals.push_back({stats[u][kGradStatsVar].item<double>(), lambda});
    }
    pending_lambda_.clear();
    const std::vector<Precision> before = state_.precision;
    state_ = precision_policy_step(policy_options_, state_, signals);
    step_.set_unit_precisions(state_.precision);
    Json names = Json::array();
    Json applied = Json::array();
    for (Precision p : state_.precision) {
      names.push_back(precision_name(p));
      applied.push_back(precision_name(step_.precision_applied(p)));
    }
    events.emplace_back("precision", Json{{"units", unit_names()},
                                          {"precision", names},
                                          {"applied", applied},
                                          {"grad_var_ema", state_.ema},
                                          {"promoted", state_.promoted},
                                          {"tau_low", state_.tau_low},
                                          {"tau_high", state_.tau_high},
                                          {"tau_curv", state_.tau_curv},
                                          {"calibrated", state_.calibrated},
                                          {"changed", before != state_.precision}});
  }
  last_call_s_ = time_since_start_s();  // the probe's own time is not training time
  return events;
}

Json TriAccelDriver::state_to_json() const {
  auto ints = [](const std::vector<Precision>& v) {
    std::vector<int> out;
    for (Precision p : v) out.push_back(static_cast<int>(p));
    return out;
  };
  return Json{{"windows", state_.windows},        {"calibrated", state_.calibrated},
              {"curv_calibrated", state_.curv_calibrated}, {"tau_low", state_.tau_low},
              {"tau_high", state_.tau_high},      {"tau_curv", state_.tau_curv},
              {"ema", state_.ema},                {"lambda_max", state_.lambda_max},
              {"base", ints(state_.base)},        {"precision", ints(state_.precision)},
              {"dwell", state_.dwell},            {"promoted", state_.promoted},
              {"pending_lambda", pending_lambda_}, {"unit_lr_scale", unit_lr_scale_},
              {"alpha", alpha_},                  {"probe_seconds", probe_seconds_},
              {"probes", probes_},                {"next_probe_step", next_probe_step_},
              {"probe_credit_s", probe_credit_s_}, {"unit_cost_s", unit_cost_s_},
              {"unit_lambda", unit_lambda_},      {"unit_probed", unit_probed_},
              {"next_unit", next_unit_}};
}

void TriAccelDriver::state_from_json(const Json& j) {
  auto precisions = [](const std::vector<int>& v) {
    std::vector<Precision> out;
    for (int p : v) out.push_back(static_cast<Precision>(std::clamp(p, 0, 2)));
    return out;
  };
  try {
    state_.windows = j.at("windows").get<int64_t>();
    state_.calibrated = j.at("calibrated").get<bool>();
    state_.curv_calibrated = j.at("curv_calibrated").get<bool>();
    state_.tau_low = j.at("tau_low").get<double>();
    state_.tau_high = j.at("tau_high").get<double>();
    state_.tau_curv = j.at("tau_curv").get<double>();
    state_.ema = j.at("ema").get<std::vector<double>>();
    state_.lambda_max = j.at("lambda_max").get<std::vector<double>>();
    state_.base = precisions(j.at("base").get<std::vector<int>>());
    state_.precision = precisions(j.at("precision").get<std::vector<int>>());
    state_.dwell = j.at("dwell").get<std::vector<int>>();
    state_.promoted = j.at("promoted").get<std::vector<bool>>();
    pending_lambda_ = j.at("pending_lambda").get<std::vector<double>>();
    unit_lr_scale_ = j.at("unit_lr_scale").get<std::vector<double>>();
    alpha_ = j.at("alpha").get<double>();
    probe_seconds_ = j.at("probe_seconds").get<double>();
    probes_ = j.at("probes").get<int64_t>();
    next_probe_step_ = j.at("next_probe_step").get<int64_t>();
    if (j.contains("unit_cost_s")) {
      probe_credit_s_ = j.at("probe_credit_s").get<double>();
      unit_cost_s_ = j.at("unit_cost_s").get<std::vector<double>>();
      unit_lambda_ = j.at("unit_lambda").get<std::vector<double>>();
      unit_probed_ = j.at("unit_probed").get<std::vector<bool>>();
      next_unit_ = j.at("next_unit").get<int64_t>();
    }
  } catch (const Json::exception&) {
    throw UserError("checkpoint has an unreadable Tri-Accel state; resume with the same --method or start afresh");
  }
  TRIACCEL_CHECK_INPUT(unit_lr_scale_.size() == model_.units().size(),
                       "checkpoint's Tri-Accel state is for another model");
  apply_lr_scales();
  if (options_.ta_precision && !state_.precision.empty()) step_.set_unit_precisions(state_.precision);
}

}  // namespace triaccel
