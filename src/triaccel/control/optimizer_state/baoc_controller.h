// The BAOC control loop as a StepController (docs/baoc.md):
//   steps 1 … W (W = plan_warmup): every tensor in fp32 AdamW, gradient-stream statistics on;
//   after step W: signals → risk → allocation under the budgets → formats applied (state converted, moments kept);
//   every R = replan_every steps after that (if R > 0): statistics over the last min(W, R) steps, then a re-plan.
// The controller owns the format plan's memory (the last signals per unit) and applies decisions through the optimizer
// and the step engine (a captured CUDA graph is dropped when the step's work changes: statistics switched on or off,
// state converted). Its event is event::kOptimPlan.
#pragma once

#include "triaccel/control/controller.h"
#include "triaccel/core/json.h"
#include "triaccel/models/model.h"
#include "triaccel/optim/baoc_optimizer.h"
#include "triaccel/control/optimizer_state/format_plan.h"

#include <functional>
#include <string>
#include <vector>

namespace triaccel {

// The `optim_formats` option: "" = all; else comma-separated names (UserError naming the option for an unknown one).
std::vector<StateFormat> optim_formats_parse(const std::string& text);

struct BaocControllerOptions {
  std::string memory_budget = "25%";  // optim_memory_budget
  std::string time_budget;            // optim_time_budget ("" = none)
  std::string formats;                // optim_formats ("" = all)
  std::string time_table;             // optim_time_table ("" = the bytes-moved model)
  double risk_floor = 1.0;            // optim_risk_floor
  int64_t plan_warmup = 50;
  int64_t replan_every = 0;
};

// The format plan's inputs for a model: one FormatPlanUnit per unit, with the shapes of its optimizer tensors.
std::vector<FormatPlanUnit> baoc_plan_units(const Model& model, const std::vector<at::Tensor>& params);
// The format plan's options from the controller's (budgets, menu, risk floor, time model).
FormatPlanOptions baoc_format_plan_options(const BaocControllerOptions& options);

class BaocController final : public StepController {
 public:
  // `next_step`: the 1-based number of the next optimizer step (> 1 on resume). `step_changed`: called when the
  // step's work changes (statistics on or off, state converted), so the engine drops its captured graph.
  BaocController(BaocControllerOptions options, const Model& model, BaocOptimizer& optimizer,
                 std::function<void()> step_changed, int64_t next_step);

  const char* state_key() const override { return "baoc"; }
  Events after_step(StepContext& ctx) override;
  Json state() const override;
  void restore(const Json& state) override;

  const std::vector<FormatPlanUnit>& plan_units() const { return plan_units_; }
  const FormatPlanOptions& plan_options() const { return plan_options_; }
  const std::vector<UnitSignals>& signals() const { return signals_; }
  // Bytes of this rank's optimizer consumer as the memory planner priced it for the warm-up (memory_setup.h,
  // optimizer_priced) that the run no longer needs: 0 before the first plan; after it, the fp32 AdamW state beyond
  // what the plan keeps (with re-plans, beyond the most a later plan may keep: the memory budget), and without
  // re-plans the statistics window's previous gradients (the window never opens again).
  int64_t state_bytes_freed() const;

 private:
  bool is_plan_step(int64_t step) const;
  bool in_window(int64_t step) const;  // statistics are gathered during `step`
  void window_sync(int64_t next_step);

  BaocControllerOptions options_;
  BaocOptimizer& optimizer_;
  std::function<void()> step_changed_;
  std::vector<int64_t> unit_of_tensor_;
  std::vector<FormatPlanUnit> plan_units_;
  FormatPlanOptions plan_options_;
  std::vector<UnitSignals> signals_;
  int64_t budget_bytes_ = 0;  // the format plan's memory budget, in bytes
  int64_t plans_ = 0;
};

}  // namespace triaccel
