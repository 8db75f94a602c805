// The memory planner (docs/memory-planner.md): the solver on made-up cost models (feasible and infeasible budgets,
// the fastest plan against a brute force over every combination of levers, a re-plan after the model changes, the
// user's fixed levers, the floor), the time model and method auto's choice, and the levers in the step engine:
// gradient accumulation gives one big batch's weights, a recomputed unit gives the kept unit's gradients (and updates
// BatchNorm's statistics once). The cost model of a real network, a planned CPU run, and `plan --vram-budget` on the
// CPU. On a GPU: test_memory_gpu.cpp; the plan's controller: test_memory_plan_controller.cpp.
#include "memory_test_util.h"
#include "triaccel/control/memory/memory_model.h"
#include "triaccel/control/memory/memory_plan_controller.h"
#include "triaccel/control/memory/memory_planner.h"
#include "triaccel/control/memory/memory_profile.h"
#include "triaccel/control/memory/partitioner.h"
#include "triaccel/control/precision/precision_controller.h"
#include "triaccel/core/cuda_graph.h"
#include "triaccel/core/device.h"
#include "triaccel/core/dist.h"
#include "triaccel/core/events.h"
#include "triaccel/data/loader.h"
#include "triaccel/methods/backprop_trainer.h"
#include "triaccel/models/aux_head.h"
#include "triaccel/models/model.h"
#include "triaccel/models/registry.h"
#include "triaccel/optim/baoc_optimizer.h"
#include "triaccel/optim/sgd.h"
#include "triaccel/optim/quant8.h"
#include "triaccel/optim/signals.h"
#include "triaccel/optim/state_format.h"
#include "triaccel/run/memory_setup.h"
#include "triaccel/train/loss_scaler.h"
#include "triaccel/train/recompute.h"
#include "triaccel/train/step.h"
#include "triaccel/train/step_graph.h"

#include <gtest/gtest.h>
#ifdef TRIACCEL_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/linear.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <utility>
#include <vector>

