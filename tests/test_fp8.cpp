// FP8 (train/fp8.h): the CPU reference of quantize / dequantize, the delayed scale, and the CUDA kernel against the
// reference byte for byte.
//
// Tolerances: a value whose x·scale is a normal FP8 number comes back within half an ulp, i.e. relative error
// ≤ 2^-4 for E4M3 (3 mantissa bits) and ≤ 2^-3 for E5M2 (2 bits); the scale is a power of two, so it adds no error.
// The tests also require the largest error seen to exceed the next format's bound down (2^-5 / 2^-4): a cast to a
// wider type, or E4M3 bytes where E5M2 was asked, would pass the bound alone. Everything else is exact: bytes, scales.
#include "triaccel/core/errors.h"
#include "triaccel/train/fp8.h"

#ifdef TRIACCEL_WITH_CUDA
#include "triaccel/kernels/fp8_quantize.h"
#endif

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace triaccel {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNan = std::numeric_limits<float>::quiet_NaN();

std::vector<int64_t> bytes_of(const at::Tensor& q) {
  const at::Tensor b = q.contiguous().view(at::kByte).to(at::kLong).cpu();
  return std::vector<int64_t>(b.data_ptr<int64_t>(), b.data_ptr<int64_t>() + b.numel());
}

std::vector<int64_t> quantize_bytes(const std::vector<float>& x, float scale, Fp8Format format) {
  return bytes_of(fp8_quantize(torch::tensor(x), scale, format));
}

TEST(Fp8FormatTest, MaxValuesAndDtypes) {
  EXPECT_EQ(fp8_max(Fp8Format::kE4M3), 448.0);
  EXPECT_EQ(fp8_max(Fp8Format::kE5M2), 57344.0);
  EXPECT_EQ(fp8_dtype(Fp8Format::kE4M3), at::kFloat8_e4m3fn);
  EXPECT_EQ(fp8_dtype(Fp8Format::kE5M2), at::kFloat8_e5m2);
  // The largest finite byte of each format decodes to fp8_max.
  const at::Tensor e4m3 = torch::tensor({0x7e}, torch::kUInt8).view(at::kFloat8_e4m3fn).to(at::kFloat);
  const at::Tensor e5m2 = torch::tensor({0x7b}, torch::kUInt8).view(at::kFloat8_e5m2).to(at::kFloat);
  EXPECT_EQ(e4m3.item<float>(), 448.f);
  EXPECT_EQ(e5m2.item<float>(), 57344.f);
}

// Values whose x·scale spans the format's normal range [min normal, fmax], both signs; the max relative error of
// the round trip.
double round_trip_max_relative_error(Fp8Format format, float scale, at::ScalarType dtype) {
  const double min_normal = format == Fp8Format::kE4M3 ? std::ldexp(1.0, -6) : std::ldexp(1.0, -14);
  torch::manual_seed(58);
  const int64_t n = 20000;
  const at::Tensor log2 = torch::rand({n}, torch::kDouble) * (std::log2(fp8_max(format)) - std::log2(min_normal)) +
                          std::log2(min_normal);
  const at::Tensor sign = torch::where(torch::rand({n}) < 0.5, -1.0, 1.0).to(torch::kDouble);
  // Rounded to dtype first, so x is exactly what the quantizer sees; x·scale stays within the normal range.
  const at::Tensor x = (sign * torch::exp2(log2) / scale).to(dtype).to(torch::kDouble);
  const at::Tensor keep = (x.abs() * scale >= min_normal) & (x.abs() * scale <= fp8_max(format));
  const at::Tensor q = fp8_quantize(x.to(dtype), scale, format);
  EXPECT_EQ(q.scalar_type(), fp8_dtype(format));
  const at::Tensor back = fp8_dequantize(q, scale, at::kDouble);
  const at::Tensor rel = ((back - x).abs() / x.abs()).masked_select(keep);
  EXPECT_GT(rel.numel(), n / 2);
  return rel.max().item<double>();
}

TEST(Fp8QuantizeTest, RoundTripE4M3WithinHalfAnUlp) {
  for (float scale : {1.f, 0.125f, 1024.f}) {
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      const double err = round_trip_max_relative_error(Fp8Format::kE4M3, scale, dtype);
      EXPECT_LE(err, std::ldexp(1.0, -4)) << "scale " << scale << " " << dtype;
      EXPECT_GT(err, std::ldexp(1.0, -5)) << "scale " << scale << " " << dtype;
    }
  }
}

TEST(Fp8QuantizeTest, RoundTripE5M2WithinHalfAnUlp) {
  for (float scale : {1.f, 0.25f, 64.f}) {
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {  // float16 ends at 65504: x = 57344 / 0.25 is inf
      const double err = round_trip_max_relative_error(Fp8Format::kE5M2, scale, dtype);
      EXPECT_LE(err, std::ldexp(1.0, -3)) << "scale " << scale << " " << dtype;
      EXPECT_GT(err, std::ldexp(1.0, -4)) << "scale " << scale << " " << dtype;
    }
  }
}

