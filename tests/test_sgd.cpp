// Sgd: the ATen reference against LibTorch's torch::optim::SGD (the spec of the math), the skip on found_inf, and
// the CUDA kernel against the reference (GPU only). Tolerances: float32 rounding only (FMA vs separate ops),
// so 1e-6 relative after 50 steps.
#include "test_util.h"
#include "triaccel/optim/sgd.h"
#ifdef TRIACCEL_WITH_CUDA
#include "triaccel/core/cuda_graph.h"
#include "triaccel/kernels/sgd_step.h"
#include "triaccel/optim/baoc_optimizer.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace triaccel {
namespace {

double max_rel_err(const at::Tensor& a, const at::Tensor& b) {
  return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item<double>();
}

TEST(SgdTest, MatchesLibTorchSgdWithNesterovAndNoDecayOnBiases) {
  torch::manual_seed(1);
  const double lr = 0.05, mu = 0.9, wd = 5e-4;
  std::vector<at::Tensor> ours = {torch::randn({8, 4}), torch::randn({8}), torch::randn({3, 2, 3, 3})};
  const at::Tensor initial = ours[0].clone();
  std::vector<at::Tensor> theirs;
  for (auto& t : ours) {
    t.set_requires_grad(true);
    theirs.push_back(t.detach().clone().set_requires_grad(true));
  }
  Sgd sgd({{"w", ours[0]}, {"b", ours[1]}, {"conv", ours[2]}}, SgdOptions{mu, true, wd});
  EXPECT_EQ(sgd.weight_decays()[0], static_cast<float>(wd));
  EXPECT_EQ(sgd.weight_decays()[1], 0.f);  // biases and norms: no decay
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{theirs[0], theirs[2]},
                      std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(lr).momentum(mu).nesterov(true).weight_decay(wd)));
  groups.emplace_back(std::vector<at::Tensor>{theirs[1]},
                      std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(lr).momentum(mu).nesterov(true)));
  torch::optim::SGD reference(groups, torch::optim::SGDOptions(lr));
  const at::Tensor lr_t = torch::full({1}, lr);
  const at::Tensor no_inf = torch::zeros({1});
  for (int step = 0; step < 50; ++step) {
    for (size_t i = 0; i < ours.size(); ++i) {
      const at::Tensor g = torch::randn_like(ours[i]);
      ours[i].mutable_grad() = g.clone();
      theirs[i].mutable_grad() = g.clone();
    }
    sgd.step(lr_t, no_inf);
    reference.step();
  }
  for (size_t i = 0; i < ours.size(); ++i) {
    EXPECT_LT(max_rel_err(ours[i].detach(), theirs[i].detach()), 1e-6) << "tensor " << i;
  }
  // The parameters moved (a no-op optimizer must not pass by matching a no-op reference).
  EXPECT_GT((ours[0].detach() - initial).abs().max().item<double>(), 1e-2);
}

TEST(SgdTest, FoundInfSkipsTheStep) {
  at::Tensor p = torch::randn({5}).set_requires_grad(true);
  const at::Tensor before = p.detach().clone();
  p.mutable_grad() = torch::ones({5});
  Sgd sgd({{"p", p}}, SgdOptions{});
  EXPECT_TRUE(sgd.momenta().empty());  // created at the first step, after the first backward (as torch.optim.SGD)
  sgd.step(torch::full({1}, 0.1), torch::ones({1}));
  EXPECT_TRUE(torch::equal(p.detach(), before));
  EXPECT_EQ(sgd.momenta()[0].abs().sum().item<float>(), 0.f);
  sgd.step(torch::full({1}, 0.1), torch::zeros({1}));
  EXPECT_FALSE(torch::equal(p.detach(), before));
}

