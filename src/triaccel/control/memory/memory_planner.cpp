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

bool update_in_backward_offered(const MemoryModel& model) { return model.update_in_backward_grads_bytes > 0; }

// The gradients' bytes alive at once.
double grads_at(const MemoryModel& model, bool update_in_backward) {
  return update_in_backward && update_in_backward_offered(model) ? model.update_in_backward_grads_bytes
                                                                 : model.grads_bytes;
}

// Bytes that do not scale with the micro-batch.
double base_bytes(const MemoryModel& model, int64_t batch, DataPlacement placement, bool update_in_backward) {
  const double data = placement == DataPlacement::kDevice ? model.dataset_bytes : model.stream_bytes;
  return model.weights_bytes + grads_at(model, update_in_backward) + model.optimizer_bytes + model.fixed_bytes +
         data + static_cast<double>(batch) * model.batch_input_bytes;
}

// What a unit may do under the constraints: bit 1 << UnitStore.
using StoreMask = unsigned;
constexpr StoreMask bit(UnitStore s) { return 1u << static_cast<unsigned>(s); }

bool fp8_offered(const UnitCost& u) { return u.fp8_bytes > 0 && u.fp8_bytes < u.saved_bytes; }
// Read from the allocator, recomputing a unit frees all of its saved bytes (its input stays counted where it was), so
// it is worth it whenever there are any; from the autograd graph, only what they hold beyond its input.
bool worth_recomputing(const MemoryModel& m, const UnitCost& u) {
  return u.recomputable && u.saved_bytes > (m.outputs_in_saved ? 0.0 : u.input_bytes);
}

bool flag_at(const std::vector<bool>& flags, size_t u) { return u < flags.size() && flags[u]; }

std::vector<StoreMask> store_masks(const MemoryModel& model, const PlanConstraints& c) {
  std::vector<StoreMask> masks;
  for (size_t u = 0; u < model.units.size(); ++u) {
    const UnitCost& unit = model.units[u];
    const bool fp8 = fp8_offered(unit) && (c.fp8_saved.empty() || flag_at(c.fp8_saved, u));
    // Asked for FP8 (the saved_activations option): FP8 instead of kept.
    StoreMask m = fp8 ? bit(UnitStore::kFp8) : 0;
    if (!(fp8 && !c.fp8_saved.empty())) m |= bit(UnitStore::kKeep);
    if (!c.recompute.empty()) {
      m = flag_at(c.recompute, u) ? bit(UnitStore::kRecompute) : m;
    } else if (worth_recomputing(model, unit)) {
      m |= bit(UnitStore::kRecompute);
    }
    masks.push_back(m);
  }
  return masks;
}

// Bytes unit u holds per sample once its forward ran (until backward reaches it), after a recomputed unit or not.
// Read from the allocator (outputs_in_saved), each unit's output is counted once: by the unit when it is kept or stored
// in FP8 (its bytes hold it), else by its reader — the next unit, whose checkpoint or graph keeps it — so a unit adds
// its input only after a recomputed unit (the first unit's input is the step's batch, counted with the data). Counted
// as its input by a recomputed unit after a kept one, the output was priced twice (GPT-char fp32: one 25 MB residual
// stream at micro-batch 64). Plans recomputing every block still read 12-14 % under their first prediction, the rest
// of it elsewhere (bench/results/h100/grid_rows_934576b).
double alive_bytes(const MemoryModel& m, size_t u, UnitStore s, bool after_recompute) {
  const UnitCost& c = m.units[u];
  const double input = m.outputs_in_saved && u > 0 && after_recompute ? c.input_bytes : 0.0;
  const double recomputed = m.outputs_in_saved ? 0.0 : c.input_bytes;  // a recomputed unit's: its checkpoint's input
  return input + (s == UnitStore::kRecompute ? recomputed : s == UnitStore::kFp8 ? c.fp8_bytes : c.saved_bytes);
}

