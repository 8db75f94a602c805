// FP8 on the device (train/fp8_device_scale.h, train/fp8_linear.h): the device scale against the host rule Fp8Scale
// amax by amax, bit for bit; the FP8 linear layer against the products of its quantized tensors, forward and backward.
//
// Tolerances: the layer is compared with the same FP8 bytes dequantized and multiplied in float32 (the only
// difference is the order of the float32 accumulation: 1e-5 of the output's largest value), and the test also
// requires the FP8 result to be off the exact float32 product by more than that (so a layer that did not quantize
// fails) and by less than 10 % of its largest value.
#include "triaccel/models/linear.h"
#include "triaccel/models/transformer.h"
#include "triaccel/train/fp8.h"
#include "triaccel/train/fp8_device_scale.h"
#include "triaccel/train/fp8_linear.h"
#include "triaccel/train/precision.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <vector>

namespace triaccel {
namespace {

constexpr float kInfinity = std::numeric_limits<float>::infinity();

// Amaxes that walk the rule's edges: powers of two, the targets themselves, just past them, zeros (the ring fills
// with them), non-finite ones (ignored), the float range's ends, and a spread of ordinary values.
std::vector<float> scripted_amaxes() {
  std::vector<float> out = {3.f, 10.f, 0.5f, 1.f, 2.f, 1.5f, std::nanf(""), kInfinity, 0.f, 0.f, 0.f, 0.f, 0.f,
                            224.f, 448.f, std::nextafter(448.f, kInfinity), 57344.f,
                            std::nextafter(57344.f, kInfinity), 1e-38f, 1e-45f, std::numeric_limits<float>::max(),
                            -kInfinity, -3.f, 316.78f, 0.0625f};
  float v = 0.37f;
  for (int i = 0; i < 40; ++i) {
    v = std::fmod(v * 7.31f + 0.113f, 1.f);
    out.push_back(std::ldexp(0.5f + v, (i * 11) % 60 - 30));
  }
  return out;
}

void expect_device_scale_equals_host(const c10::Device& device) {
  for (const Fp8Format format : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    for (const Fp8ScaleOptions options : {Fp8ScaleOptions{4, 1.0}, Fp8ScaleOptions{3, 0.5}, Fp8ScaleOptions{16, 0}}) {
      Fp8Scale host(format, options);
      Fp8DeviceScale on_device(format, options, device);
      int step = 0;
      for (const float amax : scripted_amaxes()) {
        host.update(amax);
        on_device.update(torch::tensor(amax).to(device));
        const float got = on_device.scale().cpu().item<float>();
        ASSERT_EQ(got, host.scale()) << enum_name(format) << " history " << options.history << " margin "
                                     << options.margin << " step " << step << " amax " << amax;
        ASSERT_EQ(on_device.inverse().cpu().item<float>() * got, 1.f);
        ++step;
      }
    }
  }
}

TEST(Fp8DeviceScaleTest, EqualsTheHostRuleAmaxByAmax) { expect_device_scale_equals_host(torch::kCPU); }

TEST(Fp8DeviceScaleTest, EqualsTheHostRuleOnTheGpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  expect_device_scale_equals_host(torch::Device(torch::kCUDA, 0));
}

at::Tensor dequantized(const at::Tensor& x, float scale, Fp8Format format) {
  return fp8_dequantize(fp8_quantize(x, scale, format), scale, at::kFloat);
}

double largest(const at::Tensor& t) { return t.abs().max().item<double>(); }

struct Layer {
  torch::Tensor x, w, b;
};

Layer layer(const c10::Device& device, at::ScalarType dtype) {
  torch::manual_seed(3);
  return {(3.f * torch::randn({4, 8, 48})).to(dtype).to(device), (0.1f * torch::randn({32, 48})).to(device),
          torch::randn({32}).to(device)};
}

TEST(Fp8LinearTest, ForwardIsTheProductOfTheQuantizedTensorsUnderDelayedScales) {
  const Layer l = layer(torch::kCPU, at::kFloat);
  Fp8LinearState state(Fp8ScaleOptions{4, 0}, torch::kCPU);
  const at::Tensor exact = at::matmul(l.x, l.w.t()) + l.b;
  float x_scale = 1.f, w_scale = 1.f;  // the first call quantizes with scale 1, then records the amaxes
  for (int call = 0; call < 2; ++call) {
    const at::Tensor y = fp8_linear(l.x, l.w, l.b, state);
    ASSERT_EQ(y.sizes(), (std::vector<int64_t>{4, 8, 32}));
    const at::Tensor want =
        at::matmul(dequantized(l.x, x_scale, Fp8Format::kE4M3), dequantized(l.w, w_scale, Fp8Format::kE4M3).t()) +
        l.b;
    EXPECT_LE(largest(y - want), 1e-5 * largest(want)) << "call " << call;
    EXPECT_GT(largest(y - exact), 1e-5 * largest(exact)) << "call " << call << ": no FP8 rounding";
    EXPECT_LT(largest(y - exact), 0.1 * largest(exact)) << "call " << call;
    x_scale = fp8_scale_for_amax(static_cast<float>(largest(l.x)), Fp8Format::kE4M3, 0, x_scale);
    w_scale = fp8_scale_for_amax(static_cast<float>(largest(l.w)), Fp8Format::kE4M3, 0, w_scale);
    EXPECT_EQ(state.input.scale().item<float>(), x_scale);
    EXPECT_EQ(state.weight.scale().item<float>(), w_scale);
    EXPECT_EQ(state.grad.scale().item<float>(), 1.f);  // no backward yet
  }
  EXPECT_GT(x_scale, 1.f);  // amax ~10: the second call's scale moved
}

TEST(Fp8LinearTest, BackwardTakesE5M2GradientsAndTheSavedFp8Inputs) {
  const Layer l = layer(torch::kCPU, at::kFloat);
  Fp8LinearState state(Fp8ScaleOptions{4, 0}, torch::kCPU);
  state.grad.update(torch::tensor(0.02f));  // an earlier step's gradients: 0.02·2^21 = 41943 <= 57344 < 2·41943
  const float g_scale = state.grad.scale().item<float>();
  ASSERT_EQ(g_scale, std::ldexp(1.f, 21));
  const at::Tensor x = l.x.clone().requires_grad_(true);
  const at::Tensor w = l.w.clone().requires_grad_(true);
  const at::Tensor b = l.b.clone().requires_grad_(true);
  fp8_linear(x, w, b, state);  // the first call sets the input and weight scales the second quantizes with
  const float x_scale = state.input.scale().item<float>(), w_scale = state.weight.scale().item<float>();
  const at::Tensor y = fp8_linear(x, w, b, state);
  torch::manual_seed(5);
  const at::Tensor g = 0.01f * torch::randn({4, 8, 32});  // amax ~0.035: past the earlier 0.02 (a few saturate)
  y.backward(g);
  const at::Tensor gd = dequantized(g.reshape({32, 32}), g_scale, Fp8Format::kE5M2);
  const at::Tensor xd = dequantized(l.x.reshape({32, 48}), x_scale, Fp8Format::kE4M3);
  const at::Tensor wd = dequantized(l.w, w_scale, Fp8Format::kE4M3);
  const at::Tensor dx_want = at::matmul(gd, wd).reshape({4, 8, 48});
  const at::Tensor dw_want = at::matmul(gd.t(), xd);
  EXPECT_LE(largest(x.grad() - dx_want), 1e-5 * largest(dx_want));
  EXPECT_LE(largest(w.grad() - dw_want), 1e-5 * largest(dw_want));
  EXPECT_LE(largest(b.grad() - g.reshape({32, 32}).sum(0)), 1e-6);
  // The gradients went through FP8: off the exact products, and not by E4M3's rounding (a finer grid than E5M2's).
  const at::Tensor dx_exact = at::matmul(g, l.w);
  EXPECT_GT(largest(x.grad() - dx_exact), 1e-5 * largest(dx_exact));
  const float e4m3_scale = fp8_scale_for_amax(static_cast<float>(largest(g)), Fp8Format::kE4M3, 0, 1.f);
  const at::Tensor dx_e4m3 = at::matmul(dequantized(g.reshape({32, 32}), e4m3_scale, Fp8Format::kE4M3), wd);
  EXPECT_GT(largest(x.grad().reshape({32, 48}) - dx_e4m3), 1e-5 * largest(dx_e4m3));
  // The gradient's amax is recorded after its use: the next backward's scale is the history's (0.02 and it).
  ASSERT_GT(largest(g), 0.02);
  EXPECT_EQ(state.grad.scale().item<float>(),
            fp8_scale_for_amax(static_cast<float>(largest(g)), Fp8Format::kE5M2, 0, g_scale));
  EXPECT_LT(state.grad.scale().item<float>(), g_scale);
}

TEST(Fp8LinearTest, AppliesOnlyToLinearShapes) {
  const Layer l = layer(torch::kCPU, at::kFloat);
  EXPECT_TRUE(fp8_linear_applies(l.x, l.w));
  EXPECT_FALSE(fp8_linear_applies(l.x.narrow(2, 0, 40), l.w));         // K differs
  EXPECT_FALSE(fp8_linear_applies(l.x.to(at::kLong), l.w));            // not floating
  EXPECT_FALSE(fp8_linear_applies(l.x, l.w.reshape({32, 48, 1})));     // not a matrix
  Fp8LinearState state(Fp8ScaleOptions{4, 0}, torch::kCPU);
  EXPECT_THROW(fp8_linear(l.x.narrow(2, 0, 40), l.w, l.b, state), c10::Error);
}

TEST(Fp8LinearsTest, TakeOverATransformerBlocksLinearsWithinTheirScope) {
  torch::manual_seed(0);
  TransformerBlock block(32, 2, 64, AttentionMask::kCausal, 1e-5);
  const at::Tensor x = torch::randn({2, 16, 32});
  const at::Tensor plain = block->forward(x);
  Fp8Linears fp8(Fp8ScaleOptions{4, 0});
  at::Tensor y;
  for (int call = 0; call < 2; ++call) {
    const LinearOverrideScope scope(&fp8);
    y = block->forward(x);
  }
  ASSERT_EQ(fp8.layers(), 4u);  // qkv, proj, fc1, fc2: the same four states at the second call
  for (const torch::nn::LinearImpl* layer : {block->attn->qkv.get(), block->attn->proj.get(), block->mlp->fc1.get(),
                                             block->mlp->fc2.get()}) {
    const Fp8LinearState* state = fp8.state_of(*layer);
    ASSERT_NE(state, nullptr);
    EXPECT_GT(state->input.scale().item<float>(), 1.f);  // the first call's amaxes were recorded
  }
  EXPECT_GT(largest(y - plain), 1e-5 * largest(plain));  // through FP8
  EXPECT_LT(largest(y - plain), 0.1 * largest(plain));
  EXPECT_TRUE(torch::equal(block->forward(x), plain));    // outside the scope: the block's own linears
  y.sum().backward();
  const at::Tensor g = block->mlp->fc1->weight.grad();
  ASSERT_TRUE(g.defined());
  EXPECT_TRUE(torch::isfinite(g).all().item<bool>());
  EXPECT_GT(largest(g), 0.0);
}

TEST(Fp8LinearsTest, UnderAutocastGiveAutocastsDtype) {
  torch::manual_seed(1);
  torch::nn::Linear layer(32, 16);
  const at::Tensor x = torch::randn({16, 32});  // float32, as a LayerNorm's output under autocast
  Fp8Linears fp8(Fp8ScaleOptions{4, 0});
  const AutocastScope autocast(torch::kCPU, PrecisionMode::kAmpBF16);
  const LinearOverrideScope scope(&fp8);
  EXPECT_EQ(linear_forward(*layer, x).scalar_type(), at::kBFloat16);
  EXPECT_EQ(fp8.layers(), 1u);
}

// The GPU's _scaled_mm against the CPU's on the same bytes (bf16 activations, as a unit under autocast has them).
TEST(Fp8LinearCudaTest, EqualsTheCpuLayer) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const torch::Device gpu(torch::kCUDA, 0);
  const Layer on_cpu = layer(torch::kCPU, at::kBFloat16);
  const Layer on_gpu{on_cpu.x.to(gpu), on_cpu.w.to(gpu), on_cpu.b.to(gpu)};
  EXPECT_FALSE(fp8_linear_applies(on_gpu.x.narrow(2, 0, 40), on_gpu.w.narrow(1, 0, 40)));  // K = 40: not 16·n
  Fp8LinearState cpu_state(Fp8ScaleOptions{4, 0}, torch::kCPU), gpu_state(Fp8ScaleOptions{4, 0}, gpu);
  for (int call = 0; call < 2; ++call) {
    const at::Tensor a = fp8_linear(on_cpu.x, on_cpu.w, on_cpu.b, cpu_state).to(at::kFloat);
    const at::Tensor b = fp8_linear(on_gpu.x, on_gpu.w, on_gpu.b, gpu_state).cpu().to(at::kFloat);
    EXPECT_LE(largest(a - b), 1.0 / 128 * largest(a)) << "call " << call;  // bf16 outputs: 2^-8 each, rounded twice
    EXPECT_EQ(cpu_state.input.scale().item<float>(), gpu_state.input.scale().cpu().item<float>());
  }
}

}  // namespace
}  // namespace triaccel
