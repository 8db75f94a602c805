// GradStats: the ATen reference on hand-made gradients with exact answers (the spec of the four columns, undefined
// gradients, half-precision upcasts, odd sizes, layout checks), and the CUDA kernel against the reference (GPU
// only): many shapes and dtypes, more tensors than one launch holds, more units than one finalize launch holds,
// a poisoned output, and a captured CUDA graph replayed after the gradients changed in place.
// Tolerances for CUDA vs reference (the reference sums in float64, the kernel in float32 per block, float64
// across blocks): norm 1e-5 relative; max |g| exact (max is order-independent); the mean within 1e-5 × rms(g)
// and the variance within 1e-5 × E[g²] = 1e-5 × rms(g)²: both come out of cancellations (Σg of zero-mean data;
// E[g²] − E[g]², where g² is rounded to float32 in the kernel: a 1-element unit gives var ≈ 1e-9, not 0), so rms
// is their natural scale. For the test data (|mean| ≤ std) that is still ≤ 2e-5 relative to the variance.
#include "test_util.h"
#include "triaccel/train/grad_stats.h"

#ifdef TRIACCEL_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>

namespace triaccel {
namespace {

at::Tensor f32(std::vector<float> values) { return torch::tensor(values, torch::kFloat); }

// Expects row u of stats (U, 4) to equal [norm, mean, var, max] up to float32 rounding of the result.
void expect_row(const at::Tensor& stats, int64_t u, double norm, double mean, double var, double max_abs) {
  const at::Tensor row = stats.cpu()[u];
  EXPECT_FLOAT_EQ(row[kGradStatsNorm].item<float>(), static_cast<float>(norm)) << "unit " << u;
  EXPECT_FLOAT_EQ(row[kGradStatsMean].item<float>(), static_cast<float>(mean)) << "unit " << u;
  EXPECT_FLOAT_EQ(row[kGradStatsVar].item<float>(), static_cast<float>(var)) << "unit " << u;
  EXPECT_FLOAT_EQ(row[kGradStatsMaxAbs].item<float>(), static_cast<float>(max_abs)) << "unit " << u;
}

TEST(GradStatsReferenceTest, TwoUnitsKnownValues) {
  // unit 0: {1, 2, 3, -4}: Σg² = 30, Σg = 2, n = 4 → mean 0.5, var 7.5 − 0.25 = 7.25, max 4.
  // unit 1: {-1, 3}:       Σg² = 10, Σg = 2, n = 2 → mean 1,   var 5 − 1 = 4,         max 3.
  const std::vector<at::Tensor> grads = {f32({1, 2, 3}), f32({-4}).view({1, 1}), f32({-1, 3})};
  const GradStatsLayout layout({{grads[0], grads[1]}, {grads[2]}});
  EXPECT_EQ(layout.num_units(), 2);
  EXPECT_EQ(layout.unit_numel, (std::vector<int64_t>{4, 2}));
  const at::Tensor stats = grad_stats_reference(grads, layout);
  ASSERT_EQ(stats.sizes(), at::IntArrayRef({2, 4}));
  EXPECT_EQ(stats.scalar_type(), at::kFloat);
  expect_row(stats, 0, std::sqrt(30.0), 0.5, 7.25, 4.0);
  expect_row(stats, 1, std::sqrt(10.0), 1.0, 4.0, 3.0);

  // On the CPU, grad_stats_compute is the reference; the out variant overwrites whatever out held.
  EXPECT_TRUE(at::equal(grad_stats_compute(grads, layout), stats));
  at::Tensor out = at::full({2, 4}, std::numeric_limits<float>::quiet_NaN());
  grad_stats_compute_out(grads, layout, out);
  EXPECT_TRUE(at::equal(out, stats));
}

TEST(GradStatsReferenceTest, FlatLayoutEmptyUnitAndChecks) {
  // unit 1 gets {2} and {-2, 0}: Σg² = 8, Σg = 0, n = 3 → mean 0, var 8/3, max 2. unit 2 owns nothing.
  const std::vector<at::Tensor> grads = {f32({2}), f32({5, 5}), f32({-2, 0})};
  const GradStatsLayout layout(grads, {1, 0, 1}, 3);
  EXPECT_EQ(layout.unit_numel, (std::vector<int64_t>{2, 3, 0}));
  const at::Tensor stats = grad_stats_reference(grads, layout);
  expect_row(stats, 0, std::sqrt(50.0), 5.0, 0.0, 5.0);
  expect_row(stats, 1, std::sqrt(8.0), 0.0, 8.0 / 3.0, 2.0);
  expect_row(stats, 2, 0.0, 0.0, 0.0, 0.0);

  EXPECT_THROW(GradStatsLayout(grads, {1, 0, 3}, 3), c10::Error);  // unit index out of range
  EXPECT_THROW(GradStatsLayout(grads, {1, 0}, 3), c10::Error);     // one index short
  EXPECT_THROW(grad_stats_reference({grads[0], grads[1]}, layout), c10::Error);  // one gradient short
  EXPECT_THROW(grad_stats_reference({grads[0], grads[1], f32({1, 2, 3})}, layout), c10::Error);  // wrong numel
  at::Tensor wrong_shape = at::zeros({3, 3});
  EXPECT_THROW(grad_stats_compute_out(grads, layout, wrong_shape), c10::Error);
}

TEST(GradStatsReferenceTest, UndefinedGradsCountAsZeros) {
  // unit 0: {2, 2} plus an undefined 2-element gradient → values {2, 2, 0, 0}: Σg² = 8, Σg = 4, n = 4 →
  // mean 1, var 2 − 1 = 1, max 2. unit 1: only an undefined gradient → all zeros.
  const std::vector<at::Tensor> params = {f32({0, 0}), f32({0, 0}), f32({0, 0, 0})};
  const GradStatsLayout layout({{params[0], params[1]}, {params[2]}});
  const std::vector<at::Tensor> grads = {f32({2, 2}), at::Tensor(), at::Tensor()};
  const at::Tensor stats = grad_stats_reference(grads, layout);
  expect_row(stats, 0, std::sqrt(8.0), 1.0, 1.0, 2.0);
  expect_row(stats, 1, 0.0, 0.0, 0.0, 0.0);

  // No gradient defined at all: zeros on the CPU.
  const at::Tensor none = grad_stats_compute({at::Tensor(), at::Tensor(), at::Tensor()}, layout);
  EXPECT_TRUE(none.device().is_cpu());
  EXPECT_TRUE(at::equal(none, at::zeros({2, 4})));
}

TEST(GradStatsReferenceTest, HalfPrecisionGradsAreReadInTheirDtype) {
  // 1/3 rounds to 171/512 in bfloat16 and to 1365/4096 in float16; 0.25 is exact in both.
  const std::vector<at::Tensor> grads = {f32({1.f / 3.f, 0.25f}).to(at::kBFloat16),
                                         f32({1.f / 3.f, 0.25f}).to(at::kHalf)};
  const GradStatsLayout layout({{grads[0]}, {grads[1]}});
  const at::Tensor stats = grad_stats_reference(grads, layout);
  EXPECT_EQ(stats.scalar_type(), at::kFloat);
  for (int64_t u = 0; u < 2; ++u) {
    const double a = u == 0 ? 171.0 / 512.0 : 1365.0 / 4096.0;
    const double b = 0.25;
    const double mean = (a + b) / 2;
    expect_row(stats, u, std::sqrt(a * a + b * b), mean, (a * a + b * b) / 2 - mean * mean, a);
  }
}

TEST(GradStatsReferenceTest, OddSizesAndMemoryFormats) {
  // unit 0: 1..7: Σg² = 140, Σg = 28 → mean 4, var 20 − 16 = 4, max 7.
  // unit 1: 1000003 × 0.5 and 13 × −0.5: n = 1000016, Σg = 499995, Σg² = 250004.
  // unit 2: the same random values, once contiguous and once channels_last: equal statistics.
  const at::Tensor random = torch::randn({3, 5, 7, 9});
  const std::vector<at::Tensor> grads = {torch::arange(1, 8, torch::kFloat), torch::full({1000003}, 0.5f),
                                         torch::full({13}, -0.5f), random,
                                         random.contiguous(at::MemoryFormat::ChannelsLast)};
  const GradStatsLayout layout(grads, {0, 1, 1, 2, 3}, 4);
  const at::Tensor stats = grad_stats_reference(grads, layout);
  expect_row(stats, 0, std::sqrt(140.0), 4.0, 4.0, 7.0);
  const double n = 1000016, mean = 499995 / n;
  expect_row(stats, 1, std::sqrt(250004.0), mean, 0.25 - mean * mean, 0.5);
  EXPECT_TRUE(at::allclose(stats[2], stats[3], 1e-6, 0.0));  // float64 sums, maybe in another order
  EXPECT_GT(stats[2][kGradStatsVar].item<float>(), 0.5f);
}

#ifdef TRIACCEL_WITH_CUDA

// CUDA vs reference with the tolerances in the header comment; the reference runs on CPU copies.
void expect_matches_reference(const at::Tensor& got_device, const std::vector<at::Tensor>& grads,
                              const GradStatsLayout& layout) {
  std::vector<at::Tensor> cpu;
  for (const auto& g : grads) cpu.push_back(g.defined() ? g.cpu() : at::Tensor());
  const at::Tensor want = grad_stats_reference(cpu, layout);
  const at::Tensor got = got_device.cpu();
  ASSERT_EQ(got.sizes(), want.sizes());
  ASSERT_TRUE(at::isfinite(got).all().item<bool>());
  for (int64_t u = 0; u < layout.num_units(); ++u) {
    const auto w = want[u].to(at::kDouble);
    const auto g = got[u].to(at::kDouble);
    const double norm = w[kGradStatsNorm].item<double>();
    const double n = static_cast<double>(layout.unit_numel[static_cast<size_t>(u)]);
    const double rms = n > 0 ? norm / std::sqrt(n) : 0.0;
    EXPECT_NEAR(g[kGradStatsNorm].item<double>(), norm, 1e-5 * norm) << "unit " << u;
    EXPECT_NEAR(g[kGradStatsMean].item<double>(), w[kGradStatsMean].item<double>(), 1e-5 * rms) << "unit " << u;
    // Variance as E[g²] − mean² in float32 cancels when the mean dominates (a one-element unit: true variance 0, the
    // H200 gave 3.5e-9 at rms² = 3.5e-4): relative to rms², 1e-4.
    EXPECT_NEAR(g[kGradStatsVar].item<double>(), w[kGradStatsVar].item<double>(), 1e-4 * rms * rms) << "unit " << u;
    EXPECT_EQ(g[kGradStatsMaxAbs].item<double>(), w[kGradStatsMaxAbs].item<double>()) << "unit " << u;
  }
}

// Gradients of many shapes on the GPU: units 0..4 get tensors with per-unit offsets (non-zero means) and scales,
// dtypes cycle float32 / bfloat16 / float16; unit 5 owns nothing. More than 64 tensors, so the kernel launches
// more than once.
struct GpuGrads {
  std::vector<at::Tensor> grads;
  std::vector<int64_t> unit;
};

GpuGrads gpu_grads_make() {
  torch::manual_seed(7);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  const at::ScalarType dtypes[] = {at::kFloat, at::kBFloat16, at::kHalf};
  GpuGrads out;
  auto add = [&](at::Tensor t, int64_t u) {
    out.grads.push_back(t);
    out.unit.push_back(u);
  };
  auto value = [&](std::vector<int64_t> shape, int64_t u, at::ScalarType dtype) {
    return (torch::randn(shape, cuda) * (0.5 + u) + 0.2 * u).to(dtype);
  };
  add(value({7}, 0, at::kFloat), 0);
  add(value({1000003}, 1, at::kFloat), 1);
  add(value({1000003}, 2, at::kBFloat16), 2);
  add(value({64, 3, 7, 7}, 3, at::kFloat).contiguous(at::MemoryFormat::ChannelsLast), 3);
  add(value({32, 5, 3, 3}, 4, at::kHalf).contiguous(at::MemoryFormat::ChannelsLast), 4);
  add(value({1001}, 0, at::kFloat).narrow(0, 1, 1000), 0);  // data 4 bytes past alignment: scalar loads
  add(value({4099}, 4, at::kHalf).narrow(0, 3, 4096), 4);   // 6 bytes past alignment
  for (int i = 0; i < 70; ++i) {
    const int64_t numel = 1 + (i * 977) % 20011;
    add(value({numel}, i % 5, dtypes[i % 3]), i % 5);
  }
  out.grads.insert(out.grads.begin() + 5, at::Tensor());  // an undefined gradient (of 11 elements) in unit 2
  out.unit.insert(out.unit.begin() + 5, 2);
  return out;
}

GradStatsLayout gpu_layout(const GpuGrads& g) {
  std::vector<at::Tensor> shapes;
  for (const auto& t : g.grads) shapes.push_back(t.defined() ? t : at::empty({11}));
  return GradStatsLayout(shapes, g.unit, 6);
}

TEST(GradStatsCudaTest, MatchesReferenceOnManyShapesAndDtypes) {
  TRIACCEL_SKIP_WITHOUT_GPU();
  const GpuGrads g = gpu_grads_make();
  ASSERT_GT(g.grads.size(), 64u);
  const GradStatsLayout layout = gpu_layout(g);
  at::Tensor out = at::full({6, 4}, std::numeric_limits<float>::quiet_NaN(),
                            torch::TensorOptions().device(torch::kCUDA));
  grad_stats_compute_out(g.grads, layout, out);
  expect_matches_reference(out, g.grads, layout);
  EXPECT_TRUE(at::equal(out.cpu()[5], at::zeros({4})));  // the unit without tensors
  EXPECT_GT(out.cpu()[4][kGradStatsMean].item<float>(), 0.5f);  // a non-zero mean was measured, not assumed

  const at::Tensor returned = grad_stats_compute(g.grads, layout);
  EXPECT_TRUE(returned.is_cuda());
  expect_matches_reference(returned, g.grads, layout);
}

TEST(GradStatsCudaTest, ManyUnitsAndNaN) {
  TRIACCEL_SKIP_WITHOUT_GPU();
  // 300 units (more than one finalize launch holds), unit u owns one tensor of u + 1 elements.
  torch::manual_seed(3);
  std::vector<at::Tensor> grads;
  std::vector<int64_t> unit;
  for (int64_t u = 0; u < 300; ++u) {
    grads.push_back(torch::randn({u + 1}, torch::TensorOptions().device(torch::kCUDA)) + 0.01 * u);
    unit.push_back(u);
  }
  const GradStatsLayout layout(grads, unit, 300);
  expect_matches_reference(grad_stats_compute(grads, layout), grads, layout);

  // A NaN gradient makes its unit's statistics NaN (max |g| included) and leaves the others alone.
  grads[299][5].fill_(std::numeric_limits<float>::quiet_NaN());
  const at::Tensor stats = grad_stats_compute(grads, layout).cpu();
  EXPECT_TRUE(at::isnan(stats[299]).all().item<bool>());
  EXPECT_TRUE(at::isfinite(stats.narrow(0, 0, 299)).all().item<bool>());
}

TEST(GradStatsCudaTest, CapturedInCudaGraphTracksNewValues) {
  TRIACCEL_SKIP_WITHOUT_GPU();
  GpuGrads g = gpu_grads_make();
  const GradStatsLayout layout = gpu_layout(g);
  torch::cuda::synchronize();
  const c10::cuda::CUDAStreamGuard stream(c10::cuda::getStreamFromPool());
  at::cuda::CUDAGraph graph;
  graph.capture_begin();
  const at::Tensor stats = grad_stats_compute(g.grads, layout);  // lives in the graph's pool, fixed address
  graph.capture_end();

  graph.replay();
  torch::cuda::synchronize();
  const at::Tensor first = stats.cpu();
  expect_matches_reference(first, g.grads, layout);

  for (auto& t : g.grads) {
    if (t.defined()) t.mul_(-3).add_(0.25);  // in place: same addresses, new values
  }
  graph.replay();
  torch::cuda::synchronize();
  expect_matches_reference(stats, g.grads, layout);
  EXPECT_GT((stats.cpu() - first).abs().max().item<float>(), 0.1f);
}

#endif  // TRIACCEL_WITH_CUDA

}  // namespace
}  // namespace triaccel
