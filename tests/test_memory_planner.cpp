// The memory planner (docs/memory-planner.md): the solver on made-up cost models (feasible and infeasible budgets,
// the fastest plan against a brute force over every combination of levers, a re-plan after the model changes, the
// user's fixed levers), and the levers in the step engine: gradient accumulation gives one big batch's weights, a
// recomputed unit gives the kept unit's gradients (and updates BatchNorm's statistics once), and a planned CPU run
// trains every sample once. The cost model of a real network, and `plan --vram-budget` on the CPU.
#include "test_util.h"
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
#include <vector>

namespace triaccel {
namespace {

// A made-up network: unit u keeps saved[u] bytes per sample, reads input[u], costs flops[u].
MemoryModel made_up(const std::vector<double>& saved, const std::vector<double>& input,
                    const std::vector<double>& flops) {
  MemoryModel m;
  for (size_t u = 0; u < saved.size(); ++u) {
    UnitCost c;
    c.name = "u" + std::to_string(u);
    c.saved_bytes = saved[u];
    c.input_bytes = input[u];
    c.flops = flops[u];
    m.units.push_back(c);
  }
  m.weights_bytes = 100;
  m.grads_bytes = 100;
  m.optimizer_bytes = 100;
  m.fixed_bytes = 50;
  m.dataset_bytes = 1000;
  m.stream_bytes = 100;
  m.batch_input_bytes = 2;
  m.transient_bytes = 4;
  m.overhead_s = 8;
  m.per_sample_s = 1;
  m.stream_per_sample_s = 0.05;
  return m;
}

// Every micro-batch, recompute subset and placement: the least step time among those that fit.
double brute_force_best(const MemoryModel& m, int64_t batch, double budget, bool* any) {
  double best = std::numeric_limits<double>::infinity();
  *any = false;
  const size_t n = m.units.size();
  for (DataPlacement p : {DataPlacement::kDevice, DataPlacement::kHost}) {
    for (int64_t micro = 1; micro <= batch; ++micro) {
      for (uint32_t mask = 0; mask < (1u << n); ++mask) {
        std::vector<bool> r(n);
        bool ok = true;
        for (size_t u = 0; u < n; ++u) {
          r[u] = (mask >> u) & 1u;
          ok = ok && (!r[u] || m.units[u].recomputable);
        }
        if (!ok || memory_plan_peak(m, batch, micro, r, p) > budget) continue;
        *any = true;
        best = std::min(best, memory_plan_step_s(m, batch, micro, r, p));
      }
    }
  }
  return best;
}

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
    const int64_t batch = 12;
    const double need = memory_plan_solve(m, batch, 0).predicted_peak_bytes;
    const double budget = std::floor(need * (0.3 + 0.7 * (trial % 10) / 10.0));
    bool any = false, any_tighter = false;
    const double best = brute_force_best(m, batch, budget, &any);
    const double best_tighter = brute_force_best(m, batch, 0.99 * budget, &any_tighter);
    const MemoryPlan plan = memory_plan_solve(m, batch, static_cast<int64_t>(budget));
    SCOPED_TRACE("trial " + std::to_string(trial) + " budget " + std::to_string(budget));
    if (any_tighter) ASSERT_TRUE(plan.feasible);
    if (!any) ASSERT_FALSE(plan.feasible);
    if (!plan.feasible) continue;
    ++feasible;
    EXPECT_LE(plan.predicted_peak_bytes, budget);
    EXPECT_GE(plan.predicted_step_s, best * (1 - 1e-12));
    if (any_tighter) EXPECT_LE(plan.predicted_step_s, best_tighter * (1 + 1e-12));
    EXPECT_DOUBLE_EQ(plan.predicted_peak_bytes,
                     memory_plan_peak(m, batch, plan.micro_batch, plan.recompute, plan.data_placement));
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

// A network of Linear (+ optional BatchNorm) units for the step-engine tests.
class UnitNet : public Model {
 public:
  explicit UnitNet(bool batch_norm) : Model("unit-net") {
    const int64_t widths[] = {12, 24, 24, 5};
    for (int u = 0; u < 3; ++u) {
      auto linear = register_module("fc" + std::to_string(u), torch::nn::Linear(widths[u], widths[u + 1]));
      std::vector<std::shared_ptr<torch::nn::Module>> modules{linear};
      if (batch_norm && u == 1) {
        auto bn = register_module("bn" + std::to_string(u), torch::nn::BatchNorm1d(widths[u + 1]));
        modules.push_back(bn);
        unit_add("unit" + std::to_string(u), modules, [linear, bn](const at::Tensor& x) {
          return torch::relu(bn->forward(linear->forward(x)));
        });
      } else {
        const bool last = u == 2;
        unit_add("unit" + std::to_string(u), modules, [linear, last](const at::Tensor& x) {
          const at::Tensor y = linear->forward(x);
          return last ? y : torch::tanh(y);
        });
      }
    }
  }
};

// A UnitNet on `device` with plain SGD, a loss scaler and the step engine over them (members in construction order:
// the step refers to the others).
std::vector<std::pair<std::string, at::Tensor>> named_on(Model& net, const c10::Device& device) {
  net.to(device);
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (const auto& item : net.named_parameters()) named.emplace_back(item.key(), item.value());
  return named;
}

struct UnitRig {
  UnitNet net;
  Sgd sgd;
  LossScaler scaler;
  TrainStep step;
  UnitRig(bool batch_norm, const StepOptions& so, const c10::Device& device)
      : net(batch_norm),
        sgd(named_on(net, device), SgdOptions{}),
        scaler(LossScalerOptions{}, device),
        step(net, sgd, scaler, so, device) {}
};

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

// GPU: the host-streamed loader gives the device loader's batches bit for bit (order, crops, flips, cutout), also
// when the batch size changes mid-epoch and across epochs.
TEST(MemoryGpuTest, HostPlacementGivesTheDeviceBatches) {
  TRIACCEL_SKIP_WITHOUT_GPU();
  Dataset data;
  data.name = "synthetic";
  data.images = at::randint(0, 256, {100, 3, 16, 16}, at::TensorOptions().dtype(at::kByte));
  data.labels = at::randint(0, 10, {100}, at::TensorOptions().dtype(at::kLong));
  data.num_classes = 10;
  LoaderOptions lo;
  lo.batch_size = 16;
  lo.augment = true;
  lo.cutout = 4;
  lo.seed = 9;
  const c10::Device gpu(c10::kCUDA, 0);
  const Loader device(data, {0.5f, 0.5f, 0.5f}, {0.25f, 0.25f, 0.25f}, lo, gpu);
  lo.placement = DataPlacement::kHost;
  Loader host(data, {0.5f, 0.5f, 0.5f}, {0.25f, 0.25f, 0.25f}, lo, gpu);
  Loader& dev = const_cast<Loader&>(device);
  EXPECT_EQ(host.placement(), DataPlacement::kHost);
  EXPECT_LT(host.resident_bytes(), dev.resident_bytes());
  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    dev.epoch_begin(epoch);
    host.epoch_begin(epoch);
    for (int64_t offset = 0, count = 16; offset < 100; offset += count, count = count == 16 ? 7 : 16) {
      const int64_t n = std::min<int64_t>(count, 100 - offset);
      const auto [xa, ya] = dev.batch(offset, n);
      const auto [xb, yb] = host.batch(offset, n);
      EXPECT_TRUE(torch::equal(xa, xb)) << "epoch " << epoch << " offset " << offset;
      EXPECT_TRUE(torch::equal(ya, yb)) << "epoch " << epoch << " offset " << offset;
    }
  }
}

// GPU: `steps` steps of the three-unit rig at batch 12 (every third one of `short_batch` samples when it is > 0), amp
// bf16, with or without the step's CUDA graph (captured after one warm-up step); the weights after them.
struct GpuRigRun {
  std::vector<at::Tensor> weights;
  bool captured = false;
  int64_t captures = 0;
};
GpuRigRun gpu_rig_steps(bool graphs, int64_t micro_batch, const std::vector<bool>& recompute, int steps,
                        int64_t short_batch) {
  const c10::Device gpu(c10::kCUDA, 0);
  torch::manual_seed(3);
  StepOptions so;
  so.precision = PrecisionMode::kAmpBF16;
  so.cuda_graphs = graphs;
  so.graph_batch_size = 12;
  so.warmup_steps = 1;
  so.micro_batch = micro_batch;
  UnitRig rig(false, so, gpu);
  TrainStep& step = rig.step;
  step.set_recompute(recompute);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(11);
  const at::Tensor x = at::empty({12, 12}, at::TensorOptions().device(gpu));
  const at::Tensor y = at::empty({12}, at::TensorOptions().dtype(at::kLong).device(gpu));
  for (int s = 0; s < steps; ++s) {
    const int64_t n = short_batch > 0 && s % 3 == 2 ? short_batch : 12;
    x.copy_(at::randn({12, 12}, gen));
    y.copy_(at::randint(0, 5, {12}, gen));
    step.run(x.narrow(0, 0, n), y.narrow(0, 0, n), 0.05);
  }
  GpuRigRun out;
  for (const auto& p : rig.net.parameters()) out.weights.push_back(p.detach().cpu());
  out.captured = step.graph().captured();
  out.captures = step.graph().captures();
  return out;
}

void expect_same_weights(const GpuRigRun& eager, const GpuRigRun& graphed) {
  ASSERT_EQ(eager.weights.size(), graphed.weights.size());
  for (size_t i = 0; i < eager.weights.size(); ++i) {
    EXPECT_TRUE(at::allclose(eager.weights[i], graphed.weights[i], 1e-5, 1e-6)) << i;
  }
}

// GPU: a step with micro-batches and recomputed units, captured in a CUDA graph and replayed, trains the weights
// the same step gives eagerly.
TEST(MemoryGpuTest, PlannedStepInACudaGraphMatchesEager) {
  TRIACCEL_SKIP_WITHOUT_GPU();
#ifdef TRIACCEL_WITH_CUDA
  const c10::cuda::CUDAStreamGuard stream(c10::cuda::getStreamFromPool());  // captures need a non-default stream
#endif
  const GpuRigRun eager = gpu_rig_steps(false, 5, {true, false, true}, 6, 0);
  const GpuRigRun graphed = gpu_rig_steps(true, 5, {true, false, true}, 6, 0);
  EXPECT_FALSE(eager.captured);
  EXPECT_TRUE(graphed.captured);
  expect_same_weights(eager, graphed);
}

// GPU: with eager_in_pool, an eager step of another batch size while a graph is captured (the epoch's short last
// batch) takes its memory from the graph's pool: with the default pool emptied, the allocator reserves nothing for
// its 20 MB temporary (without, it reserves a segment for it); the eager step and the replays after it compute what
// they should.
TEST(MemoryGpuTest, AnEagerStepOfAnotherSizeRunsInTheGraphsPool) {
  TRIACCEL_SKIP_WITHOUT_GPU();
#ifdef TRIACCEL_WITH_CUDA
  const c10::Device gpu(c10::kCUDA, 0);
  const c10::cuda::CUDAStreamGuard stream(c10::cuda::getStreamFromPool());
  constexpr int64_t kWidth = 1 << 20;  // 4 MB of float32 per sample
  for (const bool in_pool : {true, false}) {
    StepGraphOptions o;
    o.batch = 8;
    o.warmup_steps = 1;
    o.eager_in_pool = in_pool;
    StepGraph graph(o);
    const at::Tensor out = at::zeros({8}, at::TensorOptions().device(gpu));  // outside the pool: what the body keeps
    const StepGraph::Body body = [&](const at::Tensor& x, const at::Tensor&) {
      const at::Tensor scratch = x * 2 + 1;  // a temporary of the batch's size
      out.narrow(0, 0, x.size(0)).copy_(scratch.sum(1));
    };
    const at::Tensor y = at::zeros({8}, at::TensorOptions().dtype(at::kLong).device(gpu));
    std::vector<int64_t> growth;
    for (int s = 0; s < 7; ++s) {
      const int64_t n = s % 3 == 2 ? 5 : 8;  // 8, 8, 5, ...: captured at the second step, a short step after it
      const at::Tensor x = at::full({n, kWidth}, static_cast<float>(s), at::TensorOptions().device(gpu));
      const bool short_captured = n == 5 && graph.captured();
      if (short_captured) memory_cache_release(gpu);
      const int64_t before = memory_stats(gpu).reserved_bytes;
      graph.run(body, x, y.narrow(0, 0, n));
      if (short_captured) growth.push_back(memory_stats(gpu).reserved_bytes - before);
      // Every sample's sum is (2s + 1) · kWidth, exact in float32.
      EXPECT_EQ(out.narrow(0, 0, n).cpu().min().item<float>(), static_cast<float>((2 * s + 1) * kWidth)) << s;
      EXPECT_EQ(out.narrow(0, 0, n).cpu().max().item<float>(), static_cast<float>((2 * s + 1) * kWidth)) << s;
    }
    EXPECT_EQ(graph.captures(), 1);
    ASSERT_EQ(growth.size(), 2u);
    for (const int64_t g : growth) {
      if (in_pool) {
        EXPECT_EQ(g, 0) << "the eager short step reserved memory beside the graph's pool";
      } else {
        EXPECT_GE(g, 5 * kWidth * 4) << "the test cannot tell: the step's temporary fit in memory already reserved";
      }
    }
  }
#endif
}

// GPU: the ranks agree on every capture (agree_capture: NCCL's collectives must be captured and replayed on every
// rank). When another rank's capture ran out of memory, this rank's good capture goes too: the step runs eagerly and
// the batch size is refused, as if its own had failed; when every rank captured, it replays. Either way each step's
// work runs once.
TEST(MemoryGpuTest, ACaptureAnotherRankLostGoesOnThisRankToo) {
  TRIACCEL_SKIP_WITHOUT_GPU();
#ifdef TRIACCEL_WITH_CUDA
  const c10::Device gpu(c10::kCUDA, 0);
  const c10::cuda::CUDAStreamGuard stream(c10::cuda::getStreamFromPool());
  const auto opts = at::TensorOptions().device(gpu);
  for (const int others : {0, 1}) {
    SCOPED_TRACE(others);
    StepGraphOptions o;
    o.batch = 4;
    o.warmup_steps = 1;
    std::vector<int> outcomes;
    o.agree_capture = [&](int own) {
      outcomes.push_back(own);
      return std::max(own, others);
    };
    StepGraph graph(o);
    const at::Tensor out = at::zeros({4}, opts);
    int runs = 0;  // the body's host calls: eager steps and captures (a replay makes none)
    const StepGraph::Body body = [&](const at::Tensor& x, const at::Tensor&) {
      ++runs;
      out.add_(x.sum(1));
    };
    const at::Tensor x = at::ones({4, 8}, opts);
    const at::Tensor y = at::zeros({4}, opts.dtype(at::kLong));
    for (int s = 0; s < 4; ++s) graph.run(body, x, y);
    EXPECT_EQ(outcomes, std::vector<int>{0});
    EXPECT_EQ(graph.captured(), others == 0);
    EXPECT_EQ(graph.capture_ooms(), others);
    EXPECT_EQ(runs, others == 0 ? 2 : 5);  // warm-up, capture; or warm-up, capture, its eager step, two eager steps
    EXPECT_EQ(out.cpu().min().item<float>(), 32.f);
    EXPECT_EQ(out.cpu().max().item<float>(), 32.f);
  }
#endif
}

// GPU: a side graph (Tri-Accel's curvature pass under a budget) captured in the step graph's pool takes the step's
// scratch as its own: its 24 MB temporary reserves nothing beside the step's 32 MB one (a pool of its own reserves a
// segment for it: checked, so the test can tell); both graphs replay what they should, in any order; the side graph
// goes with the step's graph (invalidate) and a new capture replaces it.
TEST(MemoryGpuTest, ASideGraphTakesTheStepGraphsScratchAndGoesWithIt) {
  TRIACCEL_SKIP_WITHOUT_GPU();
#ifdef TRIACCEL_WITH_CUDA
  const c10::Device gpu(c10::kCUDA, 0);
  const c10::cuda::CUDAStreamGuard stream(c10::cuda::getStreamFromPool());
  constexpr int64_t kWidth = 1 << 20;  // 4 MB of float32 per row
  const auto opts = at::TensorOptions().device(gpu);
  StepGraphOptions o;
  o.batch = 8;
  o.warmup_steps = 1;
  o.eager_in_pool = true;
  StepGraph graph(o);
  const at::Tensor out = at::zeros({8}, opts);       // what the step keeps: outside the pool
  const at::Tensor side_out = at::zeros({6}, opts);  // what the side graph keeps
  const at::Tensor side_in = at::zeros({6, kWidth}, opts);
  const StepGraph::Body body = [&](const at::Tensor& x, const at::Tensor&) { out.copy_((x * 2 + 1).sum(1)); };
  const auto side_fn = [&]() { side_out.copy_((side_in * 3 - 1).sum(1)); };
  const at::Tensor y = at::zeros({8}, opts.dtype(at::kLong));
  const auto step = [&](float v) { graph.run(body, at::full({8, kWidth}, v, opts), y); };
  const auto expect_all = [](const at::Tensor& t, float v, const char* what) {
    EXPECT_EQ(t.cpu().min().item<float>(), v) << what;
    EXPECT_EQ(t.cpu().max().item<float>(), v) << what;
  };
  EXPECT_EQ(graph.side_capture(side_fn), 0) << "no step graph yet";
  step(0);  // warm-up
  step(1);  // captured
  ASSERT_TRUE(graph.captured());
  memory_cache_release(gpu);
  int64_t before = memory_stats(gpu).reserved_bytes;
  const int64_t handle = graph.side_capture(side_fn);
  ASSERT_GT(handle, 0);
  EXPECT_EQ(memory_stats(gpu).reserved_bytes - before, 0) << "the side graph reserved memory beside the step's pool";
  for (int r = 0; r < 3; ++r) {
    side_in.fill_(static_cast<float>(r));
    ASSERT_TRUE(graph.side_replay(handle));
    step(static_cast<float>(r + 2));
    expect_all(side_out, static_cast<float>((3 * r - 1) * kWidth), "side");
    expect_all(out, static_cast<float>((2 * (r + 2) + 1) * kWidth), "step");
  }
  graph.invalidate();
  EXPECT_FALSE(graph.side_replay(handle)) << "the side graph outlived the step's";
  step(5);  // eager (the warm-up after an invalidation)
  step(6);  // captured again
  ASSERT_TRUE(graph.captured());
  const int64_t again = graph.side_capture(side_fn);
  ASSERT_GT(again, 0);
  EXPECT_TRUE(graph.side_replay(again));
  EXPECT_FALSE(graph.side_replay(handle));
  // A pool of its own needs a segment for the same temporary: the first check above can fail.
  memory_cache_release(gpu);
  before = memory_stats(gpu).reserved_bytes;
  const auto own = cuda_graph_capture(side_fn);
  ASSERT_NE(own, nullptr);
  EXPECT_GE(memory_stats(gpu).reserved_bytes - before, 6 * kWidth * 4);
#endif
}

// GPU: under a budget's cap, memory freed inside a segment that still holds a live block serves a later, larger
// block (the scope's expandable segments). A 60 MB block is freed, a 12 MB block is cut from its segment and kept,
// then a 56 MB block is asked for under a cap 100 MB above what was reserved: the plain allocator needs a new 56 MB
// segment (116 MB in all) and has nothing wholly free to return, so it runs out of memory; an expandable segment
// grows the free 48 MB after the kept block by one 20 MB chunk (80 MB in all) and fits it.
TEST(MemoryGpuTest, UnderABudgetFreedMemoryInsideSegmentsGoesBackToTheCap) {
  TRIACCEL_SKIP_WITHOUT_GPU();
#ifdef TRIACCEL_WITH_CUDA
  const c10::Device gpu(c10::kCUDA, 0);
  const c10::cuda::CUDAStreamGuard stream(c10::cuda::getStreamFromPool());
  constexpr int64_t kMB = 1 << 20;
  const auto bytes = [&](int64_t mb) { return at::empty({mb * kMB}, at::TensorOptions().dtype(at::kByte).device(gpu)); };
  const auto fragment_then_allocate = [&](bool expandable) {
    memory_cache_release(gpu);
    const int64_t base = memory_stats(gpu).reserved_bytes;
    const MemoryCapScope cap(gpu, base + 100 * kMB, expandable);
    EXPECT_EQ(memory_expandable_segments(), expandable);
    bool fit = true;
    {
      (void)bytes(60);                  // freed at once: its segment stays cached
      const at::Tensor kept = bytes(12);  // cut from the cached 60 MB
      try {
        bytes(56).fill_(1);
      } catch (const c10::OutOfMemoryError&) {
        fit = false;
      }
    }
    memory_cache_release(gpu);
    return fit;
  };
  if (std::getenv("PYTORCH_ALLOC_CONF") == nullptr && std::getenv("PYTORCH_CUDA_ALLOC_CONF") == nullptr) {
    EXPECT_FALSE(fragment_then_allocate(false)) << "the test cannot tell: the plain allocator fit the block";
  }
  EXPECT_TRUE(fragment_then_allocate(true)) << "the freed memory inside the segment did not serve the block";
  EXPECT_FALSE(memory_expandable_segments()) << "the scope's setting outlived it";
#endif
}

#ifdef TRIACCEL_WITH_CUDA
// Five units, each y = tanh(x ⊙ w) with a 4 MiB weight broadcast over the batch, whose activations (32 MiB a unit at
// batch 8) dwarf it, as ResNet-18's do at CIFAR's batch 96; the logits are the first 10 features. Elementwise work
// only: no cuBLAS workspace made on the test's stream.
class ChainNet : public Model {
 public:
  ChainNet() : Model("chain-net") {
    for (int u = 0; u < 5; ++u) {
      auto scale = std::make_shared<torch::nn::Module>();
      const at::Tensor w = scale->register_parameter("weight", torch::rand({1 << 20}) + 0.5);
      register_module("scale" + std::to_string(u), scale);
      unit_add("unit" + std::to_string(u), {scale}, [w, u](const at::Tensor& x) {
        const at::Tensor y = torch::tanh(x * w);
        return u == 4 ? y.narrow(1, 0, 10) : y;
      });
    }
  }
};
#endif

// GPU: the optimizer state made before the first forward sits beside the weights, so after two steps, with the
// gradients released (as before a capture), the caching allocator keeps no partly used 20 MiB page of its expandable
// segments mapped: input (40 MiB), weights and momentum (20 MiB each) fill four pages, and cache release leaves no
// free byte in them (a small-block page aside). Made after the first backward, each momentum buffer took a hole the
// activations left and kept a page mapped (ResNet-18 b96 at 0.3 GB on the H100: 80 MB beside 102 MB of weights and
// state, which the step's CUDA graph could not use). The steps run on a stream of their own, so no block an earlier
// test left cached on a stream serves them.
TEST(MemoryGpuTest, TheOptimizerStateLeavesNoPartlyUsedPages) {
  TRIACCEL_SKIP_WITHOUT_GPU();
#ifdef TRIACCEL_WITH_CUDA
  const c10::Device gpu(c10::kCUDA, 0);
  cudaStream_t raw = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking), cudaSuccess);
  const auto slack = [&]() {
    memory_cache_release(gpu);
    const MemoryStats m = memory_stats(gpu);
    return m.reserved_bytes - m.allocated_bytes;
  };
  const int64_t before = slack();
  int64_t after = 0;
  bool expandable_on = false;
  {
    const c10::cuda::CUDAStreamGuard stream(c10::cuda::getStreamFromExternal(raw, gpu.index()));
    const ExpandableSegmentsScope expandable(gpu);
    expandable_on = memory_expandable_segments();
    torch::manual_seed(3);
    const at::Tensor x = at::randn({10, 1 << 20}, at::TensorOptions().device(gpu));
    const at::Tensor y = at::randint(0, 10, {10}, at::TensorOptions().dtype(at::kLong).device(gpu));
    ChainNet net;
    Sgd sgd(named_on(net, gpu), SgdOptions{});
    LossScaler scaler(LossScalerOptions{}, gpu);
    TrainStep step(net, sgd, scaler, StepOptions{}, gpu);
    for (int s = 0; s < 2; ++s) step.run(x, y, 0.05);
    for (const auto& p : sgd.params()) p.mutable_grad() = at::Tensor();
    device_synchronize(gpu);
    after = slack();
  }
  memory_cache_release(gpu);
  ASSERT_EQ(cudaStreamDestroy(raw), cudaSuccess);
  std::printf("reserved beyond allocated: %.1f MiB before, %.1f MiB after two steps (expandable segments: %d)\n",
              static_cast<double>(before) / (1 << 20), static_cast<double>(after) / (1 << 20), expandable_on);
  EXPECT_LE(after - before, int64_t{4} << 20) << "the optimizer state left partly used pages mapped";
