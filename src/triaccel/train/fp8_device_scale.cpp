#include "triaccel/train/fp8_device_scale.h"

#include <ATen/ATen.h>
#include <torch/utils.h>

#include <cmath>
#include <cstdint>

namespace triaccel {

Fp8DeviceScale::Fp8DeviceScale(Fp8Format format, Fp8ScaleOptions options, const c10::Device& device)
    : format_(format), options_(options) {
  options_.validate();
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  ring_ = at::zeros({options_.history}, f32);
  next_ = at::zeros({}, f32.dtype(at::kLong));
  scale_ = at::ones({}, f32);
}

at::Tensor Fp8DeviceScale::inverse() const { return at::reciprocal(scale_); }

void Fp8DeviceScale::update(const at::Tensor& amax) {
  const torch::NoGradGuard no_grad;
  const at::Tensor a = amax.to(at::kFloat).abs().reshape({});  // () float32
  const at::Tensor finite = at::isfinite(a);
  // The ring: |amax| at next when finite (else the slot keeps its amax), and next moves on only then.
  const at::Tensor slot = next_.reshape({1});
  ring_.index_copy_(0, slot, at::where(finite, a, ring_.index_select(0, slot).reshape({})).reshape({1}));
  next_.add_(finite.to(at::kLong)).remainder_(options_.history);
  // The largest e with m·2^e <= target: with m = f·2^k and target = g·2^t (f, g in [0.5, 1)), e = t - k when f <= g,
  // else t - k - 1. frexp is exact, and the comparison of f with g is made in double, as the host rule's.
  const at::Tensor m = ring_.amax();
  int t = 0;
  const double g = std::frexp(fp8_max(format_) / std::exp2(options_.margin), &t);
  const auto [f, k] = at::frexp(m);
  const at::Tensor e =
      (at::scalar_tensor(t, k.options()) - k - at::gt(f.to(at::kDouble), g).to(k.scalar_type()))
          .clamp(kFp8ScaleMinExponent, kFp8ScaleMaxExponent)
          .to(at::kInt);
  // 2^e from its bits: biased exponent e + 127 in bits 23..30, a zero mantissa.
  const at::Tensor power = (e + 127).bitwise_left_shift(23).view(at::kFloat);
  scale_.copy_(at::where(m > 0, power, scale_));
}

}  // namespace triaccel
