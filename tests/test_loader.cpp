// Loader: deterministic order per (seed, epoch), every sample once per epoch, and the augmentation reference's
// exact pixels (padding, crop offset, flip, normalization, cutout); on a GPU, the CUDA kernel against the reference.
#include "test_util.h"
#include "triaccel/core/errors.h"
#include "triaccel/data/loader.h"
#ifdef TRIACCEL_WITH_CUDA
#include "triaccel/kernels/augment.h"
#endif

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <tuple>
#include <vector>

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

Dataset random_dataset(int64_t n, int64_t side, uint64_t seed) {
  // n random 3×side×side images with bytes in [1, 255]; label i mod 10.
  torch::manual_seed(seed);
  Dataset d;
  d.name = "random";
  d.images = torch::randint(1, 256, {n, 3, side, side}, torch::kLong).to(torch::kByte);
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
  augment_reference(images, index, shift, flip, 2, at::Tensor(), 0, {0.f}, {1.f / 255.f}, out);
  EXPECT_TRUE(torch::allclose(out[0][0], images[0][0].to(torch::kFloat)));
  EXPECT_EQ(out[1][0][0][0].item<float>(), 0.f);  // padding
  EXPECT_EQ(out[1][0][2][2].item<float>(), 1.f);  // the image's (0, 0) moved to (2, 2)
  EXPECT_EQ(out[2][0][0][0].item<float>(), 4.f);  // mirrored row
  EXPECT_EQ(out[2][0][0][3].item<float>(), 1.f);
  // Normalization: (v / 255 − mean) / std.
  at::Tensor norm = torch::empty({1, 1, 4, 4});
  augment_reference(images, torch::zeros({1}, torch::kLong), at::Tensor(), at::Tensor(), 4, at::Tensor(), 0, {0.5f},
                    {0.25f}, norm);
  EXPECT_NEAR(norm[0][0][0][1].item<float>(), (2.f / 255.f - 0.5f) / 0.25f, 1e-6);
}

// The set of zeroed pixels of out[b] (any channel) as a (H, W) bool mask.
at::Tensor zero_mask(const at::Tensor& out, int64_t b) { return out[b].eq(0).any(0); }

// A (H, W) mask with rows [y0, y1) × columns [x0, x1) set.
at::Tensor box(int64_t H, int64_t W, int64_t y0, int64_t y1, int64_t x0, int64_t x1) {
  at::Tensor m = torch::zeros({H, W}, torch::kBool);
  m.narrow(0, y0, y1 - y0).narrow(1, x0, x1 - x0).fill_(true);
  return m;
}

