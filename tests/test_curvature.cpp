// Tests for curvature/: Hessian-vector products against closed forms and an explicit Hessian built by plain
// double loops of autograd::grad, power iteration with deflation against eigvalsh, and the probe on the small CNN
// (one entry per unit, model state untouched, options validation).
// Tolerances: the HVP checks run in float64 on the CPU, where H·v of a quadratic is exact up to rounding (1e-12)
// and HVP columns equal the double-loop Hessian up to rounding (1e-10). Power iteration is run to tol 1e-12 with
// enough steps that the Rayleigh quotient error, which falls as (λ_{j+1}/λ_j)^{2t}, is far below the 1e-4 (MLP)
// and 1e-8 (diagonal) relative tolerances.
#include "test_util.h"
#include "triaccel/control/curvature/hvp.h"
#include "triaccel/control/curvature/curvature_controller.h"
#include "triaccel/control/curvature/curvature_probe.h"

#include "triaccel/core/errors.h"
#include "triaccel/models/batch_norm.h"
#include "triaccel/models/model.h"
#include "triaccel/optim/sgd.h"
#include "triaccel/run/config.h"
#include "triaccel/train/loss_scaler.h"
#include "triaccel/train/step.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#ifdef TRIACCEL_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

namespace triaccel {
namespace {

const auto kF64 = at::TensorOptions().dtype(at::kDouble);

// A random symmetric (n, n) float64 matrix.
at::Tensor symmetric_random(int64_t n, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const at::Tensor m = at::randn({n, n}, gen, kF64);
  return (m + m.t()) / 2;
}

// Q diag(values) Qᵀ with a random orthogonal Q: a symmetric matrix with known eigenvalues and eigenvectors that
// are not the coordinate axes.
at::Tensor symmetric_with_eigenvalues(const std::vector<double>& values, uint64_t seed) {
  const int64_t n = static_cast<int64_t>(values.size());
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const at::Tensor q = std::get<0>(at::linalg_qr(at::randn({n, n}, gen, kF64)));
  const at::Tensor d = at::tensor(values, kF64);
  return q.matmul(at::diag(d)).matmul(q.t());
}

// ½ xᵀ A x for x = concat(parts) (flattened): its Hessian is A.
at::Tensor quadratic_loss(const at::Tensor& a, const std::vector<at::Tensor>& parts) {
  std::vector<at::Tensor> flat;
  for (const auto& p : parts) flat.push_back(p.reshape({-1}));
  const at::Tensor x = at::cat(flat);
  return 0.5 * at::dot(x, a.mv(x));
}

at::Tensor flat_cat(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> flat;
  for (const auto& t : tensors) flat.push_back(t.reshape({-1}));
  return at::cat(flat);
}

// The top |λ| first, signed values kept.
std::vector<double> by_magnitude(const at::Tensor& eigenvalues) {
  const at::Tensor e = eigenvalues.contiguous();
  std::vector<double> values(e.data_ptr<double>(), e.data_ptr<double>() + e.numel());
  std::sort(values.begin(), values.end(), [](double a, double b) { return std::abs(a) > std::abs(b); });
  return values;
}

// Runs the enclosing test on one intra-op thread and restores the count after. The double backward of a tiny CNN
// is hundreds of small ops; on the shared 2-core test machine two OpenMP threads per op made the probe test
// ~17x slower (9 s vs 0.5 s measured), while the numbers checked do not depend on the thread count.
class SingleThreadScope {
 public:
  SingleThreadScope() : threads_(at::get_num_threads()) { at::set_num_threads(1); }
  ~SingleThreadScope() { at::set_num_threads(threads_); }

