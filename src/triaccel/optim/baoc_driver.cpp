#include "triaccel/optim/baoc_driver.h"

#include "triaccel/core/errors.h"
#include "triaccel/optim/signals.h"

#include <torch/nn/modules/embedding.h>

#include <algorithm>
#include <sstream>

namespace triaccel {

std::vector<StateFormat> optim_formats_parse(const std::string& text) {
  if (text.empty() || text == "all") return state_formats_all();
  std::vector<StateFormat> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    try {
      const StateFormat f = state_format_parse(item);
      if (std::find(out.begin(), out.end(), f) == out.end()) out.push_back(f);
    } catch (const UserError& e) {
      throw UserError(std::string("--optim-formats: ") + e.what());
    }
  }
  TRIACCEL_CHECK_INPUT(!out.empty(), "--optim-formats must name at least one format");
  return out;
}

std::vector<int64_t> baoc_unit_of_tensor(const Model& model, const std::vector<at::Tensor>& params) {
  std::vector<int64_t> out(params.size(), -1);
  const auto& units = model.units();
  for (size_t u = 0; u < units.size(); ++u) {
    for (const auto& p : units[u].parameters()) {
      for (size_t i = 0; i < params.size(); ++i) {
        if (params[i].is_same(p)) out[i] = static_cast<int64_t>(u);
      }
    }
  }
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(out[i] >= 0, "baoc: optimizer tensor ", i, " belongs to no unit of the model");
  }
  return out;
}

BaocDriver::BaocDriver(const TrainOptions& options, const Model& model, BaocOptimizer& optimizer,
                       std::function<void()> invalidate_graph, int64_t next_step)
    : options_(options), optimizer_(optimizer), invalidate_graph_(std::move(invalidate_graph)) {
  unit_of_tensor_ = baoc_unit_of_tensor(model, optimizer.params());
  for (const auto& u : model.units()) {
    unit_names_.push_back(u.name);
    PlanUnitInput in{u.name, {}};
    for (const auto& m : u.modules) {
      for (const auto& sub : m->modules(/*include_self=*/true)) {
        if (sub->as<torch::nn::EmbeddingImpl>() != nullptr) in.lookup = true;
      }
    }
    plan_units_.push_back(std::move(in));
  }
  for (size_t i = 0; i < optimizer.params().size(); ++i) {
    plan_units_[static_cast<size_t>(unit_of_tensor_[i])].shapes.push_back(optimizer.params()[i].sizes().vec());
  }
  planner_.memory_budget = options.optim_memory_budget;
  planner_.time_budget = options.optim_time_budget;
  planner_.formats = optim_formats_parse(options.optim_formats);
  planner_.risk.unit_floor = options.optim_risk_floor;
  if (!options.optim_time_table.empty()) planner_.time_model = step_time_model_from_bench(options.optim_time_table);
  // Budgets that no plan can meet fail now, not after the warm-up (feasibility does not depend on the signals).
  plan_solve(plan_units_, std::vector<UnitSignals>(plan_units_.size()), planner_);
  window_sync(next_step);
}

bool BaocDriver::is_plan_step(int64_t step) const {
  const int64_t w = options_.plan_warmup;
  if (step == w) return true;
  return options_.replan_every > 0 && step > w && (step - w) % options_.replan_every == 0;
}

bool BaocDriver::in_window(int64_t step) const {
  const int64_t w = options_.plan_warmup;
  if (step <= w) return step >= 1;
  if (options_.replan_every <= 0) return false;
  const int64_t window = std::min(w, options_.replan_every);
  const int64_t next_plan = w + ((step - w + options_.replan_every - 1) / options_.replan_every) * options_.replan_every;
  return step > next_plan - window;
}

void BaocDriver::window_sync(int64_t next_step) {
  const bool on = in_window(next_step);
  if (on == optimizer_.stream_stats_enabled()) return;
  optimizer_.stream_stats_enable(on);
  if (invalidate_graph_) invalidate_graph_();
}

std::vector<std::pair<std::string, Json>> BaocDriver::after_step(int64_t step) {
  std::vector<std::pair<std::string, Json>> events;
  if (is_plan_step(step)) {
    const at::Tensor sums = optimizer_.stream_stats_take();
    signals_ = baoc_signals(optimizer_, sums, unit_of_tensor_, static_cast<int64_t>(plan_units_.size()), signals_);
    const Plan plan = plan_solve(plan_units_, signals_, planner_);
    std::vector<StateFormat> formats(unit_of_tensor_.size());
    for (size_t i = 0; i < formats.size(); ++i) formats[i] = plan.units[static_cast<size_t>(unit_of_tensor_[i])].format;
    const std::vector<StateFormat> before = optimizer_.formats();
    optimizer_.formats_set(formats);
    if (formats != before && invalidate_graph_) invalidate_graph_();
    ++plans_;
    Json fields = plan_to_json(plan);
    fields["plan"] = plans_;
    fields["state_bytes"] = optimizer_.state_bytes();
    events.emplace_back("plan", fields);
  }
  window_sync(step + 1);
  return events;
}

Json BaocDriver::state_to_json() const {
  Json sig = Json::array();
  for (const auto& s : signals_) {
    sig.push_back(Json{s.params, s.cos_successive, s.cos_momentum, s.snr, s.log_v_spread, s.precond_error,
                       s.factor_error, s.quant_error_bf16, s.quant_error_8bit});
  }
  return Json{{"plans", plans_}, {"signals", sig}};
}

void BaocDriver::state_from_json(const Json& j) {
  try {
    plans_ = j.at("plans").get<int64_t>();
    signals_.clear();
    for (const auto& a : j.at("signals")) {
      UnitSignals s;
      s.params = a.at(0).get<int64_t>();
      s.cos_successive = a.at(1).get<double>();
      s.cos_momentum = a.at(2).get<double>();
      s.snr = a.at(3).get<double>();
      s.log_v_spread = a.at(4).get<double>();
      s.precond_error = a.at(5).get<double>();
      s.factor_error = a.at(6).get<double>();
      s.quant_error_bf16 = a.at(7).get<double>();
      s.quant_error_8bit = a.at(8).get<double>();
      signals_.push_back(s);
    }
  } catch (const Json::exception&) {
    throw UserError("checkpoint has an unreadable BAOC planner state");
  }
}

}  // namespace triaccel