#endif
}

// GPU: the trainer's step with its short steps in the graph's pool (eager_in_pool) trains the weights the same
// steps give eagerly.
TEST(MemoryGpuTest, ShortStepsInTheGraphsPoolTrainTheEagerWeights) {
  TRIACCEL_SKIP_WITHOUT_GPU();
#ifdef TRIACCEL_WITH_CUDA
  const c10::cuda::CUDAStreamGuard stream(c10::cuda::getStreamFromPool());
#endif
  // Batches 12, 12, 7, ...: a short step after the capture, between replays.
  const GpuRigRun eager = gpu_rig_steps(false, 0, {}, 9, 7);
  const GpuRigRun graphed = gpu_rig_steps(true, 0, {}, 9, 7);
  EXPECT_FALSE(eager.captured);
  EXPECT_TRUE(graphed.captured);
  EXPECT_EQ(graphed.captures, 1);
  expect_same_weights(eager, graphed);
}

#ifdef TRIACCEL_WITH_CUDA
// What a plan controller did over six steps of a made-up model whose step graph's captures run out of memory:
// `failing` of them (the first ones; -1: all), with the cap `cap_over_floor` times the plan's floor and `undo` as the
// controller's capture-oom undo. With `replan_at_end`, an out-of-memory re-plan and two more steps follow.
struct CaptureOomRun {
  std::vector<std::string> reasons;  // the memory_plan events' reasons
  double cap_share = 0;
  int captures = 0;                  // captures tried
  bool captured = false;             // a graph at the end
};