 private:
  int threads_;
};


// --curv-lr-mean: the scales divided by their parameter-weighted mean; the ratios between units stay, and the
// network's mean rate is the schedule's (weighted by parameters: a big flat unit dominates it).
TEST(CurvatureLrScales, MeanOneKeepsTheRatiosAndWeighsByParameters) {
  std::vector<double> scales{0.5, 1.0, 0.8};
  const std::vector<int64_t> params{100, 300, 600};
  lr_scales_mean_one(&scales, params);
  const double mean = (0.5 * 100 + 1.0 * 300 + 0.8 * 600) / 1000;  // 0.83
  EXPECT_NEAR(scales[0], 0.5 / mean, 1e-12);
  EXPECT_NEAR(scales[1], 1.0 / mean, 1e-12);
  EXPECT_NEAR(scales[2], 0.8 / mean, 1e-12);
  EXPECT_NEAR((scales[0] * 100 + scales[1] * 300 + scales[2] * 600) / 1000, 1.0, 1e-12);
  std::vector<double> none{0.0, 0.0};
  lr_scales_mean_one(&none, {5, 5});  // nothing to divide by: unchanged
  EXPECT_EQ(none, (std::vector<double>{0.0, 0.0}));
  EXPECT_THROW(lr_scales_mean_one(&none, {5}), c10::Error);
}

// The scales at mean 1 are the default; a configuration stored before the option existed (an older checkpoint's)
// resumes with the paper's scales, as it resumes with its tolerance and estimator of that time.
TEST(CurvatureLrScales, MeanOneIsTheDefaultAndOlderConfigurationsKeepThePapersRule) {
  EXPECT_TRUE(Config{}.tri_accel.curv_lr_mean);
  Json stored = Config{}.to_json();
  EXPECT_TRUE(Config::from_json(stored).tri_accel.curv_lr_mean);
  for (const char* key : {"curv_lr_mean", "curv_tol", "curv_estimator"}) stored.erase(key);
  const Config older = Config::from_json(stored);
  EXPECT_FALSE(older.tri_accel.curv_lr_mean);
  EXPECT_DOUBLE_EQ(older.tri_accel.curv_tol, 1e-3);
  EXPECT_EQ(older.tri_accel.curv_estimator, CurvatureEstimator::kHessian);
}

TEST(HvpTest, QuadraticEqualsAv) {
  const at::Tensor a = symmetric_random(7, 1);  // (7, 7)
  // Two parameters (3) and (2, 2) make up x, so the per-parameter split of H·v is checked too.
  const at::Tensor x1 = at::randn({3}, kF64).requires_grad_(true);
  const at::Tensor x2 = at::randn({2, 2}, kF64).requires_grad_(true);
  const at::Tensor loss = quadratic_loss(a, {x1, x2});
  const at::Tensor v1 = at::randn({3}, kF64);
  const at::Tensor v2 = at::randn({2, 2}, kF64);
  const at::Tensor expected = a.mv(flat_cat({v1, v2}));  // (7)

  const std::vector<at::Tensor> hv = hessian_vector_product(loss, {x1, x2}, {v1, v2});
  ASSERT_EQ(hv.size(), 2u);
  EXPECT_EQ(hv[0].sizes(), x1.sizes());
  EXPECT_EQ(hv[1].sizes(), x2.sizes());
  EXPECT_LT((flat_cat(hv) - expected).abs().max().item<double>(), 1e-12);

  // The operator reuses its first-order gradients: repeated products on the same loss stay exact.
  const HvpOperator op(loss, {x1, x2});
  for (int repeat = 0; repeat < 3; ++repeat) {
    const at::Tensor v = at::randn({7}, kF64);
    EXPECT_LT((op.apply_flat(v) - a.mv(v)).abs().max().item<double>(), 1e-12);
  }
  // A parameter group is a block of the Hessian: H w.r.t. x1 alone is A[0:3, 0:3].
  const std::vector<at::Tensor> block = hessian_vector_product(loss, {x1}, {v1});
  EXPECT_LT((block[0] - a.slice(0, 0, 3).slice(1, 0, 3).mv(v1)).abs().max().item<double>(), 1e-12);
  EXPECT_FALSE(x1.grad().defined());  // nothing accumulates into .grad
}

TEST(HvpTest, UnusedAndLinearParametersGiveZeros) {
  const at::Tensor x = at::randn({3}, kF64).requires_grad_(true);
  const at::Tensor linear = at::randn({3}, kF64).requires_grad_(true);  // enters the loss linearly
  const at::Tensor unused = at::randn({2}, kF64).requires_grad_(true);
  const at::Tensor loss = (x * x * x).sum() + linear.sum();  // H = diag(6x) on x, 0 elsewhere
  const at::Tensor v = at::randn({3}, kF64);
  const std::vector<at::Tensor> hv =
      hessian_vector_product(loss, {x, linear, unused}, {v, at::ones({3}, kF64), at::ones({2}, kF64)});
  ASSERT_EQ(hv.size(), 3u);
  EXPECT_LT((hv[0] - 6 * x.detach() * v).abs().max().item<double>(), 1e-12);
  ASSERT_TRUE(hv[1].defined());
  ASSERT_TRUE(hv[2].defined());
  EXPECT_EQ(hv[1].abs().max().item<double>(), 0.0);
  EXPECT_EQ(hv[2].sizes(), unused.sizes());
  EXPECT_EQ(hv[2].abs().max().item<double>(), 0.0);
  // A group that only enters linearly has a zero Hessian block.
  const std::vector<at::Tensor> zero = hessian_vector_product(loss, {linear}, {v});
  EXPECT_EQ(zero[0].abs().max().item<double>(), 0.0);
}

TEST(PowerIterationTest, DeflationFindsTopThree) {
  for (const auto& spectrum : std::vector<std::vector<double>>{{5, 3, 1, 0.5}, {0.5, -5, 1, 3}}) {
    // Diagonal A first (the brief's case), then the same spectrum in a rotated basis.
    for (const bool rotated : {false, true}) {
      const at::Tensor a = rotated ? symmetric_with_eigenvalues(spectrum, 3) : at::diag(at::tensor(spectrum, kF64));
      const at::Tensor x = at::randn({4}, kF64).requires_grad_(true);
      const HvpOperator op(quadratic_loss(a, {x}), {x});
      const EigenResult result = power_iteration_topk(op, 3, 500, 1e-14, 7);
      ASSERT_EQ(result.eigenvalues.size(), 3u);
      const std::vector<double> expected = by_magnitude(at::tensor(spectrum, kF64));
      for (int i = 0; i < 3; ++i) {
        EXPECT_NEAR(result.eigenvalues[i], expected[i], 1e-8 * std::abs(expected[i]))
            << "eigenvalue " << i << (rotated ? " (rotated)" : " (diagonal)");
      }
      EXPECT_TRUE(result.converged);
      EXPECT_GT(result.iterations, 3);
      EXPECT_LE(result.iterations, 3 * 500);
    }
  }
}

TEST(PowerIterationTest, DeterministicForASeedAndStopsAtMaxIters) {
  const at::Tensor a = symmetric_random(12, 5);
  const at::Tensor x = at::randn({12}, kF64).requires_grad_(true);
  const HvpOperator op(quadratic_loss(a, {x}), {x});
  const EigenResult first = power_iteration_topk(op, 2, 6, 0.0, 11);
  const EigenResult second = power_iteration_topk(op, 2, 6, 0.0, 11);
  const EigenResult other = power_iteration_topk(op, 2, 6, 0.0, 12);
  EXPECT_EQ(first.eigenvalues, second.eigenvalues);
  EXPECT_NE(first.eigenvalues, other.eigenvalues);  // 6 steps are not enough to forget the start vector
  EXPECT_EQ(first.iterations, 2 * 6);               // tol 0 never stops early
  EXPECT_FALSE(first.converged);
  // k larger than the dimension is clamped.
  EXPECT_EQ(power_iteration_topk(op, 20, 3, 1e-3, 0).eigenvalues.size(), 12u);
}

// A tiny float64 MLP 4 → 6 (tanh) → 3 with cross-entropy on 8 samples; the group is the first layer
// (30 parameters), whose Hessian block is indefinite in general.
TEST(PowerIterationTest, MatchesExplicitHessianOfTinyMlp) {
  const SingleThreadScope single_thread;
  torch::manual_seed(3);
  torch::nn::Linear fc1(4, 6);
  torch::nn::Linear fc2(6, 3);
  fc1->to(at::kDouble);
  fc2->to(at::kDouble);
  const at::Tensor inputs = torch::randn({8, 4}, kF64);
  const at::Tensor labels = torch::randint(0, 3, {8}, at::kLong);
  const at::Tensor loss = at::cross_entropy_loss(fc2(torch::tanh(fc1(inputs))), labels);
  const std::vector<at::Tensor> group = {fc1->weight, fc1->bias};
  const int64_t n = 30;

  // Explicit block by plain double loops of autograd::grad: row i = ∂g_i/∂θ.
  const std::vector<at::Tensor> g = torch::autograd::grad({loss}, group, {}, true, true);
  const at::Tensor g_flat = flat_cat(g);  // (30)
  at::Tensor hessian = at::zeros({n, n}, kF64);
  for (int64_t i = 0; i < n; ++i) {
    hessian[i] = flat_cat(torch::autograd::grad({g_flat[i]}, group, {}, true, false));
  }
  // HVP columns on basis vectors equal it.
  const HvpOperator op(loss, group);
  for (int64_t j = 0; j < n; ++j) {
    const at::Tensor column = op.apply_flat(at::zeros({n}, kF64).index_fill_(0, at::tensor({j}), 1.0));
    EXPECT_LT((column - hessian.select(1, j)).abs().max().item<double>(), 1e-10) << "column " << j;
  }

  const std::vector<double> expected = by_magnitude(at::linalg_eigvalsh((hessian + hessian.t()) / 2));
  const EigenResult result = power_iteration_topk(op, 3, 3000, 1e-13, 1);
  ASSERT_EQ(result.eigenvalues.size(), 3u);
  double worst = 0;
  for (int i = 0; i < 3; ++i) {
    const double relative = std::abs(result.eigenvalues[i] - expected[i]) / std::abs(expected[i]);
    worst = std::max(worst, relative);
    EXPECT_LT(relative, 1e-4) << "eigenvalue " << i << ": " << result.eigenvalues[i] << " vs " << expected[i];
  }
  std::printf("[ tiny MLP ] top-3 |λ| %.6g %.6g %.6g (4th %.6g), max relative error %.2e, %d HVPs\n", expected[0],
              expected[1], expected[2], expected[3], worst, result.iterations);
}

std::shared_ptr<Model> small_cnn_make() {
  torch::manual_seed(0);
  ModelOptions options;
  options.name = "small-cnn";
  options.in_channels = 1;
  options.image_size = 28;
  return model_create(options);
}

// The probe's options these tests were written for: the Hessian's, k = 5 (the paper's), tol 1e-3, the whole batch
// in one pass (the run's defaults are the Fisher's, k = 1, tol 0.01, chunks of the estimator's own); each test sets
// what it varies.
CurvatureOptions hessian_probe_options() {
  CurvatureOptions o;
  o.top_k = 5;
  o.tol = 1e-3;
  o.chunk = 0;
  o.estimator = CurvatureEstimator::kHessian;
  return o;
}

// A batch of 8 random 28×28 images and labels drawn from `seed`, and probe options for it (top-2, batch 8).
struct ProbeBatch {
  at::Tensor images;  // (8, 1, 28, 28)
  at::Tensor labels;  // (8)
  CurvatureOptions options = hessian_probe_options();
};
ProbeBatch probe_batch(uint64_t seed, int max_iters) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  ProbeBatch b;
  b.images = at::randn({8, 1, 28, 28}, gen);
  b.labels = at::randint(0, 10, {8}, gen, at::kLong);
  b.options.top_k = 2;
  b.options.max_iters = max_iters;
  b.options.batch = 8;
  return b;
}

// Warm starts: a second probe of the same model and batch, started from the first probe's eigenvectors, needs far
// fewer Hessian-vector products for the same eigenvalues.
TEST(CurvatureProbeTest, WarmStartFromThePreviousProbeConvergesInFewerProducts) {
  const SingleThreadScope single_thread;
  auto model = small_cnn_make();
  auto [images, labels, options] = probe_batch(11, 30);
  options.tol = 1e-4;
  std::vector<std::vector<at::Tensor>> warm;
  const auto cold = curvature_probe(*model, images, labels, options, nullptr, &warm);
  ASSERT_EQ(warm.size(), cold.size());
  const auto again = curvature_probe(*model, images, labels, options, nullptr, &warm);
  int cold_products = 0, warm_products = 0;
  for (size_t i = 0; i < cold.size(); ++i) {
    cold_products += cold[i].iterations;
    warm_products += again[i].iterations;
    if (cold[i].converged) {
      EXPECT_NEAR(again[i].lambda_max, cold[i].lambda_max, 1e-2 * std::abs(cold[i].lambda_max) + 1e-6) << cold[i].unit;
    }
  }
  EXPECT_LT(warm_products * 2, cold_products) << "cold " << cold_products << ", warm " << warm_products;
}

// Probing only later units runs the earlier ones without a graph: the probed units' eigenvalues are those of a probe
// of every unit (a unit's Hessian block does not depend on the units before it), and the skipped units are marked.
TEST(CurvatureProbeTest, ProbingLateUnitsAloneGivesTheSameEigenvalues) {
  const SingleThreadScope single_thread;
  auto model = small_cnn_make();
  const auto [images, labels, options] = probe_batch(13, 10);
  const auto all = curvature_probe(*model, images, labels, options);
  ASSERT_GE(all.size(), 3u);
  const std::vector<size_t> late{all.size() - 2, all.size() - 1};
  const auto some = curvature_probe(*model, images, labels, options, nullptr, nullptr, &late);
  ASSERT_EQ(some.size(), all.size());
  for (size_t i = 0; i < all.size(); ++i) {
    const bool probed = i >= late.front();
    EXPECT_EQ(some[i].probed, probed) << all[i].unit;
    if (!probed) continue;
    ASSERT_EQ(some[i].eigenvalues.size(), all[i].eigenvalues.size()) << all[i].unit;
    for (size_t k = 0; k < all[i].eigenvalues.size(); ++k) {
      EXPECT_NEAR(some[i].eigenvalues[k], all[i].eigenvalues[k], 1e-4 * std::abs(all[i].eigenvalues[k]) + 1e-7)
          << all[i].unit << " eigenvalue " << k;
    }
  }
}

// Lockstep rounds are curvature_probe with k = 1: every unit's eigenvalue and product count, from a cold start (the
// first round stops after kColdRoundPasses passes) and again from the last round's vectors, until each unit
// converges; the model is left as found.
TEST(CurvatureRoundTest, LockstepRoundsGiveTheProbesEigenvalues) {
  const SingleThreadScope single_thread;
  auto model = small_cnn_make();
  auto [images, labels, options] = probe_batch(17, 30);
  options.top_k = 1;
  options.tol = 1e-3;  // units stop at different products: each keeps its own count
  std::vector<std::pair<std::string, at::Tensor>> before;
  for (const auto& [name, tensor] : model_state(*model)) before.emplace_back(name, tensor.clone());
  std::vector<std::vector<at::Tensor>> warm;
  CurvatureOptions cold_options = options;
  cold_options.max_iters = CurvatureRound::kColdRoundPasses;
  const auto cold = curvature_probe(*model, images, labels, cold_options, nullptr, &warm);
  const auto warm_probe = curvature_probe(*model, images, labels, options, nullptr, &warm);
  CurvatureRound round(*model, images, labels, options);
  double seconds = -1;
  const auto first = round.run(&seconds);
  const auto second = round.run();
  EXPECT_GE(seconds, 0.0);
  EXPECT_FALSE(round.graphed());  // the CPU: eager passes
  ASSERT_EQ(first.size(), cold.size());
  ASSERT_EQ(first.size(), 4u);
  int most_products = 0;
  for (size_t u = 0; u < cold.size(); ++u) {
    EXPECT_TRUE(first[u].probed);
    EXPECT_EQ(first[u].iterations, cold[u].iterations) << cold[u].unit;
    EXPECT_EQ(second[u].iterations, warm_probe[u].iterations) << cold[u].unit;
    EXPECT_NEAR(first[u].lambda_max, cold[u].lambda_max, 1e-6 * std::abs(cold[u].lambda_max) + 1e-9) << cold[u].unit;
    EXPECT_NEAR(second[u].lambda_max, warm_probe[u].lambda_max, 1e-6 * std::abs(warm_probe[u].lambda_max) + 1e-9)
        << cold[u].unit;
    EXPECT_EQ(first[u].converged, cold[u].converged) << cold[u].unit;
    EXPECT_LE(first[u].iterations, CurvatureRound::kColdRoundPasses) << cold[u].unit;
    EXPECT_EQ(second[u].converged, warm_probe[u].converged) << cold[u].unit;
    most_products = std::max(most_products, second[u].iterations);
  }
  EXPECT_EQ(round.timing().passes, most_products);  // a pass per product of the slowest unit
  size_t i = 0;
  for (const auto& [name, tensor] : model_state(*model)) EXPECT_TRUE(at::equal(tensor, before[i++].second)) << name;
  for (const auto& p : model->parameters()) EXPECT_FALSE(p.grad().defined());
}

// A model without BatchNorm: two units, tanh(Linear(784 → 16)) then Linear(16 → 10).
class TanhMlp : public Model {
 public:
  TanhMlp() : Model("tanh-mlp") {
    auto hidden = register_module("hidden", torch::nn::Linear(28 * 28, 16));
    auto out = register_module("out", torch::nn::Linear(16, 10));
    std::vector<std::shared_ptr<torch::nn::Module>> h{hidden}, o{out};
    unit_add("hidden", h, [hidden](const at::Tensor& x) { return torch::tanh(hidden->forward(x.flatten(1))); });
    unit_add("out", o, [out](const at::Tensor& x) { return out->forward(x); });
  }
};

// Chunks weighted by their share of the batch give the whole batch's Hessian when nothing couples the samples: the
// same eigenvalues in 3 chunks (3, 3, 2 samples) as in one pass.
TEST(CurvatureRoundTest, ChunksWeightedByTheirShareGiveTheWholeBatchsProducts) {
  const SingleThreadScope single_thread;
  torch::manual_seed(3);
  TanhMlp model;
  auto [images, labels, options] = probe_batch(19, 12);
  options.top_k = 1;
  options.tol = 0;
  CurvatureRound whole(model, images, labels, options);
  options.chunk = 3;
  CurvatureRound chunked(model, images, labels, options);
  for (int round = 0; round < 2; ++round) {
    const auto a = whole.run();
    const auto b = chunked.run();
    ASSERT_EQ(a.size(), 2u);
    for (size_t u = 0; u < a.size(); ++u) {
      EXPECT_GT(std::abs(a[u].lambda_max), 1e-4) << a[u].unit;
      EXPECT_NEAR(b[u].lambda_max, a[u].lambda_max, 1e-5 * std::abs(a[u].lambda_max)) << a[u].unit;
      EXPECT_EQ(b[u].iterations, a[u].iterations) << a[u].unit;
    }
  }
}

// Each unit's per-sample gradients at the given labels, (n, numel_u) float64: the rows of the explicit Fisher block.
std::vector<at::Tensor> per_sample_gradients(Model& model, const at::Tensor& images, const at::Tensor& labels) {
  std::vector<std::vector<at::Tensor>> rows(model.units().size());
  for (int64_t i = 0; i < images.size(0); ++i) {
    at::Tensor h = images.narrow(0, i, 1);
    for (const Unit& unit : model.units()) h = unit.forward(h);
    const at::Tensor loss = at::cross_entropy_loss(h, labels.narrow(0, i, 1));
    for (size_t u = 0; u < model.units().size(); ++u) {
      const auto grads = torch::autograd::grad({loss}, model.units()[u].parameters(), {}, /*retain_graph=*/true);
      rows[u].push_back(flat_cat(grads));
    }
  }
  std::vector<at::Tensor> out;
  for (const auto& r : rows) out.push_back(at::stack(r));
  return out;
}

// The Fisher estimator's rounds against the explicit Monte-Carlo Fisher of a tiny model in float64: at the labels the
// round drew, each unit's λ is the top eigenvalue of (1/n) Σ_k s_k s_kᵀ, s_k the sum of chunk k's per-sample
// gradients (chunks of 1: every sample's own; of 2: pairs), computed here independently through its dual, the Gram
// matrix (1/n) S Sᵀ, which has the same nonzero eigenvalues. The second round draws the labels again from the model
// after an update (at the same uniform draws) and continues from the first's vectors.
TEST(CurvatureRoundTest, FisherRoundsGiveTheExplicitSampledFishersTopEigenvalue) {
  const SingleThreadScope single_thread;
  for (const int64_t chunk : {1, 2}) {
    SCOPED_TRACE(chunk);
    torch::manual_seed(5);
    TanhMlp model;
    model.to(at::kDouble);
    auto [images, labels, options] = probe_batch(29, 400);
    images = images.to(at::kDouble);
    options.top_k = 1;
    options.tol = 1e-13;
    options.chunk = chunk;
    options.estimator = CurvatureEstimator::kFisher;
    CurvatureRound round(model, images, labels, options);
    EXPECT_EQ(round.chunk(), chunk);
    round.run();
    EXPECT_LE(round.timing().passes, CurvatureRound::kColdRoundPasses);
    {
      const at::NoGradGuard no_grad;
      for (auto& p : model.parameters()) p.mul_(1.3);  // in place, as an optimizer step
    }
    const auto second = round.run();
    EXPECT_TRUE(model.is_training());  // eval mode for the round only
    const auto rows = per_sample_gradients(model, images, round.labels());
    ASSERT_EQ(second.size(), 2u);
    for (size_t u = 0; u < second.size(); ++u) {
      const at::Tensor sums = rows[u].view({-1, chunk, rows[u].size(1)}).sum(1);  // (n / chunk, numel)
      const at::Tensor gram = sums.matmul(sums.t()) / static_cast<double>(images.size(0));
      const double expected = at::linalg_eigvalsh(gram).max().item<double>();
      EXPECT_GT(expected, 1e-6) << second[u].unit;
      EXPECT_NEAR(second[u].lambda_max, expected, 1e-8 * expected) << second[u].unit;
      EXPECT_TRUE(second[u].converged) << second[u].unit;
      std::printf("[ tanh-mlp %s, chunk %ld ] Fisher λ %.8g, explicit %.8g (%d passes)\n", second[u].unit.c_str(),
                  static_cast<long>(chunk), second[u].lambda_max, expected, second[u].iterations);
    }
  }
}

// A token model (n, T) → (n, T, V) whose tokens see the ones before them (a causal running mean), as a GPT's do.
class TokenMixer : public Model {
 public:
  TokenMixer() : Model("token-mixer") {
    auto embed = register_module("embed", torch::nn::Embedding(6, 4));
    auto out = register_module("out", torch::nn::Linear(4, 6));
    std::vector<std::shared_ptr<torch::nn::Module>> e{embed}, o{out};
    unit_add("embed", e, [embed](const at::Tensor& x) {
      const at::Tensor h = torch::tanh(embed->forward(x));  // (n, T, d)
      const at::Tensor count = at::arange(1, x.size(1) + 1, h.options()).view({1, -1, 1});
      return h + h.cumsum(1) / count;
    });
    unit_add("out", o, [out](const at::Tensor& x) { return out->forward(x); });
  }
};

// The Fisher's rounds on a token model: one label drawn per token from that token's softmax, and the block
// (1/(n·T)) Σ_k s_k s_kᵀ, s_k the gradient of sample k's summed token losses — the Fisher of the training loss, the
// mean over tokens. Checked against the explicit matrix at the labels the round drew; a round that divided by the
// samples (n) would be T = 5 times too large, one that drew a label per sequence could not fill (n, T).
TEST(CurvatureRoundTest, FisherRoundsOnTokensDrawALabelPerTokenAndAverageOverTokens) {
  const SingleThreadScope single_thread;
  torch::manual_seed(7);
  TokenMixer model;
  model.to(at::kDouble);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(31);
  const at::Tensor tokens = at::randint(0, 6, {8, 5}, gen, at::kLong);
  const at::Tensor targets = at::randint(0, 6, {8, 5}, gen, at::kLong);
  CurvatureOptions options;
  options.top_k = 1;
  options.tol = 1e-13;
  options.max_iters = 400;
  options.batch = 8;
  options.chunk = 1;
  options.estimator = CurvatureEstimator::kFisher;
  CurvatureRound round(model, tokens, targets, options);
  round.run();
  const auto curv = round.run();
  const at::Tensor drawn = round.labels();
  ASSERT_EQ(drawn.sizes(), targets.sizes());
  EXPECT_FALSE(drawn.equal(targets));  // drawn from the model, not the batch's targets
  ASSERT_EQ(curv.size(), 2u);
  for (size_t u = 0; u < curv.size(); ++u) {
    std::vector<at::Tensor> rows;
    for (int64_t i = 0; i < tokens.size(0); ++i) {
      at::Tensor h = tokens.narrow(0, i, 1);
      for (const Unit& unit : model.units()) h = unit.forward(h);
      const at::Tensor loss = at::cross_entropy_loss(h.reshape({-1, 6}), drawn.narrow(0, i, 1).reshape({-1}), {},
                                                     at::Reduction::Sum);
      rows.push_back(flat_cat(torch::autograd::grad({loss}, model.units()[u].parameters())));
    }
    const at::Tensor s_rows = at::stack(rows);  // (n, numel)
    const double expected =
        at::linalg_eigvalsh(s_rows.matmul(s_rows.t()) / static_cast<double>(tokens.numel())).max().item<double>();
    EXPECT_GT(expected, 1e-6) << curv[u].unit;
    EXPECT_NEAR(curv[u].lambda_max, expected, 1e-8 * expected) << curv[u].unit;
  }
}

// The labels are drawn from the model's own prediction, not taken from the batch: with the output biased to class 3
// every draw is 3; and for the output layer, where the Hessian block is exactly the Gauss-Newton block (the logits are
// linear in its weights), the Fisher over many draws (each input repeated 16 times) comes close to the Hessian's λ.
TEST(CurvatureRoundTest, FisherLabelsComeFromTheModelAndApproachTheOutputLayersHessian) {
  const SingleThreadScope single_thread;
  torch::manual_seed(7);
  TanhMlp model;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(31);
  const at::Tensor inputs = at::randn({24, 1, 28, 28}, gen);
  const at::Tensor truth = at::randint(0, 10, {24}, gen, at::kLong);
  CurvatureOptions options = hessian_probe_options();
  options.top_k = 1;
  options.max_iters = 60;
  options.tol = 1e-7;
  options.batch = 24 * 16;
  CurvatureRound hessian(model, inputs, truth, options);
  options.estimator = CurvatureEstimator::kFisher;
  options.chunk = 1;
  CurvatureRound fisher(model, inputs.repeat({16, 1, 1, 1}), truth.repeat({16}), options);
  hessian.run();
  fisher.run();
  const auto h = hessian.run();
  const auto f = fisher.run();
  const double relative = std::abs(f[1].lambda_max - h[1].lambda_max) / h[1].lambda_max;
  std::printf("[ tanh-mlp out ] Hessian λ %.6g, Fisher λ %.6g (%.1f %%); hidden: %.6g vs %.6g\n", h[1].lambda_max,
              f[1].lambda_max, 100 * relative, h[0].lambda_max, f[0].lambda_max);
  EXPECT_LT(relative, 0.2);  // 15.5 % measured: the top eigenvalue of a sampled matrix lies above its mean's

  {
    const at::NoGradGuard no_grad;
    auto out_bias = model.named_parameters()["out.bias"];
    out_bias.zero_();
    out_bias[3] = 40.0;
  }
  CurvatureOptions small = options;
  small.batch = 8;
  CurvatureRound biased(model, inputs, truth, small);
  biased.run();
  EXPECT_TRUE(at::all(biased.labels() == 3).item<bool>()) << biased.labels();
}

// curv_cudnn off: every forward of a round (the Fisher's passes, which draw its labels) and of a per-unit probe runs
// with cuDNN disabled, and the setting the training step had comes back afterwards.
TEST(CurvatureRoundTest, ProbesWithoutCudnnRunEveryForwardWithItOffAndRestoreIt) {
  const SingleThreadScope single_thread;
  struct Recorder : Model {
    std::vector<bool> seen;
    Recorder() : Model("recorder") {
      auto fc = register_module("fc", torch::nn::Linear(28 * 28, 10));
      std::vector<std::shared_ptr<torch::nn::Module>> m{fc};
      unit_add("fc", m, [this, fc](const at::Tensor& x) {
        seen.push_back(at::globalContext().userEnabledCuDNN());
        return fc->forward(x.flatten(1));
      });
    }
  };
  const bool before = at::globalContext().userEnabledCuDNN();
  at::globalContext().setUserEnabledCuDNN(true);
  for (const bool cudnn : {false, true}) {
    SCOPED_TRACE(cudnn);
    torch::manual_seed(2);
    Recorder model;
    auto [images, labels, options] = probe_batch(3, 4);
    options.top_k = 1;
    options.cudnn = cudnn;
    options.estimator = CurvatureEstimator::kFisher;
    CurvatureRound round(model, images, labels, options);
    round.run();
    options.estimator = CurvatureEstimator::kHessian;
    curvature_probe(model, images, labels, options);
    EXPECT_GE(model.seen.size(), 3u);  // the passes' chunks (two passes at least), the probe's forward
    EXPECT_EQ(std::count(model.seen.begin(), model.seen.end(), cudnn), static_cast<long>(model.seen.size()));
    EXPECT_TRUE(at::globalContext().userEnabledCuDNN());
  }
  at::globalContext().setUserEnabledCuDNN(before);
}

// curv_cudnn auto: the Fisher's probes leave cuDNN out on a model with grouped (depthwise) convolutions only; the
// Hessian's keep it everywhere.
TEST(CurvatureRoundTest, CudnnAutoIsOffForTheFisherOnGroupedConvolutionsOnly) {
  for (const std::string name : {"small-cnn", "resnet18", "efficientnet-b0"}) {
    SCOPED_TRACE(name);
    ModelOptions options;
    options.name = name;
    const auto model = model_create(options);
    EXPECT_EQ(probe_cudnn_auto(*model, CurvatureEstimator::kFisher), name != "efficientnet-b0");
    EXPECT_TRUE(probe_cudnn_auto(*model, CurvatureEstimator::kHessian));
  }
}

TEST(CurvatureProbeTest, SmallCnnOneEntryPerUnitAndModelUnchanged) {
  const SingleThreadScope single_thread;
  auto model = small_cnn_make();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  const at::Tensor images = at::randn({12, 1, 28, 28}, gen);       // (12, 1, 28, 28), fp32
  const at::Tensor labels = at::randint(0, 10, {12}, gen, at::kLong);  // (12)
  CurvatureOptions options = hessian_probe_options();
  options.top_k = 3;
  options.max_iters = 4;
  options.batch = 8;

  model->eval();
  std::vector<std::pair<std::string, at::Tensor>> before;
  for (const auto& [name, tensor] : model_state(*model)) before.emplace_back(name, tensor.clone());
  const at::Tensor cpu_state_before = at::globalContext().defaultGenerator(at::kCPU).get_state();

  double wall = 0;
  const std::vector<UnitCurvature> probed = curvature_probe(*model, images, labels, options, &wall);

  ASSERT_EQ(probed.size(), model->units().size());
  double unit_seconds = 0;
  for (size_t i = 0; i < probed.size(); ++i) {
    const UnitCurvature& entry = probed[i];
    EXPECT_EQ(entry.unit, model->units()[i].name);
    ASSERT_EQ(entry.eigenvalues.size(), 3u) << entry.unit;
    for (size_t j = 0; j < entry.eigenvalues.size(); ++j) {
      EXPECT_TRUE(std::isfinite(entry.eigenvalues[j])) << entry.unit;
      if (j > 0) EXPECT_GE(std::abs(entry.eigenvalues[j - 1]), std::abs(entry.eigenvalues[j])) << entry.unit;
    }
    EXPECT_NE(entry.eigenvalues[0], 0.0) << entry.unit;
    EXPECT_EQ(entry.lambda_max, *std::max_element(entry.eigenvalues.begin(), entry.eigenvalues.end()));
    EXPECT_GE(entry.iterations, 3 * 2) << entry.unit;  // at least two steps per eigenvalue before a stop
    EXPECT_LE(entry.iterations, 3 * 4) << entry.unit;
    unit_seconds += entry.seconds;
  }
  EXPECT_GT(wall, 0.0);
  EXPECT_GE(wall, unit_seconds);

  // Every parameter and buffer (BN running statistics, num_batches_tracked) bit-identical, mode and RNG restored.
  const auto after = model_state(*model);
  ASSERT_EQ(after.size(), before.size());
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(after[i].first, before[i].first);
    EXPECT_TRUE(at::equal(after[i].second, before[i].second)) << before[i].first;
  }
  EXPECT_FALSE(model->is_training());
  for (const auto& p : model->parameters()) EXPECT_FALSE(p.grad().defined());
  EXPECT_TRUE(at::equal(at::globalContext().defaultGenerator(at::kCPU).get_state(), cpu_state_before));

