// FP8 storage of saved activations (train/fp8_saved.h): the block format's reference on hand-computed values, the
// CUDA kernels against it byte for byte, and the scope's effect on a real backward (what it stores, once each, and
// gradients within the format's error of the exact ones).
#include "triaccel/train/fp8_saved.h"

#include "triaccel/models/registry.h"
#include "triaccel/optim/sgd.h"
#include "triaccel/train/loss_scaler.h"
#include "triaccel/train/step.h"

#ifdef TRIACCEL_WITH_CUDA
#include "triaccel/kernels/fp8_block.h"
#endif

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <vector>

namespace triaccel {
namespace {

std::vector<float> values_of(const at::Tensor& t) {
  const at::Tensor f = t.detach().to(at::kFloat).contiguous().cpu();
  return std::vector<float>(f.data_ptr<float>(), f.data_ptr<float>() + f.numel());
}

at::Tensor round_trip(const at::Tensor& x) {
  const Fp8Blocks q = fp8_block_quantize(x);
  at::Tensor out = at::empty_like(x);
  fp8_block_dequantize_into(q, out);
  return out;
}

TEST(Fp8SavedFormatTest, EachBlockHasTheLargestPowerOfTwoScaleThatKeepsItsAmaxInRange) {
  // Block 0: amax 1 = 0.5·2^1 → 2^8 (1·256 = 256 ≤ 448 < 512). Block 1: amax 0.9 = 0.9·2^0, mantissa above 0.875 →
  // 2^8 (230.4 ≤ 448 < 460.8). Block 2: all zero → 1. Block 3 (8 elements): an inf → 1, the inf saturating to 448.
  std::vector<float> x(3 * 128 + 8, 0.f);
  x[0] = 1.f;
  x[1] = 0.3f;   // 76.8 → 80 (E4M3 steps of 8 in [64, 128)) → 0.3125
  x[2] = -0.5f;  // exact
  x[128] = 0.9f;
  x[129] = std::numeric_limits<float>::quiet_NaN();
  x[3 * 128] = std::numeric_limits<float>::infinity();
  x[3 * 128 + 1] = 3.f;
  const Fp8Blocks q = fp8_block_quantize_reference(torch::tensor(x));
  EXPECT_EQ(values_of(q.scales), (std::vector<float>{256.f, 256.f, 1.f, 1.f}));
  EXPECT_EQ(q.data[129].item<uint8_t>(), 0x7f);
  at::Tensor back = at::empty({static_cast<int64_t>(x.size())});
  fp8_block_dequantize_reference_into(q, back);
  const std::vector<float> v = values_of(back);
  EXPECT_EQ(v[0], 1.f);
  EXPECT_EQ(v[1], 0.3125f);
  EXPECT_EQ(v[2], -0.5f);
  EXPECT_EQ(v[128], 0.875f);  // 230.4 → 224 (steps of 16 in [128, 256)) / 256
  EXPECT_TRUE(std::isnan(v[129]));
  EXPECT_EQ(v[3 * 128], 448.f);
  EXPECT_EQ(v[3 * 128 + 1], 3.f);
}

TEST(Fp8SavedFormatTest, ARoundTripKeepsEveryValueWithinHalfAnUlpOfItsBlockAndTheLayout) {
  torch::manual_seed(58);
  // channels_last, bf16, blocks of very different magnitudes.
  const at::Tensor x = (torch::randn({4, 8, 6, 6}) * torch::pow(10.0, torch::randint(-3, 3, {4, 8, 1, 1})))
                           .to(at::kBFloat16)
                           .contiguous(at::MemoryFormat::ChannelsLast);
  const at::Tensor back = round_trip(x);
  EXPECT_EQ(back.strides(), x.strides());
  EXPECT_EQ(back.scalar_type(), at::kBFloat16);
  // Relative error of a normal E4M3 value ≤ 2^-4, plus bf16's own rounding of the result (2^-8).
  const at::Tensor xf = x.to(at::kFloat), bf = back.to(at::kFloat);
  const at::Tensor normal = xf.abs() > xf.abs().amax() * 1e-3;  // well above the blocks' subnormal range
  const double worst = ((bf - xf).abs() / xf.abs()).masked_select(normal).max().item<double>();
  EXPECT_LE(worst, std::ldexp(1.0, -4) + std::ldexp(1.0, -8));
  EXPECT_GT(worst, std::ldexp(1.0, -6));  // it is FP8: a wider cast would pass the bound alone
}

// conv → BatchNorm → ReLU → conv, float32 on the CPU: 8·16·16·16 = 32768 elements an activation.
struct TinyChain {
  torch::nn::Conv2d c1{torch::nn::Conv2dOptions(3, 16, 3).padding(1).bias(false)};  // a bias before BatchNorm has no gradient
  torch::nn::BatchNorm2d bn{16};
  torch::nn::Conv2d c2{torch::nn::Conv2dOptions(16, 16, 3).padding(1)};

