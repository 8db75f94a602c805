// The update in backward (train/step.h; the memory planner's lever of one micro-batch, control/memory/memory_planner.h):
// the step updates each parameter as backward makes its gradient and frees it, to the same values as the plain step;
// the solver takes it when it is the fastest way to fit (against a brute force, and on a hand-computed model where
// its price decides); the option's fixed choices; the cost model's bytes and price; a CPU run with it on that trains
// exactly as the run with it off.
#include "memory_test_util.h"
#include "test_util.h"
#include "triaccel/api/api.h"
#include "triaccel/control/memory/memory_model.h"
#include "triaccel/control/memory/memory_planner.h"
#include "triaccel/core/device.h"
#include "triaccel/core/events.h"
#include "triaccel/optim/baoc_optimizer.h"
#include "triaccel/optim/sgd.h"
#include "triaccel/optim/state_format.h"
#include "triaccel/train/loss_scaler.h"
#include "triaccel/train/step.h"

#include <gtest/gtest.h>
#ifdef TRIACCEL_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif
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
using memory_test::UnitNet;
using memory_test::UnitRig;

TEST(UpdateInBackwardPlanTest, FindsTheFastestWithAndWithoutIt) {
  std::mt19937 rng(29);
  std::uniform_real_distribution<double> grads(100, 400), price(0.1, 4);
  int with = 0, without = 0;
  for (int trial = 0; trial < 40; ++trial) {
    MemoryModel m = made_up_random(rng);
    m.grads_bytes = grads(rng);
    m.update_in_backward_grads_bytes = trial % 5 == 0 ? 0 : m.grads_bytes / 8;  // not offered in every fifth
    m.update_in_backward_s = price(rng);
    m.allow_host_data = trial % 4 == 0;
    const int64_t batch = 10;
    const double need = memory_plan_solve(m, batch, 0).predicted_peak_bytes;
    const double budget = std::floor(need * (0.5 + 0.5 * (trial % 8) / 8.0));
    SCOPED_TRACE("trial " + std::to_string(trial) + " budget " + std::to_string(budget));
    const std::optional<MemoryPlan> plan = expect_fastest(m, batch, budget);
    if (!plan) continue;
    (plan->update_in_backward ? with : without) += 1;
    if (m.update_in_backward_grads_bytes == 0) EXPECT_FALSE(plan->update_in_backward);
  }
  EXPECT_GE(with, 8);  // the lever is taken in some plans and left in others
  EXPECT_GE(without, 8);
}