  // BatchNorm runs in train mode whatever the model's mode, and the probe is deterministic for a seed: a model in
  // train mode gives the same numbers. In eval mode BN would use the running statistics and the loss would differ.
  model->train();
  const std::vector<UnitCurvature> again = curvature_probe(*model, images, labels, options);
  EXPECT_TRUE(model->is_training());
  for (size_t i = 0; i < probed.size(); ++i) EXPECT_EQ(again[i].eigenvalues, probed[i].eigenvalues);
  std::printf("[ small-cnn ] probe of %zu units (batch 8, k 3, 4 iters): %.3f s; fc λ_max %.4g\n", probed.size(),
              wall, probed.back().lambda_max);
}

TEST(CurvatureControllerTest, ProbeSamplesFittingTheRoom) {
  EXPECT_EQ(probe_samples_fitting(100, 10, -1, 32), 32);   // no limit: every sample
  EXPECT_EQ(probe_samples_fitting(100, 10, 250, 32), 15);  // (250 − 100) / 10
  EXPECT_EQ(probe_samples_fitting(100, 10, 1e9, 32), 32);  // at most the batch
  EXPECT_EQ(probe_samples_fitting(100, 10, 119, 32), 0);   // not even kMinProbeSamples
  EXPECT_EQ(probe_samples_fitting(100, 0, 250, 32), 32);   // nothing per sample: all or nothing
  EXPECT_EQ(probe_samples_fitting(300, 0, 250, 32), 0);
}