namespace triaccel {
namespace {

using namespace memory_test;

TEST(MemoryPlannerTest, WithoutABudgetTheWholeBatchRunsAtOnce) {
  const MemoryModel m = made_up({10, 20, 30}, {5, 10, 15}, {1, 2, 3});
  const MemoryPlan plan = memory_plan_solve(m, 16, 0);
  EXPECT_TRUE(plan.feasible);
  EXPECT_EQ(plan.micro_batch, 16);
  EXPECT_EQ(plan.accumulation, 1);
  EXPECT_EQ(plan.recompute, std::vector<bool>(3, false));
  EXPECT_EQ(plan.data_placement, DataPlacement::kDevice);
  // 350 fixed + 1000 data + 16·2 inputs + 16·(60 + 4) activations
  EXPECT_DOUBLE_EQ(plan.predicted_peak_bytes, 350 + 1000 + 32 + 16 * 64);
}

TEST(MemoryPlannerTest, ABudgetThatFitsTheNeedChangesNothing) {
  const MemoryModel m = made_up({10, 20, 30}, {5, 10, 15}, {1, 2, 3});
  const double need = memory_plan_solve(m, 16, 0).predicted_peak_bytes;
  const MemoryPlan plan = memory_plan_solve(m, 16, static_cast<int64_t>(need));
  EXPECT_TRUE(plan.feasible);
  EXPECT_EQ(plan.micro_batch, 16);
  EXPECT_EQ(plan.recompute, std::vector<bool>(3, false));
  EXPECT_EQ(plan.data_placement, DataPlacement::kDevice);
}

TEST(MemoryPlannerTest, BelowTheFloorNothingFitsAndTheFloorIsNamed) {
  const MemoryModel m = made_up({10, 20, 30}, {5, 10, 15}, {1, 2, 3});
  // The floor: host data (100) + 350 + 16·2 inputs, micro-batch 1, u0 and u1 recomputed: u1's backward holds u0's
  // input 5 + its own 10 + 20 = 35; backward's start holds 5 + 10 + u2's 30 = 45; + 4 transient = 49 → 531.
  // (Recomputing u2 too would hold 15 + 15 + 30 = 60 during its backward.)
  const MemoryPlan plan = memory_plan_solve(m, 16, 400);
  EXPECT_FALSE(plan.feasible);
  EXPECT_GE(plan.floor_bytes, 531);
  EXPECT_LE(plan.floor_bytes, 531 * 1.01);  // the search's rounding errs towards more memory only
  const MemoryPlan at_floor = memory_plan_solve(m, 16, static_cast<int64_t>(std::ceil(plan.floor_bytes)));
  ASSERT_TRUE(at_floor.feasible);
  EXPECT_EQ(at_floor.micro_batch, 1);
  EXPECT_EQ(at_floor.data_placement, DataPlacement::kHost);
  EXPECT_EQ(at_floor.recompute, (std::vector<bool>{true, true, false}));
  EXPECT_DOUBLE_EQ(at_floor.predicted_peak_bytes, 531);
}

// Levers fixed by hand raise the floor to what a plan with them needs (the H200 grid: `--data-placement device` under
// 0.125 GB was refused with a floor of 17 MB, the floor with the data streamed).
TEST(MemoryPlannerTest, TheFloorHoldsTheLeversGivenByHand) {
  const MemoryModel m = made_up({10, 20, 30}, {5, 10, 15}, {1, 2, 3});
  PlanConstraints device;
  device.placement_fixed = true;
  device.placement = DataPlacement::kDevice;
  EXPECT_NEAR(memory_plan_solve(m, 16, 400, device).floor_bytes, 531 + 900, 531 * 0.01);  // the data's 1000, not 100
  PlanConstraints micro;
  micro.micro_batch = 4;  // 4 samples of the least activations (49 a sample) instead of 1
  EXPECT_NEAR(memory_plan_solve(m, 16, 400, micro).floor_bytes, 531 + 3 * 49, 531 * 0.01);
  PlanConstraints kept;
  kept.recompute = {false, false, false};  // nothing recomputed: 5 + 10 + 20 + ... every unit's activations, 64
  EXPECT_DOUBLE_EQ(memory_plan_solve(m, 16, 400, kept).floor_bytes, 100 + 350 + 32 + 64);
  const MemoryPlan at_floor = memory_plan_solve(m, 16, 1431 + 10, device);
  EXPECT_TRUE(at_floor.feasible);  // the floor is reachable under the constraint
}

// The solver is exact up to its rounding (which only errs towards fitting): on random models and budgets its plan
// fits, and is at least as fast as the brute force's best plan under a 1 % smaller budget.
TEST(MemoryPlannerTest, FindsTheFastestPlanThatFits) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> bytes(1, 60), cost(0.5, 5);
  int feasible = 0;
  for (int trial = 0; trial < 40; ++trial) {
    std::vector<double> saved, input, flops;
    for (int u = 0; u < 5; ++u) {
      saved.push_back(bytes(rng));
      input.push_back(bytes(rng) / 3);
      flops.push_back(cost(rng));
    }
    MemoryModel m = made_up(saved, input, flops);
    m.units[trial % 5].recomputable = trial % 3 != 0;
    m.outputs_in_saved = trial % 2 == 1;  // the allocator's reading (CUDA) and the autograd graph's
    if (trial % 4 == 1) {  // and, on CUDA, the units' own backward peaks read (some below the transient term)
      for (auto& u : m.units) u.backward_bytes = u.saved_bytes * (0.3 + 0.2 * static_cast<double>(trial % 7));
    }
    const int64_t batch = 12;
    const double need = memory_plan_solve(m, batch, 0).predicted_peak_bytes;
    const double budget = std::floor(need * (0.3 + 0.7 * (trial % 10) / 10.0));
    SCOPED_TRACE("trial " + std::to_string(trial) + " budget " + std::to_string(budget));
    if (expect_fastest(m, batch, budget)) ++feasible;
  }
  EXPECT_GT(feasible, 20);
}

// A cheap unit with big activations: recomputing it beats splitting the batch (which pays the per-micro-batch
// overhead); when the model's activations double (the allocator's correction) the plan splits the batch as well.
TEST(MemoryPlannerTest, RecomputesTheCheapUnitAndReplansWhenTheModelGrows) {
  MemoryModel m = made_up({100, 10, 10}, {1, 5, 5}, {0.1, 10, 10});
  m.dataset_bytes = 0;  // streaming saves nothing here
  const int64_t batch = 16;
  // Base 382. All kept: 16·124 → 2366. u0 recomputed: its backward holds 1 + 100, backward's start 1 + 10 + 10:
  // 16·105 → 2062.
  const int64_t budget = 382 + 16 * 110;
  const MemoryPlan plan = memory_plan_solve(m, batch, budget);
  ASSERT_TRUE(plan.feasible);
  EXPECT_EQ(plan.micro_batch, 16);
  EXPECT_EQ(plan.recompute, (std::vector<bool>{true, false, false}));
  EXPECT_DOUBLE_EQ(plan.predicted_peak_bytes, 382 + 16 * 105);
  // Scale 2: 8 × 2 with u0 recomputed (382 + 8·210 = 2062) costs 2 overheads; 6 × 3 without recompute, 3.
  m.activation_scale = 2;
  const MemoryPlan grown = memory_plan_solve(m, batch, budget);
  ASSERT_TRUE(grown.feasible);
  EXPECT_EQ(grown.micro_batch, 8);
  EXPECT_EQ(grown.accumulation, 2);
  EXPECT_EQ(grown.recompute, (std::vector<bool>{true, false, false}));
}

// Read from the allocator, a kept unit's bytes hold its output: a recomputed unit after it holds nothing more, and its
// own output is held (and counted) by the unit after it. Four units of 100 bytes a sample, each reading 10; transient
// 4; base 382 at batch 16.
TEST(MemoryPlannerTest, ARecomputedUnitAfterAKeptOneHoldsNoCopyOfItsInput) {
  MemoryModel m = made_up({100, 100, 100, 100}, {10, 10, 10, 10}, {1, 1, 1, 1});
  m.dataset_bytes = 0;
  m.outputs_in_saved = true;
  // u1 and u2 recomputed: forward leaves u0's 100, u1's output 10 (u2's checkpoint), u2's output 10 (u3 reads it) and
  // u3's 100: 220, the peak; backward at u2: 100 + 10 + u2's 100 made again = 210, at u1: 100 + 100.
  EXPECT_DOUBLE_EQ(memory_plan_peak(m, 16, 16, {false, true, true, false}, DataPlacement::kDevice), 382 + 16 * 224);
  // u1 alone recomputed, and it keeps 300: backward at u1 holds u0's 100 and u1's 300 made again: 400 (forward
  // leaves 310). Counted as its input, u0's output (inside u0's 100) came twice: 410.
  m.units[1].saved_bytes = 300;
  const std::vector<bool> one{false, true, false, false};
  EXPECT_DOUBLE_EQ(memory_plan_peak(m, 16, 16, one, DataPlacement::kDevice), 382 + 16 * (400 + 4));
  m.outputs_in_saved = false;  // the autograd graph's records: u1 holds its input beside its backward's 300
  EXPECT_DOUBLE_EQ(memory_plan_peak(m, 16, 16, one, DataPlacement::kDevice), 382 + 16 * (410 + 4));
}

// Where a unit's own backward peak was read (the allocator's, backward_bytes: its transients included), a recomputed
// unit holds that peak in place of its saved bytes and the transient term. The same four units as above, u1 alone
// recomputed with 300 saved: backward at u1 priced 100 + 300 + 4 transient = 404 unread.
TEST(MemoryPlannerTest, ARecomputedUnitHoldsItsOwnBackwardPeakWhereItWasRead) {
  MemoryModel m = made_up({100, 300, 100, 100}, {10, 10, 10, 10}, {1, 1, 1, 1});
  m.dataset_bytes = 0;
  m.outputs_in_saved = true;
  const std::vector<bool> one{false, true, false, false};
  ASSERT_DOUBLE_EQ(memory_plan_peak(m, 16, 16, one, DataPlacement::kDevice), 382 + 16 * 404);
  // Its backward peaks at 250 (it freed saved tensors before making its largest gradients): 100 + 250 at u1, above
  // the forward's end (u0 100, u2 10 + 100, u3 100, transient 4: 314).
  m.units[1].backward_bytes = 250;
  EXPECT_DOUBLE_EQ(memory_plan_peak(m, 16, 16, one, DataPlacement::kDevice), 382 + 16 * 350);
  // A peak below the transient term: the term stays the floor (backward's start, 310 + 4).
  m.units[1].backward_bytes = 3;
  EXPECT_DOUBLE_EQ(memory_plan_peak(m, 16, 16, one, DataPlacement::kDevice), 382 + 16 * 314);
  // The solver prices it the same way: at 382 + 16 · 360 the plan recomputing u1 fits with its peak read, not without.
  PlanConstraints c;
  c.micro_batch = 16;
  c.recompute = one;
  c.placement_fixed = true;
  m.units[1].backward_bytes = 250;
  EXPECT_TRUE(memory_plan_solve(m, 16, 382 + 16 * 360, c).feasible);
  m.units[1].backward_bytes = 0;
  EXPECT_FALSE(memory_plan_solve(m, 16, 382 + 16 * 360, c).feasible);
  // Kept, a unit's read peak changes nothing (the transient term prices a kept unit's backward).
  m.units[1].backward_bytes = 250;
  EXPECT_DOUBLE_EQ(memory_plan_peak(m, 16, 16, {false, false, false, false}, DataPlacement::kDevice), 382 + 16 * 604);
}

TEST(MemoryPlannerTest, KeepsTheUsersLevers) {
  const MemoryModel m = made_up({10, 20, 30}, {5, 10, 15}, {1, 2, 3});
  PlanConstraints c;
  c.micro_batch = 4;
  c.recompute = {false, true, false};
  c.placement_fixed = true;
  c.placement = DataPlacement::kHost;
  const MemoryPlan plan = memory_plan_solve(m, 16, 0, c);
  ASSERT_TRUE(plan.feasible);
  EXPECT_EQ(plan.micro_batch, 4);
  EXPECT_EQ(plan.accumulation, 4);
  EXPECT_EQ(plan.recompute, c.recompute);
  EXPECT_EQ(plan.data_placement, DataPlacement::kHost);
  EXPECT_EQ(plan.recompute_names(m), std::vector<std::string>{"u1"});
  // A fixed lever that cannot fit makes the plan infeasible rather than changing it.
  EXPECT_FALSE(memory_plan_solve(m, 16, 500, c).feasible);
}

struct StepRun {
  std::vector<at::Tensor> weights;
  std::vector<at::Tensor> buffers;
};

StepRun train_steps(int64_t micro_batch, const std::vector<bool>& recompute, bool batch_norm, int steps) {
  torch::manual_seed(3);
  StepOptions so;
  so.micro_batch = micro_batch;
  UnitRig rig(batch_norm, so, torch::kCPU);
  TrainStep& step = rig.step;
  step.set_recompute(recompute);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(11);
  for (int s = 0; s < steps; ++s) {
    const at::Tensor x = at::randn({12, 12}, gen);
    const at::Tensor y = at::randint(0, 5, {12}, gen);
    step.run(x, y, 0.05);
  }
  StepRun out;
  for (const auto& p : rig.net.parameters()) out.weights.push_back(p.detach().clone());
  for (const auto& b : rig.net.buffers()) out.buffers.push_back(b.clone());
  return out;
}

// The step engine makes the optimizer state before its first forward (train/step.cpp), not after the first backward
// where the optimizer would: a first step whose forward fails (an input of the wrong width) leaves the momentum
// made. On a GPU that puts the state beside the weights (MemoryGpuTest.TheOptimizerStateLeavesNoPartlyUsedPages).
// An epoch of backprop at a plan: every step at the plan's levers (the micro-batches' overhead and the recompute's
// repeated forward priced), a short last step at its own size, and the evaluation's forward; in seconds at the FLOP
// rate (Σ flops 6 / forward_share 1/3 = 18 FLOPs a sample at 18 FLOP/s: one second a unit of the model's time).
TEST(MemoryPlannerTest, AnEpochPricesSmallMicroBatchesAndRecompute) {
  const MemoryModel m = made_up({10, 20, 30}, {5, 10, 15}, {1, 2, 3});
  EXPECT_DOUBLE_EQ(memory_model_seconds_per_unit(m, 18), 1);
  const EpochSamples samples{40, 10};
  const MemoryPlan whole = memory_plan_solve(m, 16, 0);
  // 2 steps of 16 (8 + 16) + one of 8 (8 + 8) + the evaluation's one batch: (8 + 10) / 3.
  EXPECT_DOUBLE_EQ(memory_plan_epoch_s(m, whole, samples, 18), 2 * 24 + 16 + 6);
  EXPECT_DOUBLE_EQ(memory_plan_epoch_s(m, whole, samples, 36), (2 * 24 + 16 + 6) / 2.0);
  MemoryPlan small = whole;
  small.micro_batch = 4;
  small.accumulation = 4;
  small.recompute = {true, false, false};  // u0's FLOPs, 1 of 6, repeated: a step's forward share of them
  const double again = 1 + (1.0 / 3) * (1.0 / 6);
  const double expected = 2 * (4 * 8 + 16 * again) + (2 * 8 + 8 * again) + (3 * 8 + 10) / 3.0;
  EXPECT_NEAR(memory_plan_epoch_s(m, small, samples, 18), expected, 1e-9);
  EXPECT_GT(expected, 1.8 * (2 * 24 + 16 + 6));  // micro-batches of 4 with a recompute: nearly twice as long
  MemoryPlan none = whole;
  none.feasible = false;
  EXPECT_TRUE(std::isinf(memory_plan_epoch_s(m, none, samples, 18)));
}

// A NeuroFlux epoch on the same basis: each block's forward + backward with its heads at its batch, every step with
// the per-step overhead, its cache pass (held-out, test and, but for the last block, training rows) shared over the
// epochs, and host caches' transfers. u0: 100 parameters at 4×4 positions, a head of 8 filters (576 conv weights at
// 16 positions, 424 other parameters once); u1, the classifier: 50 parameters at one position.
TEST(PartitionerTest, AnEpochPricesBlocksHeadsAndCachePasses) {
  MemoryProfile p;
  UnitProfile u0;
  u0.params = 100;
  u0.out_shape = {8, 4, 4};
  u0.in_bytes = 40;
  u0.out_bytes = 64;
  u0.head_params = {1000, 500, 250, 125};
  u0.head_train.assign(kAuxLevels, Footprint{});
  UnitProfile u1;
  u1.params = 50;
  u1.out_shape = {10};
  u1.in_bytes = 64;
  p.units = {u0, u1};
  PartitionEpochInputs in;
  in.train_samples = 100;
  in.holdout_samples = 10;
  in.test_samples = 20;
  in.epochs = 2;
  in.flops_per_s = 1000;
  in.overhead_samples = 4;
  const double w0 = 2 * 100 * 16 + 2 * 576 * 16 + 2 * 424, w1 = 2 * 50;
  Partition one;
  one.blocks = {BlockPlan{0, 2, 16, 0}};
  partition_epoch_s(p, in, &one);
  // 7 steps of (16 + 4) samples, 3 passes' work each; the pass over 30 rows in 2 batches, once in 2 epochs.
  const double step = 20 * (w0 + w1) / 1000;
  EXPECT_DOUBLE_EQ(one.epoch_s, 7 * 3 * step + 2 * step / 2);
  EXPECT_DOUBLE_EQ(one.blocks[0].epoch_s, one.epoch_s);
  Partition two;
  two.blocks = {BlockPlan{0, 1, 16, 0}, BlockPlan{1, 2, 32, 0}};
  in.host_bytes_per_s = 100;
  partition_epoch_s(p, in, &two);
  const double step0 = 20 * w0 / 1000, step1 = 36 * w1 / 1000;
  // Block 0 writes 130 rows of 32 bytes (bf16) once; block 1 reads 100 rows of 32 bytes every epoch.
  const double first = 7 * 3 * step0 + 9 * step0 / 2 + 130.0 * 32 / 2 / 100;
  const double last = 4 * 3 * step1 + 1 * step1 / 2 + 100.0 * 32 / 100;
  EXPECT_DOUBLE_EQ(two.blocks[0].epoch_s, first);
  EXPECT_DOUBLE_EQ(two.blocks[1].epoch_s, last);
  EXPECT_DOUBLE_EQ(two.epoch_s, first + last);
}

// Method auto's rule: the fastest candidate that fits, the reason naming both predictions; when only one fits, that
// one; when none fits, the one that needs the least budget (its run names it); one that cannot run is never chosen.
TEST(MethodChoiceTest, AutoPicksTheFastestMethodThatFits) {
  const auto candidates = [](bool bp_fits, double bp_s, bool nf_fits, double nf_s) {
    MethodCandidate bp{Method::kBackprop, bp_fits, bp_s, 1.5e8, ""};
    MethodCandidate nf{Method::kNeuroFlux, nf_fits, nf_s, 0.5e8, ""};
    return std::vector<MethodCandidate>{bp, nf};
  };
  MethodChoice c = method_choose(candidates(true, 96.5, true, 12.25));
  EXPECT_EQ(c.method, Method::kNeuroFlux);
  EXPECT_TRUE(c.fits);
  EXPECT_NE(c.reason.find("12.25"), std::string::npos) << c.reason;
  EXPECT_NE(c.reason.find("backprop 96.5"), std::string::npos) << c.reason;
  c = method_choose(candidates(true, 7.75, true, 12.25));
  EXPECT_EQ(c.method, Method::kBackprop);
  EXPECT_NE(c.reason.find("7.75"), std::string::npos) << c.reason;
  EXPECT_NE(c.reason.find("neuroflux 12.25"), std::string::npos) << c.reason;
  c = method_choose(candidates(true, 96.5, false, 0));
  EXPECT_EQ(c.method, Method::kBackprop);
  EXPECT_NE(c.reason.find("neuroflux does not fit"), std::string::npos) << c.reason;
  c = method_choose(candidates(false, 0, true, 12.25));
  EXPECT_EQ(c.method, Method::kNeuroFlux);
  EXPECT_NE(c.reason.find("backprop does not fit (it needs 0.15 GB)"), std::string::npos) << c.reason;
  c = method_choose(candidates(false, 0, false, 0));
  EXPECT_FALSE(c.fits);
  EXPECT_EQ(c.method, Method::kNeuroFlux);  // 0.05 GB short of fitting rather than backprop's 0.15
  std::vector<MethodCandidate> cnn_only = candidates(true, 96.5, true, 12.25);
  cnn_only[1].not_why = "trains CNNs only";
  c = method_choose(cnn_only);
  EXPECT_EQ(c.method, Method::kBackprop);
  EXPECT_NE(c.reason.find("neuroflux cannot run (trains CNNs only)"), std::string::npos) << c.reason;
  const Json j = method_candidates_json(candidates(true, 96.5, false, 0));
  EXPECT_EQ(j[0]["method"], "backprop");
  EXPECT_EQ(j[0]["predicted_epoch_s"], 96.5);
  EXPECT_FALSE(j[1]["fits"].get<bool>());
  EXPECT_TRUE(j[1]["predicted_epoch_s"].is_null());
}

// The case on made-up costs: a budget backprop fits only with micro-batches of a few samples and recompute,
// where NeuroFlux trains one unit a block at the whole batch: both fit, NeuroFlux is predicted faster and chosen;
// with room for backprop's whole batch, backprop is (the same steps without NeuroFlux's cache passes).
TEST(MethodChoiceTest, BackpropStarvedByTheBudgetLosesToNeuroFlux) {
  MemoryModel m = made_up({400, 400, 400}, {20, 20, 20}, {100, 100, 100});
  m.overhead_s = 64;
  const EpochSamples samples{1000, 0};
  const MemoryPlan tight = memory_plan_solve(m, 96, 2000);
  ASSERT_TRUE(tight.feasible);
  ASSERT_LT(tight.micro_batch, 8);
  const MemoryPlan roomy = memory_plan_solve(m, 96, 0);
  MemoryProfile p;
  for (int u = 0; u < 3; ++u) {
    UnitProfile up;
    up.params = 50;
    up.out_shape = {1, 1, 1};  // 2 · 50 FLOPs a sample: the made-up units' 100
    if (u < 2) {
      up.head_params = {0, 0, 0, 0};
      up.head_train.assign(kAuxLevels, Footprint{});
    }
    p.units.push_back(up);
  }
  PartitionEpochInputs in;
  in.train_samples = 1000;
  in.epochs = 1;
  in.flops_per_s = kGpuTrainFlopsPerS;
  in.overhead_samples = 64;
  Partition blocks;
  blocks.blocks = {BlockPlan{0, 1, 96, 3}, BlockPlan{1, 2, 96, 3}, BlockPlan{2, 3, 96, 3}};
  partition_epoch_s(p, in, &blocks);
  const auto choose = [&](const MemoryPlan& plan) {
    return method_choose({MethodCandidate{Method::kBackprop, true, memory_plan_epoch_s(m, plan, samples), 0, ""},
                          MethodCandidate{Method::kNeuroFlux, true, blocks.epoch_s, 0, ""}});
  };
  EXPECT_EQ(choose(tight).method, Method::kNeuroFlux) << choose(tight).reason;
  EXPECT_EQ(choose(roomy).method, Method::kBackprop) << choose(roomy).reason;
}

TEST(MemoryLeverTest, TheOptimizerStateIsMadeBeforeTheFirstForward) {
  UnitRig rig(false, StepOptions{}, torch::kCPU);
  EXPECT_TRUE(rig.sgd.momenta().empty());
  EXPECT_ANY_THROW(rig.step.run(at::randn({12, 7}), at::zeros({12}, at::kLong), 0.05));
  ASSERT_EQ(rig.sgd.momenta().size(), rig.sgd.params().size());
  EXPECT_TRUE(rig.sgd.momenta()[0].defined());
}

// Gradient accumulation over micro-batches of 5, 5 and 2 gives the weights of the whole batch of 12 at once (no
// BatchNorm: the micro-batch would change its statistics), to float32 rounding.
TEST(MemoryLeverTest, AccumulationGivesTheWholeBatchsWeights) {
  const StepRun whole = train_steps(0, {}, false, 6);
  const StepRun micro = train_steps(5, {}, false, 6);
  ASSERT_EQ(whole.weights.size(), micro.weights.size());
  for (size_t i = 0; i < whole.weights.size(); ++i) {
    EXPECT_TRUE(at::allclose(whole.weights[i], micro.weights[i], 1e-5, 1e-6)) << "tensor " << i;
  }
  // It is a different computation: micro-batches of 1 without the loss weighting would be 12x the step.
  const StepRun one = train_steps(1, {}, false, 6);
  for (size_t i = 0; i < whole.weights.size(); ++i) EXPECT_TRUE(at::allclose(whole.weights[i], one.weights[i], 1e-5, 1e-6));
}

// Recomputing units gives the kept forward's weights bit for bit on the CPU, BatchNorm statistics included (the
// second forward's update is undone).
TEST(MemoryLeverTest, RecomputeGivesTheSameWeightsAndStatistics) {
  const StepRun kept = train_steps(0, {}, true, 4);
  const StepRun recomputed = train_steps(0, {true, true, false}, true, 4);
  for (size_t i = 0; i < kept.weights.size(); ++i) EXPECT_TRUE(torch::equal(kept.weights[i], recomputed.weights[i])) << i;
  ASSERT_FALSE(kept.buffers.empty());
  for (size_t i = 0; i < kept.buffers.size(); ++i) EXPECT_TRUE(torch::equal(kept.buffers[i], recomputed.buffers[i])) << i;
}

// A recomputed fp32 unit after a bf16 one keeps its input as it came (bf16, the previous unit's output), not an fp32
// copy (twice its bytes, beside the bf16 one the previous unit's backward holds), and its gradients are those of the
// kept forward: the cast into its dtype runs inside the recompute.
TEST(MemoryLeverTest, ARecomputedUnitKeepsItsInputAsItCameNotItsCast) {
  torch::manual_seed(3);
  UnitRig rig(false, StepOptions{}, torch::kCPU);
  TrainStep& step = rig.step;
  step.set_unit_precisions({Precision::kBF16, Precision::kFP32, Precision::kBF16});
  const at::Tensor x = torch::randn({6, 12});
  const auto grads_of = [&](const at::Tensor& out) {
    return torch::autograd::grad({out.to(at::kFloat).pow(2).sum()}, rig.net.parameters());
  };
  const auto kept = grads_of(step.forward(x));
  step.set_recompute({false, true, false});
  const at::Tensor out = step.forward(x);
  const std::vector<at::Tensor> inputs = recompute_kept_inputs(out);
  ASSERT_EQ(inputs.size(), 1u);
  EXPECT_EQ(inputs[0].scalar_type(), at::kBFloat16);
  EXPECT_EQ(inputs[0].sizes(), (std::vector<int64_t>{6, 24}));
  const auto again = grads_of(out);
  ASSERT_EQ(again.size(), kept.size());
  for (size_t i = 0; i < kept.size(); ++i) EXPECT_TRUE(torch::equal(kept[i], again[i])) << i;
}

// recompute_forward's gradients for the input and the parameters equal the plain forward's, and its forward keeps
// no graph inside the unit (only the function node itself).
TEST(MemoryLeverTest, RecomputeForwardMatchesThePlainGradients) {
  torch::manual_seed(5);
  torch::nn::Linear a(6, 8), b(8, 3);
  const auto fn = [&](const at::Tensor& x) { return b->forward(torch::tanh(a->forward(x))); };
  std::vector<at::Tensor> params;
  for (const auto& p : a->parameters()) params.push_back(p);
  for (const auto& p : b->parameters()) params.push_back(p);
  const at::Tensor x = torch::randn({4, 6}).requires_grad_(true);
  const auto grads_of = [&](const at::Tensor& out) {
    return torch::autograd::grad({out.pow(2).sum()}, {x, params[0], params[2]});
  };
  const auto plain = grads_of(fn(x));
  const at::Tensor out = recompute_forward(fn, x, params, {});
  EXPECT_EQ(out.grad_fn()->next_edges().size(), 1 + params.size());  // the input and the parameters, nothing inside
  const auto again = grads_of(out);
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(torch::equal(plain[i], again[i])) << i;
}

// The cost model of small-cnn: a unit per layer group, positive activations, the input of each unit the previous
// unit's output, and the whole batch's peak growing with the batch; building it leaves the weights and buffers.
TEST(MemoryModelTest, SmallCnnCostsFromItsShapes) {
  torch::manual_seed(0);
  ModelOptions mo;
  mo.name = "small-cnn";
  mo.in_channels = 1;
  mo.image_size = 28;
  const std::shared_ptr<Model> model = model_create(mo);
  std::vector<at::Tensor> before;
  for (const auto& [name, t] : model_state(*model)) before.push_back(t.clone());
  MemoryModelInputs in;
  in.optimizer_state_bytes = 4 * model->parameter_count();
  const MemoryModel m = memory_model_build(*model, torch::zeros({1, 28, 28}), in, torch::kCPU);
  ASSERT_EQ(m.units.size(), model->units().size());
  EXPECT_EQ(m.units[0].input_bytes, 28 * 28 * 4);
  for (const UnitCost& u : m.units) {
    EXPECT_GT(u.saved_bytes, 0) << u.name;
    EXPECT_GT(u.flops, 0) << u.name;
    EXPECT_TRUE(u.recomputable) << u.name;
  }
  EXPECT_DOUBLE_EQ(m.weights_bytes, 4.0 * static_cast<double>(model->parameter_count()));
  size_t i = 0;
  for (const auto& [name, t] : model_state(*model)) EXPECT_TRUE(torch::equal(t, before[i++])) << name;
}

// The evaluation batch counts everything the allocator holds as taken (the graph's pool was cut for the step), and
// takes at least the step's micro-batch, which fits in the blocks the step's own forward used.
TEST(MemoryModelTest, TheEvaluationBatchFitsBesideWhatIsHeld) {
  MemoryModel m = made_up({10, 10}, {4, 8}, {1, 1});  // widest input 8: 3 · 8 + 4 / 2 = 26 bytes a sample
  m.activation_scale = 1;
  EXPECT_DOUBLE_EQ(memory_model_eval_per_sample(m), 26);
  // 1000 held of a 3600 cap: 2600 / 26 = 100 samples in new segments.
  EXPECT_EQ(memory_model_eval_batch(m, 3600, 1000, 16, 1000), 100);
  EXPECT_EQ(memory_model_eval_batch(m, 3600, 1000, 16, 64), 64);     // never above what was asked
  EXPECT_EQ(memory_model_eval_batch(m, 3600, 3500, 16, 1000), 16);   // no room: the step's micro-batch
  EXPECT_EQ(memory_model_eval_batch(m, 3600, 4000, 0, 1000), 1);     // held above the cap: one sample
  m.activation_scale = 2;  // a calibrated scale applies to evaluation too
  EXPECT_EQ(memory_model_eval_batch(m, 3600, 1000, 16, 1000), 50);
}

// The starting scale's traces: 32/64 first, then 8/16 and 2/4 where a cap runs a pair out of memory (ViT-Tiny fp32's
// 2/4 trace read 0.883 where its steps at 256 samples read 0.989: the smallest batches under-trace). A made-up
// allocator: 1000 bytes fixed plus 3 bytes a sample over a modelled 2, so every pair that fits reads 1.5.
TEST(MemoryModelTest, TheScaleIsTracedAtTheLargestPairThatFits) {
  unsetenv("TRIACCEL_SCALE_TRACE");
  const std::vector<std::pair<int64_t, int64_t>> pairs = scale_trace_batches();
  ASSERT_EQ(pairs.size(), 3u);
  EXPECT_EQ(pairs[0], std::make_pair(int64_t{32}, int64_t{64}));
  EXPECT_EQ(pairs[1], std::make_pair(int64_t{8}, int64_t{16}));
  EXPECT_EQ(pairs[2], std::make_pair(int64_t{2}, int64_t{4}));
  setenv("TRIACCEL_SCALE_TRACE", "128,256", 1);
  EXPECT_EQ(scale_trace_batches(), (std::vector<std::pair<int64_t, int64_t>>{{128, 256}}));
  unsetenv("TRIACCEL_SCALE_TRACE");

  int64_t cap = 1000000;  // the largest batch that fits
  std::vector<int64_t> asked;
  int releases = 0;
  const auto peak_of = [&](int64_t batch) {
    asked.push_back(batch);
    TORCH_CHECK_WITH(OutOfMemoryError, batch <= cap, "made-up cap");
    return 1000.0 + 3.0 * static_cast<double>(batch);
  };
  const auto release = [&releases] { ++releases; };
  EXPECT_DOUBLE_EQ(activation_scale_from_traces(pairs, peak_of, 2, release), 1.5);
  EXPECT_EQ(asked, (std::vector<int64_t>{32, 64, 32, 64}));  // two passes, the first pair alone
  EXPECT_EQ(releases, 0);

  cap = 40;  // 64 does not fit: 8/16 next
  asked.clear();
  EXPECT_DOUBLE_EQ(activation_scale_from_traces(pairs, peak_of, 2, release), 1.5);
  EXPECT_EQ(asked, (std::vector<int64_t>{32, 64, 8, 16, 8, 16}));
  EXPECT_EQ(releases, 1);

  cap = 1;  // nothing fits: the scale stays 1
  EXPECT_DOUBLE_EQ(activation_scale_from_traces(pairs, peak_of, 2, release), 1);
  EXPECT_EQ(releases, 4);

  // A peak that does not grow with the batch: 1, not the next pair's reading.
  asked.clear();
  const auto flat = [&asked](int64_t batch) {
    asked.push_back(batch);
    return 500.0;
  };
  EXPECT_DOUBLE_EQ(activation_scale_from_traces(pairs, flat, 2, release), 1);
  EXPECT_EQ(asked.size(), 4u);
  // Clamped: 3 bytes a sample over a modelled 0.1 is 30, read as kMeasuredScaleMax.
  cap = 1000000;
  EXPECT_DOUBLE_EQ(activation_scale_from_traces(pairs, peak_of, 0.1, release), kMeasuredScaleMax);
}

// One unit, Linear(256 → 1024) then tanh, fp32: backward needs the linear's input (allocated before the unit) and
// tanh's output, 4 KiB a sample; the pre-activation is freed. On CUDA the model reads that from the allocator; the
// autograd graph's outputs would count the pre-activation too (8 KiB), as on the CPU. With `scaled_weight` the
// weight goes through the graph first (times 2, as a 16-bit cast would): a 1 MiB tensor the batch does not size.
class WideUnit : public Model {
 public:
  explicit WideUnit(bool scaled_weight = false) : Model("wide-unit") {
    auto linear = register_module("fc", torch::nn::Linear(256, 1024));
    std::vector<std::shared_ptr<torch::nn::Module>> modules{linear};
    unit_add("fc", modules, [linear, scaled_weight](const at::Tensor& x) {
      return torch::tanh(at::linear(x, scaled_weight ? linear->weight * 2.0 : linear->weight, linear->bias));
    });
  }
};

TEST(MemoryModelTest, SavedActivationsAreWhatBackwardKeeps) {
  WideUnit cpu_net;
  const MemoryModel graph = memory_model_build(cpu_net, torch::zeros({256}), MemoryModelInputs{}, torch::kCPU);
  EXPECT_DOUBLE_EQ(graph.units[0].saved_bytes, 2 * 1024 * 4);
  TRIACCEL_SKIP_WITHOUT_GPU();
  const c10::Device gpu(c10::kCUDA, 0);
  WideUnit net;
  net.to(gpu);
  const MemoryModel m = memory_model_build(net, torch::zeros({256}, at::TensorOptions().device(gpu)),
                                           MemoryModelInputs{}, gpu);
  EXPECT_DOUBLE_EQ(m.units[0].saved_bytes, 1024 * 4);
  EXPECT_DOUBLE_EQ(m.units[0].input_bytes, 256 * 4);
  EXPECT_GE(m.units[0].backward_bytes, 1024 * 4);  // its own backward's peak holds at least what it saved
}

// A unit that starts with an in-place op on its input (a Python model may): its backward peak cannot be read with
// the input as a leaf that needs a gradient, so it is left unread (0: the saved + transient price), and the model
// is still built.
class InPlaceStart : public Model {
 public:
  InPlaceStart() : Model("in-place-start") {
    auto a = register_module("a", torch::nn::Linear(256, 1024));
    auto b = register_module("b", torch::nn::Linear(1024, 16));
    unit_add("a", {a}, [a](const at::Tensor& x) { return a->forward(x); });
    unit_add("b", {b}, [b](const at::Tensor& x) { return b->forward(x.clone().relu_()).add_(1); });
    unit_add("c", {}, [](const at::Tensor& x) { return x.relu_(); });
  }
};

TEST(MemoryModelTest, AUnitThatWritesItsInputInPlaceLeavesItsBackwardPeakUnread) {
  TRIACCEL_SKIP_WITHOUT_GPU();
  const c10::Device gpu(c10::kCUDA, 0);
  InPlaceStart net;
  net.to(gpu);
  const MemoryModel m = memory_model_build(net, torch::zeros({256}, at::TensorOptions().device(gpu)),
                                           MemoryModelInputs{}, gpu);
  ASSERT_EQ(m.units.size(), 3u);
  EXPECT_GT(m.units[1].backward_bytes, 0);
  EXPECT_EQ(m.units[2].backward_bytes, 0);
}

// A unit whose graph records a tensor the batch does not size (its weight scaled before use, as a 16-bit cast is):
// the backward transient is twice the largest per-sample tensor (the 4 KiB output a sample), not the 1 MiB weight
// spread over the trace's samples.
TEST(MemoryModelTest, ATensorTheBatchDoesNotSizeIsNoPerSampleTransient) {
  WideUnit net(/*scaled_weight=*/true);
  const MemoryModel m = memory_model_build(net, torch::zeros({256}), MemoryModelInputs{}, torch::kCPU);
  EXPECT_DOUBLE_EQ(m.transient_bytes, 2 * 1024 * 4);
  EXPECT_DOUBLE_EQ(m.units[0].saved_bytes, 2 * 1024 * 4);  // the weight's product is no saved activation either
  const std::vector<double> small{100, 8}, large{100, 16};  // one tensor per graph node, traced at 2 and 4 samples
  EXPECT_DOUBLE_EQ(largest_tensor_per_sample(small, 2, large, 4), 4);
  EXPECT_DOUBLE_EQ(largest_tensor_per_sample({8}, 2, {100, 16}, 4), 25);  // graphs that differ: the large one's
}

class MemoryRunTest : public test::TinyMnistTest {};

// On the CPU the levers can be set by hand: a run with micro-batches of 24 and a recomputed unit trains every
// sample once, and its plan is in the events.
TEST_F(MemoryRunTest, ARunWithHandSetLeversTrainsAndReportsThePlan) {
  test::TempDir out("run_levers");
  Config o = options(out.path());
  o.set("micro_batch", "24");
  o.set("recompute", "block1");
  const Json summary = api::run(o);
  EXPECT_EQ(summary["memory_plan"]["micro_batch"], 24);
  EXPECT_EQ(summary["memory_plan"]["accumulation"], (o.schedule.batch_size + 23) / 24);
  int plans = 0;
  for (const auto& e : events_read(out.file("events.jsonl"))) {
    if (e["event"] == "memory_plan") {
      ++plans;
      EXPECT_EQ(e["recompute"].size(), 1u);
      // Per unit for the report: block1 holds its input alone, the others their saved activations.
      ASSERT_TRUE(e["units"].is_array());
      ASSERT_GE(e["units"].size(), 2u);
      for (const auto& u : e["units"]) {
        EXPECT_EQ(u["recompute"].get<bool>(), u["unit"] == "block1") << u.dump();
        EXPECT_GT(u["activation_bytes"].get<int64_t>(), 0) << u.dump();
      }
      EXPECT_GT(e["consumers"]["weights"].get<int64_t>(), 0);
      EXPECT_EQ(e["method"], "backprop");
      EXPECT_GT(e["predicted_epoch_s"].get<double>(), 0);
    }
  }
  EXPECT_EQ(plans, 1);
  Config bad = options(out.path());
  bad.set("recompute", "nope");
  try {
    api::run(bad);
    FAIL() << "an unknown unit was accepted";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("has no unit 'nope'"), std::string::npos) << e.what();
  }
}