// Two units of 10 bytes a sample (input 1), batch 10, no host data. Base 100 weights + 100 gradients + 100 state +
// 50 fixed + 1000 data + 10 · 2 input = 1370, activations 10 · (20 + 4) = 240: 1610 unbudgeted. Under 1540 the whole
// batch fits with the gradients at 20 (1290 + 240 = 1530), at 8 + 10 + price; or with u0 recomputed (1370 + 10 · 15 =
// 1520) at 8 + 10 · (1 + 1/3 · 1/2) = 19.67; or in two micro-batches (1490) at 26. Price 1: the update in backward
// (19); price 2: the recompute.
TEST(UpdateInBackwardPlanTest, TakesItWhereItIsTheCheapestWayToFitTheWholeBatch) {
  MemoryModel m = made_up({10, 10}, {1, 1}, {1, 1});
  m.allow_host_data = false;
  m.update_in_backward_grads_bytes = 20;
  m.update_in_backward_s = 1;
  const MemoryPlan none = memory_plan_solve(m, 10, 0);
  EXPECT_FALSE(none.update_in_backward);  // no budget: nothing to fit, the lever only costs
  EXPECT_DOUBLE_EQ(none.predicted_peak_bytes, 1610);
  const MemoryPlan cheap = memory_plan_solve(m, 10, 1540);
  ASSERT_TRUE(cheap.feasible);
  EXPECT_TRUE(cheap.update_in_backward);
  EXPECT_EQ(cheap.micro_batch, 10);
  EXPECT_EQ(cheap.recompute, (std::vector<bool>{false, false}));
  EXPECT_DOUBLE_EQ(cheap.predicted_peak_bytes, 1530);
  EXPECT_DOUBLE_EQ(cheap.predicted_step_s, 19);
  EXPECT_EQ(cheap.to_json(m)["update_in_backward"], true);
  EXPECT_EQ(cheap.to_json(m)["consumers"]["gradients"], 20);
  m.update_in_backward_s = 2;
  const MemoryPlan dear = memory_plan_solve(m, 10, 1540);
  EXPECT_FALSE(dear.update_in_backward);
  EXPECT_EQ(dear.recompute, (std::vector<bool>{true, false}));
  EXPECT_NEAR(dear.predicted_step_s, 8 + 10 * (1 + 1.0 / 6), 1e-9);
  // The floor: micro-batches of 1 with every gradient (1370 + 15) is below the whole batch updated in backward
  // (1290 + 10 · 15); with the lever fixed on, the latter.
  EXPECT_NEAR(dear.floor_bytes, 1385, 0.05);  // (the least activations by bisection)
  PlanConstraints on;
  on.update_in_backward = true;
  const MemoryPlan forced = memory_plan_solve(m, 10, 0, on);
  EXPECT_TRUE(forced.update_in_backward);
  EXPECT_EQ(forced.micro_batch, 10);
  EXPECT_DOUBLE_EQ(forced.predicted_peak_bytes, 1530);
  EXPECT_NEAR(forced.floor_bytes, 1440, 0.5);
  PlanConstraints off;
  off.update_in_backward = false;
  m.update_in_backward_s = 1;
  EXPECT_FALSE(memory_plan_solve(m, 10, 1540, off).update_in_backward);
  m.update_in_backward_grads_bytes = 0;  // not offered: the plan without it
  EXPECT_FALSE(memory_plan_solve(m, 10, 1540).update_in_backward);
}

// Two UnitNets made equal, one step updating in backward: the same parameters and momenta after three steps, bit
// for bit (each tensor's update is the same ops on the same gradient); when backward reaches fc0's weight the units
// after it hold no gradient any more (freed after their updates), where the plain step holds all of theirs; after
// the step no gradient is left.
TEST(UpdateInBackwardStepTest, GivesThePlainStepsValuesAndFreesEachGradient) {
  torch::manual_seed(3);
  UnitRig plain(true, StepOptions{}, torch::kCPU), early(true, StepOptions{}, torch::kCPU);
  {
    const torch::NoGradGuard no_grad;
    for (size_t i = 0; i < plain.sgd.params().size(); ++i) early.sgd.params()[i].copy_(plain.sgd.params()[i]);
  }
  ASSERT_TRUE(early.step.update_in_backward_possible());
  early.step.set_update_in_backward(true);
  EXPECT_TRUE(early.step.update_in_backward());
  const auto later_grads = [](UnitRig& rig) {  // gradients held by fc1 and fc2 (and bn1)
    int n = 0;
    for (const auto& item : rig.net.named_parameters()) {
      if (item.key().rfind("fc0", 0) != 0 && item.value().grad().defined()) ++n;
    }
    return n;
  };
  std::vector<int> held_plain, held_early;
  const auto watch = [&](UnitRig& rig, std::vector<int>* held) {
    rig.net.named_parameters()["fc0.weight"].register_hook([&rig, held, &later_grads](const at::Tensor& g) {
      held->push_back(later_grads(rig));
      return g;
    });
  };
  watch(plain, &held_plain);
  watch(early, &held_early);
  const at::Tensor x = torch::randn({16, 12});
  const at::Tensor y = torch::randint(0, 5, {16});
  for (int s = 0; s < 3; ++s) {
    plain.step.run(x, y, 0.1);
    early.step.run(x, y, 0.1);
  }
  EXPECT_EQ(held_plain, (std::vector<int>{6, 6, 6}));  // fc1, bn1, fc2: weight and bias each
  EXPECT_EQ(held_early, (std::vector<int>{0, 0, 0}));
  for (size_t i = 0; i < plain.sgd.params().size(); ++i) {
    EXPECT_TRUE(torch::equal(plain.sgd.params()[i], early.sgd.params()[i])) << plain.sgd.names()[i];
    EXPECT_TRUE(torch::equal(plain.sgd.momenta()[i], early.sgd.momenta()[i])) << plain.sgd.names()[i];
    EXPECT_TRUE(plain.sgd.params()[i].grad().defined());
    EXPECT_FALSE(early.sgd.params()[i].grad().defined());
  }
  EXPECT_FALSE(early.step.last_step_skipped());
  EXPECT_NEAR(early.step.loss_sum().item<double>(), plain.step.loss_sum().item<double>(), 0.0);
  // A non-finite loss (a NaN input): checked before backward, nothing is updated, the step says it skipped.
  std::vector<at::Tensor> before;
  for (const auto& p : early.sgd.params()) before.push_back(p.clone());
  at::Tensor bad = x.clone();
  bad[0][0] = std::numeric_limits<float>::quiet_NaN();
  early.step.run(bad, y, 0.1);
  EXPECT_TRUE(early.step.last_step_skipped());
  for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(torch::equal(before[i], early.sgd.params()[i]));
  // Off again: the plain step (every gradient kept until the update).
  early.step.set_update_in_backward(false);
  early.step.run(x, y, 0.1);
  EXPECT_TRUE(early.sgd.params()[0].grad().defined());
}