// Bytes unit u holds per sample while backward runs it, beside the units before it and backward's transient term: a
// recomputed unit's activations made again beside what it held, an FP8-stored unit's largest tensor made again at its
// dtype. Where the allocator's peak over the unit's own forward and backward was read (backward_bytes), a recomputed
// unit holds that peak, its transients included, in place of its saved bytes and the model's transient term: backward
// frees the saved tensors it has read before it makes the largest gradients, so saved + transient over-priced a plan
// recomputing every block by 12-14 % (GPT-char and ViT-Tiny fp32, bench/results/h100/grid_rows_934576b).
double during_bytes(const MemoryModel& m, size_t u, UnitStore s, bool after_recompute) {
  const UnitCost& c = m.units[u];
  const double alive = alive_bytes(m, u, s, after_recompute);
  if (s == UnitStore::kRecompute) {
    return alive + (c.backward_bytes > 0 ? std::max(0.0, c.backward_bytes - m.transient_bytes) : c.saved_bytes);
  }
  return s == UnitStore::kFp8 ? alive + c.fp8_unpack_bytes : alive;
}

std::vector<UnitStore> stores_of(size_t n, const std::vector<bool>& recompute, const std::vector<bool>& fp8_saved) {
  std::vector<UnitStore> out(n, UnitStore::kKeep);
  for (size_t u = 0; u < n; ++u) {
    if (flag_at(recompute, u)) {
      out[u] = UnitStore::kRecompute;
    } else if (flag_at(fp8_saved, u)) {
      out[u] = UnitStore::kFp8;
    }
  }
  return out;
}

void stores_split(const std::vector<UnitStore>& stores, std::vector<bool>* recompute, std::vector<bool>* fp8_saved) {
  recompute->assign(stores.size(), false);
  fp8_saved->assign(stores.size(), false);
  for (size_t u = 0; u < stores.size(); ++u) {
    (*recompute)[u] = stores[u] == UnitStore::kRecompute;
    (*fp8_saved)[u] = stores[u] == UnitStore::kFp8;
  }
}

// Activation bytes per sample of the micro-batch, before the scale. Backward runs the units in reverse: when it
// starts, every unit's alive bytes are; when it reaches unit u, the units after u are freed and u's bytes while it
// runs (during_bytes) are alive beside everything before u.
double activation_bytes(const MemoryModel& model, const std::vector<UnitStore>& stores) {
  double prefix = 0, peak = 0;
  bool after_recompute = false;
  for (size_t u = 0; u < model.units.size(); ++u) {
    peak = std::max(peak, prefix + during_bytes(model, u, stores[u], after_recompute));
    prefix += alive_bytes(model, u, stores[u], after_recompute);
    after_recompute = stores[u] == UnitStore::kRecompute;
  }
  return std::max(peak, prefix) + model.transient_bytes;
}

// The time a unit's choice adds per sample, in per_sample_s's unit: a recompute repeats its share of the forward,
// FP8 storage pays its passes. Never 0 for either, so that keeping wins a tie.
double store_cost(const MemoryModel& model, double flops, const UnitCost& c, UnitStore s) {
  if (s == UnitStore::kRecompute) {
    return std::max(flops > 0 ? model.forward_share * model.per_sample_s * c.flops / flops : 0.0, 1e-30);
  }
  return s == UnitStore::kFp8 ? std::max(c.fp8_s, 1e-30) : 0.0;
}

int64_t micro_batches(int64_t batch, int64_t micro) { return (batch + micro - 1) / micro; }

// Each unit's cheapest allowed choice, memory aside.
std::vector<UnitStore> cheapest_stores(const std::vector<StoreMask>& masks) {
  std::vector<UnitStore> out;
  for (StoreMask m : masks) {
    out.push_back((m & bit(UnitStore::kKeep)) ? UnitStore::kKeep
                  : (m & bit(UnitStore::kFp8)) ? UnitStore::kFp8
                                               : UnitStore::kRecompute);
  }
  return out;
}

