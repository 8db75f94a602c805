// Shared by the memory planner's tests (test_memory_planner.cpp, test_memory_gpu.cpp,
// test_memory_plan_controller.cpp): a made-up cost model, a small network of Linear units with its step engine, and
// a memory meter whose readings a test makes up.
#pragma once

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

namespace triaccel::memory_test {
// A made-up network: unit u keeps saved[u] bytes per sample, reads input[u], costs flops[u].
inline MemoryModel made_up(const std::vector<double>& saved, const std::vector<double>& input,
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

// made_up with four units drawn from `rng`: each keeps 1-60 bytes a sample, reads a third of such a draw, costs
// 0.5-5 (the random models of the solver's brute-force tests).
inline MemoryModel made_up_random(std::mt19937& rng) {
  std::uniform_real_distribution<double> bytes(1, 60), cost(0.5, 5);
  std::vector<double> saved, input, flops;
  for (int u = 0; u < 4; ++u) {
    saved.push_back(bytes(rng));
    input.push_back(bytes(rng) / 3);
    flops.push_back(cost(rng));
  }
  return made_up(saved, input, flops);
}

// Every micro-batch, placement and per-unit choice (kept; recomputed where the unit is recomputable; in FP8 where
// it is offered, fp8_bytes in (0, saved_bytes)), and at the whole batch the update in backward where it is offered:
// the least step time among those that fit `budget` (any: whether one does).
inline double brute_force_fastest(const MemoryModel& m, int64_t batch, double budget, bool* any) {
  const size_t n = m.units.size();
  std::vector<std::vector<UnitStore>> options(n);
  size_t combos = 1;
  for (size_t u = 0; u < n; ++u) {
    const UnitCost& c = m.units[u];
    options[u].push_back(UnitStore::kKeep);
    if (c.recomputable) options[u].push_back(UnitStore::kRecompute);
    if (c.fp8_bytes > 0 && c.fp8_bytes < c.saved_bytes) options[u].push_back(UnitStore::kFp8);
    combos *= options[u].size();
  }
  double best = std::numeric_limits<double>::infinity();
  *any = false;
  for (DataPlacement p : {DataPlacement::kDevice, DataPlacement::kHost}) {
    if (p == DataPlacement::kHost && !m.allow_host_data) continue;
    for (int64_t micro = 1; micro <= batch; ++micro) {
      for (size_t code = 0; code < combos; ++code) {
        std::vector<bool> r(n), f(n);
        size_t rest = code;
        for (size_t u = 0; u < n; ++u) {
          const UnitStore s = options[u][rest % options[u].size()];
          rest /= options[u].size();
          r[u] = s == UnitStore::kRecompute;
          f[u] = s == UnitStore::kFp8;
        }
        for (bool u : {false, true}) {
          if (u && (micro < batch || m.update_in_backward_grads_bytes <= 0)) continue;
          if (memory_plan_peak(m, batch, micro, r, p, f, u) > budget) continue;
          *any = true;
          best = std::min(best, memory_plan_step_s(m, batch, micro, r, p, f, u));
        }
      }
    }
  }
  return best;
}

// The solver's plan at `budget` against the brute force: feasible when a plan fits 0.99 of the budget (the rounding
// only errs towards fitting), infeasible when none fits; within the budget, no faster than the best that fits and no
// slower than the best at 0.99 of it; its predicted peak the exact model's. The plan when feasible.
inline std::optional<MemoryPlan> expect_fastest(const MemoryModel& m, int64_t batch, double budget) {
  bool any = false, any_tighter = false;
  const double best = brute_force_fastest(m, batch, budget, &any);
  const double best_tighter = brute_force_fastest(m, batch, 0.99 * budget, &any_tighter);
  const MemoryPlan plan = memory_plan_solve(m, batch, static_cast<int64_t>(budget));
  if (any_tighter) EXPECT_TRUE(plan.feasible);
  if (!any) EXPECT_FALSE(plan.feasible);
  if (!plan.feasible) return std::nullopt;
  EXPECT_LE(plan.predicted_peak_bytes, budget);
  EXPECT_GE(plan.predicted_step_s, best * (1 - 1e-12));
  if (any_tighter) EXPECT_LE(plan.predicted_step_s, best_tighter * (1 + 1e-12));
  EXPECT_DOUBLE_EQ(plan.predicted_peak_bytes, memory_plan_peak(m, plan));
  if (plan.update_in_backward) EXPECT_EQ(plan.micro_batch, batch);
  return plan;
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
inline std::vector<std::pair<std::string, at::Tensor>> named_on(Model& net, const c10::Device& device) {
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

}  // namespace triaccel::memory_test
