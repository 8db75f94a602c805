// train/grad_buckets: the gradient reduction overlapped with backward, on a chain of four Linear layers and a made-up
// collective (no ranks: `start` records what it is given, and its wait doubles the bucket, as the sum of two ranks
// holding the same gradients would). Checked: the buckets (last parameters first, one layer each at the cap used),
// their start in order while backward still runs (before the first layer's gradient exists), the weighted sums in
// every gradient, bf16 on the wire, what an unarmed pass, an unused parameter and an empty share reduce, and the
// single bucket started after backward when bucket_bytes is 0.
#include "triaccel/train/grad_buckets.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <vector>

namespace triaccel {
namespace {

struct Started {
  int64_t elements;
  at::ScalarType dtype;
  bool first_layer_grad_defined;  // whether backward had reached the first layer when the bucket started
};

class GradBucketsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    torch::manual_seed(3);
    for (int i = 0; i < 4; ++i) layers.push_back(torch::nn::Linear(16, 16));
    for (auto& l : layers) {
      params.push_back(l->weight);
      params.push_back(l->bias);
    }
  }

  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x;
    for (auto& l : layers) h = torch::tanh(l->forward(h));
    return h.square().sum();
  }

  // Each parameter's gradient of one plain backward on x (the reference), gradients cleared after.
  std::vector<at::Tensor> reference(const at::Tensor& x) {
    forward(x).backward();
    std::vector<at::Tensor> g;
    for (auto& p : params) {
      g.push_back(p.grad().clone());
      p.mutable_grad() = at::Tensor();
    }
    return g;
  }

  // A collective of two ranks holding the same gradients: the wait doubles the bucket.
  GradBucketStart doubling() {
    return [this](const at::Tensor& flat) {
      started.push_back({flat.numel(), flat.scalar_type(), params[0].grad().defined()});
      at::Tensor t = flat;
      return DistWork([t]() mutable { t.mul_(2); });
    };
  }

  std::vector<torch::nn::Linear> layers;
  std::vector<at::Tensor> params;
  std::vector<Started> started;
};

// 16×16 weights (1024 bytes) and 16 biases (64): a cap of 1100 bytes holds one layer.
constexpr int64_t kLayerBytes = 1100;

TEST_F(GradBucketsTest, BucketsStartInOrderWhileBackwardRunsAndHoldTheSums) {
  const at::Tensor x = torch::randn({8, 16});
  const std::vector<at::Tensor> ref = reference(x);
  GradBuckets buckets(params, GradBucketsOptions{kLayerBytes, at::ScalarType::Undefined, 0}, doubling());
  // Last layer first: {bias, weight} of layer 3, then 2, 1, 0.
  const std::vector<std::vector<size_t>> expected{{7, 6}, {5, 4}, {3, 2}, {1, 0}};
  EXPECT_EQ(buckets.buckets(), expected);

  buckets.arm();
  forward(x).backward();
  // Every bucket started from the hooks, in order; the first three before backward reached the first layer.
  EXPECT_EQ(buckets.started_during_backward(), 4);
  ASSERT_EQ(started.size(), 4u);
  for (size_t b = 0; b < 3; ++b) EXPECT_FALSE(started[b].first_layer_grad_defined) << "bucket " << b;
  EXPECT_TRUE(started[3].first_layer_grad_defined);
  buckets.finish();
  // Two ranks' sum of the gradient: 2 × the gradient, in place in every .grad.
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(torch::allclose(params[i].grad(), 2.0 * ref[i], 1e-6, 1e-7)) << "parameter " << i;
  }

  // The next step: the same again (the state was reset), not the buckets' sums of the last one added.
  for (auto& p : params) p.mutable_grad() = at::Tensor();
  started.clear();
  buckets.arm();
  forward(x).backward();
  buckets.finish();
  EXPECT_EQ(started.size(), 4u);
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(torch::allclose(params[i].grad(), 2.0 * ref[i], 1e-6, 1e-7)) << "parameter " << i;
  }
}

// tail_bytes: the gradients backward produces last (layer 0's, 1088 bytes) make a bucket of their own, so the
// bucket before it (layer 1) starts before backward reaches layer 0; at the cap alone (two layers a bucket) layers 1
// and 0 would share the last bucket, left to reduce after backward.
TEST_F(GradBucketsTest, TheLastGradientsMakeASmallBucketOfTheirOwn) {
  const at::Tensor x = torch::randn({8, 16});
  const std::vector<at::Tensor> ref = reference(x);
  GradBucketsOptions options{2 * kLayerBytes, at::ScalarType::Undefined, 0};
  options.tail_bytes = kLayerBytes;
  GradBuckets buckets(params, options, doubling());
  const std::vector<std::vector<size_t>> expected{{7, 6, 5, 4}, {3, 2}, {1, 0}};
  EXPECT_EQ(buckets.buckets(), expected);
  buckets.arm();
  forward(x).backward();
  buckets.finish();
  ASSERT_EQ(started.size(), 3u);
  EXPECT_FALSE(started[1].first_layer_grad_defined);  // layer 1's bucket went while layer 0's backward was to come
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(torch::allclose(params[i].grad(), 2.0 * ref[i], 1e-6, 1e-7)) << "parameter " << i;
  }
}