// GPU: a session under a budget makes expandable segments from its start, before the model's weights go to the GPU
// (NeuroFlux's profile allocates before the cap too); without a budget it leaves the allocator alone, and the
// setting ends with the session.
TEST_F(MemoryRunTest, ABudgetsSessionMakesExpandableSegmentsFromItsStart) {
  TRIACCEL_SKIP_WITHOUT_GPU();
  if (std::getenv("PYTORCH_ALLOC_CONF") != nullptr || std::getenv("PYTORCH_CUDA_ALLOC_CONF") != nullptr) {
    GTEST_SKIP() << "the user's allocator settings are left alone";
  }
  test::TempDir out("run_expandable");
  const auto expandable_at_model = [&](const char* budget) {
    Config o = options(out.path());
    o.set("device", "cuda");
    o.set("max_steps", "1");
    if (budget != nullptr) o.set("vram_budget", budget);
    std::optional<bool> seen;
    RunHooks hooks;
    hooks.model = [&seen](const ModelOptions& mo) {
      seen = memory_expandable_segments();
      return model_create(mo);
    };
    api::run(o, hooks);
    EXPECT_FALSE(memory_expandable_segments()) << "the session's setting outlived it";
    return seen.value_or(false);
  };
  EXPECT_TRUE(expandable_at_model("1GB"));
  EXPECT_FALSE(expandable_at_model(nullptr));
}