TEST(SgdTest, LrScalesMultiplyEachTensorsStep) {
  at::Tensor a = torch::ones({1, 1}).set_requires_grad(true);
  at::Tensor b = torch::ones({1, 1}).set_requires_grad(true);
  Sgd sgd({{"a", a}, {"b", b}}, SgdOptions{0.0, false, 0.0});
  sgd.set_lr_scales({1.f, 0.5f});
  a.mutable_grad() = torch::ones({1, 1});
  b.mutable_grad() = torch::ones({1, 1});
  sgd.step(torch::full({1}, 0.1), torch::zeros({1}));
  EXPECT_FLOAT_EQ(a.item<float>(), 0.9f);
  EXPECT_FLOAT_EQ(b.item<float>(), 0.95f);
  EXPECT_THROW(sgd.set_lr_scales({1.f}), c10::Error);
}

TEST(SgdTest, PlainMomentumMatchesHandComputedValues) {
  // p = 1, g = 1, wd = 0, mu = 0.5, lr = 0.1, no nesterov: m1 = 1, p1 = 0.9; m2 = 1.5, p2 = 0.75.
  at::Tensor p = torch::ones({1, 1}).set_requires_grad(true);
  Sgd sgd({{"p", p}}, SgdOptions{0.5, false, 0.0});
  p.mutable_grad() = torch::ones({1, 1});
  sgd.step(torch::full({1}, 0.1), torch::zeros({1}));
  EXPECT_FLOAT_EQ(p.item<float>(), 0.9f);
  sgd.step(torch::full({1}, 0.1), torch::zeros({1}));
  EXPECT_FLOAT_EQ(p.item<float>(), 0.75f);
}

#ifdef TRIACCEL_WITH_CUDA
TEST(SgdCudaTest, KernelMatchesReference) {
  TRIACCEL_SKIP_WITHOUT_GPU();
  torch::manual_seed(2);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  // Odd sizes (scalar tail), a channels_last conv weight, and more tensors than one launch holds.
  std::vector<std::vector<int64_t>> shapes = {{7}, {1000003}, {64, 3, 3, 3}, {10, 512}, {128, 64, 1, 1}};
  for (int i = 0; i < 70; ++i) shapes.push_back({i + 1, 5});
  std::vector<at::Tensor> p_gpu, g_gpu, m_gpu, p_ref, g_ref, m_ref;
  std::vector<float> wds, scales;
  for (const auto& s : shapes) {
    at::Tensor p = torch::randn(s, cuda);
    if (s.size() == 4) p = p.contiguous(at::MemoryFormat::ChannelsLast);
    p_gpu.push_back(p);
    // A 1×1 conv's gradient may come back contiguous while its weight is channels_last: same memory order.
    g_gpu.push_back(s.size() == 4 && s[2] == 1 ? torch::randn(s, cuda) : torch::randn_like(p));
    m_gpu.push_back(torch::randn_like(p));
    p_ref.push_back(p.clone());
    g_ref.push_back(g_gpu.back().clone());
    m_ref.push_back(m_gpu.back().clone());
    wds.push_back(s.size() > 1 ? 5e-4f : 0.f);
    scales.push_back(0.25f + 0.01f * static_cast<float>(scales.size() % 50));
  }
  const at::Tensor lr = torch::full({1}, 0.1, cuda);
  const at::Tensor found = torch::zeros({1}, cuda);
  // The scales on the device in reverse order, each tensor pointing at its row.
  std::vector<float> reversed(scales.rbegin(), scales.rend());
  const at::Tensor scales_dev = torch::tensor(reversed, cuda);
  std::vector<int64_t> rows;
  for (size_t i = 0; i < scales.size(); ++i) rows.push_back(static_cast<int64_t>(scales.size() - 1 - i));
  for (bool nesterov : {true, false}) {
    sgd_step_cuda(p_gpu, g_gpu, m_gpu, wds, scales_dev, rows, lr, found, 0.9f, nesterov);
    sgd_step_reference(p_ref, g_ref, m_ref, wds, scales, lr, found, 0.9f, nesterov);
    for (size_t i = 0; i < shapes.size(); ++i) {
      ASSERT_LT(max_rel_err(p_gpu[i], p_ref[i]), 1e-6) << "param " << i;
      ASSERT_LT(max_rel_err(m_gpu[i], m_ref[i]), 1e-6) << "momentum " << i;
    }
  }
  const at::Tensor before = p_gpu[1].clone();
  sgd_step_cuda(p_gpu, g_gpu, m_gpu, wds, scales_dev, rows, lr, torch::ones({1}, cuda), 0.9f, true);
  EXPECT_TRUE(torch::equal(before, p_gpu[1]));
}

