#include "triaccel/methods/controller_registry.h"

#include "triaccel/control/batch/elastic_batch_controller.h"
#include "triaccel/control/curvature/curvature_controller.h"
#include "triaccel/control/measure_window_controller.h"
#include "triaccel/control/memory/memory_plan_controller.h"
#include "triaccel/control/optimizer_state/baoc_controller.h"
#include "triaccel/control/precision/precision_controller.h"
#include "triaccel/core/errors.h"
#include "triaccel/optim/baoc_optimizer.h"
#include "triaccel/run/component_options.h"

#include <algorithm>
#include <utility>

namespace triaccel {
namespace {

// Lockstep curvature rounds after the first stop after this many power-iteration passes (each unit's λ then sits
// within a few % of its converged value from the last round's vector): warm Fisher rounds run to --curv-tol took
// more passes than the budget pays for with rounds a few epochs apart (measured: docs/results/tri-accel.md).
constexpr int kLockstepWarmPasses = 4;

bool tri_accel(const ControllerParts& p) { return p.config.execution.method == Method::kTriAccel; }

// Tri-Accel's curvature probe and lr scaling on a fixed batch: the first b_curv samples of epoch 0's (seeded) order.
std::unique_ptr<StepController> curvature_make(ControllerParts& p) {
  const TriAccelConfig& ta = p.config.tri_accel;
  if (!tri_accel(p) || !(ta.ta_curvature || ta.ta_precision)) return nullptr;
  p.train_loader.epoch_begin(0);
  const int64_t curv_count = std::min(ta.curv_batch, p.train_loader.size());
  auto [images, labels] = p.train_loader.batch(0, curv_count);
  CurvatureControllerOptions co = curvature_controller_options(p.config, p.session.model());
  co.probe_samples = p.train_loader.sample_indices(0, curv_count);
  co.probe.clock = &p.session.clock();
  co.probe.warm_passes = kLockstepWarmPasses;
  // Under a budget the plan fills it with the steps: the rounds take the step graph's pool as scratch.
  co.share_step_pool = co.lockstep_rounds() && p.config.execution.vram_budget_bytes() > 0 && p.device.is_cuda() &&
                       p.config.execution.cuda_graphs;
  co.total_steps = p.config.schedule.max_steps > 0 ? std::min(p.total_steps, p.config.schedule.max_steps)
                                                    : p.total_steps;
  return std::make_unique<CurvatureController>(co, p.session.model(), p.optimizer, p.step, images, labels);
}

std::unique_ptr<StepController> precision_make(ControllerParts& p) {
  if (!tri_accel(p) || !p.config.tri_accel.ta_precision) return nullptr;
  auto precision = std::make_unique<PrecisionController>(precision_policy_options(p.config),
                                                         p.config.tri_accel.ctrl_every, p.session.model(), p.optimizer,
                                                         p.step, p.device);
  p.precision = precision.get();
  return precision;
}

std::unique_ptr<StepController> baoc_make(ControllerParts& p) {
  if (p.config.optim.optimizer != OptimizerKind::kBaoc) return nullptr;
  TrainStep* step = &p.step;
  auto baoc = std::make_unique<BaocController>(baoc_controller_options(p.config), p.session.model(),
                                               static_cast<BaocOptimizer&>(p.optimizer),
                                               [step]() { step->invalidate_graph(); }, p.next_step);
  p.baoc = baoc.get();
  return baoc;
}

std::unique_ptr<StepController> measure_window_make(ControllerParts& p) {
  if (p.config.optim.optimizer == OptimizerKind::kSgd) return nullptr;
  return std::make_unique<MeasureWindowController>(p.config.baoc.plan_warmup, p.step);
}

// Under a vram_budget, Tri-Accel's elastic batch (the paper's rule on the measured peak) every control window; the
// lr follows the batch by lr_batch_rule.
std::unique_ptr<StepController> elastic_batch_make(ControllerParts& p) {
  const bool elastic = tri_accel(p) && p.config.tri_accel.ta_batch && p.config.execution.vram_budget_bytes() > 0 &&
                       p.config.execution.batch_policy == BatchPolicy::kElastic &&
                       (p.device.is_cuda() || p.session.hooks().memory_signal);
  if (!elastic) return nullptr;
  return std::make_unique<ElasticBatchController>(*p.batch_rules, p.config.tri_accel.ctrl_every,
                                                  p.config.schedule.batch_size, p.session.hooks().memory_signal);
}

// The memory planner runs last: it sees this step's precision decisions. A precision promotion no plan can pay for
// is refused, not fatal.
std::unique_ptr<StepController> memory_plan_make(ControllerParts& p) {
  if (p.memory == nullptr || !p.memory->planned) return nullptr;
  MemorySetup& m = *p.memory;
  auto planner = std::make_unique<MemoryPlanController>(m.model, m.plan, m.limits, p.step, p.memory_model_rebuild);
  planner->set_agree(memory_agree_over_ranks(p.session));
  p.memory_planner = planner.get();
  if (PrecisionController* precision = p.precision) {
    MemoryPlanController* plan = planner.get();
    precision->set_memory_check([plan](const std::vector<Precision>& ps) { return plan->fits(ps); },
                                /*hold_curvature=*/p.config.execution.vram_budget_bytes() > 0);
    plan->set_capture_oom_undo([precision]() { return precision->revert_raise(); });
  }
  if (BaocController* baoc = p.baoc) {  // after the warm-up the state shrinks: the room goes to the activations
    planner->set_optimizer_freed([baoc]() { return static_cast<double>(baoc->state_bytes_freed()); });
  }
  return planner;
}

std::vector<ControllerEntry>& entries() {
  static std::vector<ControllerEntry> list = {
      {"curvature", curvature_make},
      {"precision", precision_make},
      {"baoc", baoc_make},
      {"measure_window", measure_window_make},
      {"elastic_batch", elastic_batch_make},
      {"memory_plan", memory_plan_make},
  };
  return list;
}

}  // namespace

const std::vector<ControllerEntry>& controller_registry() { return entries(); }

std::vector<std::unique_ptr<StepController>> controllers_make(ControllerParts& parts) {
  std::vector<std::unique_ptr<StepController>> out;
  for (const ControllerEntry& entry : entries()) {
    if (auto controller = entry.make(parts)) out.push_back(std::move(controller));
  }
  return out;
}

ControllerRegistration::ControllerRegistration(ControllerEntry entry) : name_(entry.name) {
  auto& list = entries();
  TORCH_CHECK(std::none_of(list.begin(), list.end(), [&](const ControllerEntry& e) { return e.name == name_; }),
              "controller ", name_, " is registered already");
  list.push_back(std::move(entry));
}

ControllerRegistration::~ControllerRegistration() {
  auto& list = entries();
  list.erase(std::remove_if(list.begin(), list.end(), [&](const ControllerEntry& e) { return e.name == name_; }),
             list.end());
}

}  // namespace triaccel