CaptureOomRun capture_oom_steps(double cap_over_floor, int failing, const MemoryPlanController::Undo& undo,
                                bool replan_at_end) {
  const c10::Device gpu(c10::kCUDA, 0);
  const c10::cuda::CUDAStreamGuard stream(c10::cuda::getStreamFromPool());
  MemoryModel m = made_up({10, 20, 30}, {5, 10, 15}, {1, 2, 3});
  m.dataset_bytes = 0;
  m.allow_host_data = false;
  const double floor = memory_plan_solve(m, 12, 1).floor_bytes;
  torch::manual_seed(3);
  CaptureOomRun out;
  StepOptions so;
  so.precision = PrecisionMode::kAmpBF16;
  so.graph_batch_size = 12;
  so.warmup_steps = 1;
  so.during_capture = [&out, failing]() {
    ++out.captures;
    TORCH_CHECK_WITH(OutOfMemoryError, failing >= 0 && out.captures > failing, "test: no room for the graph's pool");
  };
  UnitRig rig(false, so, gpu);
  TrainStep& step = rig.step;
  MemoryPlanLimits limits;
  limits.batch = 12;
  limits.cap_bytes = static_cast<int64_t>(cap_over_floor * floor);
  limits.budget_bytes = static_cast<int64_t>(limits.cap_share * static_cast<double>(limits.cap_bytes));
  const MemoryPlan plan = memory_plan_solve(m, 12, limits.budget_bytes);
  EXPECT_TRUE(plan.feasible);
  MemoryPlanController c(m, plan, limits, step, [&](const std::vector<Precision>&) { return m; });
  if (undo) c.set_capture_oom_undo(undo);
  const at::Tensor x = at::randn({12, 12}, at::TensorOptions().device(gpu));
  const at::Tensor y = at::randint(0, 5, {12}, at::TensorOptions().dtype(at::kLong).device(gpu));
  StepContext ctx;
  for (int s = 1; s <= 6; ++s) {
    ctx.step = s;
    step.run(x, y, 0.05);
    for (const Event& e : c.after_step(ctx)) out.reasons.push_back(e.fields["reason"].get<std::string>());
  }
  if (replan_at_end) {
    c.on_out_of_memory();
    step.run(x, y, 0.05);
    step.run(x, y, 0.05);
  }
  out.cap_share = c.state()["cap_share"].get<double>();
  out.captured = step.graph().captured();
  return out;
}
#endif