// `plan` with a vram_budget on the CPU: the plan for a GPU from the modelled profile, with the fields the issue
// names, and a budget under the floor reported as infeasible with the floor.
TEST_F(MemoryRunTest, PlanWithABudgetGivesTheMemoryPlanOnTheCpu) {
  Config o = options("unused");
  o.set("vram_budget", "1GB");
  const Json p = api::plan(o);
  ASSERT_TRUE(p.contains("memory_plan"));
  const Json& m = p["memory_plan"];
  for (const char* key : {"micro_batch", "accumulation", "recompute", "data_placement", "predicted_peak_bytes",
                          "budget_bytes", "floor_bytes"}) {
    EXPECT_TRUE(m.contains(key)) << key;
  }
  EXPECT_EQ(m["budget_bytes"], 1000000000);
  EXPECT_EQ(m["micro_batch"], o.schedule.batch_size);
  EXPECT_FALSE(p.contains("optim_plan"));
  // Under a budget cuBLAS's workspace is one small chunk: 12 MB of workspaces priced, not 48 (plus the weight casts).
  const auto fixed = m["consumers"]["fixed"].get<double>();
  EXPECT_GE(fixed, kGpuFixedTransientBytesBudgeted);
  EXPECT_LT(fixed, kGpuFixedTransientBytes);
  o.set("vram_budget", "2MB");
  const Json small = api::plan(o)["memory_plan"];
  EXPECT_FALSE(small["feasible"].get<bool>());
  EXPECT_GT(small["floor_bytes"].get<int64_t>(), 1800000);
}