// A pass abandoned midway (a CUDA graph's capture that failed in backward; the step then runs eagerly): arm() starts
// the next pass from the first bucket, so its gradients are taken and reduced, not refused as late.
TEST_F(GradBucketsTest, APassAbandonedMidwayLeavesNothingForTheNextArm) {
  const at::Tensor x = torch::randn({8, 16});
  const std::vector<at::Tensor> ref = reference(x);
  GradBuckets buckets(params, GradBucketsOptions{kLayerBytes, at::ScalarType::Undefined, 0}, doubling());
  buckets.arm();
  // Only the last layer's parameters: its bucket starts, the others wait for gradients that never come.
  (layers[3]->forward(x).square().sum()).backward();
  ASSERT_EQ(buckets.started_during_backward(), 1);
  for (auto& p : params) p.mutable_grad() = at::Tensor();
  started.clear();
  buckets.arm();
  forward(x).backward();
  buckets.finish();
  EXPECT_EQ(started.size(), 4u);
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(torch::allclose(params[i].grad(), 2.0 * ref[i], 1e-6, 1e-7)) << "parameter " << i;
  }
}

TEST_F(GradBucketsTest, Bf16OnTheWireIsSummedAndCastBack) {
  const at::Tensor x = torch::randn({8, 16});
  const std::vector<at::Tensor> ref = reference(x);
  GradBuckets buckets(params, GradBucketsOptions{kLayerBytes, at::kBFloat16, 0}, doubling());
  buckets.arm();
  forward(x).backward();
  buckets.finish();
  ASSERT_EQ(started.size(), 4u);
  for (const Started& s : started) EXPECT_EQ(s.dtype, at::kBFloat16);
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(params[i].grad().scalar_type(), at::kFloat);
    // bf16 keeps 8 bits of mantissa: within 2^-8 of each value (the fp32 reduction is exact here).
    EXPECT_TRUE(torch::allclose(params[i].grad(), 2.0 * ref[i], 1.0 / 256, 1e-6)) << "parameter " << i;
  }
}

// What the memory planner and NeuroFlux's block plans count for the buckets is what they allocate: 4 bytes a float32
// parameter, 6 with bf16 on the wire, however the parameters are split into buckets.
TEST_F(GradBucketsTest, TheirBytesAreWhatThePlansCount) {
  int64_t n = 0;
  for (const auto& p : params) n += p.numel();
  for (const GradBucketsOptions& o : {GradBucketsOptions{kLayerBytes, at::ScalarType::Undefined, 0},
                                      GradBucketsOptions{kLayerBytes, at::kBFloat16, 0},
                                      GradBucketsOptions{0, at::kBFloat16, 0}}) {
    GradBuckets buckets(params, o, doubling());
    EXPECT_EQ(buckets.bytes(), grad_buckets_bytes(n, o));
  }
  EXPECT_EQ(grad_buckets_bytes(n, GradBucketsOptions{}), 4 * n);
  EXPECT_EQ(grad_buckets_bytes(n, GradBucketsOptions{0, at::kBFloat16, 0}), 6 * n);
}

TEST_F(GradBucketsTest, UnarmedPassesAccumulateAndTheLastPassReducesTheirSum) {
  const at::Tensor x1 = torch::randn({8, 16}), x2 = torch::randn({8, 16});
  std::vector<at::Tensor> ref = reference(x1);
  const std::vector<at::Tensor> ref2 = reference(x2);
  GradBuckets buckets(params, GradBucketsOptions{kLayerBytes, at::ScalarType::Undefined, 0}, doubling());
  forward(x1).backward();  // a micro-batch before the last: no reduction
  EXPECT_TRUE(started.empty());
  // A product through torch::autograd::grad (as the curvature probe's) runs no reduction either.
  torch::autograd::grad({forward(x2)}, {params[7]});
  EXPECT_TRUE(started.empty());
  buckets.arm();
  forward(x2).backward();  // the last micro-batch
  buckets.finish();
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(torch::allclose(params[i].grad(), 2.0 * (ref[i] + ref2[i]), 1e-5, 1e-6)) << "parameter " << i;
  }
}

TEST_F(GradBucketsTest, AnUnusedLayerAndAnEmptyShareReduceZerosOrWhatTheyHold) {
  const at::Tensor x = torch::randn({8, 16});
  GradBuckets buckets(params, GradBucketsOptions{kLayerBytes, at::ScalarType::Undefined, 0}, doubling());
  // The last pass skips layer 0: its bucket (the last) cannot start from a hook; finish() starts it with zeros.
  buckets.arm();
  at::Tensor h = x;
  for (size_t l = 1; l < layers.size(); ++l) h = torch::tanh(layers[l]->forward(h));
  h.square().sum().backward();
  EXPECT_EQ(buckets.started_during_backward(), 3);
  buckets.finish();
  ASSERT_EQ(started.size(), 4u);
  EXPECT_TRUE(params[0].grad().defined());
  EXPECT_EQ(params[0].grad().abs().max().item<float>(), 0.0f);
  EXPECT_GT(params[7].grad().abs().max().item<float>(), 0.0f);

  // A rank without samples: no backward, every bucket starts in finish(), in order, with zeros.
  for (auto& p : params) p.mutable_grad() = at::Tensor();
  started.clear();
  buckets.arm();
  buckets.finish();
  ASSERT_EQ(started.size(), 4u);
  for (const auto& p : params) EXPECT_EQ(p.grad().abs().max().item<float>(), 0.0f);
}

