// BAOC's format plan: budgets as users write them, the per-format step-time model, and one plan = for every unit, the
// state format minimizing the total risk (optim/risk.h) under the optimizer-state memory budget and the step-time
// budget (optim/allocation.h). Pure: unit shapes and signals in, a plan out.
#pragma once

#include "triaccel/core/json.h"
#include "triaccel/optim/allocation.h"
#include "triaccel/optim/risk.h"
#include "triaccel/optim/state_format.h"

#include <cstdint>
#include <string>
#include <vector>

namespace triaccel {

// "15%" (of fp32 AdamW's state bytes), or a size like "200MB" (core/bytes.h). UserError naming the flag.
int64_t optim_memory_budget_parse(const std::string& text, int64_t adamw_fp32_bytes);
// "" or "none": no limit (−1); "1.1x": a multiple of fp32 AdamW's step time (as the time model gives it).
double optim_time_budget_parse(const std::string& text, double adamw_fp32_seconds);

// Step time of one format per element, in seconds: defaults from the bytes each format moves per element (read
// param, grad and state, write param and state) at kModelBandwidth; the GPU micro-benchmark
// (bench/bench_optim_step.cpp) measures the real figures, which can replace these.
struct StepTimeModel {
  static constexpr double kModelBandwidth = 3.0e12;  // bytes / s (a Hopper GPU's HBM bandwidth, order of magnitude)
  std::vector<double> seconds_per_element;           // indexed by StateFormat
  std::string source = "bytes-moved model";          // or the benchmark file the times come from
  StepTimeModel();
  double seconds(StateFormat f, int64_t elements) const;
};

// The step times bench/bench_optim_step measured (its JSON: per format, the CUDA-graph median ms over `params`
// elements). UserError naming the file and what is missing.
StepTimeModel step_time_model_from_bench(const std::string& path);

struct FormatPlanUnit {
  std::string name;
  std::vector<std::vector<int64_t>> shapes;  // the unit's parameter tensors
  // The unit holds an embedding table (rows looked up by token id). Such a unit is offered only the formats that
  // keep per-element AdamW moments (fp32, bf16, 8-bit) when the menu has any: rows of rare tokens get rare, small
  // gradients that a scalar (SGD) or row/column (factored) second moment starves (docs/baoc.md, Lookup units).
  bool lookup = false;
};

// The formats of `menu` a unit may use: for a lookup unit, those with per-element AdamW moments if the menu has any
// (else the whole menu: an explicit uniform menu such as --optim-formats sgd stays uniform).
std::vector<StateFormat> format_plan_unit_menu(const FormatPlanUnit& unit, const std::vector<StateFormat>& menu);

struct FormatPlanOptions {
  std::string memory_budget = "25%";
  std::string time_budget;                       // "" = none
  std::vector<StateFormat> formats = state_formats_all();  // the menu
  RiskOptions risk;
  StepTimeModel time_model;
};

struct UnitFormatPlan {
  std::string name;
  bool lookup = false;  // FormatPlanUnit::lookup
  StateFormat format = StateFormat::kAdamW32;
  int64_t params = 0;
  int64_t bytes = 0;
  double risk = 0;
  double time_s = 0;
  UnitSignals signals;
};

struct FormatPlan {
  std::vector<UnitFormatPlan> units;
  int64_t bytes = 0;
  double risk = 0;
  double time_s = 0;
  int64_t budget_bytes = 0;
  double budget_time_s = -1;
  int64_t adamw_fp32_bytes = 0;
  double adamw_fp32_time_s = 0;
  std::string time_source;
};

// Throws UserError when no plan fits: the message names the budget, the minimum a plan needs and the flag to change.
FormatPlan format_plan_solve(const std::vector<FormatPlanUnit>& units, const std::vector<UnitSignals>& signals,
                const FormatPlanOptions& options);

Json format_plan_to_json(const FormatPlan& plan);

}  // namespace triaccel