// A capture that runs out of memory shrinks the plan's share of the budget while a plan still fits the smaller
// share; near the floor (0.9 of the cap fits, 0.81 does not) the graph is given up instead: the share stays, every
// later step runs eagerly, and no capture is tried again, even after a re-plan.
TEST(MemoryGpuTest, ACaptureThatNeverFitsNearTheFloorLeavesTheStepEager) {
  TRIACCEL_SKIP_WITHOUT_GPU();
#ifdef TRIACCEL_WITH_CUDA
  for (const bool near_floor : {false, true}) {
    const CaptureOomRun run = capture_oom_steps(near_floor ? 1 / 0.85 : 4.0, -1, nullptr, /*replan_at_end=*/true);
    if (near_floor) {
      EXPECT_EQ(run.reasons, std::vector<std::string>{"capture_oom_eager"});
      EXPECT_DOUBLE_EQ(run.cap_share, 0.9);
      EXPECT_EQ(run.captures, 1);
    } else {
      ASSERT_FALSE(run.reasons.empty());
      EXPECT_EQ(run.reasons[0], "capture_oom");
      EXPECT_LT(run.cap_share, 0.9);
      EXPECT_GT(run.captures, 1);  // it captures again after each shrink
    }
    EXPECT_FALSE(run.captured);
  }
#endif
}

