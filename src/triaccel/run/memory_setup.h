// The memory planner's set-up for a run on a Session (docs/memory-planner.md): the consumers of GPU memory priced from
// the model's trace (control/memory/memory_model.h), the optimizer state sharded over the ranks where that is a lever
// (train/param_shards.h), and the first plan under the vram_budget (control/memory/memory_planner.h), made before the
// loaders (they hold the data where the plan says). Backprop (methods/backprop_trainer.cpp) trains on it; `triaccel
// plan` (api/) previews it.
#pragma once

#include "triaccel/control/memory/memory_model.h"
#include "triaccel/control/memory/memory_plan_controller.h"
#include "triaccel/control/memory/memory_planner.h"
#include "triaccel/core/json.h"
#include "triaccel/run/session.h"
#include "triaccel/train/param_shards.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace triaccel {

struct MemorySetup {
  bool planned = false;               // a MemoryPlanController keeps the step on `plan`
  bool shard_optimizer = false;       // ZeRO stage 1 (train/param_shards.h)
  ShardLayout shards;                 // the owners and buckets over the ranks, wherever sharding is possible
  MemoryModelInputs inputs;
  MemoryModel model;
  MemoryPlan plan;
  MemoryPlanLimits limits;
  at::Tensor sample;                  // one input sample on the device (the model's trace)
  DataPlacement placement = DataPlacement::kDevice;

  // The largest evaluation batch (at most `asked`) that fits beside the `held_bytes` the allocator reserves, the
  // step's pool included (memory_model_eval_batch); `asked` without a budget.
  bool budgeted() const { return planned && limits.cap_bytes > 0; }
  int64_t eval_batch(int64_t asked, int64_t held_bytes, int64_t micro_batch) const {
    if (!budgeted()) return asked;
    return memory_model_eval_batch(model, limits.cap_bytes, held_bytes, micro_batch, asked);
  }
};

// The set-up for this session's run; preview: plan for a GPU whatever the device (no CUDA-only condition). UserError
// naming the floor when no plan fits the vram_budget (not in a preview).
std::unique_ptr<MemorySetup> memory_setup_make(Session& session, bool preview = false);

// "with --micro-batch 8, --data-placement device as given (less with them left to the planner)": the memory planner's
// levers the configuration fixes, for a floor message; "" when it fixes none.
std::string memory_levers_given(const Config& config);

// The memory plan a run of the session's configuration would start with, as the memory_plan event's fields, on any
// device: without a GPU it is planned for one from the modelled profile (`triaccel plan --vram-budget`); null when the
// run would not plan (no budget and no memory option set).
Json memory_plan_preview(Session& session);

// Data parallelism: each number's largest value over the ranks (what the memory planner's ranks agree through);
// null with one process.
MemoryPlanController::Agree memory_agree_over_ranks(Session& session);

// The optimizer's bytes as the memory plan prices them (MemoryModelInputs): its state and what it allocates beside
// the state at times. SGD: momentum, 4 bytes an element (none without momentum); AdamW: 8. BAOC: per tensor the
// largest state of its warm-up's fp32 AdamW and every format of its menu (optim_formats), which is the worst case
// rather than the format plan's bytes: the memory plan is made before the warm-up's signals exist, the warm-up
// holds fp32 AdamW state for its first steps whatever the plan then chooses, and a re-plan may move any unit to any
// format of the menu. Beside it: the statistics window's float32 copy of the previous gradients (4 bytes an element,
// during the warm-up and every window), the per-tensor step counts and window sums and the 8-bit maps, and the
// largest conversion between formats (formats_set: one tensor at a time, its two moments decoded to float32 and its
// new state made before the old one goes), priced on top of the step's peak because a conversion runs between steps
// while a captured step's graph pool still holds the step's memory.
struct OptimizerBytes {
  int64_t state = 0;
  int64_t transient = 0;
};
OptimizerBytes optimizer_priced(const Config& config, const std::vector<std::vector<int64_t>>& param_shapes);

// Method auto (api/api.cpp): each method's fit under the vram_budget and its predicted seconds per epoch, on one basis
// (memory_plan_epoch_s for backprop at its memory plan, partition_epoch_s for NeuroFlux at its blocks).
struct MethodCandidate {
  Method method = Method::kBackprop;
  bool fits = false;
  double epoch_s = 0;      // predicted seconds per epoch (meaningful when it fits)
  double need_bytes = 0;   // the least vram_budget it fits in (when it does not: its floor)
  std::string not_why;     // a method that cannot run this configuration at all: why ("" otherwise)
};
struct MethodChoice {
  Method method = Method::kBackprop;
  bool fits = false;       // false: no candidate fits (`method` is then the first candidate that can run)
  std::string reason;      // names the candidates' predictions
};
// The fastest candidate that fits (the earlier one on a tie); when none fits, the first that can run at all. Pure.
MethodChoice method_choose(const std::vector<MethodCandidate>& candidates);
// [{"method", "fits", "predicted_epoch_s", "need_bytes", "not_why"}, ...]
Json method_candidates_json(const std::vector<MethodCandidate>& candidates);
// Backprop's candidate from its plan preview (memory_plan_preview's fields: feasible, predicted_epoch_s, floor).
MethodCandidate method_candidate_backprop(const Json& preview);
// NeuroFlux's candidate for the session's configuration under its vram_budget, planned for a GPU: the units' memory
// profile (modelled, or measured on CUDA as the run would), the partition NeuroFlux would train and its epoch.
MethodCandidate method_candidate_neuroflux(Session& session);

}  // namespace triaccel
