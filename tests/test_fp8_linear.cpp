// FP8 on the device (train/fp8_device_scale.h, train/fp8_linear.h): the device scale against the host rule Fp8Scale
// amax by amax, bit for bit; the FP8 linear layer against the products of its quantized tensors, forward and backward.
//
// Tolerances: the layer is compared with the same FP8 bytes dequantized and multiplied in float32 (the only
// difference is the order of the float32 accumulation: 1e-5 of the output's largest value), and the test also
// requires the FP8 result to be off the exact float32 product by more than that (so a layer that did not quantize
// fails) and by less than 10 % of its largest value.
#include "test_util.h"
#include "triaccel/control/memory/memory_model.h"

#include "triaccel/core/errors.h"
#include "triaccel/models/linear.h"
#include "triaccel/models/model.h"
#include "triaccel/models/registry.h"
#include "triaccel/models/transformer.h"
#include "triaccel/optim/sgd.h"
#include "triaccel/train/fp8.h"
#include "triaccel/train/fp8_device_scale.h"
#include "triaccel/train/fp8_linear.h"
#include "triaccel/train/loss_scaler.h"
#include "triaccel/train/precision.h"
#include "triaccel/train/step.h"

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

// quantize(): the bytes of the reference under the scale before the call, the inverse of that scale, and then the
// tensor's amax recorded (delayed scaling), call after call: odd sizes (a tail after the 16-byte loads), an input that
// starts one element past an aligned address (the one-by-one kernel), each input dtype, a NaN (its byte 0x7f, its
// amax not recorded) and an empty tensor.
void expect_quantize_is_delayed(const c10::Device& device) {
  torch::manual_seed(2);
  std::vector<at::Tensor> inputs;
  for (int call = 0; call < 4; ++call) inputs.push_back(std::ldexp(1.f, 3 * call - 4) * torch::randn({37, 19}));
  inputs.push_back(torch::randn({1 + 64 * 9}).narrow(0, 1, 64 * 9));
  inputs.push_back((40.f * torch::randn({3, 40})).to(at::kBFloat16));
  inputs.push_back(torch::randn({128}).to(at::kHalf));
  at::Tensor with_nan = torch::randn({50});
  with_nan[7] = std::nanf("");
  inputs.push_back(with_nan);
  inputs.push_back(torch::zeros({0}));
  for (const Fp8Format format : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    Fp8DeviceScale scale(format, Fp8ScaleOptions{3, 0}, device);
    Fp8Scale host(format, Fp8ScaleOptions{3, 0});
    for (size_t i = 0; i < inputs.size(); ++i) {
      const at::Tensor& x = inputs[i];
      const float before = host.scale();
      const Fp8ScaledTensor q = scale.quantize(x.to(device));
      ASSERT_EQ(q.data.scalar_type(), fp8_dtype(format));
      EXPECT_TRUE(torch::equal(q.data.cpu().view(at::kByte), fp8_quantize(x, before, format).view(at::kByte)))
          << enum_name(format) << " input " << i;
      EXPECT_EQ(q.inverse.cpu().item<float>(), 1.f / before) << enum_name(format) << " input " << i;
      host.update(x.numel() == 0 ? 0.f : x.abs().max().to(at::kFloat).item<float>());
      EXPECT_EQ(scale.scale().cpu().item<float>(), host.scale()) << enum_name(format) << " input " << i;
    }
    EXPECT_NE(host.scale(), 1.f);
  }
}

TEST(Fp8DeviceScaleTest, QuantizesUnderTheScaleBeforeItsOwnAmax) { expect_quantize_is_delayed(torch::kCPU); }

TEST(Fp8DeviceScaleTest, QuantizesUnderTheScaleBeforeItsOwnAmaxOnTheGpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  expect_quantize_is_delayed(torch::Device(torch::kCUDA, 0));
}