// The controller's schedule of lockstep rounds over a run of `pace->total_steps` whose training time after `step`
// steps is training_s(step): control windows every 50 steps, the first round there (costing first_s, then
// pace->round_cost_s each), the next one T_curv (200) steps later at the earliest and whenever round_pace_due says
// so, projected from the rate since the last round. Returns the rounds' steps; `pace` is left as after the last window.
std::vector<int64_t> paced_round_steps(const std::function<double(int64_t)>& training_s, double first_s,
                                       RoundPace* pace) {
  std::vector<int64_t> rounds;
  int64_t next = -1;
  for (int64_t step = 50; step < pace->total_steps; step += 50) {
    pace->training_s = training_s(step);
    if (!rounds.empty()) {
      pace->step_s = (pace->training_s - training_s(pace->last_round_step)) /
                     static_cast<double>(step - pace->last_round_step);
    }
    if (next >= 0 && step < next) continue;
    if (!rounds.empty() && !round_pace_due(*pace, step)) continue;
    pace->probe_s += rounds.empty() ? first_s : pace->round_cost_s;
    pace->last_round_step = step;
    rounds.push_back(step);
    next = step + 200;
  }
  return rounds;
}

// Paced lockstep rounds, on the H100's numbers for ResNet-18 (15 epochs of 521 steps at 2.6 ms, a first round of
// 0.70 s at step 50, warm rounds of 0.069 s, a 5 % budget): the budget left after the first round (1.016 − 0.70 s)
// pays for 4 rounds, and they split the steps after the first into 5 equal stretches, each round at the first window
// after its mark: rounds at 50, 1650, 3200, 4750, 6300, no stretch longer than 1600 steps (3.07 epochs), 0.976 s
// spent. The credit advanced by the first round's unpaid share (the rule before) probed at 50, 1450, 3250, 5250,
// 7050: stretches of up to 2000 steps, as seed 0 did on the H100.
TEST(CurvatureControllerTest, PacedRoundsSpreadTheRunsBudgetEvenly) {
  const int64_t total = 15 * 521;
  const double step_s = 2.6e-3;
  RoundPace pace;
  pace.budget = 0.05;
  pace.round_cost_s = 0.069;
  pace.total_steps = total;
  const auto rounds = paced_round_steps([&](int64_t step) { return step_s * static_cast<double>(step); }, 0.70, &pace);
  EXPECT_EQ(rounds, (std::vector<int64_t>{50, 1650, 3200, 4750, 6300}));
  EXPECT_LE(pace.probe_s, pace.budget * step_s * static_cast<double>(total));
  // Not before the last round, not at or past the end, nothing the budget cannot pay for.
  pace.last_round_step = 6300;
  pace.training_s = step_s * 6400;
  EXPECT_FALSE(round_pace_due(pace, 6300));
  EXPECT_FALSE(round_pace_due(pace, total));
  pace.probe_s = 0.0;  // 1.016 s left: m = 14 rounds, one due (7815 − 6300) / 15 = 101 steps after the last
  EXPECT_FALSE(round_pace_due(pace, 6400));
  EXPECT_TRUE(round_pace_due(pace, 6450));
  pace.probe_s = 1.0;
  EXPECT_FALSE(round_pace_due(pace, 7800));
}

