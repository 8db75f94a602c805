#include "triaccel/train/fp8.h"

#include "triaccel/core/errors.h"
#ifdef TRIACCEL_WITH_CUDA
#include "triaccel/kernels/fp8_quantize.h"
#endif

#include <ATen/ATen.h>
#include <torch/utils.h>

#include <algorithm>
#include <cmath>
#include <string>

namespace triaccel {
namespace {

constexpr int64_t kFp8NanByte = 0x7f;

void fp8_input_check(const at::Tensor& x) {
  TORCH_CHECK(x.defined(), "fp8_quantize: x is undefined");
  TORCH_CHECK(fp8_quantizable(x.scalar_type()), "fp8_quantize: x must be float32, bfloat16 or float16, got ",
              x.scalar_type());
}

void fp8_quantize_check(const at::Tensor& x, float scale) {
  fp8_input_check(x);
  TORCH_CHECK(std::isfinite(scale) && scale > 0.f, "fp8_quantize: scale must be finite and > 0, got ", scale);
}

}  // namespace

double fp8_max(Fp8Format format) { return format == Fp8Format::kE4M3 ? 448.0 : 57344.0; }

bool fp8_quantizable(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

at::ScalarType fp8_dtype(Fp8Format format) {
  return format == Fp8Format::kE4M3 ? at::kFloat8_e4m3fn : at::kFloat8_e5m2;
}

void Fp8ScaleOptions::validate() const {
  TRIACCEL_CHECK_INPUT(history >= 1, "fp8 scale: history must be >= 1, got ", history);
  TRIACCEL_CHECK_INPUT(std::isfinite(margin) && margin >= 0, "fp8 scale: margin must be >= 0, got ", margin);
}

float fp8_scale_for_amax(float amax, Fp8Format format, double margin, float previous) {
  if (!std::isfinite(amax) || amax <= 0.f) return previous;
  // The largest e with amax·2^e ≤ target; ldexp on a double holding a float is exact here, so the comparisons are.
  const double a = static_cast<double>(amax);
  const double target = fp8_max(format) / std::exp2(margin);
  int e = static_cast<int>(std::floor(std::log2(target / a)));
  while (std::ldexp(a, e) > target) --e;
  while (std::ldexp(a, e + 1) <= target) ++e;
  e = std::clamp(e, kFp8ScaleMinExponent, kFp8ScaleMaxExponent);
  return std::ldexp(1.f, e);
}

Fp8Scale::Fp8Scale(Fp8Format format, Fp8ScaleOptions options) : format_(format), options_(options) {
  options_.validate();
  ring_.reserve(static_cast<size_t>(options_.history));
}

void Fp8Scale::update(float amax) {
  if (!std::isfinite(amax)) {
    ++ignored_;
    return;
  }
  const float a = std::fabs(amax);
  if (ring_.size() < static_cast<size_t>(options_.history)) {
    ring_.push_back(a);
  } else {
    ring_[next_] = a;
    next_ = (next_ + 1) % ring_.size();
  }
  ++updates_;
  const float history_max = *std::max_element(ring_.begin(), ring_.end());
  scale_ = fp8_scale_for_amax(history_max, format_, options_.margin, scale_);
}

std::vector<float> Fp8Scale::history() const {
  std::vector<float> out(ring_.begin() + static_cast<std::ptrdiff_t>(next_), ring_.end());
  out.insert(out.end(), ring_.begin(), ring_.begin() + static_cast<std::ptrdiff_t>(next_));
  return out;
}

Json Fp8Scale::state() const {
  return Json{{"format", enum_name(format_)}, {"history", history()}, {"scale", scale_},
              {"updates", updates_},          {"ignored", ignored_}};
}

void Fp8Scale::restore(const Json& j) {
  std::vector<float> amaxes;
  float scale = 1.f;
  int64_t updates = 0, ignored = 0;
  try {
    TRIACCEL_CHECK_INPUT(j.at("format").get<std::string>() == enum_name(format_),
                         "checkpoint's fp8 scale is for ", j.at("format").get<std::string>(), ", this one for ",
                         enum_name(format_));
    amaxes = j.at("history").get<std::vector<float>>();
    scale = j.at("scale").get<float>();
    updates = j.at("updates").get<int64_t>();
    ignored = j.at("ignored").get<int64_t>();
  } catch (const Json::exception& e) {
    throw UserError(str_cat("checkpoint has an unreadable fp8 scale state (", e.what(), ")"));
  }
  TRIACCEL_CHECK_INPUT(std::isfinite(scale) && scale > 0.f, "checkpoint's fp8 scale must be finite and > 0, got ",
                       scale);
  const size_t keep = std::min(amaxes.size(), static_cast<size_t>(options_.history));
  ring_.assign(amaxes.end() - static_cast<std::ptrdiff_t>(keep), amaxes.end());
  next_ = 0;
  scale_ = scale;
  updates_ = updates;
  ignored_ = ignored;
}

namespace {

// The reference's bytes for xf (float32, contiguous) and a () float32 scale on its device.
at::Tensor fp8_quantize_reference_data(const at::Tensor& xf, const at::Tensor& scale, Fp8Format format) {
  const double fmax = fp8_max(format);
  // (…) float32: one multiply per element by the float scale, as the kernel's.
  const at::Tensor scaled = xf.mul(scale);
  at::Tensor data = at::clamp(scaled, -fmax, fmax).to(fp8_dtype(format));
  // The clamp passes NaN through with whatever sign the multiply left; the spec's NaN byte is 0x7f.
  const at::Tensor nan = at::isnan(xf);
  data.view(at::kByte).masked_fill_(nan, kFp8NanByte);
  return data;
}

}  // namespace

Fp8Quantized fp8_quantize_reference(const at::Tensor& x, float scale, Fp8Format format) {
  fp8_quantize_check(x, scale);
  const torch::NoGradGuard no_grad;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor amax = xf.numel() == 0 ? at::zeros({}, xf.options()) : at::amax(at::abs(xf));
  return {fp8_quantize_reference_data(xf, at::scalar_tensor(scale, xf.options()), format), amax.reshape({})};
}

Fp8Quantized fp8_quantize_amax(const at::Tensor& x, float scale, Fp8Format format) {
#ifdef TRIACCEL_WITH_CUDA
  if (x.is_cuda()) {
    fp8_quantize_check(x, scale);
    const at::Tensor xc = x.contiguous();
    at::Tensor data = at::empty(xc.sizes(), xc.options().dtype(fp8_dtype(format)));
    at::Tensor amax = at::empty({}, xc.options().dtype(at::kFloat));
    fp8_quantize_cuda(xc, scale, data, amax);
    return {data, amax};
  }
#endif
  return fp8_quantize_reference(x, scale, format);
}

at::Tensor fp8_quantize(const at::Tensor& x, float scale, Fp8Format format) {
#ifdef TRIACCEL_WITH_CUDA
  if (x.is_cuda()) {
    fp8_quantize_check(x, scale);
    const at::Tensor xc = x.contiguous();
    at::Tensor data = at::empty(xc.sizes(), xc.options().dtype(fp8_dtype(format)));
    fp8_quantize_cuda(xc, scale, data, at::Tensor());
    return data;
  }
#endif
  fp8_quantize_check(x, scale);
  const torch::NoGradGuard no_grad;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  return fp8_quantize_reference_data(xf, at::scalar_tensor(scale, xf.options()), format);
}

at::Tensor fp8_quantize_scaled(const at::Tensor& x, const at::Tensor& scale, Fp8Format format) {
  fp8_input_check(x);
  TORCH_CHECK(scale.defined() && scale.numel() == 1 && scale.scalar_type() == at::kFloat &&
                  scale.device() == x.device(),
              "fp8_quantize_scaled: scale must be one float32 on x's device");
  const torch::NoGradGuard no_grad;
  return fp8_quantize_reference_data(x.to(at::kFloat).contiguous(), scale.reshape({}), format);
}

at::Tensor fp8_dequantize(const at::Tensor& q, float scale, at::ScalarType dtype) {
  TORCH_CHECK(q.scalar_type() == at::kFloat8_e4m3fn || q.scalar_type() == at::kFloat8_e5m2,
              "fp8_dequantize: q must be float8_e4m3fn or float8_e5m2, got ", q.scalar_type());
  TORCH_CHECK(std::isfinite(scale) && scale > 0.f, "fp8_dequantize: scale must be finite and > 0, got ", scale);
  const torch::NoGradGuard no_grad;
  const at::Tensor f = q.to(at::kFloat);
  return f.div(at::scalar_tensor(scale, f.options())).to(dtype);
}

}  // namespace triaccel