// Tri-Accel changes the lr scales between replays of the captured step: every fused kernel (SGD, and BAOC's
// element-wise, 8-bit and factored ones) must read them on the device, so that a replay after set_lr_scales uses
// the new scales without a re-capture. Scale 0 for one tensor: the replay leaves it where it was (momentum or
// moments still move) and moves the others; then back to 1: it moves again.
TEST(OptimizerCudaTest, ACapturedStepReplaysWithTheLrScalesSetAfterTheCapture) {
  TRIACCEL_SKIP_WITHOUT_GPU();
  torch::manual_seed(3);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  const c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());
  const std::vector<std::vector<int64_t>> shapes = {{64, 32}, {32}, {16, 8, 3, 3}, {300}};
  struct Case {
    const char* name;
    std::vector<StateFormat> formats;  // empty: Sgd
  };
  const std::vector<Case> cases = {
      {"sgd", {}},
      {"baoc adamw32/nomomentum/adamw16/sgd", {StateFormat::kAdamW32, StateFormat::kNoMomentum, StateFormat::kAdamW16,
                                               StateFormat::kSgdMomentum}},
      {"baoc adamw8/factored", {StateFormat::kAdamW8, StateFormat::kFactored, StateFormat::kFactored,
                                StateFormat::kAdamW8}}};
  for (const Case& c : cases) {
    std::vector<std::pair<std::string, at::Tensor>> named;
    for (size_t i = 0; i < shapes.size(); ++i) {
      at::Tensor p = torch::randn(shapes[i], cuda);
      p.mutable_grad() = torch::randn_like(p);
      named.emplace_back("p" + std::to_string(i), p);
    }
    std::unique_ptr<Optimizer> opt;
    if (c.formats.empty()) {
      opt = std::make_unique<Sgd>(named, SgdOptions{});
    } else {
      auto baoc = std::make_unique<BaocOptimizer>(named, BaocOptions{});
      baoc->formats_set(c.formats);
      opt = std::move(baoc);
    }
    const at::Tensor lr = torch::full({1}, 0.01, cuda);
    const at::Tensor found = torch::zeros({1}, cuda);
    opt->step(lr, found);  // the state exists before the capture (its addresses are the graph's)
    const auto graph = cuda_graph_capture([&]() { opt->step(lr, found); });
    ASSERT_NE(graph, nullptr) << c.name;
    const auto moved = [&](const std::vector<at::Tensor>& before) {
      std::vector<bool> out;
      for (size_t i = 0; i < before.size(); ++i) out.push_back(!torch::equal(before[i], named[i].second));
      return out;
    };
    const auto snapshot = [&]() {
      std::vector<at::Tensor> out;
      for (const auto& [name, p] : named) out.push_back(p.clone());
      return out;
    };
    opt->set_lr_scales({1.f, 1.f, 0.f, 1.f});
    std::vector<at::Tensor> before = snapshot();
    graph->replay();
    EXPECT_EQ(moved(before), (std::vector<bool>{true, true, false, true})) << c.name;
    opt->set_lr_scales({1.f, 1.f, 1.f, 1.f});
    before = snapshot();
    graph->replay();
    EXPECT_EQ(moved(before), (std::vector<bool>{true, true, true, true})) << c.name;
  }
}
#endif

}  // namespace
}  // namespace triaccel