TEST(Fp8QuantizeTest, SaturatesAtFmaxInsteadOfNan) {
  // torch's own cast gives NaN for 470 in e4m3fn and inf for 61440 in e5m2; the quantizer clamps first.
  const std::vector<float> big = {460.f, 470.f, 500.f, 1e30f, kInf, -470.f, -1e30f, -kInf};
  EXPECT_EQ(quantize_bytes(big, 1.f, Fp8Format::kE4M3),
            (std::vector<int64_t>{0x7e, 0x7e, 0x7e, 0x7e, 0x7e, 0xfe, 0xfe, 0xfe}));
  const std::vector<float> huge = {59392.f, 61440.f, 1e30f, kInf, -61440.f, -kInf};
  EXPECT_EQ(quantize_bytes(huge, 1.f, Fp8Format::kE5M2), (std::vector<int64_t>{0x7b, 0x7b, 0x7b, 0x7b, 0xfb, 0xfb}));
  // Saturation applies to x·scale: 100 × 8 = 800 > 448.
  EXPECT_EQ(quantize_bytes({100.f, -100.f}, 8.f, Fp8Format::kE4M3), (std::vector<int64_t>{0x7e, 0xfe}));
  // A NaN in x is the canonical NaN byte in both formats, whatever its sign.
  EXPECT_EQ(quantize_bytes({kNan, -kNan}, 1.f, Fp8Format::kE4M3), (std::vector<int64_t>{0x7f, 0x7f}));
  EXPECT_EQ(quantize_bytes({kNan, -kNan}, 1.f, Fp8Format::kE5M2), (std::vector<int64_t>{0x7f, 0x7f}));
}

TEST(Fp8QuantizeTest, RoundsExactTiesToEven) {
  // E4M3 in [1, 2): step 1/8; 1 = 0x38. 1.0625 lies halfway between 1 (0x38, even) and 1.125 (0x39); 1.1875 halfway
  // between 1.125 (0x39) and 1.25 (0x3a, even). Subnormals: step 2^-9; 2^-10 → 0, 3·2^-10 → 2^-8 (0x02).
  const std::vector<float> e4m3 = {1.0625f, 1.1875f, -1.0625f, -1.1875f, 0x1p-10f, 0x3p-10f, 464.f};
  const std::vector<int64_t> e4m3_bytes = {0x38, 0x3a, 0xb8, 0xba, 0x00, 0x02, 0x7e};
  EXPECT_EQ(quantize_bytes(e4m3, 1.f, Fp8Format::kE4M3), e4m3_bytes);
  // The same ties reached through the scale (exact: a power of two).
  std::vector<float> quarter;
  for (float v : e4m3) quarter.push_back(v / 4.f);
  EXPECT_EQ(quantize_bytes(quarter, 4.f, Fp8Format::kE4M3), e4m3_bytes);
  // E5M2 in [1, 2): step 1/4; 1 = 0x3c. 1.125 → 1 (0x3c); 1.375 → 1.5 (0x3e). Subnormals: step 2^-16; 2^-17 → 0,
  // 3·2^-17 → 2^-15 (0x02).
  const std::vector<float> e5m2 = {1.125f, 1.375f, -1.125f, -1.375f, 0x1p-17f, 0x3p-17f};
  EXPECT_EQ(quantize_bytes(e5m2, 1.f, Fp8Format::kE5M2), (std::vector<int64_t>{0x3c, 0x3e, 0xbc, 0xbe, 0x00, 0x02}));
}

TEST(Fp8QuantizeTest, AmaxComesWithTheBytes) {
  const at::Tensor x = torch::tensor({0.5f, -3.f, 2.f});
  const Fp8Quantized q = fp8_quantize_amax(x, 2.f, Fp8Format::kE4M3);
  EXPECT_EQ(q.amax.dim(), 0);
  EXPECT_EQ(q.amax.item<float>(), 3.f);  // of x, before the scale
  EXPECT_EQ(bytes_of(q.data), bytes_of(fp8_quantize(x, 2.f, Fp8Format::kE4M3)));
  EXPECT_TRUE(std::isnan(fp8_quantize_amax(torch::tensor({1.f, kNan}), 1.f, Fp8Format::kE4M3).amax.item<float>()));
  EXPECT_EQ(fp8_quantize_amax(torch::empty({0}), 1.f, Fp8Format::kE5M2).amax.item<float>(), 0.f);
  EXPECT_THROW(fp8_quantize(x, 0.f, Fp8Format::kE4M3), c10::Error);
  EXPECT_THROW(fp8_quantize(x.to(at::kDouble), 1.f, Fp8Format::kE4M3), c10::Error);
}