// A rank whose step failed midway (its step ran out of memory): the buckets backward had not started carry NaN, so
// every rank's sums there come out non-finite; those already sent hold the sums as they were. Once every bucket has
// started there is nothing left to carry the NaN (false). The next pass reduces plain sums again.
TEST_F(GradBucketsTest, APoisonedPassSendsNaNInTheBucketsNotYetStarted) {
  const at::Tensor x = torch::randn({8, 16});
  const std::vector<at::Tensor> ref = reference(x);
  GradBuckets buckets(params, GradBucketsOptions{kLayerBytes, at::ScalarType::Undefined, 0}, doubling());
  buckets.arm();
  (layers[3]->forward(x).square().sum()).backward();  // only the last layer's bucket starts
  ASSERT_EQ(buckets.started_during_backward(), 1);
  EXPECT_TRUE(buckets.finish_poisoned());
  ASSERT_EQ(started.size(), 4u);
  EXPECT_TRUE(torch::isfinite(params[7].grad()).all().item<bool>());
  for (size_t i = 0; i < 6; ++i) EXPECT_TRUE(torch::isnan(params[i].grad()).all().item<bool>()) << "parameter " << i;

  for (auto& p : params) p.mutable_grad() = at::Tensor();
  buckets.arm();
  forward(x).backward();
  EXPECT_FALSE(buckets.finish_poisoned());  // every bucket had gone: nothing carries the NaN
  for (auto& p : params) p.mutable_grad() = at::Tensor();
  buckets.arm();
  forward(x).backward();
  buckets.finish();
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(torch::allclose(params[i].grad(), 2.0 * ref[i], 1e-6, 1e-7)) << "parameter " << i;
  }
}

// A channels_last convolution weight (a CNN's on the GPU): its gradient after finish() is its place in the bucket,
// laid out as the weight, holding the doubled gradient; the bucket's memory is the gradient's (no copy back).
TEST(GradBucketsLayoutTest, AGradientIsItsBucketSlotInTheParametersLayout) {
  torch::manual_seed(5);
  const at::Tensor w = torch::randn({4, 3, 3, 3}).contiguous(at::MemoryFormat::ChannelsLast).set_requires_grad(true);
  const at::Tensor b = torch::randn({4}).set_requires_grad(true);
  const at::Tensor x = torch::randn({2, 3, 5, 5}).contiguous(at::MemoryFormat::ChannelsLast);
  const auto loss = [&] { return at::conv2d(x, w, b).square().sum(); };
  loss().backward();
  const at::Tensor ref_w = w.grad().clone(), ref_b = b.grad().clone();
  w.mutable_grad() = at::Tensor();
  b.mutable_grad() = at::Tensor();
  at::Tensor flat;
  GradBuckets buckets({w, b}, GradBucketsOptions{1 << 20, at::ScalarType::Undefined, 0}, [&](const at::Tensor& t) {
    flat = t;
    at::Tensor u = t;
    return DistWork([u]() mutable { u.mul_(2); });
  });
  buckets.arm();
  loss().backward();
  buckets.finish();
  EXPECT_TRUE(at::allclose(w.grad(), ref_w * 2, 1e-5, 1e-5));
  EXPECT_TRUE(at::allclose(b.grad(), ref_b * 2, 1e-5, 1e-5));
  EXPECT_EQ(w.grad().strides(), w.strides()) << "the slot keeps the weight's channels_last layout";
  ASSERT_TRUE(flat.defined());
  EXPECT_TRUE(w.grad().is_alias_of(flat));
  EXPECT_TRUE(b.grad().is_alias_of(flat));
}

TEST_F(GradBucketsTest, ZeroBytesIsOneBucketStartedAfterBackward) {
  const at::Tensor x = torch::randn({8, 16});
  const std::vector<at::Tensor> ref = reference(x);
  GradBuckets buckets(params, GradBucketsOptions{0, at::ScalarType::Undefined, 0}, doubling());
  ASSERT_EQ(buckets.buckets().size(), 1u);
  buckets.arm();
  forward(x).backward();
  EXPECT_TRUE(started.empty());  // nothing while backward ran
  buckets.finish();
  EXPECT_EQ(buckets.started_during_backward(), 0);
  ASSERT_EQ(started.size(), 1u);
  EXPECT_EQ(started[0].elements, 4 * (16 * 16 + 16));
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::allclose(params[i].grad(), 2.0 * ref[i])) << i;
}

}  // namespace
}  // namespace triaccel