// quantize_transposed(): the bytes of quantize() and their transpose, the scale moving as quantize()'s does: matrices
// that fill whole 64 x 64 tiles, part of one (80 x 48, multiples of 16: the 16-byte path), and odd sizes (the one by
// one path), in each input dtype.
void expect_quantize_transposed_equals_quantize(const c10::Device& device) {
  torch::manual_seed(8);
  std::vector<at::Tensor> inputs = {torch::randn({128, 64}), 5.f * torch::randn({80, 48}), torch::randn({37, 19}),
                                    (0.01f * torch::randn({64, 192})).to(at::kBFloat16),
                                    torch::randn({16, 144}).to(at::kHalf), torch::randn({3, 1})};
  for (const Fp8Format format : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    Fp8DeviceScale plain(format, Fp8ScaleOptions{4, 0}, torch::kCPU);
    Fp8DeviceScale transposed(format, Fp8ScaleOptions{4, 0}, device);
    for (size_t i = 0; i < inputs.size(); ++i) {
      const Fp8ScaledTensor want = plain.quantize(inputs[i]);
      const Fp8ScaledTensor got = transposed.quantize_transposed(inputs[i].to(device));
      const at::Tensor bytes = want.data.view(at::kByte);
      EXPECT_TRUE(torch::equal(got.data.cpu().view(at::kByte), bytes)) << enum_name(format) << " input " << i;
      ASSERT_EQ(got.data_t.sizes(), (std::vector<int64_t>{inputs[i].size(1), inputs[i].size(0)}));
      EXPECT_TRUE(got.data_t.is_contiguous());
      EXPECT_TRUE(torch::equal(got.data_t.cpu().view(at::kByte), bytes.t())) << enum_name(format) << " input " << i;
      EXPECT_EQ(got.inverse.cpu().item<float>(), want.inverse.item<float>()) << enum_name(format) << " input " << i;
      EXPECT_EQ(transposed.scale().cpu().item<float>(), plain.scale().item<float>()) << enum_name(format);
    }
  }
}

TEST(Fp8DeviceScaleTest, QuantizesAMatrixAndItsTranspose) {
  expect_quantize_transposed_equals_quantize(torch::kCPU);
}

TEST(Fp8DeviceScaleTest, QuantizesAMatrixAndItsTransposeOnTheGpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  expect_quantize_transposed_equals_quantize(torch::Device(torch::kCUDA, 0));
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
    const Fp8LinearState* state = fp8.state_of(layer->weight);
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

// A checkpoint's FP8 state: a second Fp8Linears restored from the first's state() computes the next forward bit for
// bit as the first does, where a fresh one (scales at 1) does not; an entry no layer has is refused by name.
TEST(Fp8LinearsTest, RestoreTheirScalesFromState) {
  torch::manual_seed(9);
  TransformerBlock block(32, 2, 64, AttentionMask::kCausal, 1e-5);
  const at::Tensor x = torch::randn({2, 16, 32});
  Fp8Linears first(Fp8ScaleOptions{4, 0});
  first.layers_name(*block);
  for (int call = 0; call < 3; ++call) {
    const LinearOverrideScope scope(&first);
    block->forward(x).sum().backward();
  }
  NamedTensors saved;
  for (const auto& [name, t] : first.state()) saved.emplace_back(name, t.clone());
  ASSERT_EQ(saved.size(), 4u * 3u * 3u);  // four layers, three scales each, three tensors a scale
  EXPECT_EQ(saved.front().first, "fp8.attn.qkv.input.ring");
  Fp8Linears restored(Fp8ScaleOptions{4, 0}), fresh(Fp8ScaleOptions{4, 0});
  restored.layers_name(*block);
  restored.restore(saved, "ckpt.pt");
  EXPECT_EQ(restored.layers(), 4u);
  at::Tensor want, got, unrestored;
  {
    const LinearOverrideScope scope(&first);
    want = block->forward(x);
  }
  {
    const LinearOverrideScope scope(&restored);
    got = block->forward(x);
  }
  {
    const LinearOverrideScope scope(&fresh);
    unrestored = block->forward(x);
  }
  EXPECT_TRUE(torch::equal(got, want));
  EXPECT_FALSE(torch::equal(unrestored, want));
  NamedTensors foreign = saved;
  foreign.emplace_back("fp8.blocks.9.mlp.fc1.input.scale", torch::ones({}));
  Fp8Linears other(Fp8ScaleOptions{4, 0});
  other.layers_name(*block);
  try {
    other.restore(foreign, "ckpt.pt");
    FAIL() << "a scale of a layer the model lacks was taken";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("ckpt.pt holds fp8 scales of 1 tensors no linear layer"), std::string::npos)
        << e.what();
  }
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
  torch::manual_seed(4);
  const at::Tensor g = 0.01f * torch::randn({4, 8, 32});
  for (int call = 0; call < 3; ++call) {
    std::vector<at::Tensor> cpu_in, gpu_in;
    for (const at::Tensor& t : {on_cpu.x, on_cpu.w, on_cpu.b}) cpu_in.push_back(t.clone().requires_grad_(true));
    for (const at::Tensor& t : {on_gpu.x, on_gpu.w, on_gpu.b}) gpu_in.push_back(t.clone().requires_grad_(true));
    const at::Tensor ya = fp8_linear(cpu_in[0], cpu_in[1], cpu_in[2], cpu_state);
    const at::Tensor yb = fp8_linear(gpu_in[0], gpu_in[1], gpu_in[2], gpu_state);
    const at::Tensor a = ya.to(at::kFloat), b = yb.cpu().to(at::kFloat);
    EXPECT_LE(largest(a - b), 1.0 / 128 * largest(a)) << "call " << call;  // bf16 outputs: 2^-8 each, rounded twice
    ya.backward(g.to(ya.scalar_type()));
    yb.backward(g.to(yb.scalar_type()).to(gpu));
    for (size_t i = 0; i < cpu_in.size(); ++i) {
      const at::Tensor ga = cpu_in[i].grad().to(at::kFloat), gb = gpu_in[i].grad().cpu().to(at::kFloat);
      EXPECT_LE(largest(ga - gb), 1.0 / 64 * largest(ga)) << "call " << call << " gradient " << i;
    }
    for (const auto& [c, d] : {std::pair{&cpu_state.input, &gpu_state.input}, std::pair{&cpu_state.weight,
                               &gpu_state.weight}, std::pair{&cpu_state.grad, &gpu_state.grad}}) {
      EXPECT_EQ(c->scale().item<float>(), d->scale().cpu().item<float>()) << "call " << call;
    }
  }
  EXPECT_NE(gpu_state.grad.scale().cpu().item<float>(), 1.f);  // the gradients' amaxes were recorded
}