// AdamW (BaocOptimizer at its fp32, 8-bit and factored formats) updating in backward: after three steps the
// parameters, every state tensor (moments, their scales) and the step counts are the plain step's bit for bit, and
// no gradient is left. While BAOC's gradient statistics are gathered (they read a step's gradients together) it
// cannot update one tensor alone.
TEST(UpdateInBackwardStepTest, AdamWGivesThePlainStepsValuesAndState) {
  for (const StateFormat format : {StateFormat::kAdamW32, StateFormat::kAdamW8, StateFormat::kFactored}) {
    SCOPED_TRACE(state_format_traits(format).name);
    torch::manual_seed(5);
    UnitNet plain_net(true), early_net(true);
    {
      const torch::NoGradGuard no_grad;
      auto from = plain_net.parameters();
      auto to = early_net.parameters();
      for (size_t i = 0; i < from.size(); ++i) to[i].copy_(from[i]);
    }
    BaocOptimizer plain_opt(memory_test::named_on(plain_net, torch::kCPU), BaocOptions{}, format);
    BaocOptimizer early_opt(memory_test::named_on(early_net, torch::kCPU), BaocOptions{}, format);
    LossScaler plain_scaler(LossScalerOptions{}, torch::kCPU), early_scaler(LossScalerOptions{}, torch::kCPU);
    TrainStep plain(plain_net, plain_opt, plain_scaler, StepOptions{}, torch::kCPU);
    TrainStep early(early_net, early_opt, early_scaler, StepOptions{}, torch::kCPU);
    ASSERT_TRUE(early.update_in_backward_possible());
    early.set_update_in_backward(true);
    const at::Tensor x = torch::randn({16, 12});
    const at::Tensor y = torch::randint(0, 5, {16});
    for (int s = 0; s < 3; ++s) {
      plain.run(x, y, 0.01);
      early.run(x, y, 0.01);
    }
    for (size_t i = 0; i < plain_opt.params().size(); ++i) {
      EXPECT_TRUE(torch::equal(plain_opt.params()[i], early_opt.params()[i])) << plain_opt.names()[i];
      EXPECT_FALSE(early_opt.params()[i].grad().defined());
    }
    const NamedTensors a = plain_opt.state_tensors(), b = early_opt.state_tensors();
    ASSERT_EQ(a.size(), b.size());
    for (size_t k = 0; k < a.size(); ++k) {
      ASSERT_EQ(a[k].first, b[k].first);
      EXPECT_TRUE(torch::equal(a[k].second, b[k].second)) << a[k].first;
    }
    EXPECT_TRUE(torch::equal(early_opt.counts(), torch::full({early_opt.counts().size(0), 2}, 3.0, torch::kDouble)));
  }
  UnitNet net(false);
  BaocOptimizer gathering(memory_test::named_on(net, torch::kCPU), BaocOptions{});
  EXPECT_TRUE(gathering.steps_one());
  gathering.stream_stats_enable(true);
  EXPECT_FALSE(gathering.steps_one());
}