// The least-time choice per unit whose activations (per sample, before the scale) stay within `room`: a dynamic
// program over the units in order whose state is the bytes alive before the next unit (rounded up to buckets) and
// whether the unit before it was recomputed (what the next unit holds depends on it: alive_bytes).
bool store_search(const MemoryModel& model, const std::vector<StoreMask>& masks, double room,
                  std::vector<UnitStore>* chosen) {
  const size_t n = model.units.size();
  chosen->assign(n, UnitStore::kKeep);
  room -= model.transient_bytes;
  if (room < 0) return false;
  const double flops = total_flops(model);
  const double quantum = std::max(room / kBuckets, 1e-12);
  const auto buckets = [&](double bytes) {  // more than the room: kBuckets + 1 (no overflow of the int)
    return static_cast<int>(std::min(std::ceil(bytes / quantum - 1e-9), static_cast<double>(kBuckets + 1)));
  };
  const double inf = std::numeric_limits<double>::infinity();
  // State k = 2·b + r: b buckets alive, r = the last unit recomputed. cost[u][k]: least time over units [0, u) ending
  // in state k; took/from: unit u-1's choice and the state before it.
  constexpr int kStates = 2 * (kBuckets + 1);
  std::vector<std::vector<double>> cost(n + 1, std::vector<double>(kStates, inf));
  std::vector<std::vector<char>> took(n + 1, std::vector<char>(kStates, 0));
  std::vector<std::vector<int>> from(n + 1, std::vector<int>(kStates, -1));
  cost[0][0] = 0;
  constexpr UnitStore kChoices[] = {UnitStore::kKeep, UnitStore::kFp8, UnitStore::kRecompute};
  for (size_t u = 0; u < n; ++u) {
    for (UnitStore s : kChoices) {
      if (!(masks[u] & bit(s))) continue;
      const double price = store_cost(model, flops, model.units[u], s);
      const int r_next = s == UnitStore::kRecompute ? 1 : 0;
      for (int r = 0; r < 2; ++r) {
        const int adds = buckets(alive_bytes(model, u, s, r == 1));
        const int during = buckets(during_bytes(model, u, s, r == 1));
        for (int b = 0; b <= kBuckets; ++b) {
          const int k = 2 * b + r;
          if (!std::isfinite(cost[u][k]) || b + adds > kBuckets || b + during > kBuckets) continue;
          const double t = cost[u][k] + price;
          const int next = 2 * (b + adds) + r_next;
          if (t < cost[u + 1][next]) {
            cost[u + 1][next] = t;
            took[u + 1][next] = static_cast<char>(s);
            from[u + 1][next] = k;
          }
        }
      }
    }
  }
  int best = -1;
  for (int k = 0; k < kStates; ++k) {
    if (std::isfinite(cost[n][k]) && (best < 0 || cost[n][k] < cost[n][best])) best = k;
  }
  if (best < 0) return false;
  for (size_t u = n; u > 0; --u) {
    (*chosen)[u - 1] = static_cast<UnitStore>(took[u][best]);
    best = from[u][best];
  }
  return true;
}

// The cost model's peak and step time at these per-unit choices (memory_plan_peak and memory_plan_step_s on flags).
double peak_at(const MemoryModel& model, int64_t batch, int64_t micro, const std::vector<UnitStore>& stores,
               DataPlacement placement, bool update_in_backward) {
  return base_bytes(model, batch, placement, update_in_backward) +
         static_cast<double>(micro) * model.activation_scale * activation_bytes(model, stores);
}

double step_at(const MemoryModel& model, int64_t batch, int64_t micro, const std::vector<UnitStore>& stores,
               DataPlacement placement, bool update_in_backward) {
  const double flops = total_flops(model);
  double per_sample = model.per_sample_s;
  for (size_t u = 0; u < model.units.size(); ++u) {
    if (stores[u] != UnitStore::kKeep) per_sample += store_cost(model, flops, model.units[u], stores[u]);
  }
  const double k = static_cast<double>(micro_batches(batch, micro));
  const double stream = placement == DataPlacement::kHost ? model.stream_per_sample_s * static_cast<double>(batch) : 0;
  const double update = update_in_backward && update_in_backward_offered(model) ? model.update_in_backward_s : 0;
  return k * model.overhead_s + static_cast<double>(batch) * per_sample + stream + update;
}

// The cheapest choice per unit that fits `budget` at this micro-batch and placement; false when none does.
bool fit_stores(const MemoryModel& model, const std::vector<StoreMask>& masks, int64_t batch, int64_t micro,
                DataPlacement placement, bool update_in_backward, double budget, std::vector<UnitStore>* best) {
  const double room = (budget - base_bytes(model, batch, placement, update_in_backward)) /
                      (static_cast<double>(micro) * model.activation_scale);
  *best = cheapest_stores(masks);
  if (peak_at(model, batch, micro, *best, placement, update_in_backward) <= budget) return true;  // (no rounding)
  if (!store_search(model, masks, room, best)) return false;
  return peak_at(model, batch, micro, *best, placement, update_in_backward) <= budget;  // the rounding, not trusted
}