// The same run with its first 600 steps at 4.5 ms (a first epoch's warm-up) and 2.5 ms after: projected from the
// rate since the last round, the rounds come at 50, 550, 2050, 3500, 4950, 6400, no stretch over 1500 steps; projected
// from the run's average (its slow start counted for every step left) they came at 50, 550, 1400, 2500, 3850, 5850,
// and the last 1965 steps went unprobed.
TEST(CurvatureControllerTest, PacedRoundsProjectTheRunFromTheRateSinceTheLastRound) {
  const auto training_s = [](int64_t step) {
    return 4.5e-3 * static_cast<double>(std::min<int64_t>(step, 600)) +
           2.5e-3 * static_cast<double>(std::max<int64_t>(0, step - 600));
  };
  RoundPace pace;
  pace.budget = 0.05;
  pace.round_cost_s = 0.069;
  pace.total_steps = 15 * 521;
  EXPECT_EQ(paced_round_steps(training_s, 0.66, &pace), (std::vector<int64_t>{50, 550, 2050, 3500, 4950, 6400}));
  EXPECT_LE(pace.probe_s, pace.budget * training_s(pace.total_steps));
}

// A memory meter whose room and readings the test makes up: measure() runs the probe and returns the next reading.
class ScriptedMeter : public MemoryMeter {
 public:
  double room = -1;
  std::vector<double> readings;
  size_t measured = 0;
  MemoryStats window() override { return {}; }
  void restart() override {}
  double room_bytes() override { return room; }
  double measure(const std::function<void()>& fn) override {
    fn();
    return readings.at(measured++);
  }
};

