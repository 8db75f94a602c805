// Loader: deterministic order per (seed, epoch), every sample once per epoch, and the augmentation reference's
// exact pixels (padding, crop offset, flip, normalization); on a GPU, the CUDA kernel against the reference.
#include "test_util.h"
#include "triaccel/data/loader.h"
#ifdef TRIACCEL_WITH_CUDA
#include "triaccel/kernels/augment.h"
#endif

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace triaccel {
namespace {

Dataset counting_dataset(int64_t n) {
  // Image i is filled with the value i (mod 256); label i mod 10.
  Dataset d;
  d.name = "counting";
  d.images = torch::arange(n).remainder(256).to(torch::kByte).view({n, 1, 1, 1}).expand({n, 1, 4, 4}).contiguous();
  d.labels = torch::arange(n).remainder(10);
  d.num_classes = 10;
  return d;
}

TEST(LoaderTest, EveryEpochVisitsEverySampleOnceInASeededOrder) {
  const Dataset d = counting_dataset(103);
  LoaderOptions o;
  o.batch_size = 10;
  o.seed = 7;
  Loader a(d, {0.f}, {1.f / 255.f}, o, torch::kCPU);
  Loader b(d, {0.f}, {1.f / 255.f}, o, torch::kCPU);
  EXPECT_EQ(a.steps_per_epoch(), 11);
  auto epoch_values = [](Loader& l, int64_t epoch) {
    l.epoch_begin(epoch);
    std::vector<at::Tensor> parts;
    for (int64_t off = 0; off < l.size(); off += 10) {
      // With mean 0 and std 1/255 the normalized value equals the raw byte: the sample id.
      parts.push_back(l.batch(off, std::min<int64_t>(10, l.size() - off)).first.select(2, 0).select(2, 0).flatten());
    }
    return torch::cat(parts).round().to(torch::kLong);
  };
  const at::Tensor e0 = epoch_values(a, 0);
  EXPECT_TRUE(torch::equal(std::get<0>(e0.sort()), torch::arange(103)));  // each sample exactly once
  EXPECT_TRUE(torch::equal(e0, epoch_values(b, 0)));                       // same seed, same order
  EXPECT_FALSE(torch::equal(e0, epoch_values(a, 1)));                      // a new order each epoch
  EXPECT_FALSE(torch::equal(e0, torch::arange(103)));                      // shuffled
}

TEST(LoaderTest, AugmentReferencePixels) {
  // One 1×4×4 image with values 1..16, mean 0, std 1/255 (normalized value = raw byte).
  const at::Tensor images = torch::arange(1, 17).to(torch::kByte).view({1, 1, 4, 4});
  const at::Tensor index = torch::zeros({3}, torch::kLong);
  // Sample 0: offset (pad, pad) = identity; sample 1: offset (0, 0) = shifted down-right by pad;
  // sample 2: identity crop, flipped.
  const at::Tensor shift = torch::tensor({2, 2, 0, 0, 2, 2}, torch::kLong).view({3, 2});
  const at::Tensor flip = torch::tensor({0, 0, 1}, torch::kByte);
  at::Tensor out = torch::empty({3, 1, 4, 4});
  augment_reference(images, index, shift, flip, 2, {0.f}, {1.f / 255.f}, out);
  EXPECT_TRUE(torch::allclose(out[0][0], images[0][0].to(torch::kFloat)));
  EXPECT_EQ(out[1][0][0][0].item<float>(), 0.f);  // padding
  EXPECT_EQ(out[1][0][2][2].item<float>(), 1.f);  // the image's (0, 0) moved to (2, 2)
  EXPECT_EQ(out[2][0][0][0].item<float>(), 4.f);  // mirrored row
  EXPECT_EQ(out[2][0][0][3].item<float>(), 1.f);
  // Normalization: (v / 255 − mean) / std.
  at::Tensor norm = torch::empty({1, 1, 4, 4});
  augment_reference(images, torch::zeros({1}, torch::kLong), at::Tensor(), at::Tensor(), 4, {0.5f}, {0.25f}, norm);
  EXPECT_NEAR(norm[0][0][0][1].item<float>(), (2.f / 255.f - 0.5f) / 0.25f, 1e-6);
}

#ifdef TRIACCEL_WITH_CUDA
TEST(LoaderCudaTest, AugmentKernelMatchesReference) {
  TRIACCEL_SKIP_WITHOUT_GPU();
  torch::manual_seed(3);
  const at::Tensor images = torch::randint(0, 256, {50, 3, 32, 32}, torch::kLong).to(torch::kByte);
  const at::Tensor index = torch::randint(0, 50, {37}, torch::kLong);
  const at::Tensor shift = torch::randint(0, 9, {37, 2}, torch::kLong);
  const at::Tensor flip = torch::randint(0, 2, {37}, torch::kLong).to(torch::kByte);
  const std::vector<float> mean = {0.49f, 0.48f, 0.45f}, std = {0.25f, 0.24f, 0.26f};
  at::Tensor ref = torch::empty({37, 3, 32, 32});
  augment_reference(images, index, shift, flip, 4, mean, std, ref);
  for (auto format : {at::MemoryFormat::Contiguous, at::MemoryFormat::ChannelsLast}) {
    at::Tensor out = torch::full({37, 3, 32, 32}, NAN, torch::TensorOptions().device(torch::kCUDA)).contiguous(format);
    augment_cuda(images.cuda(), index.cuda(), shift.cuda(), flip.cuda(), 4, mean, std, out);
    EXPECT_LT((out.cpu() - ref).abs().max().item<float>(), 1e-5);  // NaN poison would fail here too
  }
}
#endif

}  // namespace
}  // namespace triaccel
