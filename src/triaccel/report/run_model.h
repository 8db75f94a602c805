// One run's report data, built from its events (run_events.h): the row of the side-by-side table (the Tri-Accel
// paper's Table 1: accuracy, seconds per epoch, peak GB, efficiency score) and the series each chart draws.
// Invariants: eff_score = test_acc / (epoch_s × peak_gb), set only when all three are known and epoch_s, peak_gb > 0;
// a run whose events lack something has that chart key absent, never an empty series.
#pragma once

#include "triaccel/core/json.h"
#include "triaccel/report/run_events.h"

#include <optional>
#include <string>
#include <vector>

namespace triaccel {

// Where a table row's figures come from.
enum class TableSource { kSummary, kEpochEvents, kNone };
const char* table_source_name(TableSource s);

struct TableRow {
  std::string run, method, model, dataset, precision;
  std::optional<int64_t> epochs;
  std::optional<double> test_acc;   // percent: the summary's test_acc, else the last epoch's
  std::optional<double> epoch_s;    // the summary's epoch_s, else the mean of the last 5 epochs (docs/measuring.md)
  std::optional<double> peak_gb;    // the summary's peak_vram_gb, else the largest epoch peak_vram_gb
  std::optional<double> eff_score;  // test_acc / (epoch_s × peak_gb)
  TableSource source = TableSource::kNone;
  // Data-parallel ranks (world_size of its events; 1 for runs before it). With several, peak_gb is the largest
  // rank's peak (the epoch events' rank_peak_vram_gb), the figure a per-GPU budget is about.
  int64_t ranks = 1;
};

struct RunModel {
  std::string name, file;
  std::vector<std::string> problems;  // the reader's, then the model's (no summary, no figures)
  TableRow row;
  // What the page draws; each key present only when the run has its events:
  //   epochs     {epoch, time_s, train_loss, test_loss, train_acc, test_acc}: arrays, one entry per epoch event
  //   memory     {source, time_s, batch, current_gb, peak_gb, budget_gb}: from batch events (each control
  //              interval), else epoch events, else NeuroFlux block events; peak_gb is the running maximum of current_gb
  //   precision  {units, time_s, step, levels}: levels[unit][event] = the applied precision ("fp32", "bf16", ...)
  //   curvature  {units, lambda_max, probes}: each unit's last measured λ_max (null if never probed), probe count
  //   plan       {step, plans, units: [{unit, format, params, bytes, risk}], total_bytes, budget_bytes,
  //               adamw_fp32_bytes, total_risk}: the last BAOC plan event
  //   memory_plan {step, plans, reason, micro_batch, accumulation, data_placement, predicted_peak_bytes,
  //               measured_peak_bytes, budget_bytes, plan_limit_bytes, units: [{unit, recompute, activation_bytes}],
  //               consumers: {weights, gradients, optimizer, data, fixed, transient}}: the last memory_plan event
  //   blocks     {unit, block, train_acc, holdout_acc, test_acc}: NeuroFlux per-unit local accuracies, in order
  //   exits      {unit, params, holdout_acc, test_acc, chosen, tolerance, full_params}: the NeuroFlux exit curve
  Json charts = Json::object();
};

RunModel run_model_build(const RunEvents& run);

// The page's view of a run: name, file, problems, row and charts as one JSON object.
Json run_model_json(const RunModel& model);

}  // namespace triaccel