// The probe's batch is sized to the room the run's plan leaves: the first time a unit is the earliest probed, two
// one-product probes (2 and 4 samples: 120 and 140 bytes, so 100 fixed + 10 a sample) measure it; room 250 gives
// 15 of the 32 samples. A probe above its prediction (15 samples measured at 300 against 250) raises the unit's fixed
// bytes, and the next probe shrinks to 10 samples; room for less than 2 samples skips the probe. Without a limit
// the whole batch, measured once.
TEST(CurvatureControllerTest, AProbeUsesTheSamplesThatFitTheRoomThePlanLeaves) {
  const SingleThreadScope single_thread;
  auto model = small_cnn_make();
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (const auto& item : model->named_parameters()) named.emplace_back(item.key(), item.value());
  Sgd sgd(named, SgdOptions{});
  LossScaler scaler(LossScalerOptions{}, torch::kCPU);
  TrainStep step(*model, sgd, scaler, StepOptions{}, torch::kCPU);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(4);
  const at::Tensor images = at::randn({32, 1, 28, 28}, gen);
  const at::Tensor labels = at::randint(0, 10, {32}, gen, at::kLong);
  const auto make = [&]() {
    CurvatureControllerOptions co;
    co.lr_mean_one = false;
    co.probe = hessian_probe_options();
    co.ctrl_every = 1;
    co.budget = 0;  // every unit at every probe: the stem is always the earliest
    co.lr_scaling = false;
    co.probe.top_k = 1;
    co.probe.max_iters = 2;
    co.probe.batch = 32;
    co.probe.every_steps = 1;
    for (int64_t i = 0; i < 32; ++i) co.probe_samples.push_back(100 + i);
    return std::make_unique<CurvatureController>(co, *model, sgd, step, images, labels);
  };
  const auto probe_at = [&](CurvatureController& c, ScriptedMeter& meter, int64_t at_step) {
    StepContext ctx;
    ctx.step = at_step;
    ctx.batch = 8;
    ctx.memory = &meter;
    const Events events = c.after_step(ctx);
    EXPECT_EQ(events.size(), 1u);
    return events.empty() ? Json() : events[0].fields;
  };
  {
    auto c = make();
    ScriptedMeter meter;
    meter.room = 250;
    meter.readings = {120, 140, 300, 200};
    const Json first = probe_at(*c, meter, 1);
    EXPECT_EQ(meter.measured, 3u);  // 2 and 4 samples, then the probe
    ASSERT_TRUE(first.contains("probe_samples"));
    EXPECT_EQ(first["probe_samples"].size(), 15u);
    EXPECT_EQ(first["probe_samples"][0].get<int64_t>(), 100);
    EXPECT_DOUBLE_EQ(first["probe_bytes"].get<double>(), 300.0);
    EXPECT_DOUBLE_EQ(first["room_bytes"].get<double>(), 250.0);
    const Json second = probe_at(*c, meter, 2);  // fixed now 150: (250 − 150) / 10
    EXPECT_EQ(meter.measured, 4u);
    EXPECT_EQ(second["probe_samples"].size(), 10u);
    meter.room = 165;  // (165 − 150) / 10 = 1 sample
    const Json third = probe_at(*c, meter, 3);
    EXPECT_EQ(third["skipped"].get<std::string>(), "no memory");
    EXPECT_EQ(meter.measured, 4u);
  }
  {
    auto c = make();
    ScriptedMeter meter;
    meter.readings = {500};
    const Json whole = probe_at(*c, meter, 1);
    EXPECT_EQ(meter.measured, 1u);
    EXPECT_EQ(whole["probe_samples"].size(), 32u);
    EXPECT_TRUE(whole["room_bytes"].is_null());
  }
}