// A capture that runs out of memory right after what made the step bigger (Tri-Accel's precision raise, put back by
// the undo) keeps the plan's share of the budget and captures again; when the undo finds nothing to put back, the
// share shrinks as above.
TEST(MemoryGpuTest, ACaptureOutOfMemoryAfterARaiseUndoesTheRaiseNotTheShare) {
  TRIACCEL_SKIP_WITHOUT_GPU();
#ifdef TRIACCEL_WITH_CUDA
  for (const bool raised : {true, false}) {
    int undos = 0;
    const CaptureOomRun run = capture_oom_steps(4.0, 1, [&]() {
      ++undos;
      return raised;
    }, false);
    EXPECT_EQ(undos, 1) << raised;
    EXPECT_EQ(run.reasons, std::vector<std::string>{raised ? "capture_oom_undone" : "capture_oom"});
    if (raised) {
      EXPECT_DOUBLE_EQ(run.cap_share, 0.9);
    } else {
      EXPECT_LT(run.cap_share, 0.9);
    }
    EXPECT_EQ(run.captures, 2) << raised;  // the failed one, then one that fits
    EXPECT_TRUE(run.captured) << raised;
  }
#endif
}

// A memory meter whose readings the test makes up.
class FakeMeter : public MemoryMeter {
 public:
  std::function<double()> peak;
  int windows = 0;
  MemoryStats window() override {
    ++windows;
    MemoryStats m;
    m.peak_allocated_bytes = static_cast<int64_t>(peak());
    return m;
  }
  void restart() override {}
};

// GPU: a capture that runs out of memory allocated up to the cap before it failed; its step is no calibration
// reading (the meter reads a peak far above any plan's on exactly those steps: read, it would end the run with "no
// way to train"), and the plan's measured peak never holds it.
TEST(MemoryGpuTest, AFailedCaptureIsNoCalibrationReading) {
  TRIACCEL_SKIP_WITHOUT_GPU();
#ifdef TRIACCEL_WITH_CUDA
  const c10::Device gpu(c10::kCUDA, 0);
  const c10::cuda::CUDAStreamGuard stream(c10::cuda::getStreamFromPool());
  MemoryModel m = made_up({10, 20, 30}, {5, 10, 15}, {1, 2, 3});
  m.dataset_bytes = 0;
  m.allow_host_data = false;
  bool failed_now = false;
  int failures = 0;
  StepOptions so;
  so.precision = PrecisionMode::kAmpBF16;
  so.graph_batch_size = 12;
  so.warmup_steps = 1;
  so.during_capture = [&]() {
    if (failures >= 2) return;  // the first two captures fail, the third succeeds
    ++failures;
    failed_now = true;
    TORCH_CHECK_WITH(OutOfMemoryError, false, "test: the capture filled the cap");
  };
  UnitRig rig(false, so, gpu);
  TrainStep& step = rig.step;
  MemoryPlanLimits limits;
  limits.batch = 12;
  limits.cap_bytes = static_cast<int64_t>(100 * memory_plan_solve(m, 12, 1).floor_bytes);
  limits.budget_bytes = static_cast<int64_t>(limits.cap_share * static_cast<double>(limits.cap_bytes));
  const MemoryPlan plan = memory_plan_solve(m, 12, limits.budget_bytes);
  ASSERT_TRUE(plan.feasible);
  MemoryPlanController c(m, plan, limits, step, [&](const std::vector<Precision>&) { return m; });
  const double truth = plan.predicted_peak_bytes;
  FakeMeter meter;
  meter.peak = [&] { return failed_now ? 1e12 : truth; };
  StepContext ctx;
  ctx.memory = &meter;
  const at::Tensor x = at::randn({12, 12}, at::TensorOptions().device(gpu));
  const at::Tensor y = at::randint(0, 5, {12}, at::TensorOptions().dtype(at::kLong).device(gpu));
  for (int s = 1; s <= 12; ++s) {
    failed_now = false;
    ctx.step = s;
    step.run(x, y, 0.05);
    c.after_step(ctx);
    const Json f = c.plan_fields("test");
    if (f["measured_peak_bytes"].is_number()) EXPECT_LT(f["measured_peak_bytes"].get<double>(), 1e11) << s;
    EXPECT_LT(c.plan_measured_peak_bytes(), 1e11) << s;
  }
  EXPECT_EQ(failures, 2);
  EXPECT_TRUE(step.graph().captured());
  EXPECT_LT(c.model().activation_scale, 2.0);
#endif
}

// A made-up three-unit model whose fp32 units keep twice the activations of 16-bit ones (40 bytes per sample, not 20).
MemoryModel promotion_model(const std::vector<Precision>& p) {
  std::vector<double> saved;
  for (Precision q : p) saved.push_back(q == Precision::kFP32 ? 40 : 20);
  MemoryModel m = made_up(saved, {2, 2, 2}, {1, 5, 5});
  m.dataset_bytes = 0;
  m.allow_host_data = false;
  return m;
}

// The planner in the loop, on made-up models: a Tri-Accel run without a budget keeps its first (16-bit) peak as the
// limit, so a unit promoted to fp32 (twice the activations) is paid for by recomputing it rather than by a higher
// peak; an out-of-memory error raises the activation scale and the limit with it; each change reaches the step
// engine and the events, and the scale survives a checkpoint.
TEST(MemoryPlanControllerTest, PaysForAPromotionWithinTheFirstPeak) {
  UnitRig rig(false, StepOptions{}, torch::kCPU);
  TrainStep& step = rig.step;
  step.set_unit_precisions({Precision::kBF16, Precision::kBF16, Precision::kBF16});
  const auto model_for = promotion_model;
  MemoryModel first = model_for(step.unit_precisions());
  MemoryPlanLimits limits;
  limits.batch = 16;
  limits.limit_from_first_model = true;
  limits.budget_bytes = static_cast<int64_t>(memory_plan_solve(first, 16, 0).predicted_peak_bytes);
  const MemoryPlan plan = memory_plan_solve(first, 16, limits.budget_bytes);
  MemoryPlanController c(first, plan, limits, step, model_for);
  EXPECT_EQ(step.micro_batch(), 0);
  EXPECT_TRUE(step.recompute().empty());
  StepContext ctx;
  ctx.step = 10;  // past calibration
  EXPECT_TRUE(c.after_step(ctx).empty());  // nothing changed

  step.set_unit_precisions({Precision::kFP32, Precision::kBF16, Precision::kBF16});
  const Events events = c.after_step(ctx);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].fields["reason"], "precision");
  EXPECT_EQ(c.plan().micro_batch, 16);
  EXPECT_EQ(step.recompute(), (std::vector<bool>{true, false, false}));  // the promoted unit is recomputed
  EXPECT_LE(c.plan().predicted_peak_bytes, limits.budget_bytes);

  // Out of memory: scale 1.25, the limit scales with it (the same plan still fits).
  Event oom = c.on_out_of_memory();
  EXPECT_EQ(oom.fields["reason"], "oom");
  EXPECT_DOUBLE_EQ(oom.fields["activation_scale"].get<double>(), 1.25);
  EXPECT_EQ(c.plan().recompute, (std::vector<bool>{true, false, false}));
  // All units fp32: recomputing the first no longer fits under the 16-bit peak (2 + 40 + 40 kept when backward
  // starts); recomputing the first two does (u1's backward: 2 + 2 + 40), cheaper than splitting the batch.
  step.set_unit_precisions({Precision::kFP32, Precision::kFP32, Precision::kFP32});
  c.after_step(ctx);
  EXPECT_EQ(c.plan().micro_batch, 16);
  EXPECT_EQ(step.recompute(), (std::vector<bool>{true, true, false}));
  EXPECT_EQ(c.state()["activation_scale"], 1.25);
  // The scale persists in the checkpoint: a restored controller plans with it.
  MemoryPlanController again(first, plan, limits, step, model_for);
  again.restore(c.state());
  EXPECT_DOUBLE_EQ(again.model().activation_scale, 1.25);
}