// A tiny GPT (one block of test::gpt_tiny_options, vocabulary 16) and its training step in the given precision
// mode, on `device`.
struct TinyGptStep {
  std::shared_ptr<Model> model;
  std::unique_ptr<Sgd> sgd;
  std::unique_ptr<LossScaler> scaler;
  std::unique_ptr<TrainStep> step;
};

TinyGptStep tiny_gpt_step(PrecisionMode precision, const c10::Device& device) {
  torch::manual_seed(6);
  ModelOptions mo = test::gpt_tiny_options();
  mo.num_classes = 16;  // the head 32 -> 16
  mo.gpt_layers = 1;
  TinyGptStep t;
  t.model = model_create(mo);
  t.model->to(device);
  t.model->train();
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (const auto& item : t.model->named_parameters()) named.emplace_back(item.key(), item.value());
  t.sgd = std::make_unique<Sgd>(named, SgdOptions{});
  t.scaler = std::make_unique<LossScaler>(LossScalerOptions{}, device);
  StepOptions so;
  so.precision = precision;
  so.cuda_graphs = false;
  t.step = std::make_unique<TrainStep>(*t.model, *t.sgd, *t.scaler, so, device);
  return t;
}

// amp-fp8: the step's forward runs the GPT's linear layers in FP8 (qkv, proj, fc1, fc2 and the 32 -> 16 head), also
// in a recomputed unit's second forward in backward (autograd's thread), and trains: the loss falls as amp-bf16's.
TEST(Fp8StepTest, AmpFp8RunsTheLinearLayersInFp8AndTrains) {
  const c10::Device cpu(c10::kCPU);
  torch::manual_seed(7);
  const at::Tensor tokens = torch::randint(0, 16, {4, 16}, torch::kLong);
  const at::Tensor targets = torch::roll(tokens, 1, 1);
  for (const bool recompute : {false, true}) {
    TinyGptStep fp8 = tiny_gpt_step(PrecisionMode::kAmpFP8, cpu);
    TinyGptStep bf16 = tiny_gpt_step(PrecisionMode::kAmpBF16, cpu);
    if (recompute) {
      std::vector<bool> flags(fp8.model->units().size(), false);
      flags[1] = true;  // blocks.0
      fp8.step->set_recompute(flags);
    }
    double first = 0, last = 0;
    for (int s = 0; s < 8; ++s) {
      fp8.step->run(tokens, targets, 0.05);
      bf16.step->run(tokens, targets, 0.05);
      (s == 0 ? first : last) = fp8.step->last_loss().item<double>();
    }
    EXPECT_EQ(fp8.step->fp8_layers(), 5u) << "recompute " << recompute;
    EXPECT_EQ(bf16.step->fp8_layers(), 0u);
    EXPECT_LT(last, first - 0.5) << "recompute " << recompute;
    EXPECT_NEAR(last, bf16.step->last_loss().item<double>(), 0.25) << "recompute " << recompute;
    // Through FP8: the weights after the same steps differ from amp-bf16's.
    const at::Tensor w8 = fp8.model->named_parameters()["blocks.0.mlp.fc1.weight"];
    const at::Tensor w16 = bf16.model->named_parameters()["blocks.0.mlp.fc1.weight"];
    EXPECT_GT(largest(w8 - w16), 1e-4);
  }
}