// ProbePrecision::kBF16 (bench_curvature's comparison; not a run option): the products run in bf16 with fp32
// accumulation. The output unit's λ_max is the fp32 probe's to bf16's rounding; deeper units' can be far off (here
// block2, even in sign; on the H100 EfficientNet-B0's units 2–72 %), which is why runs probe in fp32. The
// call gives back the run's autocast and the fused BatchNorm kernel switch. A probe that ignored the option would
// give the fp32 values exactly.
TEST(CurvatureProbeTest, Bf16ProductsAreNotBitEqualAndRestoreTheRunsState) {
  const SingleThreadScope single_thread;
  auto model = small_cnn_make();
  auto [images, labels, options] = probe_batch(17, 25);
  options.top_k = 1;
  options.tol = 1e-5;
  const auto fp32 = curvature_probe(*model, images, labels, options);
  options.precision = ProbePrecision::kBF16;
  const auto bf16 = curvature_probe(*model, images, labels, options);
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
  EXPECT_TRUE(batch_norm_kernel_enabled());
  ASSERT_EQ(fp32.size(), bf16.size());
  const UnitCurvature& out32 = fp32.back();
  const UnitCurvature& out16 = bf16.back();
  EXPECT_LT(std::abs(out16.lambda_max - out32.lambda_max) / std::abs(out32.lambda_max), 0.05) << out32.unit;
  EXPECT_NE(out16.lambda_max, out32.lambda_max) << "the bf16 probe gave the fp32 value: its arithmetic was fp32";
  for (size_t i = 0; i < fp32.size(); ++i) {
    std::printf("[ small-cnn %s ] λ_max fp32 %.6g bf16 %.6g\n", fp32[i].unit.c_str(), fp32[i].lambda_max,
                bf16[i].lambda_max);
  }
}

#ifdef TRIACCEL_WITH_CUDA
// On the GPU each unit's products after the first replay a CUDA graph: the eigenvalues and product counts equal
// the eager probe's (same kernels on the same saved tensors), every unit with parameters reports graphed, and on
// the default stream (where a capture is not allowed) the probe stays eager. A graph that replayed stale inputs
// (v not copied in) or read a freed output would give different eigenvalues; one never captured fails `graphed`.
// ResNet-18 on the GPU (weights from `seed`) and a batch of 16 random CIFAR-sized images and labels.
struct GpuProbeRig {
  std::shared_ptr<Model> model;
  at::Tensor images;  // (16, 3, 32, 32)
  at::Tensor labels;  // (16)
};
GpuProbeRig resnet18_on_gpu(uint64_t seed) {
  torch::manual_seed(seed);
  ModelOptions model_options;
  model_options.name = "resnet18";
  GpuProbeRig rig{model_create(model_options), torch::randn({16, 3, 32, 32}, torch::kCUDA),
                  torch::randint(0, 10, {16}, torch::TensorOptions().device(torch::kCUDA).dtype(at::kLong))};
  rig.model->to(torch::kCUDA);
  return rig;
}

