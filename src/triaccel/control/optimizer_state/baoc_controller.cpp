#include "triaccel/control/optimizer_state/baoc_controller.h"

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
      throw UserError(option_ref("optim_formats") + ": " + e.what());
    }
  }
  TRIACCEL_CHECK_INPUT(!out.empty(), option_ref("optim_formats"), " must name at least one format");
  return out;
}

std::vector<FormatPlanUnit> baoc_plan_units(const Model& model, const std::vector<at::Tensor>& params) {
  std::vector<FormatPlanUnit> units;
  for (const auto& u : model.units()) {
    FormatPlanUnit in{u.name, {}};
    for (const auto& m : u.modules) {
      for (const auto& sub : m->modules(/*include_self=*/true)) {
        if (sub->as<torch::nn::EmbeddingImpl>() != nullptr) in.lookup = true;
      }
    }
    units.push_back(std::move(in));
  }
  const std::vector<int64_t> unit_of = model_unit_of_params(model, params);
  for (size_t i = 0; i < params.size(); ++i) {
    units[static_cast<size_t>(unit_of[i])].shapes.push_back(params[i].sizes().vec());
  }
  return units;
}

FormatPlanOptions baoc_format_plan_options(const BaocControllerOptions& options) {
  FormatPlanOptions plan;
  plan.memory_budget = options.memory_budget;
  plan.time_budget = options.time_budget;
  plan.formats = optim_formats_parse(options.formats);
  plan.risk.unit_floor = options.risk_floor;
  if (!options.time_table.empty()) plan.time_model = step_time_model_from_bench(options.time_table);
  return plan;
}

BaocController::BaocController(BaocControllerOptions options, const Model& model, BaocOptimizer& optimizer,
                               std::function<void()> step_changed, int64_t next_step)
    : options_(std::move(options)),
      optimizer_(optimizer),
      step_changed_(std::move(step_changed)),
      unit_of_tensor_(model_unit_of_params(model, optimizer.params())),
      plan_units_(baoc_plan_units(model, optimizer.params())),
      plan_options_(baoc_format_plan_options(options_)) {
  // Budgets that no plan can meet fail now, not after the warm-up (feasibility does not depend on the signals).
  budget_bytes_ = format_plan_solve(plan_units_, std::vector<UnitSignals>(plan_units_.size()), plan_options_).budget_bytes;
  window_sync(next_step);
}

int64_t BaocController::state_bytes_freed() const {
  if (plans_ == 0) return 0;
  int64_t warmup = 0, window = 0;
  for (size_t i = 0; i < optimizer_.params().size(); ++i) {
    if (!optimizer_.owned(i)) continue;
    const at::Tensor& p = optimizer_.params()[i];
    warmup += state_format_bytes(StateFormat::kAdamW32, p.sizes().vec());
    window += 4 * p.numel();  // the previous gradient, float32
  }
  int64_t kept = optimizer_.state_bytes();
  if (options_.replan_every > 0) kept = std::max(kept, std::min(budget_bytes_, warmup));
  return std::max<int64_t>(0, warmup - kept) + (options_.replan_every > 0 ? 0 : window);
}

bool BaocController::is_plan_step(int64_t step) const {
  const int64_t w = options_.plan_warmup;
  if (step == w) return true;
  return options_.replan_every > 0 && step > w && (step - w) % options_.replan_every == 0;
}

bool BaocController::in_window(int64_t step) const {
  const int64_t w = options_.plan_warmup;
  if (step <= w) return step >= 1;
  if (options_.replan_every <= 0) return false;
  const int64_t window = std::min(w, options_.replan_every);
  const int64_t next_plan = w + ((step - w + options_.replan_every - 1) / options_.replan_every) * options_.replan_every;
  return step > next_plan - window;
}

void BaocController::window_sync(int64_t next_step) {
  const bool on = in_window(next_step);
  if (on == optimizer_.stream_stats_enabled()) return;
  optimizer_.stream_stats_enable(on);
  if (step_changed_) step_changed_();
}

Events BaocController::after_step(StepContext& ctx) {
  Events events;
  const int64_t step = ctx.step;
  if (is_plan_step(step)) {
    // The plan's signals and conversions are a transient between steps: measured apart from the steps' readings.
    FormatPlan plan;
    std::vector<StateFormat> before;
    const auto replan = [&] {
      const at::Tensor sums = optimizer_.stream_stats_take();
      signals_ = baoc_signals(optimizer_, sums, unit_of_tensor_, static_cast<int64_t>(plan_units_.size()), signals_);
      plan = format_plan_solve(plan_units_, signals_, plan_options_);
      std::vector<StateFormat> formats(unit_of_tensor_.size());
      for (size_t i = 0; i < formats.size(); ++i) {
        formats[i] = plan.units[static_cast<size_t>(unit_of_tensor_[i])].format;
      }
      before = optimizer_.formats();
      optimizer_.formats_set(formats);
    };
    if (ctx.memory != nullptr) {
      ctx.memory->measure(replan);
    } else {
      replan();
    }
    if (optimizer_.formats() != before && step_changed_) step_changed_();
    ++plans_;
    Json fields = format_plan_to_json(plan);
    fields["plan"] = plans_;
    fields["state_bytes"] = optimizer_.state_bytes();
    events.push_back({event::kOptimPlan, fields});
  }
  window_sync(step + 1);
  return events;
}

Json BaocController::state() const {
  Json sig = Json::array();
  for (const auto& s : signals_) {
    sig.push_back(Json{s.params, s.cos_successive, s.cos_momentum, s.snr, s.log_v_spread, s.precond_error,
                       s.factor_error, s.quant_error_bf16, s.quant_error_8bit});
  }
  return Json{{"plans", plans_}, {"signals", sig}};
}

void BaocController::restore(const Json& j) {
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
    throw UserError("checkpoint has an unreadable BAOC format plan state");
  }
}

}  // namespace triaccel
