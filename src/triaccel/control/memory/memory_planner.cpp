// The memory planner's solver; see memory_planner.h for the cost model.
#include "triaccel/control/memory/memory_planner.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace triaccel {
namespace {

// Buckets of the dynamic program's byte axis: bytes are rounded up to a bucket, so a set the program accepts fits,
// and its exact peak is checked again afterwards.
constexpr int kBuckets = 1024;

double total_flops(const MemoryModel& model) {
  double s = 0;
  for (const UnitCost& u : model.units) s += u.flops;
  return s;
}

bool worth_recomputing(const UnitCost& u) { return u.recomputable && u.saved_bytes > u.input_bytes; }

// Bytes that do not scale with the micro-batch.
double base_bytes(const MemoryModel& model, int64_t batch, DataPlacement placement) {
  const double data = placement == DataPlacement::kDevice ? model.dataset_bytes : model.stream_bytes;
  return model.weights_bytes + model.grads_bytes + model.optimizer_bytes + model.fixed_bytes + data +
         static_cast<double>(batch) * model.batch_input_bytes;
}

// Activation bytes per sample of the micro-batch, before the scale. Backward runs the units in reverse: when it
// starts, every kept unit's activations and every recomputed unit's input are alive; when it reaches a recomputed
// unit u, the units after u are freed and u's activations are alive again beside everything before u.
double activation_bytes(const MemoryModel& model, const std::vector<bool>& recompute) {
  double prefix = 0, peak = 0;
  for (size_t u = 0; u < model.units.size(); ++u) {
    const UnitCost& c = model.units[u];
    if (u < recompute.size() && recompute[u]) {
      peak = std::max(peak, prefix + c.input_bytes + c.saved_bytes);
      prefix += c.input_bytes;
    } else {
      prefix += c.saved_bytes;
    }
  }
  return std::max(peak, prefix) + model.transient_bytes;
}

int64_t micro_batches(int64_t batch, int64_t micro) { return (batch + micro - 1) / micro; }

// The least-FLOPs recompute set whose activations (per sample, before the scale) stay within `room`: a dynamic
// program over the units in order whose state is the bytes alive before the next unit (rounded up to buckets).
bool recompute_search(const MemoryModel& model, double room, std::vector<bool>* chosen) {
  const size_t n = model.units.size();
  chosen->assign(n, false);
  room -= model.transient_bytes;
  if (room < 0) return false;
  const double quantum = std::max(room / kBuckets, 1e-12);
  const auto buckets = [&](double bytes) { return static_cast<int>(std::ceil(bytes / quantum - 1e-9)); };
  const double inf = std::numeric_limits<double>::infinity();
  // cost[u][b]: least FLOPs over units [0, u) with b buckets alive after them; choice[u][b]: recompute unit u-1.
  std::vector<std::vector<double>> cost(n + 1, std::vector<double>(kBuckets + 1, inf));
  std::vector<std::vector<char>> took(n + 1, std::vector<char>(kBuckets + 1, 0));
  std::vector<std::vector<int>> from(n + 1, std::vector<int>(kBuckets + 1, -1));
  cost[0][0] = 0;
  for (size_t u = 0; u < n; ++u) {
    const UnitCost& c = model.units[u];
    const int keep = buckets(c.saved_bytes), in = buckets(c.input_bytes), during = buckets(c.input_bytes + c.saved_bytes);
    for (int b = 0; b <= kBuckets; ++b) {
      if (!std::isfinite(cost[u][b])) continue;
      if (b + keep <= kBuckets && cost[u][b] < cost[u + 1][b + keep]) {
        cost[u + 1][b + keep] = cost[u][b];
        took[u + 1][b + keep] = 0;
        from[u + 1][b + keep] = b;
      }
      if (worth_recomputing(c) && b + during <= kBuckets && b + in <= kBuckets) {
        const double f = cost[u][b] + std::max(c.flops, 1e-30);
        if (f < cost[u + 1][b + in]) {
          cost[u + 1][b + in] = f;
          took[u + 1][b + in] = 1;
          from[u + 1][b + in] = b;
        }
      }
    }
  }
  int best = -1;
  for (int b = 0; b <= kBuckets; ++b) {
    if (std::isfinite(cost[n][b]) && (best < 0 || cost[n][b] < cost[n][best])) best = b;
  }
  if (best < 0) return false;
  for (size_t u = n; u > 0; --u) {
    (*chosen)[u - 1] = took[u][best] != 0;
    best = from[u][best];
  }
  return true;
}

// The cheapest recompute set that fits `budget` at this micro-batch and placement; false when none does.
bool fit_recompute(const MemoryModel& model, int64_t batch, int64_t micro, DataPlacement placement, double budget,
                   std::vector<bool>* best) {
  const double room = (budget - base_bytes(model, batch, placement)) /
                      (static_cast<double>(micro) * model.activation_scale);
  best->assign(model.units.size(), false);
  if (activation_bytes(model, *best) <= room) return true;  // nothing to recompute (exact, no rounding)
  if (!recompute_search(model, room, best)) return false;
  return memory_plan_peak(model, batch, micro, *best, placement) <= budget;  // the rounding, never trusted
}

// The least room (activation bytes per sample, before the scale) in which the search still finds a recompute set:
// a budget that leaves this room fits a plan at micro-batch 1.
double least_activation_bytes(const MemoryModel& model) {
  std::vector<bool> all_kept(model.units.size(), false), r;
  double hi = activation_bytes(model, all_kept), lo = model.transient_bytes;
  for (int i = 0; i < 40; ++i) {
    const double mid = (lo + hi) / 2;
    (recompute_search(model, mid, &r) ? hi : lo) = mid;
  }
  return hi;
}

// The least any plan needs: micro-batches of 1, the recompute set that holds least, the data where it takes least —
// each unless the constraints fix it (a placement, micro-batch or recompute set given by hand).
double floor_bytes(const MemoryModel& model, int64_t batch, const PlanConstraints& constraints) {
  double base = base_bytes(model, batch, constraints.placement_fixed ? constraints.placement : DataPlacement::kDevice);
  if (!constraints.placement_fixed && model.allow_host_data) {
    base = std::min(base, base_bytes(model, batch, DataPlacement::kHost));
  }
  const double micro = constraints.micro_batch > 0 ? static_cast<double>(std::min(constraints.micro_batch, batch)) : 1;
  const double activations =
      constraints.recompute.empty() ? least_activation_bytes(model) : activation_bytes(model, constraints.recompute);
  return base + micro * model.activation_scale * activations;
}

}  // namespace