// The update in backward's settings worth trying at micro-batch `micro` of `batch` (false first).
std::vector<bool> update_in_backward_choices(const MemoryModel& model, int64_t batch, int64_t micro,
                                             const PlanConstraints& c) {
  if (micro < batch || !update_in_backward_offered(model) || c.update_in_backward == false) return {false};
  if (c.update_in_backward == true) return {true};
  return {false, true};
}

// The least room (activation bytes per sample, before the scale) in which the search still finds a choice: a budget
// that leaves this room fits a plan at micro-batch 1.
double least_activation_bytes(const MemoryModel& model, const std::vector<StoreMask>& masks) {
  std::vector<UnitStore> r;
  double hi = activation_bytes(model, cheapest_stores(masks)), lo = model.transient_bytes;
  for (int i = 0; i < 40; ++i) {
    const double mid = (lo + hi) / 2;
    (store_search(model, masks, mid, &r) ? hi : lo) = mid;
  }
  return hi;
}

// The least any plan needs: micro-batches of 1 (or the whole batch updated in backward, where that takes less), the
// choice per unit that holds least, the data where it takes least — each unless the constraints fix it (a placement,
// micro-batch, recompute set, FP8 set or update in backward given by hand).
double floor_bytes(const MemoryModel& model, int64_t batch, const PlanConstraints& constraints) {
  const double least = model.activation_scale * least_activation_bytes(model, store_masks(model, constraints));
  const auto floor_at = [&](int64_t micro, bool update_in_backward) {
    double base = base_bytes(model, batch, constraints.placement_fixed ? constraints.placement : DataPlacement::kDevice,
                             update_in_backward);
    if (!constraints.placement_fixed && model.allow_host_data) {
      base = std::min(base, base_bytes(model, batch, DataPlacement::kHost, update_in_backward));
    }
    return base + static_cast<double>(micro) * least;
  };
  const bool offered = update_in_backward_offered(model);
  if (constraints.update_in_backward == true && offered) return floor_at(batch, true);
  const int64_t micro = constraints.micro_batch > 0 ? std::min(constraints.micro_batch, batch) : 1;
  double floor = floor_at(micro, false);
  if (offered && constraints.update_in_backward != false && (constraints.micro_batch <= 0 || micro >= batch)) {
    floor = std::min(floor, floor_at(batch, true));
  }
  return floor;
}

}  // namespace

double memory_plan_peak(const MemoryModel& model, int64_t batch, int64_t micro_batch,
                        const std::vector<bool>& recompute, DataPlacement placement,
                        const std::vector<bool>& fp8_saved, bool update_in_backward) {
  return peak_at(model, batch, micro_batch, stores_of(model.units.size(), recompute, fp8_saved), placement,
                 update_in_backward);
}

double memory_plan_peak(const MemoryModel& model, const MemoryPlan& plan) {
  return memory_plan_peak(model, plan.batch, plan.micro_batch, plan.recompute, plan.data_placement, plan.fp8_saved,
                          plan.update_in_backward);
}

