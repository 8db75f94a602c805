#include "triaccel/control/precision/precision_controller.h"

#include "triaccel/core/errors.h"
#include "triaccel/train/grad_stats.h"

#include <algorithm>

namespace triaccel {

std::string precision_reason(const PrecisionState& state, size_t u) {
  if (!state.calibrated) return "calibrating";
  if (u < state.promoted.size() && state.promoted[u]) return "curvature";
  switch (state.base[u]) {
    case Precision::kFP8:
    case Precision::kFP16: return "low variance";
    case Precision::kFP32: return "high variance";
    default: return "variance";
  }
}

std::vector<Precision> PrecisionController::affordable(const std::vector<Precision>& before,
                                                       const std::vector<Precision>& wanted) {
  memory_refused_.assign(wanted.size(), false);
  std::vector<Precision> asked = wanted;
  if (fits_ && hold_curvature_) {
    // Under a budget a promotion by curvature stays where it was, unasked: the plan's price for one was wrong every
    // time it was measured (each ran a step or its capture out of memory, and the re-plans that followed ran slower
    // micro-batches for epochs; measured: docs/results/memory-planner.md).
    for (size_t u = 0; u < asked.size() && u < before.size() && u < state_.promoted.size(); ++u) {
      if (state_.promoted[u] && asked[u] > before[u]) {
        asked[u] = before[u];
        memory_refused_[u] = true;
      }
    }
  }
  bool raised = before.size() != asked.size();
  for (size_t u = 0; u < asked.size() && !raised; ++u) raised = asked[u] > before[u];
  if (!fits_ || !raised) return asked;
  const bool known_refusal = std::find(refused_.begin(), refused_.end(), asked) != refused_.end();
  if (!known_refusal && fits_(asked)) return asked;
  if (!known_refusal) refused_.push_back(asked);
  std::vector<Precision> held = asked;
  for (size_t u = 0; u < held.size(); ++u) {
    if (u < before.size() && held[u] > before[u]) {
      held[u] = before[u];
      memory_refused_[u] = true;
    }
  }
  return held;
}

PrecisionController::PrecisionController(PrecisionPolicyOptions policy, int64_t ctrl_every, const Model& model,
                                         Optimizer& optimizer, TrainStep& step, const c10::Device& device)
    : policy_(policy), ctrl_every_(ctrl_every), model_(model), step_(step), device_(device) {
  policy_.validate();
  const auto n_units = static_cast<int64_t>(model_.units().size());
  step_.grad_stats_enable(GradStatsLayout(optimizer.params(), model_unit_of_params(model_, optimizer.params()), n_units));
  step_.set_unit_precisions(std::vector<Precision>(static_cast<size_t>(n_units), policy_.default_precision));
}

Events PrecisionController::after_step(StepContext& ctx) {
  Events events;
  if (ctx.step % ctrl_every_ != 0) return events;
  const at::Tensor stats = step_.grad_stats_take();  // (U, columns) on the CPU
  std::vector<UnitPrecisionSignal> signals;
  for (int64_t u = 0; u < stats.size(0); ++u) {
    const double lambda = ctx.unit_lambda_max.empty() ? -1.0 : ctx.unit_lambda_max[static_cast<size_t>(u)];
    signals.push_back({stats[u][kGradStatsVar].item<double>(), lambda});
  }
  const std::vector<Precision> before = step_.unit_precisions();
  state_ = precision_policy_step(policy_, state_, signals);
  state_.precision = affordable(before, state_.precision);
  raised_from_.clear();
  for (size_t u = 0; u < state_.precision.size() && u < before.size(); ++u) {
    if (state_.precision[u] > before[u]) raised_from_ = before;
  }
  step_.set_unit_precisions(state_.precision);
  Json units = Json::array(), names = Json::array(), applied = Json::array();
  for (const auto& u : model_.units()) units.push_back(u.name);
  Json reasons = Json::array();
  for (size_t u = 0; u < state_.precision.size(); ++u) {
    names.push_back(enum_name(state_.precision[u]));
    applied.push_back(enum_name(precision_applied(state_.precision[u], device_)));
    reasons.push_back(memory_refused_[u] ? std::string("memory") : precision_reason(state_, u));
  }
  events.push_back({event::kPrecision, Json{{"units", units},
                                            {"precision", names},
                                            {"applied", applied},
                                            {"reason", reasons},
                                            {"grad_var_ema", state_.ema},
                                            {"promoted", state_.promoted},
                                            {"tau_low", state_.tau_low},
                                            {"tau_high", state_.tau_high},
                                            {"tau_curv", state_.tau_curv},
                                            {"calibrated", state_.calibrated},
                                            {"changed", before != state_.precision}}});
  return events;
}

bool PrecisionController::revert_raise() {
  if (raised_from_.empty()) return false;
  refused_.push_back(state_.precision);
  state_.precision = raised_from_;
  raised_from_.clear();
  step_.set_unit_precisions(state_.precision);
  return true;
}

Json PrecisionController::state() const {
  auto ints = [](const std::vector<Precision>& v) {
    std::vector<int> out;
    for (Precision p : v) out.push_back(static_cast<int>(p));
    return out;
  };
  return Json{{"windows", state_.windows},     {"calibrated", state_.calibrated},
              {"curv_calibrated", state_.curv_calibrated}, {"tau_low", state_.tau_low},
              {"tau_high", state_.tau_high},   {"tau_curv", state_.tau_curv},
              {"ema", state_.ema},             {"lambda_max", state_.lambda_max},
              {"base", ints(state_.base)},     {"precision", ints(state_.precision)},
              {"dwell", state_.dwell},         {"promoted", state_.promoted}};
}

void PrecisionController::restore(const Json& j) {
  auto precisions = [](const std::vector<int>& v) {
    std::vector<Precision> out;
    for (int p : v) out.push_back(static_cast<Precision>(std::clamp(p, -1, 2)));
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
  } catch (const Json::exception&) {
    throw UserError(str_cat("checkpoint has an unreadable Tri-Accel state; resume with the same ",
                            option_ref("method"), " or start afresh"));
  }
  if (!state_.precision.empty()) step_.set_unit_precisions(state_.precision);
}

}  // namespace triaccel