double memory_plan_peak(const MemoryModel& model, int64_t batch, int64_t micro_batch,
                        const std::vector<bool>& recompute, DataPlacement placement) {
  return base_bytes(model, batch, placement) +
         static_cast<double>(micro_batch) * model.activation_scale * activation_bytes(model, recompute);
}

double memory_plan_step_s(const MemoryModel& model, int64_t batch, int64_t micro_batch,
                          const std::vector<bool>& recompute, DataPlacement placement) {
  const double flops = total_flops(model);
  double recomputed = 0;
  for (size_t u = 0; u < model.units.size() && u < recompute.size(); ++u) {
    recomputed += recompute[u] ? model.units[u].flops : 0;
  }
  const double share = flops > 0 ? model.forward_share * recomputed / flops : 0;
  const double k = static_cast<double>(micro_batches(batch, micro_batch));
  const double stream = placement == DataPlacement::kHost ? model.stream_per_sample_s * static_cast<double>(batch) : 0;
  return k * model.overhead_s + static_cast<double>(batch) * model.per_sample_s * (1 + share) + stream;
}

double memory_model_seconds_per_unit(const MemoryModel& model, double flops_per_s) {
  const double step_flops = total_flops(model) / std::max(model.forward_share, 1e-9);
  return step_flops / std::max(flops_per_s, 1e-30) / std::max(model.per_sample_s, 1e-30);
}

double memory_plan_epoch_s(const MemoryModel& model, const MemoryPlan& plan, const EpochSamples& samples,
                           double flops_per_s) {
  if (!plan.feasible || plan.batch <= 0 || plan.micro_batch <= 0) return std::numeric_limits<double>::infinity();
  const int64_t full = samples.train / plan.batch, rest = samples.train % plan.batch;
  double units = static_cast<double>(full) *
                 memory_plan_step_s(model, plan.batch, plan.micro_batch, plan.recompute, plan.data_placement);
  if (rest > 0) {
    units += memory_plan_step_s(model, rest, std::min(plan.micro_batch, rest), plan.recompute, plan.data_placement);
  }
  if (samples.eval > 0) {
    const double batches = static_cast<double>(micro_batches(samples.eval, plan.micro_batch));
    units += model.forward_share *
             (batches * model.overhead_s + static_cast<double>(samples.eval) * model.per_sample_s);
  }
  return units * memory_model_seconds_per_unit(model, flops_per_s);
}