// Without a budget the limit is the 16-bit peak the calibration steps measured: a promoted plan that peaks above its
// prediction (here the fp32 unit keeps 60 % more than modelled; three recomputed fp32 units did on the H100) has
// the scale refit on its reading, and the plan recomputes more to stay under that peak, where the limit priced at the
// refit scale rose with it and let the peak follow.
TEST(MemoryPlanControllerTest, APromotedPlanAboveItsPredictionKeepsTheCalibratedLimit) {
  UnitRig rig(false, StepOptions{}, torch::kCPU);
  TrainStep& step = rig.step;
  step.set_unit_precisions({Precision::kBF16, Precision::kBF16, Precision::kBF16});
  const MemoryModel first = promotion_model(step.unit_precisions());
  MemoryPlanLimits limits;
  limits.batch = 16;
  limits.limit_from_first_model = true;
  limits.budget_bytes = static_cast<int64_t>(memory_plan_solve(first, 16, 0).predicted_peak_bytes);
  MemoryPlanController c(first, memory_plan_solve(first, 16, limits.budget_bytes), limits, step, promotion_model);
  double true_scale = 1.0;
  const auto truth = [&](const MemoryPlan& p) {
    MemoryModel t = promotion_model(step.unit_precisions());
    t.activation_scale = true_scale;
    return memory_plan_peak(t, p.batch, p.micro_batch, p.recompute, p.data_placement);
  };
  FakeMeter meter;
  meter.peak = [&] { return truth(c.plan()); };
  StepContext ctx;
  ctx.memory = &meter;
  std::vector<std::string> reasons;
  const auto steps = [&](int from, int to) {
    for (int s = from; s <= to; ++s) {
      ctx.step = s;
      for (const Event& e : c.after_step(ctx)) reasons.push_back(e.fields["reason"].get<std::string>());
    }
  };
  steps(1, 8);  // calibrated on the 16-bit model, which the meter reads as modelled
  const int64_t calibrated = c.limit_bytes();
  EXPECT_NEAR(static_cast<double>(calibrated), static_cast<double>(limits.budget_bytes), 1.0);
  step.set_unit_precisions({Precision::kFP32, Precision::kBF16, Precision::kBF16});
  true_scale = 1.6;  // the promoted plan keeps more than its prediction
  reasons.clear();
  steps(9, 16);
  ASSERT_FALSE(reasons.empty());
  EXPECT_EQ(reasons[0], "precision");
  EXPECT_GT(c.model().activation_scale, 1.5);  // refit on the promoted plan's reading
  EXPECT_EQ(c.limit_bytes(), calibrated);
  EXPECT_LE(truth(c.plan()), static_cast<double>(calibrated));
  EXPECT_EQ(c.state()["limit_scale"].get<double>(), 1.0);
  std::printf("[ made-up ] limit %ld, promoted plan's true peak %.0f, recompute u0 u1 u2: %d %d %d, reasons:",
              static_cast<long>(calibrated), truth(c.plan()), static_cast<int>(c.plan().recompute[0]),
              static_cast<int>(c.plan().recompute[1]), static_cast<int>(c.plan().recompute[2]));
  for (const auto& r : reasons) std::printf(" %s", r.c_str());
  std::printf("\n");
  // A model corrected past any plan under that peak (a resumed run's state at scale 50): the plan at the floor, not
  // "no way to train" (there is no budget).
  Json state = c.state();
  state["activation_scale"] = 50.0;
  EXPECT_NO_THROW(c.restore(state));
  EXPECT_TRUE(c.plan().feasible);
  EXPECT_GT(c.plan().predicted_peak_bytes, static_cast<double>(calibrated));
  EXPECT_NEAR(c.plan().predicted_peak_bytes, c.plan().floor_bytes, 1.0);
  EXPECT_EQ(c.limit_bytes(), calibrated);
  // Every unit back in 16 bits: priced at the scale the 16-bit steps measured (the limit's, 1), not at the 50 the
  // state brought: nothing recomputed, the whole batch at once (at scale 50 every unit is recomputed).
  step.set_unit_precisions({Precision::kBF16, Precision::kFP16, Precision::kBF16});
  steps(17, 18);
  EXPECT_EQ(c.plan().recompute, std::vector<bool>(3, false));
  EXPECT_EQ(c.plan().micro_batch, 16);
  EXPECT_EQ(std::count(step.recompute().begin(), step.recompute().end(), true), 0);
  EXPECT_EQ(c.plan_fields("test")["plan_limit_bytes"].get<int64_t>(), calibrated);
}

// The planner answers whether a promotion fits: under the 16-bit peak of PaysForAPromotionWithinTheFirstPeak's
// made-up model one fp32 unit fits (recomputed); under a budget between the 16-bit and the all-fp32 floors three
// do not, though the 16-bit model fits there.
TEST(MemoryPlanControllerTest, FitsAnswersForPrecisionsNotYetApplied) {
  UnitRig rig(false, StepOptions{}, torch::kCPU);
  rig.step.set_unit_precisions({Precision::kBF16, Precision::kBF16, Precision::kBF16});
  const auto model_for = promotion_model;
  const MemoryModel first = model_for(rig.step.unit_precisions());
  MemoryPlanLimits limits;
  limits.batch = 16;
  limits.budget_bytes = static_cast<int64_t>(memory_plan_solve(first, 16, 0).predicted_peak_bytes);
  const MemoryPlan plan = memory_plan_solve(first, 16, limits.budget_bytes);
  const MemoryPlanController c(first, plan, limits, rig.step, model_for);
  using P = Precision;
  EXPECT_TRUE(c.fits({P::kFP32, P::kBF16, P::kBF16}));
  EXPECT_TRUE(c.fits({P::kFP16, P::kBF16, P::kBF16}));
  const MemoryModel all_fp32 = model_for({P::kFP32, P::kFP32, P::kFP32});
  const double fp32_floor = memory_plan_solve(all_fp32, 16, 1).floor_bytes;  // the least any plan needs
  const double first_floor = memory_plan_solve(first, 16, 1).floor_bytes;
  ASSERT_LT(first_floor, fp32_floor);
  limits.budget_bytes = static_cast<int64_t>((first_floor + fp32_floor) / 2);
  ASSERT_TRUE(memory_plan_solve(first, 16, limits.budget_bytes).feasible);  // the 16-bit model still fits
  const MemoryPlanController tight(first, memory_plan_solve(first, 16, limits.budget_bytes), limits, rig.step,
                                   model_for);
  EXPECT_FALSE(tight.fits({P::kFP32, P::kFP32, P::kFP32}));
  EXPECT_EQ(rig.step.unit_precisions(), (std::vector<P>{P::kBF16, P::kBF16, P::kBF16}));  // asking applies nothing
  // A trace of the promoted model that runs out of memory (under a budget, beside the run's tensors) answers "does
  // not fit" instead of ending the run.
  const MemoryPlanController no_room(first, plan, limits, rig.step, [&](const std::vector<Precision>& p) {
    if (p[0] == P::kFP32) TORCH_CHECK_WITH(OutOfMemoryError, false, "made-up: the trace did not fit");
    return model_for(p);
  });
  EXPECT_FALSE(no_room.fits({P::kFP32, P::kBF16, P::kBF16}));
  EXPECT_TRUE(no_room.fits({P::kFP16, P::kBF16, P::kBF16}));
}

// Tri-Accel's precision controller over UnitRig's three units, deciding at every step from fixed variance thresholds
// (and τ_curv when given), with a memory check that counts its questions and answers `accept`.
struct PrecisionRig {
  struct Seeded {
    Seeded() { torch::manual_seed(5); }
  } seeded;
  UnitRig rig{false, StepOptions{}, torch::kCPU};
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(11);
  PrecisionController c;
  int asked = 0;
  std::vector<Precision> last_asked;
  bool accept = true;