// With several ranks the optimizer state's shard (ZeRO-1) is a lever the planner takes first: at a budget just under
// what the plan with AdamW's whole state needs in one pass, `auto` shards the state and keeps each rank's share in
// one pass, while `off` has to split it or recompute; with room to spare nothing is sharded.
TEST_F(MemoryRunTest, PlanOnTwoRanksShardsTheOptimizerStateBeforeTheOtherLevers) {
  Config o = options("unused");
  o.set("nproc", "2");
  o.set("optimizer", "adamw");
  o.set("lr", "1e-3");
  o.set("vram_budget", "1GB");
  const Json roomy = api::plan(o)["memory_plan"];
  EXPECT_FALSE(roomy["shard_optimizer"].get<bool>());
  EXPECT_EQ(roomy["micro_batch"], 32);  // the rank's share of 64, in one pass
  const double share = roomy["plan_limit_bytes"].get<double>() / roomy["budget_bytes"].get<double>();
  const double need = roomy["predicted_peak_bytes"].get<double>();
  o.set("vram_budget", std::to_string(static_cast<int64_t>((need - 2000) / share)));
  o.set("shard_optimizer", "off");
  const Json whole = api::plan(o)["memory_plan"];
  EXPECT_FALSE(whole["shard_optimizer"].get<bool>());
  EXPECT_TRUE(whole["micro_batch"].get<int64_t>() < 32 || !whole["recompute"].empty()) << whole.dump();
  o.set("shard_optimizer", "auto");
  const Json sharded = api::plan(o)["memory_plan"];
  EXPECT_TRUE(sharded["shard_optimizer"].get<bool>());
  EXPECT_EQ(sharded["micro_batch"], 32) << sharded.dump();
  EXPECT_TRUE(sharded["recompute"].empty()) << sharded.dump();
  EXPECT_LT(sharded["predicted_peak_bytes"].get<double>(), need - 2000);
}

