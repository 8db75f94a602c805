// The BAOC control loop, driven by the trainer after every optimizer step (docs/baoc.md):
//   steps 1 … W (W = --plan-warmup): every tensor in fp32 AdamW, gradient-stream statistics on;
//   after step W: signals → risk → allocation under the budgets → formats applied (state converted, moments kept);
//   every R = --replan-every steps after that (if R > 0): statistics over the last min(W, R) steps, then a re-plan.
// The driver owns the planner's memory (the last signals per unit) and applies decisions through the optimizer and
// the `invalidate_graph` callback (a captured CUDA graph must be dropped when the step's work changes: statistics
// switched on or off, state converted). It returns the events to log ("plan").
#pragma once

#include "triaccel/core/json.h"
#include "triaccel/models/model.h"
#include "triaccel/optim/baoc_optimizer.h"
#include "triaccel/optim/planner.h"
#include "triaccel/train/options.h"

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace triaccel {

// --optim-formats: "" = all; else comma-separated names (UserError for an unknown one).
std::vector<StateFormat> optim_formats_parse(const std::string& text);

// The unit of each optimizer tensor (params in the optimizer's order, matched to the model's units by identity).
std::vector<int64_t> baoc_unit_of_tensor(const Model& model, const std::vector<at::Tensor>& params);

class BaocDriver {
 public:
  // `next_step`: the 1-based number of the next optimizer step (progress.step + 1; > 1 on resume).
  BaocDriver(const TrainOptions& options, const Model& model, BaocOptimizer& optimizer,
             std::function<void()> invalidate_graph, int64_t next_step);

  std::vector<std::pair<std::string, Json>> after_step(int64_t step);

  // The planner's inputs for this model and the options' budgets (also used by tests and the plan CLI).
  const std::vector<PlanUnitInput>& plan_units() const { return plan_units_; }
  const PlannerOptions& planner_options() const { return planner_; }
  const std::vector<UnitSignals>& signals() const { return signals_; }

  Json state_to_json() const;
  void state_from_json(const Json& json);

 private:
  bool is_plan_step(int64_t step) const;
  bool in_window(int64_t step) const;  // statistics are gathered during `step`
  void window_sync(int64_t next_step);

  const TrainOptions& options_;
  BaocOptimizer& optimizer_;
  std::function<void()> invalidate_graph_;
  std::vector<int64_t> unit_of_tensor_;
  std::vector<std::string> unit_names_;
  std::vector<PlanUnitInput> plan_units_;
  PlannerOptions planner_;
  std::vector<UnitSignals> signals_;
  int64_t plans_ = 0;
};

}  // namespace triaccel