TEST(LoaderTest, CutoutReferencePixels) {
  // One 1×6×6 image with values 1..36; mean 0.5, std 0.25: no image pixel normalizes to 0 (that needs v = 127.5)
  // and the crop padding normalizes to −2, so the zeros are exactly the cutout squares.
  const at::Tensor images = torch::arange(1, 37).to(torch::kByte).view({1, 1, 6, 6});
  const at::Tensor index = torch::zeros({5}, torch::kLong);
  // Crop offsets with pad 2: (2, 2) is the identity; sample 3 is shifted by (0, 0), sample 4 flipped.
  const at::Tensor shift = torch::tensor({2, 2, 2, 2, 2, 2, 0, 0, 2, 2}, torch::kLong).view({5, 2});
  const at::Tensor flip = torch::tensor({0, 0, 0, 0, 1}, torch::kByte);
  // Centres (cy, cx); size 3 covers rows [cy − 1, cy + 2).
  const at::Tensor centres = torch::tensor({2, 3, 0, 0, 5, 5, 3, 1, 1, 0}, torch::kLong).view({5, 2});
  at::Tensor out = torch::empty({5, 1, 6, 6});
  augment_reference(images, index, shift, flip, 2, centres, 3, {0.5f}, {0.25f}, out);
  EXPECT_TRUE(torch::equal(zero_mask(out, 0), box(6, 6, 1, 4, 2, 5)));  // inside: 3×3 = 9 pixels
  EXPECT_TRUE(torch::equal(zero_mask(out, 1), box(6, 6, 0, 2, 0, 2)));  // top-left corner, clipped: 2×2
  EXPECT_TRUE(torch::equal(zero_mask(out, 2), box(6, 6, 4, 6, 4, 6)));  // bottom-right corner, clipped: 2×2
  EXPECT_TRUE(torch::equal(zero_mask(out, 3), box(6, 6, 2, 5, 0, 3)));  // in output coordinates, whatever the shift
  EXPECT_TRUE(torch::equal(zero_mask(out, 4), box(6, 6, 0, 3, 0, 2)));  // and the flip
  EXPECT_EQ(out.eq(0).sum().item<int64_t>(), 9 + 4 + 4 + 9 + 6);
  // Outside the squares the pixels are those of the same crop and flip without cutout.
  at::Tensor plain = torch::empty({5, 1, 6, 6});
  augment_reference(images, index, shift, flip, 2, at::Tensor(), 0, {0.5f}, {0.25f}, plain);
  EXPECT_TRUE(torch::equal(out, torch::where(out.eq(0), out, plain)));
  EXPECT_EQ(plain.eq(0).sum().item<int64_t>(), 0);
  // Sample 3 (shift (0, 0)) keeps its padding at −2 outside the square: the square is the mean, not black.
  EXPECT_EQ(out[3][0][0][4].item<float>(), -2.f);
  // Sample 4, flipped: its (0, 5) is the image's (0, 0) = 1, normalized.
  EXPECT_FLOAT_EQ(out[4][0][0][5].item<float>(), (1.f / 255.f - 0.5f) / 0.25f);

  // Even size 2 covers rows [cy − 1, cy + 1); size 1 is the centre pixel; size 6 = the whole image from (3, 3).
  // No crop or flip (undefined): cutout alone.
  const at::Tensor one = torch::zeros({1}, torch::kLong);
  for (const auto& [size, cy, cx, expect] :
       std::vector<std::tuple<int64_t, int64_t, int64_t, at::Tensor>>{{2, 4, 1, box(6, 6, 3, 5, 0, 2)},
                                                                      {1, 5, 2, box(6, 6, 5, 6, 2, 3)},
                                                                      {6, 3, 3, box(6, 6, 0, 6, 0, 6)},
                                                                      {6, 0, 5, box(6, 6, 0, 3, 2, 6)}}) {
    at::Tensor o = torch::empty({1, 1, 6, 6});
    augment_reference(images, one, at::Tensor(), at::Tensor(), 2, torch::tensor({cy, cx}, torch::kLong).view({1, 2}),
                      size, {0.5f}, {0.25f}, o);
    EXPECT_TRUE(torch::equal(zero_mask(o, 0), expect)) << "size " << size << " at (" << cy << ", " << cx << ")";
  }
}

