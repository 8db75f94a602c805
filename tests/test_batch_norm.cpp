// BatchNorm: the fused CUDA kernel (kernels/batch_norm.cu) against its spec, ATen's batch_norm in float64 on the
// same bf16 or fp16 values, and the dispatch (models/batch_norm.h) that chooses between it and BatchNorm2d::forward.
//
// Tolerances, kernel vs float64 reference (statistics are float32 in the kernel; 16-bit outputs are rounded once):
//  - y, dx: |got − ref| ≤ 2·u·|ref| + 1e-3·max|ref| (bf16) or + 1e-4·max|ref| (fp16), u the unit roundoff (bf16
//    2⁻⁹, fp16 2⁻¹¹). One round-to-nearest is ≤ u relative; float32 error in mean / invstd / the dx coefficients is
//    ~1e-6 of the terms. fp16 outputs rounded as bf16 would be off by up to 2⁻⁹, outside the fp16 bound. A wrong formula, a missing ReLU or a
//    missing ReLU mask in the backward is off by O(max|ref|) on many elements.
//  - dweight, dbias (float32 sums over M = N·H·W terms): |got − ref| ≤ 1e-4·Σ|terms| + 1e-6 (Σ|g·x̂|, Σ|g|).
//  - running_mean / running_var: |got − ref| ≤ 1e-5·|ref| + 1e-6. At M = 16 (shape 16×24×1×1) the biased and
//    unbiased variances differ by 1/15, i.e. momentum·var/15 ≈ 1e-2·var in running_var: far outside it; a swapped
//    momentum (0.9 instead of 0.1) is off by ~80 % of the update.
// The ReLU reference backward masks dy by the kernel's own y > 0: elements with y within rounding of 0 would
// otherwise be decided differently by a float64 reference, and the kernel's contract is exactly y > 0.
#include "test_util.h"
#include "triaccel/models/batch_norm.h"
#include "triaccel/models/model.h"

#ifdef TRIACCEL_WITH_CUDA
#include "triaccel/kernels/batch_norm.h"

#include <ATen/autocast_mode.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <iostream>
#include <string>
#include <vector>

namespace triaccel {
namespace {

constexpr double kMomentum = 0.1;
constexpr double kEps = 1e-5;

// Restores the process-wide kernel switch when a test ends (tests flip it).
class KernelSwitchScope {
 public:
  explicit KernelSwitchScope(bool enabled) : previous_(batch_norm_kernel_enabled()) {
    batch_norm_kernel_set_enabled(enabled);
  }
  ~KernelSwitchScope() { batch_norm_kernel_set_enabled(previous_); }

