// FP8 storage of saved activations as the memory planner's third per-unit choice (issue 58; train/fp8_saved.h,
// control/memory/memory_planner.h): the solver against a brute force over keep / FP8 / recompute for every unit,
// micro-batch and placement; a hand-computed model where FP8 is the fastest way to fit and one where its price makes
// recompute win; the saved_activations option's fixed choices; the cost model's FP8 bytes and price of one unit
// traced under a store; and a CPU run with saved_activations fp8 whose gradients show the storage was used.
#include "memory_test_util.h"
#include "test_util.h"
#include "triaccel/api/api.h"
#include "triaccel/control/memory/memory_model.h"
#include "triaccel/control/memory/memory_plan_controller.h"
#include "triaccel/control/memory/memory_planner.h"
#include "triaccel/core/events.h"
#include "triaccel/models/model.h"
#include "triaccel/train/fp8_saved.h"

#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace triaccel {
namespace {

using memory_test::expect_fastest;
using memory_test::made_up;
using memory_test::made_up_random;
using memory_test::UnitRig;

TEST(Fp8SavedPlanTest, FindsTheFastestOfKeptFp8AndRecomputedForEveryUnit) {
  std::mt19937 rng(17);
  std::uniform_real_distribution<double> share(0.3, 0.7), price(0.005, 0.1);
  int feasible = 0, with_fp8 = 0;
  for (int trial = 0; trial < 40; ++trial) {
    MemoryModel m = made_up_random(rng);
    for (size_t u = 0; u < m.units.size(); ++u) {
      if ((trial + static_cast<int>(u)) % 4 == 0) continue;  // not offered
      m.units[u].fp8_bytes = share(rng) * m.units[u].saved_bytes;
      m.units[u].fp8_s = price(rng);
      m.units[u].fp8_unpack_bytes = 0.25 * share(rng) * m.units[u].saved_bytes;
    }
    m.units[trial % 4].recomputable = trial % 3 != 0;
    m.outputs_in_saved = trial % 2 == 1;  // the allocator's reading (CUDA) and the autograd graph's
    const int64_t batch = 10;
    const double need = memory_plan_solve(m, batch, 0).predicted_peak_bytes;
    const double budget = std::floor(need * (0.3 + 0.7 * (trial % 10) / 10.0));
    SCOPED_TRACE("trial " + std::to_string(trial) + " budget " + std::to_string(budget));
    const std::optional<MemoryPlan> plan = expect_fastest(m, batch, budget);
    if (!plan) continue;
    ++feasible;
    for (size_t u = 0; u < m.units.size(); ++u) {
      EXPECT_FALSE(plan->recompute[u] && plan->fp8_saved[u]) << u;
      with_fp8 += plan->fp8_saved[u] ? 1 : 0;
    }
  }
  EXPECT_GT(feasible, 20);
  EXPECT_GT(with_fp8, 10) << with_fp8;  // the lever is taken, not only offered
}

// Three units: u0 keeps 100 bytes a sample (50 in FP8), u1 and u2 40 (20), inputs 20, 10 FLOPs each. Base 382
// (made_up, no dataset, 16 samples' inputs); 16 samples; transient 4. All kept: 184 a sample. The budget leaves 140:
//   u0 in FP8: 50 + 40 + 40 + 4 = 134, priced 16 · 0.02 = 0.32 a step;
//   u0 recomputed: max(20 + 100, 20 + 40 + 40) + 4 = 124, priced 16 · (1/3 · 10/30) = 1.78;
//   micro-batches of 8, all kept: one more overhead, 8.
// FP8 wins; at 0.5 a sample (8 a step) recompute does.
TEST(Fp8SavedPlanTest, StoresTheUnitInFp8WhenThatIsTheCheapestWayToFit) {
  MemoryModel m = made_up({100, 40, 40}, {20, 20, 20}, {10, 10, 10});
  m.dataset_bytes = 0;
  m.units[0].fp8_bytes = 50;
  m.units[0].fp8_s = 0.02;
  for (int u : {1, 2}) {
    m.units[u].fp8_bytes = 20;
    m.units[u].fp8_s = 0.02;
  }
  const int64_t batch = 16, budget = 382 + 16 * 140;
  const MemoryPlan plan = memory_plan_solve(m, batch, budget);
  ASSERT_TRUE(plan.feasible);
  EXPECT_EQ(plan.micro_batch, 16);
  EXPECT_EQ(plan.fp8_saved, (std::vector<bool>{true, false, false}));
  EXPECT_EQ(plan.recompute, (std::vector<bool>{false, false, false}));
  EXPECT_DOUBLE_EQ(plan.predicted_peak_bytes, 382 + 16 * 134);
  EXPECT_DOUBLE_EQ(plan.predicted_step_s, 8 + 16 * 1.02);
  const Json j = plan.to_json(m);
  EXPECT_EQ(j["fp8_saved"], Json(std::vector<std::string>{"u0"}));
  EXPECT_EQ(j["units"][0]["fp8_saved"], true);
  EXPECT_EQ(j["units"][0]["activation_bytes"], 16 * 50);
  EXPECT_EQ(j["units"][1]["activation_bytes"], 16 * 40);
  // Without a budget nothing is stored in FP8: it costs time and nothing needs the memory.
  const MemoryPlan free = memory_plan_solve(m, batch, 0);
  EXPECT_EQ(free.fp8_saved, (std::vector<bool>{false, false, false}));
  // Priced at 0.5 a sample the FP8 storage costs 8 a step: recomputing u0 is cheaper.
  m.units[0].fp8_s = 0.5;
  const MemoryPlan dear = memory_plan_solve(m, batch, budget);
  ASSERT_TRUE(dear.feasible);
  EXPECT_EQ(dear.fp8_saved, (std::vector<bool>{false, false, false}));
  EXPECT_EQ(dear.recompute, (std::vector<bool>{true, false, false}));
  EXPECT_EQ(dear.micro_batch, 16);
  // Backward makes u0's largest stored tensor again: at 100 bytes a sample its backward holds 50 + 100 + 4 > 140,
  // so u0 is recomputed instead.
  m.units[0].fp8_s = 0.02;
  m.units[0].fp8_unpack_bytes = 100;
  const MemoryPlan unpacked = memory_plan_solve(m, batch, budget);
  ASSERT_TRUE(unpacked.feasible);
  EXPECT_EQ(unpacked.fp8_saved, (std::vector<bool>{false, false, false}));
  EXPECT_EQ(unpacked.recompute, (std::vector<bool>{true, false, false}));
  m.units[0].fp8_unpack_bytes = 80;  // 50 + 80 + 4 = 134: fits again
  EXPECT_EQ(memory_plan_solve(m, batch, budget).fp8_saved, (std::vector<bool>{true, false, false}));
  EXPECT_DOUBLE_EQ(memory_plan_solve(m, batch, budget).predicted_peak_bytes, 382 + 16 * 134);
  // A unit not offered (no FP8 bytes traced) is never stored so.
  m.units[0].fp8_s = 0.02;
  m.units[0].fp8_bytes = 0;
  EXPECT_EQ(memory_plan_solve(m, batch, budget).fp8_saved, (std::vector<bool>{false, false, false}));
}

// saved_activations keep: FP8 never (the planner recomputes instead); fp8: every offered unit in FP8 even without a
// budget, and a unit recomputed by hand stays recomputed. The floor counts FP8 where it may be chosen.
TEST(Fp8SavedPlanTest, TheOptionsFixedChoicesHold) {
  MemoryModel m = made_up({100, 40, 40}, {20, 20, 20}, {10, 10, 10});
  m.dataset_bytes = 0;
  m.units[0].fp8_bytes = 50;
  m.units[1].fp8_bytes = 20;
  m.units[0].fp8_s = m.units[1].fp8_s = 0.02;
  const int64_t batch = 16, budget = 382 + 16 * 140;
  PlanConstraints keep;
  keep.fp8_saved.assign(3, false);
  const MemoryPlan kept = memory_plan_solve(m, batch, budget, keep);
  ASSERT_TRUE(kept.feasible);
  EXPECT_EQ(kept.fp8_saved, (std::vector<bool>{false, false, false}));
  EXPECT_EQ(kept.recompute, (std::vector<bool>{true, false, false}));
  PlanConstraints fp8;
  fp8.fp8_saved.assign(3, true);
  const MemoryPlan all = memory_plan_solve(m, batch, 0, fp8);
  ASSERT_TRUE(all.feasible);
  EXPECT_EQ(all.fp8_saved, (std::vector<bool>{true, true, false}));  // u2 is not offered
  EXPECT_DOUBLE_EQ(all.predicted_peak_bytes, 382 + 16 * (50 + 20 + 40 + 4));
  EXPECT_DOUBLE_EQ(all.predicted_step_s, 8 + 16 * 1.04);
  fp8.recompute = {false, true, false};
  const MemoryPlan both = memory_plan_solve(m, batch, 0, fp8);
  EXPECT_EQ(both.recompute, (std::vector<bool>{false, true, false}));
  EXPECT_EQ(both.fp8_saved, (std::vector<bool>{true, false, false}));
  EXPECT_EQ(both.fp8_saved_names(m), std::vector<std::string>{"u0"});
  // The floor (micro-batch 1, the least that holds): u0 in FP8 and u1 recomputed, or all recomputed:
  // u0 recomputed: max(20 + 100, 20 + in(u1) 20 + in(u2) 20 ...) — the solver's least, below keep's floor.
  const MemoryPlan auto_floor = memory_plan_solve(m, batch, 1);
  const MemoryPlan keep_floor = memory_plan_solve(m, batch, 1, keep);
  EXPECT_LT(auto_floor.floor_bytes, keep_floor.floor_bytes);
}

// An out-of-memory error on a plan the planner gave FP8 storage (the lever's memory is the model's least sure term):
// the run plans without FP8 from then on, and the step stores nothing in FP8. With saved_activations fixed by the user the lever stays.
TEST(Fp8SavedPlanTest, AnOutOfMemoryOnAnFp8PlanLeavesTheLever) {
  UnitRig rig(false, StepOptions{}, torch::kCPU);
  MemoryModel m = made_up({100, 40, 40}, {20, 20, 20}, {10, 10, 10});
  m.dataset_bytes = 0;
  m.allow_host_data = false;
  m.units[0].fp8_bytes = 50;
  m.units[0].fp8_s = 0.02;
  MemoryPlanLimits limits;
  limits.batch = 16;
  limits.budget_bytes = 382 + 16 * 140;
  const auto same = [m](const std::vector<Precision>&) { return m; };
  MemoryPlanController c(m, memory_plan_solve(m, 16, limits.budget_bytes), limits, rig.step, same);
  ASSERT_EQ(c.plan().fp8_saved, (std::vector<bool>{true, false, false}));
  EXPECT_EQ(rig.step.fp8_saved(), (std::vector<bool>{true, false, false}));
  // The scale steps up as after any error (the same error at the same scale hit the plan without FP8 on the H200),
  // and no plan stores anything in FP8 again: at 1.25 micro-batches of 8; back at scale 1 (a checkpoint's), u0 is
  // recomputed where the first plan stored it in FP8.
  const Event off = c.on_out_of_memory();
  EXPECT_EQ(off.fields["reason"], "oom_fp8_off");
  EXPECT_DOUBLE_EQ(c.model().activation_scale, kOomScaleStep);
  EXPECT_EQ(c.plan().fp8_saved, (std::vector<bool>{false, false, false}));
  EXPECT_EQ(c.plan().micro_batch, 8);
  EXPECT_TRUE(rig.step.fp8_saved().empty());
  EXPECT_EQ(c.on_out_of_memory().fields["reason"], "oom");
  EXPECT_DOUBLE_EQ(c.model().activation_scale, kOomScaleStep * kOomScaleStep);
  c.restore(Json{{"activation_scale", 1.0}});
  EXPECT_EQ(c.plan().micro_batch, 16);
  EXPECT_EQ(c.plan().recompute, (std::vector<bool>{true, false, false}));
  EXPECT_EQ(c.plan().fp8_saved, (std::vector<bool>{false, false, false}));
  limits.constraints.fp8_saved.assign(3, true);  // saved_activations fp8
  MemoryPlanController fixed(m, memory_plan_solve(m, 16, limits.budget_bytes, limits.constraints), limits, rig.step,
                             same);
  EXPECT_EQ(fixed.on_out_of_memory().fields["reason"], "oom");
  EXPECT_EQ(fixed.plan().fp8_saved[0], true);
}

// Linear(256 → 4096) then tanh, fp32. Under an FP8 store its input and weight are leaves (left as they are) and the
// tanh output, 4096 floats a sample, is stored: 4096 bytes and 32 scales (128 bytes) a sample. On the CPU the saved
// bytes are the graph's (pre-activation and output, 32 KiB a sample): in FP8 32768 − 16384 + 4224; backward makes
// the 16 KiB output again. The price: the
// 16384 bytes read and 4224 written, then the reverse, at kGpuMemoryBytesPerS, in units of one sample's step
// (2 · 1,052,672 weights / forward_share 1/3 at kGpuTrainFlopsPerS). On CUDA the allocator reads what is alive.
class WideTanh : public Model {
 public:
  WideTanh() : Model("wide-tanh") {
    auto linear = register_module("fc", torch::nn::Linear(256, 4096));
    std::vector<std::shared_ptr<torch::nn::Module>> modules{linear};
    unit_add("fc", modules, [linear](const at::Tensor& x) { return torch::tanh(linear->forward(x)); });
  }
};

TEST(Fp8SavedPlanTest, TheCostModelTracesEachUnitsFp8BytesAndPrice) {
  ASSERT_TRUE(fp8_saved_available());
  WideTanh net;
  MemoryModelInputs in;
  const MemoryModel plain = memory_model_build(net, torch::zeros({256}), in, torch::kCPU);
  EXPECT_EQ(plain.units[0].fp8_bytes, 0);  // not asked for: not offered
  in.fp8_saved = true;
  const MemoryModel m = memory_model_build(net, torch::zeros({256}), in, torch::kCPU);
  const UnitCost& u = m.units[0];
  EXPECT_DOUBLE_EQ(u.saved_bytes, 2 * 4096 * 4);
  EXPECT_DOUBLE_EQ(u.fp8_bytes, 32768 - 16384 + 4224);
  EXPECT_DOUBLE_EQ(u.fp8_unpack_bytes, 4096 * 4);  // the tanh output, dequantized in backward
  const double seconds_per_unit = 2.0 * (256 * 4096 + 4096) * 3 / kGpuTrainFlopsPerS;
  EXPECT_NEAR(u.fp8_s, 2 * (16384 + 4224) / kGpuMemoryBytesPerS / seconds_per_unit, 1e-12);
  TRIACCEL_SKIP_WITHOUT_GPU();
  const c10::Device gpu(c10::kCUDA, 0);
  WideTanh on_gpu;
  on_gpu.to(gpu);
  const MemoryModel g = memory_model_build(on_gpu, torch::zeros({256}, at::TensorOptions().device(gpu)), in, gpu);
  EXPECT_DOUBLE_EQ(g.units[0].saved_bytes, 4096 * 4);
  // The output stays counted at its dtype (alive until the next unit ran) beside its FP8 copy: 16384 + 4224 (the
  // allocator's 512-byte blocks), no less than kept, so the planner never stores this unit so.
  EXPECT_NEAR(g.units[0].fp8_bytes, 16384 + 4224, 256);
  EXPECT_GE(g.units[0].fp8_bytes, g.units[0].saved_bytes);
  PlanConstraints fp8;
  fp8.fp8_saved = {true};
  EXPECT_FALSE(memory_plan_solve(g, 4, 0, fp8).fp8_saved.at(0));
}

class Fp8SavedRunTest : public test::TinyMnistTest {};

// A CPU run with saved_activations fp8: the plan stores every offered unit in FP8 (events, summary, `plan`), and
// training differs from the same run with the activations kept (the gradients come from dequantized values) while
// staying close to it.
TEST_F(Fp8SavedRunTest, SavedActivationsFp8TrainsWithTheUnitsStoredInFp8) {
  test::TempDir out("run_fp8_saved");
  const auto run = [&](const char* saved) {
    Config o = options(out.path());
    o.set("saved_activations", saved);
    o.set("optimizer", "sgd");
    return api::run(o);
  };
  const Json fp8 = run("fp8");

  std::vector<std::string> stored;
  for (const auto& e : events_read(out.file("events.jsonl"))) {
    if (e["event"] != "memory_plan") continue;
    for (const auto& u : e["units"]) {
      if (u["fp8_saved"].get<bool>()) stored.push_back(u["unit"].get<std::string>());
    }
  }
  EXPECT_FALSE(stored.empty());
  EXPECT_EQ(fp8["memory_plan"]["fp8_saved"].size(), stored.size());
  const Json kept = run("keep");
  EXPECT_TRUE(kept["memory_plan"].is_null());  // keep, the default, is no lever: nothing to plan without a budget
  const double loss_fp8 = fp8["test_loss"].get<double>();
  const double loss_kept = kept["test_loss"].get<double>();
  EXPECT_NE(loss_fp8, loss_kept);
  EXPECT_NEAR(loss_fp8, loss_kept, 0.05 * loss_kept);
  Config o = options(out.path());
  o.set("saved_activations", "fp8");
  o.set("optimizer", "sgd");
  const Json p = api::plan(o)["memory_plan"];  // a lever given by hand: the memory plan, without a budget too
  EXPECT_EQ(p["fp8_saved"].size(), stored.size());
}

}  // namespace
}  // namespace triaccel