TEST(CurvatureProbeTest, CudaGraphedProductsGiveTheEagerEigenvalues) {
  TRIACCEL_SKIP_WITHOUT_GPU();
  const auto [model, images, labels] = resnet18_on_gpu(21);
  CurvatureOptions options = hessian_probe_options();
  options.top_k = 2;
  options.max_iters = 6;
  options.tol = 0.0;  // every eigenvalue takes all its products: the counts must match exactly
  options.batch = 16;
  const std::vector<size_t> late{model->units().size() - 3, model->units().size() - 2, model->units().size() - 1};
  torch::cuda::synchronize();
  std::vector<UnitCurvature> eager, graphed, default_stream;
  {
    const c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());
    options.cuda_graphs = false;
    eager = curvature_probe(*model, images, labels, options, nullptr, nullptr, &late);
    options.cuda_graphs = true;
    graphed = curvature_probe(*model, images, labels, options, nullptr, nullptr, &late);
    torch::cuda::synchronize();
  }
  default_stream = curvature_probe(*model, images, labels, options, nullptr, nullptr, &late);
  // A warm start converges in a few products, fewer than a capture costs: those products stay eager.
  std::vector<std::vector<at::Tensor>> warm;
  std::vector<UnitCurvature> warm_probe;
  {
    const c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());
    curvature_probe(*model, images, labels, options, nullptr, &warm, &late);
    warm_probe = curvature_probe(*model, images, labels, options, nullptr, &warm, &late);
    torch::cuda::synchronize();
  }
  for (const size_t u : late) EXPECT_FALSE(warm_probe[u].graphed) << warm_probe[u].unit;
  for (const size_t u : late) {
    EXPECT_FALSE(eager[u].graphed) << eager[u].unit;
    EXPECT_TRUE(graphed[u].graphed) << graphed[u].unit;
    EXPECT_FALSE(default_stream[u].graphed) << default_stream[u].unit;
    EXPECT_EQ(graphed[u].iterations, eager[u].iterations) << eager[u].unit;
    ASSERT_EQ(graphed[u].eigenvalues.size(), eager[u].eigenvalues.size()) << eager[u].unit;
    for (size_t k = 0; k < eager[u].eigenvalues.size(); ++k) {
      EXPECT_NEAR(graphed[u].eigenvalues[k], eager[u].eigenvalues[k], 1e-4 * std::abs(eager[u].eigenvalues[k]) + 1e-6)
          << eager[u].unit << " eigenvalue " << k;
    }
    std::printf("[ resnet18 %s ] λ eager %.6g graphed %.6g (%d products)\n", eager[u].unit.c_str(),
                eager[u].lambda_max, graphed[u].lambda_max, graphed[u].iterations);
  }
}

// The captured pass reads the weights as they are at each replay: after an in-place update (what the optimizer does) a
// replayed round gives the eager round's eigenvalues at the new weights, not the old ones. Both estimators; the vectors
// live in host memory and the replayed pass copies them in and out.
TEST(CurvatureRoundTest, ReplayedPassesReadTheCurrentWeights) {
  TRIACCEL_SKIP_WITHOUT_GPU();
  for (const CurvatureEstimator estimator : {CurvatureEstimator::kHessian, CurvatureEstimator::kFisher}) {
    SCOPED_TRACE(enum_name(estimator));
    const auto [model, images, labels] = resnet18_on_gpu(23);
    CurvatureOptions options = hessian_probe_options();
    options.top_k = 1;
    options.max_iters = 4;
    options.tol = 0.0;
    options.batch = 16;
    options.estimator = estimator;
    options.chunk = estimator == CurvatureEstimator::kFisher ? 4 : 0;
    torch::cuda::synchronize();
    const c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());
    CurvatureOptions eager_options = options;
    eager_options.cuda_graphs = false;
    CurvatureRound graphed(*model, images, labels, options);
    CurvatureRound eager(*model, images, labels, eager_options);
    graphed.run();
    const auto old_weights = eager.run();
    ASSERT_TRUE(graphed.graphed());
    EXPECT_FALSE(eager.graphed());
    EXPECT_GT(graphed.graph_bytes(), 0);
    {
      const torch::NoGradGuard no_grad;
      // In place, as an optimizer step. The Fisher reads the model in eval mode, where this untrained model's
      // BatchNorm does not normalize: × 1.5 on every layer saturates its softmax (every λ 0), × 1.05 moves it.
      const double scale = estimator == CurvatureEstimator::kFisher ? 1.05 : 1.5;
      for (auto& p : model->parameters()) p.mul_(scale);
    }
    const auto replayed = graphed.run();
    const auto reference = eager.run();
    torch::cuda::synchronize();
    EXPECT_GT(graphed.timing().replay_s, 0.0);
    EXPECT_TRUE(at::equal(graphed.labels(), eager.labels()));
    int moved = 0;  // units whose eigenvalue the update changed: a replay of stale weights would miss them
    for (size_t u = 0; u < reference.size(); ++u) {
      EXPECT_NEAR(replayed[u].lambda_max, reference[u].lambda_max, 1e-3 * std::abs(reference[u].lambda_max) + 1e-6)
          << reference[u].unit;
      EXPECT_EQ(replayed[u].iterations, reference[u].iterations) << reference[u].unit;
      EXPECT_GT(std::abs(reference[u].lambda_max), 1e-6) << reference[u].unit;
      moved +=
          std::abs(reference[u].lambda_max - old_weights[u].lambda_max) > 0.05 * std::abs(reference[u].lambda_max);
      std::printf("[ resnet18 %s %s ] λ eager %.6g replayed %.6g\n", enum_name(estimator),
                  reference[u].unit.c_str(), reference[u].lambda_max, replayed[u].lambda_max);
    }
    EXPECT_GE(moved, 3);
  }
}
#endif

void expect_user_error(const CurvatureOptions& options, const std::string& message) {
  try {
    options.validate();
    ADD_FAILURE() << "expected UserError: " << message;
  } catch (const UserError& e) {
    EXPECT_EQ(std::string(e.what()), message);
  }
}

TEST(CurvatureOptionsTest, ValidateNamesTheFlag) {
  CurvatureOptions options;
  EXPECT_NO_THROW(options.validate());
  EXPECT_EQ(options.top_k, 1);          // the run's curv_top_k: λ_max (the paper's k is 5)
  EXPECT_EQ(options.batch, 32);         // b_curv
  EXPECT_EQ(options.every_steps, 200);  // T_curv

  CurvatureOptions bad = options;
  bad.top_k = 0;
  expect_user_error(bad, "curv_top_k must be >= 1, got 0");
  bad = options;
  bad.max_iters = -2;
  expect_user_error(bad, "curv_max_iters must be >= 1, got -2");
  bad = options;
  bad.tol = -0.5;
  expect_user_error(bad, "curvature probe: tol must be a number >= 0, got -0.5");
  bad = options;
  bad.tol = std::nan("");
  EXPECT_THROW(bad.validate(), UserError);
  bad = options;
  bad.batch = 0;
  expect_user_error(bad, "curv_batch must be >= 1, got 0");
  bad = options;
  bad.every_steps = 0;
  expect_user_error(bad, "curv_every must be >= 1, got 0");

  // The probe validates too, before touching the model.
  auto model = small_cnn_make();
  bad = options;
  bad.top_k = 0;
  EXPECT_THROW(curvature_probe(*model, at::zeros({2, 1, 28, 28}), at::zeros({2}, at::kLong), bad), UserError);
}

}  // namespace
}  // namespace triaccel
