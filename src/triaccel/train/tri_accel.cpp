#include "triaccel/train/tri_accel.h"

#include "triaccel/core/errors.h"
#include "triaccel/core/grad_stats.h"
#include "triaccel/core/io.h"

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
  double seconds = 0;
  const std::vector<UnitCurvature> curv =
      curvature_probe(model_, probe_images_, probe_labels_, curvature_options_, &seconds, &warm_start_);
  probe_seconds_ += seconds;
  probes_ += 1;
  std::vector<double> lambda;
  Json eigen = Json::array();
  int64_t products = 0;
  for (const auto& c : curv) {
    lambda.push_back(c.lambda_max);
    eigen.push_back(c.eigenvalues);
    products += c.iterations;
  }
  if (options_.ta_curvature) {
    if (alpha_ < 0) {
      // No manual tuning: α so that the 0.9-quantile unit gets half its rate (flat units keep nearly all of theirs).
      std::vector<double> positive;
      for (double l : lambda) {
        if (l > 0 && std::isfinite(l)) positive.push_back(l);
      }
      alpha_ = options_.curv_alpha >= 0 ? options_.curv_alpha
                                        : (positive.empty() ? 0.0 : 1.0 / quantile(positive, 0.9));
    }
    for (size_t u = 0; u < lambda.size(); ++u) {
      const double l = std::isfinite(lambda[u]) ? std::max(0.0, lambda[u]) : 0.0;
      unit_lr_scale_[u] = 1.0 / (1.0 + alpha_ * l);
    }
    apply_lr_scales();
  }
  pending_lambda_ = lambda;
  // Space the next probe so that probes take at most curv_budget of the training time (no manual tuning of T_curv
  // per model or GPU): gap ≥ probe_s / (budget · seconds per step), and never below curv_every.
  int64_t gap = options_.curv_every;
  if (options_.curv_budget > 0 && steps_since_probe_ > 0 && train_s_since_probe_ > 0) {
    const double step_s = train_s_since_probe_ / static_cast<double>(steps_since_probe_);
    gap = std::max<int64_t>(gap, static_cast<int64_t>(std::ceil(seconds / (options_.curv_budget * step_s))));
  }
  next_probe_step_ = step + gap;
  train_s_since_probe_ = 0;
  steps_since_probe_ = 0;
  events.emplace_back("curvature", Json{{"units", unit_names()},
                                        {"lambda_max", lambda},
                                        {"eigenvalues", eigen},
                                        {"lr_scale", unit_lr_scale_},
                                        {"alpha", alpha_},
                                        {"probe_s", seconds},
                                        {"hvp_products", products},
                                        {"probe_s_total", probe_seconds_},
                                        {"next_probe_step", next_probe_step_},
                                        {"lr_scaling", options_.ta_curvature}});
}

std::vector<std::pair<std::string, Json>> TriAccelDriver::after_step(int64_t step) {
  std::vector<std::pair<std::string, Json>> events;
  const double now = time_since_start_s();
  if (last_call_s_ >= 0) {
    train_s_since_probe_ += now - last_call_s_;
    steps_since_probe_ += 1;
  }
  const bool window = step % options_.ctrl_every == 0;
  const bool probe_due = next_probe_step_ < 0 ? window : step >= next_probe_step_;
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
              {"probes", probes_},                {"next_probe_step", next_probe_step_}};
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
  } catch (const Json::exception&) {
    throw UserError("checkpoint has an unreadable Tri-Accel state; resume with the same --method or start afresh");
  }
  TRIACCEL_CHECK_INPUT(unit_lr_scale_.size() == model_.units().size(),
                       "checkpoint's Tri-Accel state is for another model");
  apply_lr_scales();
  if (options_.ta_precision && !state_.precision.empty()) step_.set_unit_precisions(state_.precision);
}

}  // namespace triaccel