// Where the update in backward cannot run: loss scaling (its skip needs every gradient first), fault injection, and
// micro-batches (the gradients accumulate: the step updates after them as before).
TEST(UpdateInBackwardStepTest, RefusedWhereItCannotRunAndSkippedOverMicroBatches) {
  UnitNet net(false);
  Sgd sgd(memory_test::named_on(net, torch::kCPU), SgdOptions{});
  LossScalerOptions scaled;
  scaled.enabled = true;
  LossScaler fp16(scaled, torch::kCPU);
  TrainStep with_scaling(net, sgd, fp16, StepOptions{}, torch::kCPU);
  EXPECT_FALSE(with_scaling.update_in_backward_possible());
  EXPECT_THROW(with_scaling.set_update_in_backward(true), c10::Error);
  LossScaler plain(LossScalerOptions{}, torch::kCPU);
  StepOptions faults;
  faults.fault_injection = true;
  EXPECT_FALSE(TrainStep(net, sgd, plain, faults, torch::kCPU).update_in_backward_possible());

  StepOptions micro;
  micro.micro_batch = 4;
  TrainStep split(net, sgd, plain, micro, torch::kCPU);
  split.set_update_in_backward(true);
  const at::Tensor before = sgd.params()[0].clone();
  split.run(torch::randn({8, 12}), torch::randint(0, 5, {8}), 0.1);
  EXPECT_TRUE(sgd.params()[0].grad().defined());  // accumulated over the two micro-batches, then one update
  EXPECT_FALSE(torch::equal(before, sgd.params()[0]));
}

// The cost model: under the offer, the gradients of the two largest parameters (UnitNet: fc1's 24 × 24 weight and
// fc0's 24 × 12), and a price per step of two launches per parameter (6 parameters) in the model's time unit.
TEST(UpdateInBackwardPlanTest, TheCostModelPricesTheTwoLargestGradientsAndTheLaunches) {
  UnitNet net(false);
  MemoryModelInputs in;
  const at::Tensor sample = torch::zeros({12});
  EXPECT_EQ(memory_model_build(net, sample, in, torch::kCPU).update_in_backward_grads_bytes, 0);
  in.update_in_backward = true;
  const MemoryModel m = memory_model_build(net, sample, in, torch::kCPU);
  EXPECT_DOUBLE_EQ(m.update_in_backward_grads_bytes, 4.0 * (576 + 288));
  EXPECT_DOUBLE_EQ(m.update_in_backward_s, 12 * kGpuLaunchS / memory_model_seconds_per_unit(m));
  EXPECT_DOUBLE_EQ(m.grads_bytes, 4.0 * (288 + 24 + 576 + 24 + 120 + 5));
}

// Four Linear(1024 → 1024) + tanh units (4.2 MB of fp32 gradient each, 16.8 MB in all).
class WideChain : public Model {
 public:
  WideChain() : Model("wide-chain") {
    for (int u = 0; u < 4; ++u) {
      auto linear = register_module("fc" + std::to_string(u), torch::nn::Linear(1024, 1024));
      std::vector<std::shared_ptr<torch::nn::Module>> modules{linear};
      unit_add("fc" + std::to_string(u), modules, [linear](const at::Tensor& x) { return torch::tanh(linear->forward(x)); });
    }
  }
};

struct WideRig {
  WideChain net;
  Sgd sgd;
  LossScaler scaler;
  TrainStep step;
  WideRig(const StepOptions& so, const c10::Device& device)
      : sgd(memory_test::named_on(net, device), SgdOptions{}),
        scaler(LossScalerOptions{}, device),
        step(net, sgd, scaler, so, device) {}
};