struct ScaleStep {
  float amax;
  float scale;                // expected scale() after update(amax)
  std::vector<float> history;  // expected history(), oldest first
};

// history 4, margin 1 (target fmax / 2 = 224 for E4M3): the scale is the largest 2^e with max(history)·2^e ≤ 224.
// A history of 3 or 5, or no margin, gives another scale at some step below.
TEST(Fp8ScaleTest, DelayedScaleOverAScriptedAmaxSequence) {
  Fp8Scale s(Fp8Format::kE4M3, Fp8ScaleOptions{4, 1.0});
  EXPECT_EQ(s.scale(), 1.f);
  const std::vector<ScaleStep> steps = {
      {3.f, 64.f, {3}},                    // 3·64 = 192 ≤ 224 < 384 (no margin: 128)
      {10.f, 16.f, {3, 10}},               // 160 ≤ 224 < 320
      {0.5f, 16.f, {3, 10, 0.5f}},
      {1.f, 16.f, {3, 10, 0.5f, 1}},
      {2.f, 16.f, {10, 0.5f, 1, 2}},       // 3 leaves; 10 still rules (history 3: 64)
      {1.5f, 64.f, {0.5f, 1, 2, 1.5f}},    // 10 leaves (history 5: 16)
      {kNan, 64.f, {0.5f, 1, 2, 1.5f}},    // ignored
      {kInf, 64.f, {0.5f, 1, 2, 1.5f}},    // ignored
      {0.f, 64.f, {1, 2, 1.5f, 0}},
      {0.f, 64.f, {2, 1.5f, 0, 0}},
      {0.f, 128.f, {1.5f, 0, 0, 0}},       // 1.5·128 = 192
      {0.f, 128.f, {0, 0, 0, 0}},          // all zero: the last scale stays
      {224.f, 1.f, {0, 0, 0, 224}},        // exactly on the target
      {1000.f, 0.125f, {0, 0, 224, 1000}}, // 125 ≤ 224 < 250
  };
  for (size_t i = 0; i < steps.size(); ++i) {
    s.update(steps[i].amax);
    EXPECT_EQ(s.scale(), steps[i].scale) << "step " << i << " amax " << steps[i].amax;
    EXPECT_EQ(s.history(), steps[i].history) << "step " << i;
  }
  EXPECT_EQ(s.updates(), 12);
  EXPECT_EQ(s.ignored(), 2);
}

TEST(Fp8ScaleTest, ScaleRuleEdges) {
  // E5M2, no margin: 57344 = 1.75·2^15, so amax 1 → 2^15; amax 57344 → 1; just above → 1/2.
  EXPECT_EQ(fp8_scale_for_amax(1.f, Fp8Format::kE5M2, 0, 1.f), 32768.f);
  EXPECT_EQ(fp8_scale_for_amax(57344.f, Fp8Format::kE5M2, 0, 1.f), 1.f);
  EXPECT_EQ(fp8_scale_for_amax(std::nextafter(57344.f, kInf), Fp8Format::kE5M2, 0, 1.f), 0.5f);
  EXPECT_EQ(fp8_scale_for_amax(448.f, Fp8Format::kE4M3, 2, 1.f), 0.25f);
  // A fractional margin: target 448 / 2^0.5 ≈ 316.8; 1·256 ≤ 316.8 < 512.
  EXPECT_EQ(fp8_scale_for_amax(1.f, Fp8Format::kE4M3, 0.5, 1.f), 256.f);
  // A tiny amax is clamped to 2^127 (finite); the largest float gives 2^-120 (255.99…; 2^-119 would be 511.99…).
  EXPECT_EQ(fp8_scale_for_amax(1e-38f, Fp8Format::kE4M3, 0, 1.f), std::ldexp(1.f, 127));
  EXPECT_EQ(fp8_scale_for_amax(std::numeric_limits<float>::max(), Fp8Format::kE4M3, 0, 1.f), std::ldexp(1.f, -120));
  EXPECT_EQ(fp8_scale_for_amax(0.f, Fp8Format::kE4M3, 0, 8.f), 8.f);
  EXPECT_EQ(fp8_scale_for_amax(kNan, Fp8Format::kE4M3, 0, 8.f), 8.f);
  EXPECT_EQ(fp8_scale_for_amax(-kInf, Fp8Format::kE4M3, 0, 8.f), 8.f);
  EXPECT_THROW(Fp8Scale(Fp8Format::kE4M3, Fp8ScaleOptions{0, 0}), UserError);
  EXPECT_THROW(Fp8Scale(Fp8Format::kE4M3, Fp8ScaleOptions{4, -1}), UserError);
}