// The model's parameter shapes, in the optimizer's order.
std::vector<std::vector<int64_t>> parameter_shapes(Model& model) {
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& item : model.named_parameters()) shapes.push_back(item.value().sizes().vec());
  return shapes;
}

// What BAOC adds to AdamW's state is priced before it allocates: per tensor the largest state of its warm-up (fp32
// AdamW) and its menu, the statistics window's previous gradients (4 bytes an element), the step counts and window
// sums (float64), the 8-bit maps, and its largest conversion (the largest tensor's two moments decoded to float32
// beside its new state); `plan` (warm-up of 2 steps for its format plan) shows it in the optimizer's consumer and in
// the peak, at the same levers.
TEST_F(MemoryRunTest, PlanPricesBaocsFormatsItsWindowAndItsConversions) {
  Config o = options("unused");
  o.set("vram_budget", "1GB");
  o.set("lr", "1e-3");
  o.set("optimizer", "adamw");
  const Json adamw = api::plan(o)["memory_plan"];
  o.set("optimizer", "baoc");
  o.set("optim_formats", "adamw-8bit,factored,sgd");
  o.set("plan_warmup", "2");
  const Json baoc = api::plan(o)["memory_plan"];
  ModelOptions mo;
  mo.name = "small-cnn";
  mo.in_channels = 1;
  mo.image_size = 28;
  const std::shared_ptr<Model> model = model_create(mo);
  const auto shapes = parameter_shapes(*model);
  int64_t n = 0, largest = 0;
  for (const auto& shape : shapes) {
    const int64_t numel = std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
    n += numel;
    largest = std::max(largest, numel);
  }
  const auto tensors = static_cast<int64_t>(shapes.size());
  // The window, the bookkeeping, then the larger of a conversion (m and v decoded, the new state beside the old, a
  // chunk of the 8-bit codec's temporaries) and
  // a chunk of the plan's signals (optim/signals.h), which come one after the other.
  const int64_t signals = std::min(n, kSignalChunkElements) * kSignalChunkBytesPerElement;
  const int64_t conversion = (8 + 8) * largest + std::min(largest, kQuant8ChunkElements) * kQuant8ChunkBytesPerElement;
  const int64_t extra = 4 * n + tensors * (2 + kStreamColumns) * 8 + 4 * 256 * 4 + std::max(conversion, signals);
  EXPECT_EQ(baoc["consumers"]["optimizer"].get<int64_t>() - adamw["consumers"]["optimizer"].get<int64_t>(), extra);
  ASSERT_EQ(baoc["micro_batch"], adamw["micro_batch"]);
  EXPECT_NEAR(baoc["predicted_peak_bytes"].get<double>() - adamw["predicted_peak_bytes"].get<double>(),
              static_cast<double>(extra), 2);
  // Whatever the format plan chooses from its menu, its state is within what is priced.
  Config resolved = o;
  resolved.resolve();
  const OptimizerBytes priced = optimizer_priced(resolved, shapes);
  for (StateFormat f : {StateFormat::kAdamW32, StateFormat::kAdamW8, StateFormat::kFactored, StateFormat::kSgd}) {
    int64_t bytes = 0;
    for (const auto& shape : shapes) bytes += state_format_bytes(f, shape);
    EXPECT_LE(bytes, priced.state) << state_format_name(f);
  }
  EXPECT_EQ(priced.state, 8 * n);  // the warm-up's fp32 AdamW, the largest
}