  PrecisionRig(double tau_low, double tau_high, double tau_curv = -1)
      : c(options(tau_low, tau_high, tau_curv), 1, rig.net, rig.sgd, rig.step, torch::kCPU) {}
  static PrecisionPolicyOptions options(double tau_low, double tau_high, double tau_curv) {
    PrecisionPolicyOptions po;
    po.tau_low = tau_low;
    po.tau_high = tau_high;
    po.tau_curv = tau_curv;
    return po;
  }
  void check(bool hold_curvature = false) {
    c.set_memory_check(
        [this](const std::vector<Precision>& p) {
          ++asked;
          last_asked = p;
          return accept;
        },
        hold_curvature);
  }
  // One step and the controller's window after it.
  Events window(int64_t step, std::vector<double> lambda_max = {}) {
    rig.step.run(at::randn({12, 12}, gen), at::randint(0, 5, {12}, gen), 0.05);
    StepContext ctx;
    ctx.step = step;
    ctx.unit_lambda_max = std::move(lambda_max);
    return c.after_step(ctx);
  }
  std::vector<std::string> reasons(const Events& events) const {
    std::vector<std::string> out;
    for (const auto& r : events.at(0).fields.at("reason")) out.push_back(r.get<std::string>());
    return out;
  }
};

// Thresholds of 0 put every unit in fp32 by the variance rule: a check that refuses fp32 keeps them where they were,
// the event says "memory" for each, and the same refused decision is not traced again at the next window. A check
// that accepts gives fp32 and "high variance".
TEST(PrecisionControllerTest, APromotionNoPlanFitsIsRefusedAndNamed) {
  for (const bool accept : {false, true}) {
    PrecisionRig t(0, 0);
    t.accept = accept;
    t.check();
    t.window(1);
    const Events events = t.window(2);
    ASSERT_EQ(events.size(), 1u);
    const Precision want = accept ? Precision::kFP32 : Precision::kBF16;
    EXPECT_EQ(t.rig.step.unit_precisions(), std::vector<Precision>(3, want)) << "accept " << accept;
    EXPECT_EQ(t.reasons(events), std::vector<std::string>(3, accept ? "high variance" : "memory"));
    EXPECT_EQ(t.asked, 1) << "accept " << accept;
    EXPECT_EQ(t.last_asked, std::vector<Precision>(3, Precision::kFP32));
  }
}

// Under a budget's plan (a memory check holding curvature) a promotion by curvature is held where it was, named
// "memory", and not even asked for; with a plan without a budget (the check alone) the same λ_max promote units 0
// and 2 to fp32, named "curvature", once the check says they fit.
TEST(PrecisionControllerTest, UnderABudgetCurvaturePromotionsAreHeld) {
  for (const bool budget : {true, false}) {
    PrecisionRig t(0, 1e30, 1.0);  // every unit bf16 by its variance; λ_max above 1 promotes
    t.check(budget);
    const Events events = t.window(1, {5.0, 0.5, 5.0});
    ASSERT_EQ(events.size(), 1u);
    const Precision promoted = budget ? Precision::kBF16 : Precision::kFP32;
    EXPECT_EQ(t.rig.step.unit_precisions(), (std::vector<Precision>{promoted, Precision::kBF16, promoted}))
        << "budget " << budget;
    const std::string why = budget ? "memory" : "curvature";
    EXPECT_EQ(t.reasons(events), (std::vector<std::string>{why, "variance", why}));
    EXPECT_EQ(t.asked, budget ? 0 : 1);
  }
}

// A promotion the check accepted whose step then ran out of memory (the trainer calls revert_raise before
// re-planning): the units go back to bf16, the decision is refused from then on without asking the check again, and
// the next window names them "memory"; a second revert has nothing to put back.
TEST(PrecisionControllerTest, APromotionThatRanOutOfMemoryIsPutBackAndRefused) {
  PrecisionRig t(0, 0);
  t.check();
  EXPECT_FALSE(t.c.revert_raise()) << "nothing raised yet";
  t.window(1);  // thresholds of 0: every unit to fp32 at the first window
  ASSERT_EQ(t.rig.step.unit_precisions(), std::vector<Precision>(3, Precision::kFP32));
  EXPECT_TRUE(t.c.revert_raise());
  EXPECT_EQ(t.rig.step.unit_precisions(), std::vector<Precision>(3, Precision::kBF16));
  EXPECT_FALSE(t.c.revert_raise()) << "put back twice";
  const Events events = t.window(2);
  EXPECT_EQ(t.rig.step.unit_precisions(), std::vector<Precision>(3, Precision::kBF16));
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(t.reasons(events), std::vector<std::string>(3, "memory"));
  EXPECT_EQ(t.asked, 1) << "the refused promotion was traced again";
  EXPECT_FALSE(t.c.revert_raise()) << "a window that raised nothing";
}

// The calibration tests' rig: a made-up model whose true run needs `true_scale` of the modelled activations and 30
// bytes the model missed, a controller planning it under 2000 bytes, and a meter that reads the truth of the plan in
// force.
struct CalibrationRig {
  UnitRig rig{false, StepOptions{}, torch::kCPU};
  MemoryModel m = [] {
    MemoryModel made = made_up({100, 60, 20}, {2, 10, 6}, {1, 5, 5});
    made.dataset_bytes = 0;
    made.allow_host_data = false;
    return made;
  }();
  MemoryPlanLimits limits = [] {
    MemoryPlanLimits l;
    l.batch = 16;
    l.budget_bytes = 2000;
    return l;
  }();
  MemoryPlanController c{m, memory_plan_solve(m, 16, limits.budget_bytes), limits, rig.step,
                         [this](const std::vector<Precision>&) { return m; }};
  double true_scale = 0.5;
  FakeMeter meter;
  StepContext ctx;
  std::vector<std::string> reasons;  // of the events after_step returned

  CalibrationRig() {
    meter.peak = [this] { return truth(c.plan()); };
    ctx.memory = &meter;
  }
  double truth(const MemoryPlan& p) const {
    MemoryModel t = m;
    t.activation_scale = true_scale;
    t.fixed_bytes += 30;
    return memory_plan_peak(t, p.batch, p.micro_batch, p.recompute, p.data_placement);
  }
  void steps(int from, int to) {
    for (int s = from; s <= to; ++s) {
      ctx.step = s;
      for (const Event& e : c.after_step(ctx)) reasons.push_back(e.fields["reason"].get<std::string>());
    }
  }
};

// Calibration on made-up readings: after the calibration steps (the session's first step is not read) the plan's
// prediction equals the truth and the plan fits it.
TEST(MemoryPlanControllerTest, CalibratesScaleAndFixedBytesFromReadings) {
  CalibrationRig r;
  r.steps(1, 8);
  const MemoryPlan& plan = r.c.plan();
  EXPECT_EQ(r.meter.windows, 8);  // every eager step: the first one's taken but not read, then 5 readings, then the plan's
  EXPECT_NEAR(plan.predicted_peak_bytes, r.truth(plan), 0.02 * r.truth(plan));
  // After calibration the plan's own steps measure it (what the prediction is checked against in the results).
  EXPECT_DOUBLE_EQ(r.c.plan_measured_peak_bytes(), static_cast<double>(static_cast<int64_t>(r.truth(plan))));
  EXPECT_LE(r.truth(plan), r.limits.budget_bytes);
  EXPECT_LT(r.c.model().activation_scale, 0.9);  // it learned the model over-predicts
}