// Tri-Accel under amp-fp8: only the units at fp8 compute their linear layers in FP8, in the step's forward and in a
// recomputed unit's backward. The GPT's units: embed, blocks.0 (qkv, proj, fc1, fc2), head (one linear).
TEST(Fp8StepTest, UnitPrecisionsPutOnlyTheFp8UnitsLinearLayersInFp8) {
  const c10::Device cpu(c10::kCPU);
  torch::manual_seed(8);
  const at::Tensor tokens = torch::randint(0, 16, {4, 16}, torch::kLong);
  const at::Tensor targets = torch::roll(tokens, 1, 1);
  const Precision b = Precision::kBF16, f = Precision::kFP8;
  struct Case {
    std::vector<Precision> precisions;
    bool recompute;
    size_t fp8_layers;
  };
  for (const Case& c : {Case{{b, b, b}, false, 0}, Case{{b, f, b}, false, 4}, Case{{b, b, f}, false, 1},
                        Case{{b, f, b}, true, 4}, Case{{f, f, f}, false, 5}}) {
    TinyGptStep fp8 = tiny_gpt_step(PrecisionMode::kAmpFP8, cpu);
    ASSERT_EQ(fp8.model->units().size(), 3u);
    fp8.step->set_unit_precisions(c.precisions);
    if (c.recompute) fp8.step->set_recompute({false, true, false});
    TinyGptStep bf16 = tiny_gpt_step(PrecisionMode::kAmpBF16, cpu);
    bf16.step->set_unit_precisions({b, b, b});  // the same per-unit forward (each unit's input cast to its dtype)
    for (int s = 0; s < 2; ++s) {
      fp8.step->run(tokens, targets, 0.05);
      bf16.step->run(tokens, targets, 0.05);
    }
    EXPECT_EQ(fp8.step->fp8_layers(), c.fp8_layers) << "fp8 layers, recompute " << c.recompute;
    // Through FP8 or not: blocks.0's weights equal amp-bf16's exactly when that unit is not at fp8.
    const std::string w = "blocks.0.mlp.fc1.weight";
    const double diff = largest(fp8.model->named_parameters()[w] - bf16.model->named_parameters()[w]);
    if (c.precisions[1] == f) {
      EXPECT_GT(diff, 1e-4);
    } else if (c.precisions[2] == b) {
      EXPECT_EQ(diff, 0.0);  // no unit in FP8: the same step as amp-bf16's, bit for bit
    }
  }
}

// The memory model traces a unit at fp8 with its linear layers in FP8, as the step runs it (an FP8 layer keeps its
// input for backward in FP8, a 16-bit one a 16-bit copy): blocks.0 at fp8 is priced below blocks.0 at bf16 in the same
// amp-fp8 run. A GPT whose tokens per sample are no multiple of 16 (FP8 would apply at some batches only) is priced at
// 16 bits.
TEST(Fp8StepTest, TheMemoryModelPricesAUnitAtFp8InFp8) {
  const Precision b = Precision::kBF16, f = Precision::kFP8;
  const auto blocks0_saved = [](int64_t tokens, const std::vector<Precision>& precisions) {
    torch::manual_seed(6);
    ModelOptions mo = test::gpt_tiny_options();
    mo.num_classes = 16;
    mo.gpt_layers = 1;
    mo.block_size = tokens;
    const std::shared_ptr<Model> model = model_create(mo);
    MemoryModelInputs in;
    in.precision = PrecisionMode::kAmpFP8;
    in.unit_precisions = precisions;
    const MemoryModel m = memory_model_build(*model, torch::zeros({tokens}, torch::kLong), in, torch::kCPU);
    return m.units.at(1).saved_bytes;
  };
  const double at_bf16 = blocks0_saved(16, {b, b, b}), at_fp8 = blocks0_saved(16, {b, f, b});
  EXPECT_LT(at_fp8, 0.9 * at_bf16) << at_fp8 << " against " << at_bf16;
  EXPECT_DOUBLE_EQ(blocks0_saved(15, {b, f, b}), blocks0_saved(15, {b, b, b}));
}

}  // namespace
}  // namespace triaccel