MemoryPlan memory_plan_solve(const MemoryModel& model, int64_t batch, int64_t budget_bytes,
                             const PlanConstraints& constraints) {
  MemoryPlan plan;
  plan.batch = batch;
  plan.budget_bytes = budget_bytes;
  plan.floor_bytes = floor_bytes(model, batch, constraints);
  const std::vector<bool> none(model.units.size(), false);
  const double budget = budget_bytes > 0 ? static_cast<double>(budget_bytes) : std::numeric_limits<double>::infinity();
  // Micro-batch sizes worth trying: ceil(B / k) for every k (larger k with the same size only adds steps); without
  // a budget, the whole batch.
  std::vector<int64_t> micros;
  if (constraints.micro_batch > 0) {
    micros.push_back(std::min(constraints.micro_batch, batch));
  } else if (budget_bytes <= 0) {
    micros.push_back(batch);
  } else {
    for (int64_t k = 1; k <= batch; ++k) {
      const int64_t m = (batch + k - 1) / k;
      if (micros.empty() || m != micros.back()) micros.push_back(m);
    }
  }
  std::vector<DataPlacement> placements{DataPlacement::kDevice};
  if (constraints.placement_fixed) {
    placements = {constraints.placement};
  } else if (model.allow_host_data && budget_bytes > 0) {
    placements.push_back(DataPlacement::kHost);
  }
  const bool recompute_fixed = !constraints.recompute.empty();
  double best_s = std::numeric_limits<double>::infinity();
  for (DataPlacement p : placements) {
    for (int64_t m : micros) {
      // A lower bound of every plan at this or a smaller micro-batch: nothing recomputed.
      if (memory_plan_step_s(model, batch, m, none, p) >= best_s) break;
      std::vector<bool> r;
      if (recompute_fixed) {
        r = constraints.recompute;
        if (memory_plan_peak(model, batch, m, r, p) > budget) continue;
      } else if (budget_bytes <= 0) {
        r = none;
      } else if (!fit_recompute(model, batch, m, p, budget, &r)) {
        continue;
      }
      const double s = memory_plan_step_s(model, batch, m, r, p);
      if (s < best_s) {
        best_s = s;
        plan.feasible = true;
        plan.micro_batch = m;
        plan.accumulation = micro_batches(batch, m);
        plan.recompute = r;
        plan.data_placement = p;
        plan.predicted_step_s = s;
        plan.predicted_peak_bytes = memory_plan_peak(model, batch, m, r, p);
      }
    }
  }
  return plan;
}

std::vector<std::string> MemoryPlan::recompute_names(const MemoryModel& model) const {
  std::vector<std::string> out;
  for (size_t u = 0; u < recompute.size() && u < model.units.size(); ++u) {
    if (recompute[u]) out.push_back(model.units[u].name);
  }
  return out;
}

Json MemoryPlan::to_json(const MemoryModel& model) const {
  // Per unit, what its activations hold at the micro-batch (its input alone when recomputed); the consumers that
  // do not scale with it. The report draws both (report/run_model.h).
  Json units = Json::array();
  const double per_micro = static_cast<double>(micro_batch) * model.activation_scale;
  for (size_t u = 0; u < model.units.size(); ++u) {
    const UnitCost& c = model.units[u];
    const bool r = u < recompute.size() && recompute[u];
    units.push_back(Json{{"unit", c.name},
                         {"recompute", r},
                         {"activation_bytes", static_cast<int64_t>(per_micro * (r ? c.input_bytes : c.saved_bytes))}});
  }
  const double data = data_placement == DataPlacement::kDevice ? model.dataset_bytes : model.stream_bytes;
  const auto whole = [](double b) { return static_cast<int64_t>(std::ceil(b)); };
  const Json consumers{{"weights", whole(model.weights_bytes)},
                       {"gradients", whole(model.grads_bytes)},
                       {"optimizer", whole(model.optimizer_bytes)},
                       {"data", whole(data + static_cast<double>(batch) * model.batch_input_bytes)},
                       {"fixed", whole(model.fixed_bytes)},
                       {"transient", whole(per_micro * model.transient_bytes)}};
  return Json{{"feasible", feasible},
              {"batch", batch},
              {"micro_batch", micro_batch},
              {"accumulation", accumulation},
              {"recompute", recompute_names(model)},
              {"data_placement", enum_name(data_placement)},
              {"predicted_peak_bytes", static_cast<int64_t>(std::ceil(predicted_peak_bytes))},
              {"plan_limit_bytes", budget_bytes},
              {"floor_bytes", static_cast<int64_t>(std::ceil(floor_bytes))},
              {"predicted_step_s", predicted_step_s},
              {"activation_scale", model.activation_scale},
              {"units", units},
              {"consumers", consumers}};
}

bool MemoryPlan::operator==(const MemoryPlan& o) const {
  return feasible == o.feasible && batch == o.batch && micro_batch == o.micro_batch &&
         accumulation == o.accumulation && recompute == o.recompute && data_placement == o.data_placement;
}

}  // namespace triaccel