 private:
  bool previous_;
};

torch::nn::BatchNorm2d bn_make(int64_t channels) {
  torch::nn::BatchNorm2d bn(torch::nn::BatchNorm2dOptions(channels).eps(kEps).momentum(kMomentum));
  torch::NoGradGuard no_grad;
  bn->weight.copy_(1 + 0.5 * torch::randn({channels}));
  bn->bias.copy_(torch::randn({channels}));
  bn->running_mean.copy_(0.1 * torch::randn({channels}));
  bn->running_var.copy_(0.5 + torch::rand({channels}));
  return bn;
}

// A second module with bn's parameters and buffers (deep copies).
torch::nn::BatchNorm2d bn_clone(const torch::nn::BatchNorm2d& bn) {
  return std::dynamic_pointer_cast<torch::nn::BatchNorm2dImpl>(bn->clone());
}

int64_t batches_tracked(const torch::nn::BatchNorm2d& bn) { return bn->num_batches_tracked.item<int64_t>(); }

TEST(BatchNormDispatchTest, SwitchDefaultsOnAndToggles) {
  EXPECT_TRUE(batch_norm_kernel_enabled());
  {
    const KernelSwitchScope off(false);
    EXPECT_FALSE(batch_norm_kernel_enabled());
  }
  EXPECT_TRUE(batch_norm_kernel_enabled());
}

// On the CPU the module runs: same output, running stats and counter as BatchNorm2d (+ relu), for fp32 and bf16.
TEST(BatchNormDispatchTest, CpuFallsBackToModuleAndCountsBatches) {
  torch::manual_seed(0);
  for (const bool relu : {false, true}) {
    auto bn = bn_make(6);
    auto reference = bn_clone(bn);
    const at::Tensor x = (2 + 3 * torch::randn({4, 6, 5, 5})).contiguous(at::MemoryFormat::ChannelsLast);
    EXPECT_FALSE(batch_norm_kernel_applies(*bn, x));
    const at::Tensor y = batch_norm_forward(bn, x, relu);
    const at::Tensor y_ref = relu ? torch::relu(reference->forward(x)) : reference->forward(x);
    EXPECT_TRUE(torch::equal(y, y_ref)) << "relu " << relu;
    EXPECT_TRUE(torch::equal(bn->running_mean, reference->running_mean));
    EXPECT_TRUE(torch::equal(bn->running_var, reference->running_var));
    EXPECT_EQ(batches_tracked(bn), 1);
    if (relu) {
      EXPECT_EQ(y.min().item<float>(), 0.f);  // the ReLU was applied
    } else {
      EXPECT_LT(y.min().item<float>(), 0.f);
    }

    batch_norm_forward(bn, x.to(at::kBFloat16), relu);  // bf16 on the CPU: still the module
    EXPECT_EQ(batches_tracked(bn), 2);
  }
}

// The block end on the CPU (no kernel): relu(bn(x) + residual) exactly as the module composition computes it, the
// batch counted once. A version that dropped the residual or the ReLU differs on most elements.
TEST(BatchNormDispatchTest, AddReluOnCpuIsTheComposition) {
  torch::manual_seed(2);
  auto bn = bn_make(6);
  auto reference = bn_clone(bn);
  const at::Tensor x = (2 + 3 * torch::randn({4, 6, 5, 5})).contiguous(at::MemoryFormat::ChannelsLast);
  const at::Tensor residual = torch::randn({4, 6, 5, 5}).contiguous(at::MemoryFormat::ChannelsLast);
  const at::Tensor y = batch_norm_add_relu(bn, x, residual);
  EXPECT_TRUE(torch::equal(y, torch::relu(reference->forward(x) + residual)));
  EXPECT_GT((y == 0).sum().item<int64_t>(), y.numel() / 10);
  EXPECT_TRUE(torch::equal(bn->running_mean, reference->running_mean));
  EXPECT_EQ(batches_tracked(bn), 1);
}

// Eval mode uses the running stats and leaves every buffer alone, as BatchNorm2d does.
TEST(BatchNormDispatchTest, EvalUsesRunningStatsAndCountsNothing) {
  torch::manual_seed(1);
  auto bn = bn_make(3);
  bn->eval();
  const at::Tensor running_var = bn->running_var.clone();
  const at::Tensor x = torch::randn({2, 3, 4, 4});
  const at::Tensor y = batch_norm_forward(bn, x, /*relu=*/false);
  const at::Tensor expected = (x - bn->running_mean.view({1, 3, 1, 1})) /
                                  torch::sqrt(bn->running_var.view({1, 3, 1, 1}) + kEps) *
                                  bn->weight.view({1, 3, 1, 1}) +
                              bn->bias.view({1, 3, 1, 1});
  EXPECT_TRUE(torch::allclose(y, expected, 1e-5, 1e-6));
  EXPECT_TRUE(torch::equal(bn->running_var, running_var));
  EXPECT_EQ(batches_tracked(bn), 0);
}

// Synchronized BatchNorm (--sync-bn) over one rank — its sum the identity, its gradient weight 1 — is BatchNorm2d:
// the same output, input and parameter gradients, running statistics and count (fp32 on the CPU; on a GPU also bf16
// channels_last input against the module in fp32). It sums 2C + 1 numbers per forward and 2C per backward; outside
// its scope the module runs again.
TEST(BatchNormSyncTest, OneRankIsBatchNorm2d) {
  std::vector<std::pair<at::Device, at::ScalarType>> cases = {{at::kCPU, at::kFloat}};
  if (torch::cuda::is_available()) cases.push_back({at::Device(at::kCUDA, 0), at::kBFloat16});
  for (const auto& [device, dtype] : cases) {
    torch::manual_seed(3);
    auto bn = bn_make(5);
    auto reference = bn_clone(bn);
    bn->to(device);
    reference->to(device);
    const at::Tensor x0 = (1 + 2 * torch::randn({6, 5, 4, 4})).to(device);
    const at::Tensor x = x0.to(dtype).contiguous(at::MemoryFormat::ChannelsLast).requires_grad_(true);
    const at::Tensor x_ref = x0.to(dtype).to(at::kFloat).requires_grad_(true);
    const at::Tensor dy = torch::randn({6, 5, 4, 4}).to(device);
    std::vector<int64_t> summed;
    BatchNormSync sync;
    sync.sum = [&](at::Tensor& t) { summed.push_back(t.numel()); };
    at::Tensor y;
    {
      const BatchNormSyncScope scope(sync);
      y = batch_norm_forward(bn, x, /*relu=*/true);
      (y.to(at::kFloat) * dy).sum().backward();
    }
    const at::Tensor y_ref = torch::relu(reference->forward(x_ref));
    (y_ref * dy).sum().backward();
    const double tol = dtype == at::kFloat ? 1e-5 : 3e-2;  // bf16: the output is rounded to 8 bits of mantissa
    EXPECT_EQ(y.scalar_type(), dtype);
    EXPECT_TRUE(torch::allclose(y.to(at::kFloat), y_ref, tol, tol)) << device;
    EXPECT_TRUE(torch::allclose(x.grad().to(at::kFloat), x_ref.grad(), tol, tol)) << device;
    // bf16: the gradient reaching the bf16 output is rounded to bf16 too (the reference's stays fp32).
    const double ptol = dtype == at::kFloat ? 1e-4 : 3e-2;
    EXPECT_TRUE(torch::allclose(bn->weight.grad(), reference->weight.grad(), ptol, ptol))
        << device << " " << (bn->weight.grad() - reference->weight.grad()).abs().max().item<double>();
    EXPECT_TRUE(torch::allclose(bn->bias.grad(), reference->bias.grad(), ptol, ptol))
        << device << " " << (bn->bias.grad() - reference->bias.grad()).abs().max().item<double>();
    EXPECT_TRUE(torch::allclose(bn->running_mean, reference->running_mean, 1e-5, 1e-6)) << device;
    EXPECT_TRUE(torch::allclose(bn->running_var, reference->running_var, 1e-5, 1e-6)) << device;
    EXPECT_EQ(batches_tracked(bn), 1);
    EXPECT_EQ(summed, (std::vector<int64_t>{11, 10}));
    batch_norm_forward(bn, x.detach(), /*relu=*/false);  // no scope: the module (or the kernel), no sums
    EXPECT_EQ(summed.size(), 2u);
    EXPECT_EQ(batches_tracked(bn), 2);
  }
}

// Every BatchNorm of the CNNs goes through the dispatch: one training forward counts one batch in each.
TEST(BatchNormModelTest, TrainingForwardCountsOneBatchInEveryBatchNorm) {
  torch::manual_seed(2);
  for (const std::string name : {"resnet18", "small-cnn", "efficientnet-b0"}) {
    ModelOptions options;
    options.name = name;
    auto model = model_create(options);
    model->train();
    model->forward(torch::randn({2, 3, 32, 32}));
    int bns = 0;
    for (const auto& module : model->modules(/*include_self=*/false)) {
      if (auto* bn = module->as<torch::nn::BatchNorm2dImpl>()) {
        ++bns;
        EXPECT_EQ(bn->num_batches_tracked.item<int64_t>(), 1) << name;
      }
    }
    EXPECT_GT(bns, 0) << name;
  }
}

#ifdef TRIACCEL_WITH_CUDA

const auto kCuda = torch::TensorOptions().device(torch::kCUDA);

struct BnCase {
  at::Tensor x;       // (N, C, H, W) bf16 or fp16 channels_last, CUDA
  at::Tensor dy;      // same
  at::Tensor weight;  // (C) float32
  at::Tensor bias;
  at::Tensor running_mean;
  at::Tensor running_var;
};

// x has mean 3 and std 2 per element (|mean| > std exercises the variance's centering).
BnCase case_make(std::vector<int64_t> shape, at::ScalarType dtype = at::kBFloat16) {
  const int64_t c = shape[1];
  BnCase k;
  k.x = (3 + 2 * torch::randn(shape, kCuda)).to(dtype).contiguous(at::MemoryFormat::ChannelsLast);
  k.dy = torch::randn(shape, kCuda).to(dtype).contiguous(at::MemoryFormat::ChannelsLast);
  k.weight = 1 + 0.5 * torch::randn({c}, kCuda);
  k.bias = torch::randn({c}, kCuda);
  k.running_mean = 0.1 * torch::randn({c}, kCuda);
  k.running_var = 0.5 + torch::rand({c}, kCuda);
  return k;
}

struct BnResult {
  at::Tensor y, dx, dweight, dbias, running_mean, running_var;
};

// Runs the kernels on fresh copies of the running stats.
BnResult kernel_run(const BnCase& k, const at::Tensor& x, bool relu) {
  BnResult r;
  r.running_mean = k.running_mean.clone();
  r.running_var = k.running_var.clone();
  auto [y, stats] =
      batch_norm_forward_cuda(x, k.weight, k.bias, r.running_mean, r.running_var, kMomentum, kEps, relu);
  auto [dx, dweight, dbias] = batch_norm_backward_cuda(k.dy, x, k.weight, stats, relu);
  r.y = y;
  r.dx = dx;
  r.dweight = dweight;
  r.dbias = dbias;
  return r;
}

void expect_close(const at::Tensor& got, const at::Tensor& ref, const at::Tensor& tol, const std::string& what) {
  const at::Tensor err = (got.to(at::kDouble) - ref).abs();
  const at::Tensor excess = err - tol;
  const int64_t bad = (excess > 0).sum().item<int64_t>();
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << ref.numel() << " outside tolerance, worst excess "
                    << excess.max().item<double>() << ", max |err| " << err.max().item<double>();
  EXPECT_TRUE(at::isfinite(got).all().item<bool>()) << what;
}

// Compares r (the kernel's results for case k, input x) with ATen's batch_norm in float64.
void expect_matches_reference(const BnCase& k, const at::Tensor& x, bool relu, const BnResult& r,
                              const std::string& what) {
  const at::Tensor x64 = x.to(at::kDouble).requires_grad_(true);
  const at::Tensor w64 = k.weight.to(at::kDouble).requires_grad_(true);
  const at::Tensor b64 = k.bias.to(at::kDouble).requires_grad_(true);
  const at::Tensor rm64 = k.running_mean.to(at::kDouble);
  const at::Tensor rv64 = k.running_var.to(at::kDouble);
  const at::Tensor pre = at::batch_norm(x64, w64, b64, rm64, rv64, /*training=*/true, kMomentum, kEps,
                                        /*cudnn_enabled=*/false);
  const at::Tensor y_ref = relu ? at::relu(pre) : pre;
  at::Tensor g = k.dy.to(at::kDouble);
  if (relu) g = g * (r.y > 0).to(at::kDouble);  // the kernel's mask: its own y > 0
  const auto grads = torch::autograd::grad({pre}, {x64, w64, b64}, {g});

  const bool half = x.scalar_type() == at::kHalf;
  const double rel = half ? 2.0 / 2048 : 2.0 / 512;  // 2·u
  const double floor = half ? 1e-4 : 1e-3;
  const double y_max = y_ref.abs().max().item<double>();
  expect_close(r.y, y_ref.detach(), rel * y_ref.detach().abs() + floor * y_max, what + " y");
  const double dx_max = grads[0].abs().max().item<double>();
  expect_close(r.dx, grads[0], rel * grads[0].abs() + floor * dx_max, what + " dx");

  const std::vector<int64_t> reduce_dims = {0, 2, 3};
  const at::Tensor x_plain = x64.detach();
  const at::Tensor xhat = (x_plain - x_plain.mean(reduce_dims, /*keepdim=*/true)) /
                          torch::sqrt(x_plain.var(reduce_dims, /*unbiased=*/false, /*keepdim=*/true) + kEps);
  const at::Tensor dw_scale = (g * xhat).abs().sum(reduce_dims);
  const at::Tensor db_scale = g.abs().sum(reduce_dims);
  expect_close(r.dweight, grads[1], 1e-4 * dw_scale + 1e-6, what + " dweight");
  expect_close(r.dbias, grads[2], 1e-4 * db_scale + 1e-6, what + " dbias");
  expect_close(r.running_mean, rm64, 1e-5 * rm64.abs() + 1e-6, what + " running_mean");
  expect_close(r.running_var, rv64, 1e-5 * rv64.abs() + 1e-6, what + " running_var");

  EXPECT_EQ(r.y.scalar_type(), x.scalar_type());
  EXPECT_EQ(r.dx.scalar_type(), x.scalar_type());
  EXPECT_TRUE(r.y.is_contiguous(at::MemoryFormat::ChannelsLast));
  EXPECT_TRUE(r.dx.is_contiguous(at::MemoryFormat::ChannelsLast));
  if (relu) {  // enough masked elements that a missing mask shows
    EXPECT_GT((r.y == 0).sum().item<int64_t>(), r.y.numel() / 10) << what;
  }
}

std::string shape_name(const at::Tensor& x, bool relu) {
  std::string s = x.scalar_type() == at::kHalf ? "fp16 " : "bf16 ";
  for (const int64_t d : x.sizes()) s += (s.back() == ' ' ? "" : "x") + std::to_string(d);
  return s + (relu ? " relu" : "");
}

// Shapes: vectorized C (64, 512, 24 with H·W = 1, 200 with a partial channel tile), odd C (1, 3, 10, 100), tiny
// M, and one with many row blocks; in bf16 and in fp16.
TEST(BatchNormCudaTest, MatchesFloat64Reference) {
  TRIACCEL_SKIP_WITHOUT_GPU();
  torch::manual_seed(3);
  const std::vector<std::vector<int64_t>> shapes = {{4, 64, 8, 8},  {2, 512, 4, 4}, {16, 24, 1, 1},
                                                    {3, 200, 2, 3}, {2, 1, 1, 2},   {3, 3, 5, 7},
                                                    {5, 10, 3, 3},  {2, 100, 3, 3}, {64, 64, 16, 16}};
  for (const at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    for (const auto& shape : shapes) {
      const BnCase k = case_make(shape, dtype);
      for (const bool relu : {false, true}) {
        const BnResult r = kernel_run(k, k.x, relu);
        expect_matches_reference(k, k.x, relu, r, shape_name(k.x, relu));
      }
    }
  }
}

// x at an address that is not 16-byte aligned (C % 8 == 0 otherwise vectorizes): the scalar path, same answers.
TEST(BatchNormCudaTest, MisalignedInputMatchesReference) {
  TRIACCEL_SKIP_WITHOUT_GPU();
  torch::manual_seed(4);
  for (const at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    const BnCase k = case_make({4, 32, 6, 6}, dtype);
    const int64_t n = k.x.numel();
    at::Tensor buffer = torch::empty({n + 1}, kCuda.dtype(dtype));
    at::Tensor x = buffer.narrow(0, 1, n).view({4, 6, 6, 32}).permute({0, 3, 1, 2});  // NHWC storage, offset 2 bytes
    x.copy_(k.x);
    ASSERT_TRUE(x.is_contiguous(at::MemoryFormat::ChannelsLast));
    ASSERT_NE(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16, 0u);
    for (const bool relu : {false, true}) {
      expect_matches_reference(k, x, relu, kernel_run(k, x, relu), "misaligned " + shape_name(x, relu));
    }
  }
}

// Two runs on the same inputs give the same bits (no atomics, fixed reduction order).
TEST(BatchNormCudaTest, BitReproducible) {
  TRIACCEL_SKIP_WITHOUT_GPU();
  torch::manual_seed(5);
  for (const auto& shape : std::vector<std::vector<int64_t>>{{128, 64, 16, 16}, {32, 10, 9, 9}}) {
    const BnCase k = case_make(shape);
    const BnResult a = kernel_run(k, k.x, true);
    const BnResult b = kernel_run(k, k.x, true);
    EXPECT_TRUE(torch::equal(a.y, b.y));
    EXPECT_TRUE(torch::equal(a.dx, b.dx));
    EXPECT_TRUE(torch::equal(a.dweight, b.dweight));
    EXPECT_TRUE(torch::equal(a.dbias, b.dbias));
    EXPECT_TRUE(torch::equal(a.running_mean, b.running_mean));
    EXPECT_TRUE(torch::equal(a.running_var, b.running_var));
  }
}

// Forward and backward captured in a CUDA graph, replayed on new input values: the same bits as eager calls.
TEST(BatchNormCudaTest, CapturedInCudaGraphMatchesEager) {
  TRIACCEL_SKIP_WITHOUT_GPU();
  torch::manual_seed(6);
  const BnCase k = case_make({16, 64, 8, 8});
  const at::Tensor running_mean = k.running_mean.clone();
  const at::Tensor running_var = k.running_var.clone();
  torch::cuda::synchronize();  // inputs were made on the default stream
  at::Tensor y, dx, dweight;
  {
    const c10::cuda::CUDAStreamGuard stream(c10::cuda::getStreamFromPool());
    kernel_run(k, k.x, true);  // warm-up outside the capture (on copies of the running stats)
    torch::cuda::synchronize();
    at::cuda::CUDAGraph graph;
    graph.capture_begin();
    auto [y_c, stats] =
        batch_norm_forward_cuda(k.x, k.weight, k.bias, running_mean, running_var, kMomentum, kEps, true);
    auto [dx_c, dweight_c, dbias_c] = batch_norm_backward_cuda(k.dy, k.x, k.weight, stats, true);
    graph.capture_end();
    y = y_c;
    dx = dx_c;
    dweight = dweight_c;
    k.x.mul_(-1.5).add_(0.5);  // in place: new values at the captured addresses
    k.dy.mul_(2);
    graph.replay();
    torch::cuda::synchronize();
  }
  const BnResult eager = kernel_run(k, k.x, true);  // from the same initial running stats
  EXPECT_TRUE(torch::equal(y, eager.y));
  EXPECT_TRUE(torch::equal(dx, eager.dx));
  EXPECT_TRUE(torch::equal(dweight, eager.dweight));
  EXPECT_TRUE(torch::equal(running_mean, eager.running_mean));
  EXPECT_TRUE(torch::equal(running_var, eager.running_var));
}

// The dispatch: the kernel for bf16 channels_last CUDA input in training, the module otherwise; the counter moves
// on both paths; the kernel path agrees with the module path.
TEST(BatchNormCudaTest, DispatchChoosesKernelOnlyWhereItApplies) {
  TRIACCEL_SKIP_WITHOUT_GPU();
  torch::manual_seed(7);
  auto bn = bn_make(16);
  bn->to(torch::kCUDA);
  auto module_path = bn_clone(bn);
  const at::Tensor x = (1 + torch::randn({8, 16, 5, 5}, kCuda)).to(at::kBFloat16);
  const at::Tensor x_cl = x.contiguous(at::MemoryFormat::ChannelsLast);

  EXPECT_TRUE(batch_norm_kernel_applies(*bn, x_cl));
  EXPECT_FALSE(batch_norm_kernel_applies(*bn, x));                     // NCHW
  EXPECT_FALSE(batch_norm_kernel_applies(*bn, x_cl.to(at::kFloat)));  // fp32
  EXPECT_TRUE(batch_norm_kernel_applies(*bn, x_cl.to(at::kHalf)));    // fp16: the kernel too
  EXPECT_FALSE(batch_norm_kernel_applies(*bn, x.to(at::kHalf)));       // fp16 NCHW
  EXPECT_FALSE(batch_norm_kernel_applies(*bn, x_cl.narrow(0, 0, 1).narrow(2, 0, 1).narrow(3, 0, 1)));  // M = 1

  const at::Tensor y = batch_norm_forward(bn, x_cl.clone().requires_grad_(true), true);
  ASSERT_TRUE(y.grad_fn());
  EXPECT_NE(y.grad_fn()->name().find("BatchNormFunction"), std::string::npos) << y.grad_fn()->name();
  EXPECT_EQ(batches_tracked(bn), 1);
  const at::Tensor y_module = torch::relu(module_path->forward(x_cl));
  EXPECT_TRUE(torch::allclose(y.to(at::kFloat), y_module.to(at::kFloat), 1e-2, 1e-2));
  EXPECT_TRUE(torch::allclose(bn->running_mean, module_path->running_mean, 1e-5, 1e-6));
  EXPECT_TRUE(torch::allclose(bn->running_var, module_path->running_var, 1e-5, 1e-6));

  for (const at::Tensor& other : {x, x_cl.to(at::kFloat)}) {  // module path, counted too
    const at::Tensor y_other = batch_norm_forward(bn, other.clone().requires_grad_(true), true);
    EXPECT_EQ(y_other.grad_fn()->name().find("BatchNormFunction"), std::string::npos);
  }
  EXPECT_EQ(batches_tracked(bn), 3);
  {
    const KernelSwitchScope off(false);
    EXPECT_FALSE(batch_norm_kernel_applies(*bn, x_cl));
    const at::Tensor y_off = batch_norm_forward(bn, x_cl.clone().requires_grad_(true), true);
    EXPECT_EQ(y_off.grad_fn()->name().find("BatchNormFunction"), std::string::npos);
  }
  EXPECT_EQ(batches_tracked(bn), 4);
  bn->eval();
  EXPECT_FALSE(batch_norm_kernel_applies(*bn, x_cl));
}

// Through autograd: gradients of x, weight and bias match the module's; create_graph through the kernel throws.
TEST(BatchNormCudaTest, AutogradMatchesModuleAndRefusesDoubleBackward) {
  TRIACCEL_SKIP_WITHOUT_GPU();
  torch::manual_seed(8);
  auto bn = bn_make(32);
  bn->to(torch::kCUDA);
  auto module_path = bn_clone(bn);
  const at::Tensor x = (torch::randn({8, 32, 6, 6}, kCuda)).to(at::kBFloat16).contiguous(at::MemoryFormat::ChannelsLast);
  const at::Tensor dy = torch::randn({8, 32, 6, 6}, kCuda).to(at::kBFloat16);

  const at::Tensor x_a = x.clone().requires_grad_(true);
  batch_norm_forward(bn, x_a, true).backward(dy);
  const at::Tensor x_b = x.clone().requires_grad_(true);
  torch::relu(module_path->forward(x_b)).backward(dy);
  EXPECT_TRUE(torch::allclose(x_a.grad().to(at::kFloat), x_b.grad().to(at::kFloat), 2e-2, 2e-2));
  EXPECT_TRUE(torch::allclose(bn->weight.grad(), module_path->weight.grad(), 1e-2, 1e-2));
  EXPECT_TRUE(torch::allclose(bn->bias.grad(), module_path->bias.grad(), 1e-2, 1e-2));

  const at::Tensor x_c = x.clone().requires_grad_(true);
  const at::Tensor loss = batch_norm_forward(bn, x_c, false).to(at::kFloat).square().sum();
  EXPECT_THROW(torch::autograd::grad({loss}, {x_c}, {}, /*retain_graph=*/true, /*create_graph=*/true), c10::Error);
}

// The block end's kernels (batch_norm_add_relu_forward_cuda / _backward_cuda) against relu(bn(x) + r) in float64
// on the same 16-bit values; the mask is the kernel's own y > 0 (as for the fused ReLU). dresidual must be dy where
// y > 0 and 0 elsewhere, bit for bit (the kernel writes dy's own bits or 0). Without the residual in the forward,
// or with the mask recomputed without it, y and dx are off by O(max|ref|).
void expect_add_relu_matches_reference(const BnCase& k, const at::Tensor& x, const at::Tensor& residual,
                                       const std::string& what) {
  BnResult r;
  r.running_mean = k.running_mean.clone();
  r.running_var = k.running_var.clone();
  auto [y, stats] = batch_norm_add_relu_forward_cuda(x, residual, k.weight, k.bias, r.running_mean, r.running_var,
                                                     kMomentum, kEps);
  auto [dx, dweight, dbias, dresidual] = batch_norm_add_relu_backward_cuda(k.dy, x, y, k.weight, stats);
  r.y = y;
  r.dx = dx;
  r.dweight = dweight;
  r.dbias = dbias;

  const at::Tensor x64 = x.to(at::kDouble).requires_grad_(true);
  const at::Tensor w64 = k.weight.to(at::kDouble).requires_grad_(true);
  const at::Tensor b64 = k.bias.to(at::kDouble).requires_grad_(true);
  const at::Tensor rm64 = k.running_mean.to(at::kDouble);
  const at::Tensor rv64 = k.running_var.to(at::kDouble);
  const at::Tensor pre = at::batch_norm(x64, w64, b64, rm64, rv64, /*training=*/true, kMomentum, kEps,
                                        /*cudnn_enabled=*/false);
  const at::Tensor y_ref = at::relu(pre + residual.to(at::kDouble)).detach();
  const at::Tensor passes = y > 0;
  const at::Tensor g = k.dy.to(at::kDouble) * passes.to(at::kDouble);
  const auto grads = torch::autograd::grad({pre}, {x64, w64, b64}, {g});

  const bool half = x.scalar_type() == at::kHalf;
  const double rel = half ? 2.0 / 2048 : 2.0 / 512;
  const double floor = half ? 1e-4 : 1e-3;
  expect_close(y, y_ref, rel * y_ref.abs() + floor * y_ref.abs().max().item<double>(), what + " y");
  expect_close(dx, grads[0], rel * grads[0].abs() + floor * grads[0].abs().max().item<double>(), what + " dx");
  const std::vector<int64_t> reduce_dims = {0, 2, 3};
  const at::Tensor x_plain = x64.detach();
  const at::Tensor xhat = (x_plain - x_plain.mean(reduce_dims, /*keepdim=*/true)) /
                          torch::sqrt(x_plain.var(reduce_dims, /*unbiased=*/false, /*keepdim=*/true) + kEps);
  expect_close(dweight, grads[1], 1e-4 * (g * xhat).abs().sum(reduce_dims) + 1e-6, what + " dweight");
  expect_close(dbias, grads[2], 1e-4 * g.abs().sum(reduce_dims) + 1e-6, what + " dbias");
  expect_close(r.running_mean, rm64, 1e-5 * rm64.abs() + 1e-6, what + " running_mean");
  expect_close(r.running_var, rv64, 1e-5 * rv64.abs() + 1e-6, what + " running_var");
  EXPECT_TRUE(torch::equal(dresidual, torch::where(passes, k.dy, torch::zeros_like(k.dy)))) << what;
  EXPECT_EQ(dresidual.scalar_type(), x.scalar_type());
  EXPECT_TRUE(y.is_contiguous(at::MemoryFormat::ChannelsLast) && dx.is_contiguous(at::MemoryFormat::ChannelsLast));
  // Enough masked elements, and enough where the residual decides the mask (bn(x) < 0 < bn(x) + r or the reverse),
  // that a mask taken from bn(x) alone shows.
  const at::Tensor pre_positive = pre.detach() > 0;
  EXPECT_GT((y == 0).sum().item<int64_t>(), y.numel() / 10) << what;
  EXPECT_GT((pre_positive != (y_ref > 0)).sum().item<int64_t>(), y.numel() / 20) << what;
}

TEST(BatchNormCudaTest, AddReluMatchesFloat64Reference) {
  TRIACCEL_SKIP_WITHOUT_GPU();
  torch::manual_seed(11);
  const std::vector<std::vector<int64_t>> shapes = {{4, 64, 8, 8}, {2, 512, 4, 4}, {3, 200, 2, 3},
                                                    {3, 3, 5, 7},  {64, 64, 16, 16}};
  for (const at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    for (const auto& shape : shapes) {
      const BnCase k = case_make(shape, dtype);
      const at::Tensor residual =
          (2 * torch::randn(shape, kCuda)).to(dtype).contiguous(at::MemoryFormat::ChannelsLast);
      expect_add_relu_matches_reference(k, k.x, residual, "add_relu " + shape_name(k.x, true));
    }
  }
}

// Restores the kernels' launch rules when a test ends.
class LaunchScope {
 public:
  explicit LaunchScope(const BatchNormLaunch& launch) { batch_norm_launch_set(launch); }
  ~LaunchScope() { batch_norm_launch_set({}); }
};

// Every launch choice (BatchNormLaunch: the rules, the grid of 4 blocks per SM with 4 rows in flight they replaced,
// one block per SM, 8 per SM — more than the heavier kernels hold, so a second wave —, 2 and 4 rows) gives answers
// within the reference's tolerance, for each mask (none, ReLU, the block end's): a walk that skipped or repeated
// rows when the grid or the unroll changes is off by O(max|ref|) in dweight and dx. Shapes with many row blocks, a
// remainder of rows, and more than one channel tile; 64x64x32x32 at one block per SM gives a thread 16 rows, so the
// walk of 4 rows in flight runs its unrolled loop under each mask (with fewer than 4 rows a thread only takes the
// remainder loop, and a 4-row walk that stepped 5 rows passed). Out-of-range choices are refused.
TEST(BatchNormCudaTest, EveryLaunchChoiceMatchesFloat64Reference) {
  TRIACCEL_SKIP_WITHOUT_GPU();
  torch::manual_seed(13);
  const std::vector<BatchNormLaunch> launches = {{0, 0}, {4, 4}, {2, 1}, {4, 8}, {2, 0}, {4, 0}, {4, 1}};
  const std::vector<std::vector<int64_t>> shapes = {{64, 64, 16, 16}, {37, 128, 7, 5}, {2, 200, 2, 3},
                                                    {64, 64, 32, 32}};
  for (const BatchNormLaunch& launch : launches) {
    const LaunchScope scope(launch);
    for (const auto& shape : shapes) {
      const BnCase k = case_make(shape);
      const std::string what = "launch " + std::to_string(launch.rows_in_flight) + ":" +
                               std::to_string(launch.blocks_per_sm) + " " + shape_name(k.x, true);
      for (const bool relu : {false, true}) expect_matches_reference(k, k.x, relu, kernel_run(k, k.x, relu), what);
      const at::Tensor residual =
          (2 * torch::randn(shape, kCuda)).to(at::kBFloat16).contiguous(at::MemoryFormat::ChannelsLast);
      expect_add_relu_matches_reference(k, k.x, residual, "add_relu " + what);
    }
  }
  EXPECT_THROW(batch_norm_launch_set({3, 0}), c10::Error);
  EXPECT_THROW(batch_norm_launch_set({0, -1}), c10::Error);
  batch_norm_launch_set({});
}

// A residual at an address that is not 16-byte aligned: the scalar path, the same answers.
TEST(BatchNormCudaTest, AddReluMisalignedResidualMatchesReference) {
  TRIACCEL_SKIP_WITHOUT_GPU();
  torch::manual_seed(12);
  const BnCase k = case_make({4, 32, 6, 6});
  const int64_t n = k.x.numel();
  at::Tensor buffer = torch::empty({n + 1}, kCuda.dtype(at::kBFloat16));
  at::Tensor residual = buffer.narrow(0, 1, n).view({4, 6, 6, 32}).permute({0, 3, 1, 2});
  residual.copy_(2 * torch::randn({4, 32, 6, 6}, kCuda));
  ASSERT_TRUE(residual.is_contiguous(at::MemoryFormat::ChannelsLast));
  ASSERT_NE(reinterpret_cast<uintptr_t>(residual.data_ptr()) % 16, 0u);
  expect_add_relu_matches_reference(k, k.x, residual, "add_relu misaligned residual");
}

// Through autograd (batch_norm_add_relu): the fused Function where it applies, its gradients of x, the residual,
// weight and bias exactly the kernels' own (a swapped or dropped gradient fails), its output within rounding of the
// composition's (which rounds three times, so its mask may differ where bn(x) + r is within rounding of 0); the
// composition where the residual does not fit or the fusion is off; the batch counted once per call on every path.
TEST(BatchNormCudaTest, AddReluAutogradIsTheKernelAndDispatches) {
  TRIACCEL_SKIP_WITHOUT_GPU();
  torch::manual_seed(13);
  auto bn = bn_make(32);
  bn->to(torch::kCUDA);
  auto module_path = bn_clone(bn);
  auto kernel_path = bn_clone(bn);
  const auto cl = [](const at::Tensor& t) { return t.to(at::kBFloat16).contiguous(at::MemoryFormat::ChannelsLast); };
  const at::Tensor x = cl(1 + torch::randn({8, 32, 6, 6}, kCuda));
  const at::Tensor res = cl(torch::randn({8, 32, 6, 6}, kCuda));
  const at::Tensor dy = cl(torch::randn({8, 32, 6, 6}, kCuda));

  const at::Tensor x_a = x.clone().requires_grad_(true), r_a = res.clone().requires_grad_(true);
  const at::Tensor y_a = batch_norm_add_relu(bn, x_a, r_a);
  ASSERT_TRUE(y_a.grad_fn());
  EXPECT_NE(y_a.grad_fn()->name().find("BatchNormAddReluFunction"), std::string::npos) << y_a.grad_fn()->name();
  y_a.backward(dy);
  auto [y_k, stats] = batch_norm_add_relu_forward_cuda(x, res, kernel_path->weight, kernel_path->bias,
                                                       kernel_path->running_mean, kernel_path->running_var,
                                                       kMomentum, kEps);
  auto [dx, dweight, dbias, dres] = batch_norm_add_relu_backward_cuda(dy, x, y_k, kernel_path->weight, stats);
  EXPECT_TRUE(torch::equal(y_a, y_k));
  EXPECT_TRUE(torch::equal(x_a.grad(), dx));
  EXPECT_TRUE(torch::equal(r_a.grad(), dres));
  EXPECT_TRUE(torch::equal(bn->weight.grad(), dweight));
  EXPECT_TRUE(torch::equal(bn->bias.grad(), dbias));
  EXPECT_FALSE(torch::equal(x_a.grad(), r_a.grad()));
  const at::Tensor y_b = torch::relu(module_path->forward(x) + res);
  EXPECT_TRUE(torch::allclose(y_a.to(at::kFloat), y_b.to(at::kFloat), 2e-2, 2e-2));
  EXPECT_TRUE(torch::allclose(bn->running_mean, module_path->running_mean, 1e-5, 1e-6));
  EXPECT_EQ(batches_tracked(bn), 1);

  const auto fused_name = [](const at::Tensor& y) {
    return y.grad_fn()->name().find("BatchNormAddReluFunction") != std::string::npos;
  };
  const at::Tensor x_c = x.clone().requires_grad_(true);
  EXPECT_FALSE(fused_name(batch_norm_add_relu(bn, x_c, res.contiguous())));  // NCHW residual: the composition
  const at::Tensor res_float = res.to(at::kFloat).contiguous(at::MemoryFormat::ChannelsLast);
  EXPECT_FALSE(fused_name(batch_norm_add_relu(bn, x_c, res_float)));  // another dtype: the composition
  batch_norm_add_relu_set_fused(false);
  EXPECT_FALSE(fused_name(batch_norm_add_relu(bn, x_c, res)));
  batch_norm_add_relu_set_fused(true);
  EXPECT_EQ(batches_tracked(bn), 4);
}

// A ResNet-18 step under bf16 (then fp16) autocast in channels_last, with the kernel and with the module (ATen),
// each compared with the same step in fp32: the kernel's gradients must be about as close to fp32 as ATen's 16-bit
// gradients are (rounding compounds through 20 layers, so the bound is relative to ATen's own error). State names
// and num_batches_tracked equal the module path's.
TEST(BatchNormModelTest, Resnet16BitStepAsCloseToFp32AsModulePath) {
  TRIACCEL_SKIP_WITHOUT_GPU();
  ModelOptions options;
  options.name = "resnet18";
  const at::Tensor x = torch::randn({32, 3, 32, 32}, kCuda).contiguous(at::MemoryFormat::ChannelsLast);
  const at::Tensor labels = torch::randint(0, 10, {32}, kCuda.dtype(at::kLong));
  struct Run {
    bool kernel;
    at::ScalarType dtype;  // autocast dtype; kFloat: no autocast
    std::shared_ptr<Model> model;
    double loss = 0;
    at::Tensor grads;  // all parameter gradients, flattened, float32
  };
  const auto run_step = [&](Run& run) {
    torch::manual_seed(9);
    run.model = model_create(options);
    run.model->to(torch::kCUDA);
    for (auto& p : run.model->parameters()) {
      if (p.dim() == 4) p.set_data(p.contiguous(at::MemoryFormat::ChannelsLast));
    }
    run.model->train();
    const KernelSwitchScope kernel(run.kernel);
    at::autocast::set_autocast_enabled(at::kCUDA, run.dtype != at::kFloat);
    at::autocast::set_autocast_dtype(at::kCUDA, run.dtype == at::kFloat ? at::kBFloat16 : run.dtype);
    const at::Tensor loss = torch::cross_entropy_loss(run.model->forward(x).to(at::kFloat), labels);
    at::autocast::set_autocast_enabled(at::kCUDA, false);
    at::autocast::clear_cache();
    loss.backward();
    run.loss = loss.item<double>();
    std::vector<at::Tensor> flat;
    for (const auto& p : run.model->parameters()) flat.push_back(p.grad().to(at::kFloat).flatten());
    run.grads = torch::cat(flat);
  };
  Run fp32{false, at::kFloat, nullptr};
  run_step(fp32);
  const auto rel_err = [&](const Run& r) {
    return (r.grads - fp32.grads).norm().item<double>() / fp32.grads.norm().item<double>();
  };
  for (const at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    const std::string name = dtype == at::kHalf ? "fp16" : "bf16";
    Run fused{true, dtype, nullptr};
    Run plain{false, dtype, nullptr};
    run_step(fused);
    run_step(plain);
    const double err_fused = rel_err(fused), err_plain = rel_err(plain);
    std::cout << "[ resnet18 " << name << " ] gradient error vs fp32 (relative L2): kernel " << err_fused
              << ", ATen " << err_plain << "\n";
    EXPECT_LT(err_fused, 1.5 * err_plain + 0.01) << name << " module-path error " << err_plain;
    EXPECT_NEAR(fused.loss, fp32.loss, 2 * std::abs(plain.loss - fp32.loss) + 1e-3 * std::abs(fp32.loss)) << name;

    const auto fused_state = model_state(*fused.model);
    const auto plain_state = model_state(*plain.model);
    ASSERT_EQ(fused_state.size(), plain_state.size());
    for (size_t i = 0; i < fused_state.size(); ++i) {
      EXPECT_EQ(fused_state[i].first, plain_state[i].first);
      if (fused_state[i].first.find("num_batches_tracked") != std::string::npos) {
        EXPECT_TRUE(torch::equal(fused_state[i].second, plain_state[i].second)) << fused_state[i].first;
      }
    }
  }
}

#endif  // TRIACCEL_WITH_CUDA

}  // namespace
}  // namespace triaccel