TEST(LoaderTest, CutoutDrawsArePerSeedAndEpochAndLeaveCropsAlone) {
  // 40 random 3×8×8 images with no byte normalizing to 0 (mean 0.5, std 0.25: v = 127.5 would).
  const Dataset d = random_dataset(40, 8, 5);
  const std::vector<float> mean(3, 0.5f), std(3, 0.25f);
  LoaderOptions o;
  o.batch_size = 40;
  o.augment = true;
  o.pad = 2;
  o.seed = 11;
  LoaderOptions oc = o;
  oc.cutout = 3;
  Loader plain(d, mean, std, o, torch::kCPU), cut(d, mean, std, oc, torch::kCPU), cut2(d, mean, std, oc, torch::kCPU);
  for (int64_t epoch : {0, 1}) {
    plain.epoch_begin(epoch);
    cut.epoch_begin(epoch);
    const auto [p, lp] = plain.batch(0, 40);
    const auto [c, lc] = cut.batch(0, 40);
    EXPECT_TRUE(torch::equal(lp, lc));                                 // same order
    EXPECT_TRUE(torch::equal(c, torch::where(c.eq(0), c, p)));         // same crops and flips outside the squares
    for (int64_t b = 0; b < 40; ++b) {
      const at::Tensor zeros = c[b].eq(0);
      const at::Tensor m = zeros.any(0);
      EXPECT_TRUE(torch::equal(zeros, m.unsqueeze(0).expand_as(zeros)));  // every channel
      // One square of side 3, clipped to 2 at the borders: a full rectangle with sides in {2, 3}.
      const int64_t rows = m.any(1).sum().item<int64_t>(), cols = m.any(0).sum().item<int64_t>();
      EXPECT_TRUE(rows >= 2 && rows <= 3 && cols >= 2 && cols <= 3) << b << ": " << rows << "×" << cols;
      EXPECT_EQ(m.sum().item<int64_t>(), rows * cols) << b;
    }
  }
  // A pure function of (seed, epoch): another loader, and the same loader going back to an epoch, draw the same.
  cut.epoch_begin(0);
  const at::Tensor e0 = cut.batch(0, 40).first;
  cut2.epoch_begin(1);
  cut2.epoch_begin(0);
  EXPECT_TRUE(torch::equal(e0, cut2.batch(0, 40).first));
  cut2.epoch_begin(1);
  EXPECT_FALSE(torch::equal(e0.eq(0), cut2.batch(0, 40).first.eq(0)));  // new squares in a new epoch
  // Cutout without crop and flip.
  oc.augment = false;
  Loader only(d, mean, std, oc, torch::kCPU);
  const at::Tensor c = only.batch(0, 40).first;
  const int64_t zeros = c.eq(0).sum().item<int64_t>();
  EXPECT_GE(zeros, 40 * 3 * 4);
  EXPECT_LE(zeros, 40 * 3 * 9);
}

// A served dataset of n samples (sample i is the value i) that records what the loader tells it.
class RecordingSource final : public SampleSource {
 public:
  explicit RecordingSource(int64_t n) : n_(n) {}
  int64_t size() const override { return n_; }
  void epoch_begin(const std::vector<int64_t>& order) override { begun.push_back(order); }
  void epoch_ahead(const std::vector<int64_t>& order) override { ahead.push_back({fetched, order}); }
  std::pair<at::Tensor, at::Tensor> fetch(int64_t, const std::vector<int64_t>& ids) override {
    fetched += static_cast<int64_t>(ids.size());
    const at::Tensor x = torch::tensor(ids, torch::kLong).to(torch::kFloat).view({-1, 1});
    return {x, x.to(torch::kLong).view({-1})};
  }
  std::vector<std::vector<int64_t>> begun;
  std::vector<std::pair<int64_t, std::vector<int64_t>>> ahead;  // (samples fetched before, the order)
  int64_t fetched = 0;

 private:
  int64_t n_;
};

TEST(LoaderTest, ASourceIsToldTheNextEpochsOrderOnceTheEpochsLastSampleIsFetched) {
  auto source = std::make_shared<RecordingSource>(23);
  const Dataset d = dataset_from_source(source, "train");  // fetches its one-sample example
  LoaderOptions o;
  o.batch_size = 10;
  o.seed = 5;
  Loader loader(d, {}, {}, o, torch::kCPU);  // tells the source epoch 0's order
  ASSERT_EQ(source->fetched, 1);
  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    if (epoch > 0) loader.epoch_begin(epoch);
    for (int64_t off = 0; off < 23; off += 10) {
      EXPECT_EQ(source->ahead.size(), static_cast<size_t>(epoch));  // not before the epoch's last samples
      const auto [x, y] = loader.batch(off, std::min<int64_t>(10, 23 - off));
      EXPECT_EQ(std::vector<int64_t>(y.data_ptr<int64_t>(), y.data_ptr<int64_t>() + y.numel()),
                loader.sample_indices(off, x.size(0)));
    }
  }
  ASSERT_EQ(source->begun.size(), 2u);  // epoch 0 (the constructor's), epoch 1
  ASSERT_EQ(source->ahead.size(), 2u);
  EXPECT_EQ(source->ahead[0].first, 1 + 23);  // right after epoch 0's last batch
  EXPECT_EQ(source->ahead[0].second, source->begun[1]);  // epoch 1's order, as epoch_begin(1) then gave it
  EXPECT_NE(source->ahead[0].second, source->begun[0]);
  EXPECT_EQ(source->ahead[1].first, 1 + 46);
  loader.epoch_begin(2);
  EXPECT_EQ(source->ahead[1].second, source->begun[2]);
}