// A reading far under its prediction lowers the scale by kCalibrationDownStep a step, not to the fit (which the next,
// bolder plan ran out of memory with on the H100); after an out-of-memory error the readings never take the scale
// back below the scale that error left.
TEST(MemoryPlanControllerTest, CalibrationStepsTheScaleDownAndNeverBelowAnOutOfMemory) {
  CalibrationRig r;
  r.true_scale = 0.1;
  ASSERT_DOUBLE_EQ(r.c.model().activation_scale, 1);
  r.steps(1, 2);  // the first step is not read; the second is
  EXPECT_DOUBLE_EQ(r.c.model().activation_scale, kCalibrationDownStep);
  r.steps(3, 3);
  EXPECT_DOUBLE_EQ(r.c.model().activation_scale, kCalibrationDownStep * kCalibrationDownStep);
  r.c.on_out_of_memory();
  const double after_oom = kCalibrationDownStep * kCalibrationDownStep * kOomScaleStep;
  EXPECT_DOUBLE_EQ(r.c.model().activation_scale, after_oom);
  r.steps(4, 6);
  EXPECT_DOUBLE_EQ(r.c.model().activation_scale, after_oom);
}

// The scale an out-of-memory error left holds the model above what the readings fit (it keeps the failed plan out
// of reach): the plan stays, and its prediction is its own reading, not the floored model's (GPT-char at 0.5 GB on
// the H100 was predicted 0.434 GB and peaked at 0.391).
TEST(MemoryPlanControllerTest, APlanHeldAboveItsReadingsByAnOutOfMemoryPredictsItsOwnPeak) {
  CalibrationRig r;
  r.steps(1, 1);
  r.c.on_out_of_memory();
  ASSERT_DOUBLE_EQ(r.c.model().activation_scale, kOomScaleStep);
  r.steps(2, 6);  // the five calibration readings, no step after them (a captured step's replays read nothing)
  EXPECT_DOUBLE_EQ(r.c.model().activation_scale, kOomScaleStep);  // the floor holds
  const MemoryPlan& plan = r.c.plan();
  MemoryModel floored = r.c.model();
  EXPECT_GT(memory_plan_peak(floored, plan.batch, plan.micro_batch, plan.recompute, plan.data_placement),
            1.2 * r.truth(plan));  // what the floored model alone would predict
  EXPECT_NEAR(plan.predicted_peak_bytes, r.truth(plan), 1.0);  // the meter reads whole bytes
}

// After calibration a plan whose own peak is off its prediction by more than 5 %: over-predicted, the plan stays and
// its prediction is corrected, the model's scale kept (a refit down on one plan's low reading under-predicted the
// next plans); under-predicted past the limit, the scale is refit on its reading (a few times at most) and a new plan
// fits. A plan within 5 % changes nothing.
TEST(MemoryPlanControllerTest, APlanOffItsPredictionAfterCalibrationIsRecalibrated) {
  CalibrationRig r;
  r.steps(1, 8);  // calibrated on the true model
  ASSERT_NEAR(r.c.plan().predicted_peak_bytes, r.truth(r.c.plan()), 0.02 * r.truth(r.c.plan()));
  r.reasons.clear();
  r.steps(9, 12);  // within 5 %: nothing more
  EXPECT_TRUE(r.reasons.empty());
  const MemoryPlan kept = r.c.plan();
  r.true_scale = 0.3;  // what the calibration saw no longer holds (a plan that recomputes other units)
  r.steps(13, 20);
  EXPECT_EQ(r.reasons, std::vector<std::string>{"remeasured"});
  EXPECT_TRUE(r.c.plan() == kept);
  EXPECT_NEAR(r.c.plan().predicted_peak_bytes, r.truth(r.c.plan()), 1.0);  // the meter reads whole bytes
  EXPECT_NEAR(r.c.model().activation_scale, 0.5, 0.05);                      // the calibrated scale, kept
  r.reasons.clear();
  r.true_scale = 2.0;  // under-predicted: the plan no longer fits its limit
  r.steps(21, 30);
  ASSERT_FALSE(r.reasons.empty());
  EXPECT_EQ(r.reasons[0], "recalibrated");
  EXPECT_FALSE(r.c.plan() == kept);
  EXPECT_LE(r.truth(r.c.plan()), r.limits.budget_bytes);
  EXPECT_NEAR(r.c.plan().predicted_peak_bytes, r.truth(r.c.plan()), kPredictionTolerance * r.truth(r.c.plan()));
}

// A store port for the next two-rank test of this file: one free now (ctest -j runs test binaries side by side).
int next_port() { return free_local_port(); }

// Data parallelism: two ranks whose traces differ (rank 1's unit 1 keeps more, its unit 2 cannot be recomputed, its
// fixed bytes are higher) agree on one model, each number the larger, the flag the stricter.
TEST(MemoryPlanControllerTest, RanksAgreeOnTheLargerModel) {
  std::vector<MemoryModel> models(2);
  const auto errors = test::on_two_ranks(next_port(), [&](int r, Dist& dist) {
    MemoryModel m = made_up({100, r == 0 ? 60.0 : 75.0, 20}, {2, 10, 6}, {1, 5, 5});
    m.fixed_bytes = r == 0 ? 500 : 400;
    m.units[2].recomputable = r == 0;
    memory_model_agree(m, [&](std::vector<double> v) { return dist.all_reduce_max(std::move(v)); });
    models[static_cast<size_t>(r)] = m;
  });
  EXPECT_EQ(errors, (std::vector<std::string>{"", ""}));
  for (const MemoryModel& m : models) {
    EXPECT_EQ(m.units[1].saved_bytes, 75);
    EXPECT_EQ(m.units[0].saved_bytes, 100);
    EXPECT_EQ(m.fixed_bytes, 500);
    EXPECT_TRUE(m.units[0].recomputable);
    EXPECT_FALSE(m.units[2].recomputable);
  }
}

// Data parallelism: two ranks whose allocators read differently (rank 1's run needs 1.5 × the modelled activations,
// rank 0's 0.5 ×) calibrate alike when they agree on the worst reading each step: one plan (micro-batch, recompute),
// one model, within the budget on the rank that needs more. Alone, each rank's calibration makes a plan of its own.
TEST(MemoryPlanControllerTest, TwoRanksWithDifferentReadingsAgreeOnOnePlan) {
  const double scales[2] = {0.5, 1.5};
  std::vector<MemoryPlan> alone(2);
  for (size_t r = 0; r < 2; ++r) {
    CalibrationRig rig;
    rig.true_scale = scales[r];
    rig.steps(1, 8);
    alone[r] = rig.c.plan();
  }
  ASSERT_FALSE(alone[0] == alone[1]) << "the readings must lead to different plans for the agreement to matter";

  std::vector<MemoryPlan> agreed(2);
  std::vector<double> scale(2), fits(2);
  const auto errors = test::on_two_ranks(next_port(), [&](int r, Dist& dist) {
    CalibrationRig rig;
    rig.true_scale = scales[r];
    rig.c.set_agree([&](std::vector<double> v) { return dist.all_reduce_max(std::move(v)); });
    rig.steps(1, 8);
    agreed[static_cast<size_t>(r)] = rig.c.plan();
    scale[static_cast<size_t>(r)] = rig.c.model().activation_scale;
    fits[static_cast<size_t>(r)] = rig.truth(rig.c.plan()) <= static_cast<double>(rig.limits.budget_bytes);
  });
  ASSERT_EQ(errors, (std::vector<std::string>{"", ""}));
  EXPECT_TRUE(agreed[0] == agreed[1]);
  EXPECT_TRUE(agreed[1] == alone[1]);  // the worst rank's plan
  EXPECT_EQ(scale[0], scale[1]);
  EXPECT_EQ(fits, (std::vector<double>{1, 1}));
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
  const int64_t extra = 4 * n + tensors * (2 + kStreamColumns) * 8 + 4 * 256 * 4 + (8 + 8) * largest;
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