  at::Tensor forward(const at::Tensor& x) { return c2(torch::relu(bn(c1(x)))); }
  std::vector<at::Tensor> params() {
    std::vector<at::Tensor> p;
    for (auto* m : std::vector<torch::nn::Module*>{c1.get(), bn.get(), c2.get()}) {
      for (const auto& t : m->parameters()) p.push_back(t);
    }
    return p;
  }
};

std::vector<at::Tensor> chain_grads(TinyChain& chain, const at::Tensor& x, Fp8SavedStore* store) {
  at::Tensor y;
  if (store != nullptr) {
    const Fp8SavedScope scope(*store);
    y = chain.forward(x);
  } else {
    y = chain.forward(x);
  }
  const at::Tensor target = torch::ones_like(y);
  return torch::autograd::grad({(y - target).pow(2).mean()}, chain.params());
}

TEST(Fp8SavedScopeTest, TheChainsActivationsAreStoredOnceEachInAQuarterOfTheirBytesAndItsGradientsStayClose) {
  ASSERT_TRUE(fp8_saved_available());
  torch::manual_seed(3);
  TinyChain chain;
  const at::Tensor x = torch::randn({8, 3, 16, 16});
  const std::vector<at::Tensor> exact = chain_grads(chain, x, nullptr);
  Fp8SavedStore store;
  const std::vector<at::Tensor> stored = chain_grads(chain, x, &store);
  // BatchNorm's input and the ReLU's output (which the second convolution saves too: shared). The input (a leaf),
  // the weights and BatchNorm's per-channel statistics stay as they are.
  EXPECT_EQ(store.stored_tensors(), 2);
  EXPECT_GE(store.passed_tensors(), 5);
  EXPECT_EQ(store.original_bytes(), 2 * 32768 * 4);
  EXPECT_EQ(store.stored_bytes(), 2 * (32768 + 4 * 256));
  // Every gradient within a few percent of the exact one (norm of the difference), and not equal to it.
  ASSERT_EQ(stored.size(), exact.size());
  double largest = 0;
  for (size_t i = 0; i < exact.size(); ++i) {
    const double rel = (stored[i] - exact[i]).norm().item<double>() / exact[i].norm().item<double>();
    EXPECT_LT(rel, 0.03) << "parameter " << i;
    largest = std::max(largest, rel);
  }
  EXPECT_GT(largest, 1e-4);
  // Outside a scope nothing is stored.
  Fp8SavedStore untouched;
  { const Fp8SavedScope scope(untouched); }
  (void)chain_grads(chain, x, nullptr);
  EXPECT_EQ(untouched.stored_tensors(), 0);
}

TEST(Fp8SavedScopeTest, WhatIsMadeFromLeavesAloneIsNotStored) {
  ASSERT_TRUE(fp8_saved_available());
  // mm saves its operands: `a` (a leaf) and w.t() (a view of a leaf alone, as a weight's autocast cast is); tanh
  // saves its output, made from both: the one tensor stored.
  torch::manual_seed(5);
  const at::Tensor w = torch::randn({128, 128}, torch::requires_grad());
  const at::Tensor a = torch::randn({64, 128}, torch::requires_grad());
  Fp8SavedStore store;
  at::Tensor y;
  {
    const Fp8SavedScope scope(store);
    y = torch::tanh(a.mm(w.t())).sum();
  }
  (void)torch::autograd::grad({y}, {w, a});
  EXPECT_EQ(store.stored_tensors(), 1);
  EXPECT_EQ(store.passed_tensors(), 2);
}

// ResNet-18 (CIFAR stem, fp32, CPU) through TrainStep::forward with every unit's saved activations in FP8 against
// the same step without: each unit stores what it saves (the units' outputs once), the gradients stay within a few
// percent, and a unit also recomputed is recomputed instead.
TEST(Fp8SavedStepTest, TheStepStoresTheChosenUnitsActivationsInFp8) {
  ASSERT_TRUE(fp8_saved_available());
  const c10::Device cpu(c10::kCPU);
  torch::manual_seed(0);
  ModelOptions mo;
  mo.name = "resnet18";
  auto model = model_create(mo);
  model->train();
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (const auto& it : model->named_parameters()) named.emplace_back(it.key(), it.value());
  Sgd sgd(named, SgdOptions{});
  LossScaler scaler(LossScalerOptions{}, cpu);
  StepOptions so;
  so.cuda_graphs = false;
  TrainStep step(*model, sgd, scaler, so, cpu);
  const at::Tensor x = torch::randn({2, 3, 32, 32});
  std::vector<at::Tensor> params;
  for (const auto& p : named) params.push_back(p.second);
  const BuffersKept kept(model->buffers());
  const auto grads = [&] {
    const at::Tensor out = step.forward(x);
    return torch::autograd::grad({out.pow(2).mean()}, params);
  };
  const std::vector<at::Tensor> exact = grads();
  EXPECT_EQ(step.fp8_saved_last_tensors(), 0);
  const size_t units = model->units().size();
  step.set_fp8_saved(std::vector<bool>(units, true));
  const std::vector<at::Tensor> stored = grads();
  const int64_t all = step.fp8_saved_last_tensors();
  EXPECT_GE(all, static_cast<int64_t>(2 * units));  // every unit saves more than one large tensor
  double largest = 0;
  for (size_t i = 0; i < exact.size(); ++i) {
    if (exact[i].norm().item<double>() < 1e-6) continue;  // biases before a BatchNorm
    largest = std::max(largest, (stored[i] - exact[i]).norm().item<double>() / exact[i].norm().item<double>());
  }
  EXPECT_LT(largest, 0.10);  // 20 layers deep at batch 2: the E4M3 errors do not average out (5.3 % measured)
  EXPECT_GT(largest, 1e-4);
  // Unit 1 recomputed as well: its tensors are not stored (the recompute keeps only its input).
  std::vector<bool> recompute(units, false);
  recompute[1] = true;
  step.set_recompute(recompute);
  (void)grads();
  EXPECT_LT(step.fp8_saved_last_tensors(), all);
  EXPECT_GT(step.fp8_saved_last_tensors(), 0);
}

#ifdef TRIACCEL_WITH_CUDA
TEST(Fp8SavedFormatTest, TheCudaKernelsWriteTheReferencesBytesAndValues) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU";
  torch::manual_seed(7);
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (const int64_t n : {int64_t{1}, int64_t{127}, int64_t{128}, int64_t{1000}, int64_t{70001}}) {
      at::Tensor x = (torch::randn({n}) * torch::pow(10.0, torch::randint(-4, 4, {n}))).to(dtype);
      if (n > 3) {
        x[1] = std::numeric_limits<float>::quiet_NaN();
        x[2] = std::numeric_limits<float>::infinity();
        x[n - 1] = 0;
      }
      const Fp8Blocks ref = fp8_block_quantize_reference(x);
      at::Tensor back_ref = at::empty_like(x);
      fp8_block_dequantize_reference_into(ref, back_ref);
      // Aligned (the kernels' vector loads and stores, the tail one at a time) and one element off (one at a time).
      for (const bool shifted : {false, true}) {
        const at::Tensor on_gpu = shifted ? at::cat({x.slice(0, 0, 1), x}).cuda().narrow(0, 1, n) : x.cuda();
        const Fp8Blocks dev = fp8_block_quantize(on_gpu);
        EXPECT_TRUE(torch::equal(dev.data.cpu(), ref.data)) << dtype << " n " << n << " shifted " << shifted;
        EXPECT_TRUE(torch::equal(dev.scales.cpu(), ref.scales)) << dtype << " n " << n << " shifted " << shifted;
        at::Tensor back_dev = shifted ? at::empty({n + 1}, on_gpu.options()).narrow(0, 1, n) : at::empty_like(on_gpu);
        fp8_block_dequantize_into(dev, back_dev);
        EXPECT_TRUE(torch::equal(back_dev.cpu().view(-1).nan_to_num(0), back_ref.view(-1).nan_to_num(0)))
            << dtype << " n " << n << " shifted " << shifted;
      }
    }
  }
}
#else
TEST(Fp8SavedFormatTest, TheCudaKernelsWriteTheReferencesBytesAndValues) {
  GTEST_SKIP() << "built without CUDA (-DTRIACCEL_CUDA=ON)";
}
#endif

}  // namespace
}  // namespace triaccel