TEST(LoaderTest, CutoutOutOfRangeIsRefused) {
  const Dataset d = counting_dataset(8);  // 4×4 images
  LoaderOptions o;
  o.cutout = 4;
  EXPECT_NO_THROW({ Loader whole(d, {0.f}, {1.f}, o, torch::kCPU); });  // the whole image
  o.cutout = 5;
  try {
    Loader too_large(d, {0.f}, {1.f}, o, torch::kCPU);
    FAIL() << "expected UserError";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("cutout 5 is larger than the 4×4 images"), std::string::npos) << e.what();
  }
  o.cutout = -1;
  EXPECT_THROW(o.validate(), UserError);
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
  const at::Tensor centres = torch::randint(0, 32, {37, 2}, torch::kLong);
  // No cutout, cutout 12 (even), 7 (odd), 32 (the whole side); with and without crop and flip.
  for (const int64_t size : {0, 12, 7, 32}) {
    for (const bool crop_flip : {true, false}) {
      const at::Tensor s = crop_flip ? shift : at::Tensor(), f = crop_flip ? flip : at::Tensor();
      const at::Tensor cut = size > 0 ? centres : at::Tensor();
      at::Tensor ref = torch::empty({37, 3, 32, 32});
      augment_reference(images, index, s, f, 4, cut, size, mean, std, ref);
      // At least a corner-clipped square per image: ⌈size/2⌉² pixels.
      if (size > 0) EXPECT_GE(ref.eq(0).sum().item<int64_t>(), 37 * 3 * ((size + 1) / 2) * ((size + 1) / 2));
      for (auto format : {at::MemoryFormat::Contiguous, at::MemoryFormat::ChannelsLast}) {
        at::Tensor out =
            torch::full({37, 3, 32, 32}, NAN, torch::TensorOptions().device(torch::kCUDA)).contiguous(format);
        augment_cuda(images.cuda(), index.cuda(), s.defined() ? s.cuda() : s, f.defined() ? f.cuda() : f, 4,
                     cut.defined() ? cut.cuda() : cut, size, mean, std, out);
        const at::Tensor got = out.cpu();
        EXPECT_LT((got - ref).abs().max().item<float>(), 1e-5) << "cutout " << size;  // NaN poison would fail too
        EXPECT_TRUE(torch::equal(got.eq(0), ref.eq(0))) << "cutout " << size;     // the same pixels zeroed
      }
    }
  }
}

TEST(LoaderCudaTest, LoaderWithCutoutMatchesOnCpuAndGpu) {
  TRIACCEL_SKIP_WITHOUT_GPU();
  const Dataset d = random_dataset(70, 16, 4);
  LoaderOptions o;
  o.batch_size = 32;
  o.augment = true;
  o.cutout = 8;
  o.seed = 9;
  const std::vector<float> mean = {0.49f, 0.48f, 0.45f}, std = {0.25f, 0.24f, 0.26f};
  Loader cpu(d, mean, std, o, torch::kCPU);
  Loader gpu(d, mean, std, o, torch::kCUDA);
  for (int64_t epoch : {0, 3}) {
    cpu.epoch_begin(epoch);
    gpu.epoch_begin(epoch);
    for (int64_t off = 0; off < 70; off += 32) {
      const int64_t n = std::min<int64_t>(32, 70 - off);
      const auto [xc, yc] = cpu.batch(off, n);
      const auto [xg, yg] = gpu.batch(off, n);
      EXPECT_TRUE(torch::equal(yc, yg.cpu()));
      EXPECT_LT((xc - xg.cpu()).abs().max().item<float>(), 1e-5);
      EXPECT_TRUE(torch::equal(xc.eq(0), xg.cpu().eq(0)));
    }
  }
}
#endif

}  // namespace
}  // namespace triaccel