// fp32 against amp-bf16 at the same levers: the peak differs by what the two price differently, the activations at
// 4 bytes an element instead of 2 (each unit's, and backward's transients) and the 16-bit weight casts that fp32 does
// not make; the loss scaler's state is in both.
TEST_F(MemoryRunTest, PlanPricesFp32ActivationsAndNoWeightCasts) {
  Config o = options("unused");
  o.set("vram_budget", "1GB");
  const auto plan_at = [&](const char* precision) {
    o.set("precision", precision);
    return api::plan(o)["memory_plan"];
  };
  const Json fp32 = plan_at("fp32"), bf16 = plan_at("amp-bf16");
  ASSERT_EQ(fp32["micro_batch"], bf16["micro_batch"]);
  ASSERT_TRUE(fp32["recompute"].empty() && bf16["recompute"].empty());
  const auto activations = [](const Json& plan) {  // m · scale · (Σ saved + transient), nothing recomputed
    double saved = 0;
    for (const auto& u : plan["units"]) saved += u["saved_bytes_per_sample"].get<double>();
    return plan["consumers"]["transient"].get<double>() +
           plan["micro_batch"].get<double>() * plan["activation_scale"].get<double>() * saved;
  };
  const auto fixed = [](const Json& plan) { return plan["consumers"]["fixed"].get<double>(); };
  const double params = static_cast<double>(api::plan(o)["params"].get<int64_t>());
  EXPECT_DOUBLE_EQ(fixed(bf16) - fixed(fp32), 2 * params);  // the bf16 casts of the fp32 weights
  EXPECT_GE(fixed(fp32), kLossScalerBytes + kGpuFixedTransientBytesBudgeted);
  EXPECT_GT(activations(fp32), 1.6 * activations(bf16));  // 4 bytes an element against 2 (the pools' int64 indices:
                                                          // 8 in both)
  EXPECT_NEAR(fp32["predicted_peak_bytes"].get<double>() - bf16["predicted_peak_bytes"].get<double>(),
              activations(fp32) - activations(bf16) - 2 * params, 16);
}

