#include "triaccel/train/fp8_device_scale.h"

#ifdef TRIACCEL_WITH_CUDA
#include "triaccel/kernels/fp8_quantize.h"
#endif

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
  if (device.is_cuda()) amax_ = at::zeros({}, f32);
}

namespace {

// fmax / 2^margin as g·2^t with g in [0.5, 1): the target the scale's exponent is found against.
double scale_target(Fp8Format format, const Fp8ScaleOptions& options, int* exponent) {
  return std::frexp(fp8_max(format) / std::exp2(options.margin), exponent);
}

}  // namespace

at::Tensor Fp8DeviceScale::inverse() const { return at::reciprocal(scale_); }

void Fp8DeviceScale::update(const at::Tensor& amax) {
  const torch::NoGradGuard no_grad;
#ifdef TRIACCEL_WITH_CUDA
  if (amax_.defined()) {
    amax_.copy_(amax.reshape({}));
    update_from_amax();
    return;
  }
#endif
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
  const double g = scale_target(format_, options_, &t);
  const auto [f, k] = at::frexp(m);
  const at::Tensor e =
      (at::scalar_tensor(t, k.options()) - k - at::gt(f.to(at::kDouble), g).to(k.scalar_type()))
          .clamp(kFp8ScaleMinExponent, kFp8ScaleMaxExponent)
          .to(at::kInt);
  // 2^e from its bits: biased exponent e + 127 in bits 23..30, a zero mantissa.
  const at::Tensor power = (e + 127).bitwise_left_shift(23).view(at::kFloat);
  scale_.copy_(at::where(m > 0, power, scale_));
}

#ifdef TRIACCEL_WITH_CUDA
void Fp8DeviceScale::update_from_amax() {
  int t = 0;
  const double g = scale_target(format_, options_, &t);
  fp8_scale_update_cuda(ring_, next_, scale_, amax_, t, g);
}

Fp8ScaledTensor Fp8DeviceScale::quantize_on_device(const at::Tensor& x, bool transposed) {
  TORCH_CHECK(x.device() == scale_.device(), "Fp8DeviceScale::quantize: x on ", x.device(), ", the scale on ",
              scale_.device());
  const at::Tensor xc = x.contiguous();
  const auto bytes = xc.options().dtype(fp8_dtype(format_));
  Fp8ScaledTensor out{at::empty(xc.sizes(), bytes), at::empty({}, scale_.options())};
  if (transposed) {
    out.data_t = at::empty({xc.size(1), xc.size(0)}, bytes);
    fp8_quantize_transpose_cuda(xc, scale_, out.data, out.data_t, amax_, out.inverse);
  } else {
    fp8_quantize_device_scale_cuda(xc, scale_, out.data, amax_, out.inverse);
  }
  update_from_amax();
  return out;
}
#endif

Fp8ScaledTensor Fp8DeviceScale::quantize(const at::Tensor& x) {
  const torch::NoGradGuard no_grad;
#ifdef TRIACCEL_WITH_CUDA
  if (amax_.defined() && x.is_cuda()) return quantize_on_device(x, /*transposed=*/false);
#endif
  Fp8ScaledTensor out{fp8_quantize_scaled(x, scale_, format_), inverse()};
  update(x.numel() == 0 ? at::zeros({}, x.options().dtype(at::kFloat)) : at::amax(at::abs(x)));
  return out;
}

Fp8ScaledTensor Fp8DeviceScale::quantize_transposed(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "Fp8DeviceScale::quantize_transposed: x must be a matrix, got ", x.sizes());
  const torch::NoGradGuard no_grad;
#ifdef TRIACCEL_WITH_CUDA
  if (amax_.defined() && x.is_cuda()) return quantize_on_device(x, /*transposed=*/true);
#endif
  Fp8ScaledTensor out = quantize(x);
  out.data_t = out.data.t().contiguous();
  return out;
}

}  // namespace triaccel