double memory_plan_step_s(const MemoryModel& model, int64_t batch, int64_t micro_batch,
                          const std::vector<bool>& recompute, DataPlacement placement,
                          const std::vector<bool>& fp8_saved, bool update_in_backward) {
  return step_at(model, batch, micro_batch, stores_of(model.units.size(), recompute, fp8_saved), placement,
                 update_in_backward);
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
                 memory_plan_step_s(model, plan.batch, plan.micro_batch, plan.recompute, plan.data_placement,
                                    plan.fp8_saved, plan.update_in_backward);
  if (rest > 0) {
    units += memory_plan_step_s(model, rest, std::min(plan.micro_batch, rest), plan.recompute, plan.data_placement,
                                plan.fp8_saved, plan.update_in_backward);
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
  const double budget = budget_bytes > 0 ? static_cast<double>(budget_bytes) : std::numeric_limits<double>::infinity();
  // Micro-batch sizes worth trying: ceil(B / k) for every k (larger k with the same size only adds steps); without
  // a budget, the whole batch.
  std::vector<int64_t> micros;
  if (constraints.update_in_backward == true && update_in_backward_offered(model)) {
    micros.push_back(batch);  // (one micro-batch: the update in backward's)
  } else if (constraints.micro_batch > 0) {
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
  const std::vector<StoreMask> masks = store_masks(model, constraints);
  const std::vector<UnitStore> cheapest = cheapest_stores(masks);
  double best_s = std::numeric_limits<double>::infinity();
  for (DataPlacement p : placements) {
    for (int64_t m : micros) {
      // A lower bound of every plan at this or a smaller micro-batch: each unit's cheapest choice, no update in
      // backward (which only adds time).
      if (step_at(model, batch, m, cheapest, p, false) >= best_s) break;
      for (bool u : update_in_backward_choices(model, batch, m, constraints)) {
        std::vector<UnitStore> stores = cheapest;
        if (budget_bytes > 0 && !fit_stores(model, masks, batch, m, p, u, budget, &stores)) continue;
        const double s = step_at(model, batch, m, stores, p, u);
        if (s < best_s) {
          best_s = s;
          plan.feasible = true;
          plan.micro_batch = m;
          plan.accumulation = micro_batches(batch, m);
          stores_split(stores, &plan.recompute, &plan.fp8_saved);
          plan.data_placement = p;
          plan.update_in_backward = u;
          plan.predicted_step_s = s;
          plan.predicted_peak_bytes = peak_at(model, batch, m, stores, p, u);
        }
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

std::vector<std::string> MemoryPlan::fp8_saved_names(const MemoryModel& model) const {
  std::vector<std::string> out;
  for (size_t u = 0; u < fp8_saved.size() && u < model.units.size(); ++u) {
    if (fp8_saved[u] && !flag_at(recompute, u)) out.push_back(model.units[u].name);
  }
  return out;
}

Json MemoryPlan::to_json(const MemoryModel& model) const {
  // Per unit, what its activations hold at the micro-batch (its input alone when recomputed, its FP8 bytes when
  // stored so); the consumers that do not scale with it. The report draws both (report/run_model.h).
  Json units = Json::array();
  const double per_micro = static_cast<double>(micro_batch) * model.activation_scale;
  const std::vector<UnitStore> stores = stores_of(model.units.size(), recompute, fp8_saved);
  for (size_t u = 0; u < model.units.size(); ++u) {
    const bool after_recompute = u > 0 && stores[u - 1] == UnitStore::kRecompute;
    units.push_back(
        Json{{"unit", model.units[u].name},
             {"recompute", stores[u] == UnitStore::kRecompute},
             {"fp8_saved", stores[u] == UnitStore::kFp8},
             {"activation_bytes", static_cast<int64_t>(per_micro * alive_bytes(model, u, stores[u], after_recompute))},
             {"backward_bytes", static_cast<int64_t>(per_micro * model.units[u].backward_bytes)}});
  }
  const double data = data_placement == DataPlacement::kDevice ? model.dataset_bytes : model.stream_bytes;
  const auto whole = [](double b) { return static_cast<int64_t>(std::ceil(b)); };
  const Json consumers{{"weights", whole(model.weights_bytes)},
                       {"gradients", whole(grads_at(model, update_in_backward))},
                       {"optimizer", whole(model.optimizer_bytes)},
                       {"data", whole(data + static_cast<double>(batch) * model.batch_input_bytes)},
                       {"fixed", whole(model.fixed_bytes)},
                       {"transient", whole(per_micro * model.transient_bytes)}};
  return Json{{"feasible", feasible},
              {"batch", batch},
              {"micro_batch", micro_batch},
              {"accumulation", accumulation},
              {"recompute", recompute_names(model)},
              {"fp8_saved", fp8_saved_names(model)},
              {"data_placement", enum_name(data_placement)},
              {"update_in_backward", update_in_backward},
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
         accumulation == o.accumulation && recompute == o.recompute && fp8_saved == o.fp8_saved &&
         data_placement == o.data_placement && update_in_backward == o.update_in_backward;
}

}  // namespace triaccel