// `plan` with method auto names the candidates, each with whether it fits and its predicted seconds per epoch, and
// the method is the fastest that fits; under backprop's floor only NeuroFlux fits.
TEST_F(MemoryRunTest, PlanWithMethodAutoNamesTheCandidatesAndTheFastest) {
  Config o = options("unused");
  o.set("method", "auto");
  o.set("vram_budget", "1GB");
  Json p = api::plan(o);
  ASSERT_TRUE(p.contains("method_candidates")) << p.dump();
  const Json& c = p["method_candidates"];
  ASSERT_EQ(c.size(), 2u);
  EXPECT_EQ(c[0]["method"], "backprop");
  EXPECT_EQ(c[1]["method"], "neuroflux");
  ASSERT_TRUE(c[0]["fits"].get<bool>() && c[1]["fits"].get<bool>()) << c.dump();
  const double bp = c[0]["predicted_epoch_s"].get<double>(), nf = c[1]["predicted_epoch_s"].get<double>();
  EXPECT_GT(bp, 0);
  EXPECT_GT(nf, 0);
  EXPECT_EQ(p["method"], bp <= nf ? "backprop" : "neuroflux") << p["method_reason"];
  EXPECT_DOUBLE_EQ(p["memory_plan"]["predicted_epoch_s"].get<double>(), bp);
  o.set("vram_budget", std::to_string(p["memory_plan"]["floor_bytes"].get<int64_t>()));  // below it: a 0.9 share
  p = api::plan(o);
  EXPECT_FALSE(p["method_candidates"][0]["fits"].get<bool>()) << p["method_candidates"].dump();
  EXPECT_TRUE(p["method_candidates"][1]["fits"].get<bool>()) << p["method_candidates"].dump();
  EXPECT_EQ(p["method"], "neuroflux") << p["method_reason"];
  EXPECT_NE(p["method_reason"].get<std::string>().find("backprop does not fit"), std::string::npos);
  // Options NeuroFlux's run would refuse keep auto on backprop (the H200 grid: auto with --optimizer baoc or a hand-set
  // --data-placement chose neuroflux, whose run then refused them).
  for (const auto& [key, value] : {std::pair<const char*, const char*>{"optimizer", "adamw"},
                                   {"data_placement", "host"}}) {
    SCOPED_TRACE(key);
    Config given = o;
    given.set(key, value);
    const Json q = api::plan(given);
    EXPECT_FALSE(q["method_candidates"][1]["fits"].get<bool>()) << q["method_candidates"].dump();
    EXPECT_NE(q["method_candidates"][1]["not_why"].get<std::string>().find(key == std::string("optimizer")
                                                                               ? "fused SGD"
                                                                               : "a lever of backprop's"),
              std::string::npos);
    EXPECT_EQ(q["method"], "backprop") << q["method_reason"];
  }
}

}  // namespace
}  // namespace triaccel