TEST(Fp8ScaleTest, StateRoundTripsThroughJson) {
  Fp8Scale a(Fp8Format::kE5M2, Fp8ScaleOptions{3, 0});
  for (float amax : {7.f, 0.1f, kNan, 90.f, 3.f}) a.update(amax);  // the ring has wrapped: 7 left
  const Json saved = Json::parse(a.state().dump());
  Fp8Scale b(Fp8Format::kE5M2, Fp8ScaleOptions{3, 0});
  b.restore(saved);
  EXPECT_EQ(b.scale(), a.scale());
  EXPECT_EQ(b.history(), (std::vector<float>{0.1f, 90.f, 3.f}));
  EXPECT_EQ(b.updates(), 4);
  EXPECT_EQ(b.ignored(), 1);
  // Both go on alike: 90 leaves after two more steps.
  for (float amax : {2.f, 1.f, 0.5f}) {
    a.update(amax);
    b.update(amax);
    EXPECT_EQ(b.scale(), a.scale()) << "after " << amax;
    EXPECT_EQ(b.history(), a.history()) << "after " << amax;
  }
  EXPECT_EQ(b.scale(), 16384.f);  // max 2: 2·2^14 ≤ 57344 < 2·2^15
  // A shorter history keeps the newest amaxes; another format or a broken state is refused.
  Fp8Scale c(Fp8Format::kE5M2, Fp8ScaleOptions{2, 0});
  c.restore(saved);
  EXPECT_EQ(c.history(), (std::vector<float>{90.f, 3.f}));
  Fp8Scale d(Fp8Format::kE4M3, Fp8ScaleOptions{3, 0});
  EXPECT_THROW(d.restore(saved), UserError);
  Json broken = saved;
  broken.erase("scale");
  EXPECT_THROW(b.restore(broken), UserError);
}

// The kernel's bytes against the reference's on the same inputs, bit for bit: random values over many binades,
// saturating ones, FP8 subnormals, exact ties, ±0, ±inf and NaN; float32, bfloat16 and float16 inputs; power-of-two
// and other scales; sizes that leave partial blocks and need the grid-stride loop.
TEST(Fp8CudaTest, KernelBytesEqualTheReference) {
#ifndef TRIACCEL_WITH_CUDA
  GTEST_SKIP() << "built without CUDA (-DTRIACCEL_CUDA=ON)";
#else
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU";
  torch::manual_seed(58);
  const std::vector<float> special = {0.f, -0.f, kInf, -kInf, kNan, -kNan, 1.0625f, 1.1875f, 1.125f, 1.375f,
                                      0x1p-10f, 0x3p-10f, 0x1p-17f, 0x3p-17f, 464.f, 470.f, 59392.f, 61440.f, 1e-40f};
  for (int64_t n : {int64_t{1}, int64_t{19}, int64_t{4097}, int64_t{3000017}}) {
    at::Tensor x = torch::randn({n}) * torch::exp2(torch::randint(-24, 24, {n}).to(torch::kFloat));
    const int64_t k = std::min<int64_t>(n, static_cast<int64_t>(special.size()));
    x.slice(0, 0, k).copy_(torch::tensor(special).slice(0, 0, k));
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      const at::Tensor xd = x.to(dtype);
      for (Fp8Format format : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
        for (float scale : {1.f, 0.0078125f, 128.f, 3.3f}) {
          const Fp8Quantized want = fp8_quantize_reference(xd, scale, format);
          const Fp8Quantized got = fp8_quantize_amax(xd.cuda(), scale, format);
          const std::string what = "n " + std::to_string(n) + " " + c10::toString(dtype) + " " + enum_name(format) +
                                   " scale " + std::to_string(scale);
          ASSERT_TRUE(got.data.is_cuda()) << what;
          EXPECT_TRUE(torch::equal(got.data.cpu().view(at::kByte), want.data.view(at::kByte))) << what;
          EXPECT_TRUE(torch::equal(fp8_quantize(xd.cuda(), scale, format).cpu().view(at::kByte),
                                   want.data.view(at::kByte))) << what;
          const float got_amax = got.amax.item<float>(), want_amax = want.amax.item<float>();
          if (k > 4) {
            EXPECT_TRUE(std::isnan(got_amax) && std::isnan(want_amax)) << what;
          } else {
            EXPECT_EQ(got_amax, want_amax) << what;
          }
        }
      }
    }
    // Without NaN the amax is a number both agree on.
    const at::Tensor finite = torch::nan_to_num(x, 0.0, 0.0, 0.0);
    EXPECT_EQ(fp8_quantize_amax(finite.cuda(), 1.f, Fp8Format::kE4M3).amax.item<float>(),
              fp8_quantize_reference(finite, 1.f, Fp8Format::kE4M3).amax.item<float>());
  }
#endif
}

}  // namespace
}  // namespace triaccel
