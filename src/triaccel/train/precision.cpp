#include "triaccel/train/precision.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>

namespace triaccel {

PrecisionMode precision_mode_of(Precision p) {
  switch (p) {
    case Precision::kFP32: return PrecisionMode::kFP32;
    case Precision::kBF16: return PrecisionMode::kAmpBF16;
    case Precision::kFP16: return PrecisionMode::kAmpFP16;
    case Precision::kFP8: return PrecisionMode::kAmpFP8;
  }
  return PrecisionMode::kFP32;
}

at::ScalarType autocast_dtype(PrecisionMode mode) {
  switch (mode) {
    case PrecisionMode::kFP32: return at::kFloat;
    case PrecisionMode::kAmpFP16: return at::kHalf;
    case PrecisionMode::kAmpBF16:
    case PrecisionMode::kAmpFP8: return at::kBFloat16;
  }
  return at::kFloat;
}

AutocastScope::AutocastScope(const c10::Device& device, PrecisionMode precision)
    : type_(device.type()),
      prev_enabled_(at::autocast::is_autocast_enabled(device.type())),
      prev_dtype_(at::autocast::get_autocast_dtype(device.type())),
      active_(precision != PrecisionMode::kFP32) {
  if (!active_) return;
  at::autocast::set_autocast_enabled(type_, true);
  at::autocast::set_autocast_dtype(type_, autocast_dtype(precision));
  // No weight-cast cache: a cached cast would be baked into a captured graph with stale values.
  at::autocast::set_autocast_cache_enabled(false);
  at::autocast::increment_nesting();
}

AutocastScope::~AutocastScope() {
  if (!active_) return;
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(type_, prev_enabled_);
  at::autocast::set_autocast_dtype(type_, prev_dtype_);
}

PrecisionMode unit_mode(const std::optional<Precision>& unit, PrecisionMode run) {
  return unit ? precision_mode_of(*unit) : run;
}

at::Tensor unit_forward_at(const std::optional<Precision>& unit, PrecisionMode run, const c10::Device& device,
                           const at::Tensor& x, const std::function<at::Tensor(const at::Tensor&)>& forward) {
  at::Tensor in = x;
  if (unit) {
    const at::ScalarType dtype = precision_dtype(*unit);
    if (in.is_floating_point() && in.scalar_type() != dtype) in = in.to(dtype);
  }
  const AutocastScope autocast(device, unit_mode(unit, run));
  return forward(in);
}

at::ScalarType precision_dtype(Precision p) {
  return p == Precision::kFP32 ? at::kFloat : p == Precision::kFP16 ? at::kHalf : at::kBFloat16;
}

Precision precision_applied(Precision decided, const c10::Device& device) {
  return decided == Precision::kFP16 && !device.is_cuda() ? Precision::kBF16 : decided;
}

std::optional<Precision> unit_precision_at(const std::vector<Precision>& precisions, size_t u,
                                           const c10::Device& device) {
  if (precisions.empty()) return std::nullopt;
  return precision_applied(precisions[u], device);
}

}  // namespace triaccel