// GPU: the update in backward inside a captured CUDA graph (the fused kernel on one tensor at a time) gives the
// plain graphed step's weights bit for bit after 8 steps, and an eager step's allocated peak falls by at least two of
// the four weights' gradients (the step holds one or two of them, not four).
TEST(UpdateInBackwardGpuTest, TheGraphedStepMatchesThePlainOneAndItsPeakHoldsFewerGradients) {
  TRIACCEL_SKIP_WITHOUT_GPU();
#ifdef TRIACCEL_WITH_CUDA
  const c10::cuda::CUDAStreamGuard stream(c10::cuda::getStreamFromPool());  // captures need a non-default stream
  const c10::Device cuda(c10::kCUDA, 0);
  StepOptions graphed;
  graphed.cuda_graphs = true;
  graphed.graph_batch_size = 64;
  torch::manual_seed(5);
  WideRig plain(graphed, cuda), early(graphed, cuda);
  {
    const torch::NoGradGuard no_grad;
    for (size_t i = 0; i < plain.sgd.params().size(); ++i) early.sgd.params()[i].copy_(plain.sgd.params()[i]);
  }
  early.step.set_update_in_backward(true);
  const at::Tensor x = torch::randn({64, 1024}, cuda);
  const at::Tensor y = torch::randint(0, 10, {64}, at::TensorOptions().device(cuda).dtype(at::kLong));
  for (int s = 0; s < 8; ++s) {
    plain.step.run(x, y, 0.05);
    early.step.run(x, y, 0.05);
  }
  EXPECT_TRUE(plain.step.graph().captured());
  EXPECT_TRUE(early.step.graph().captured());
  for (size_t i = 0; i < plain.sgd.params().size(); ++i) {
    EXPECT_TRUE(torch::equal(plain.sgd.params()[i], early.sgd.params()[i])) << plain.sgd.names()[i];
  }
  const auto eager_peak = [&](bool update_in_backward) {
    StepOptions eager;
    eager.cuda_graphs = false;
    WideRig rig(eager, cuda);
    rig.step.set_update_in_backward(update_in_backward);
    rig.step.run(x, y, 0.05);  // the momenta made
    rig.step.grads_release();
    device_synchronize(cuda);
    memory_stats_reset_peak(cuda);
    const int64_t before = memory_stats(cuda).allocated_bytes;
    rig.step.run(x, y, 0.05);
    device_synchronize(cuda);
    return memory_stats(cuda).peak_allocated_bytes - before;
  };
  const int64_t with_all = eager_peak(false), with_few = eager_peak(true);
  EXPECT_GE(with_all - with_few, 2 * 4 * 1024 * 1024) << with_all << " against " << with_few;
#endif
}

class UpdateInBackwardRunTest : public test::TinyMnistTest {};

// A CPU run with update_in_backward on (a lever given by hand: planned without a budget) trains exactly as the run
// with it off, with SGD and with AdamW: the same test loss, bit for bit; the plan and its event say so; BAOC, whose
// plan reads a step's gradients together, is refused in one line naming the way out.
TEST_F(UpdateInBackwardRunTest, OnTrainsAsOffAndBaocIsRefused) {
  test::TempDir out("run_update_in_backward");
  const auto run = [&](const char* toggle, const char* optimizer) {
    Config o = options(out.path());
    o.set("update_in_backward", toggle);
    o.set("optimizer", optimizer);
    return api::run(o);
  };
  const Json adamw_on = run("on", "adamw");
  const Json adamw_off = run("off", "adamw");
  EXPECT_EQ(adamw_on["memory_plan"]["update_in_backward"], true);
  EXPECT_EQ(adamw_on["test_loss"].get<double>(), adamw_off["test_loss"].get<double>());
  const Json on = run("on", "sgd");
  bool planned = false;
  for (const auto& e : events_read(out.file("events.jsonl"))) {
    if (e["event"] == "memory_plan") planned = planned || e["update_in_backward"].get<bool>();
  }
  EXPECT_TRUE(planned);
  EXPECT_EQ(on["memory_plan"]["update_in_backward"], true);
  const Json off = run("off", "sgd");
  EXPECT_TRUE(off["memory_plan"].is_null());
  EXPECT_NE(on["test_loss"].get<double>(), adamw_on["test_loss"].get<double>());
  EXPECT_EQ(on["test_loss"].get<double>(), off["test_loss"].get<double>());
  EXPECT_EQ(on["test_acc"].get<double>(), off["test_acc"].get<double>());
  Config baoc = options(out.path());
  baoc.set("update_in_backward", "on");
  baoc.set("optimizer", "baoc");
  try {
    api::run(baoc);
    ADD_FAILURE() << "baoc with update_in_backward on ran";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("is not for --optimizer baoc"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace triaccel
