// FP8 delayed scaling on the device (issue 58): the rule of Fp8Scale (train/fp8.h) kept in tensors on the tensor's
// device and updated by tensor ops alone, so that a step captured in a CUDA graph replays it with no host sync.
//
// State: a (history) float32 ring of amaxes, zeros at first (amaxes are >= 0, so a ring not yet full has the max of
// the amaxes recorded), the () int64 position of the next amax, and the () float32 scale, 1 at first. update(amax)
// records |amax| when it is finite (a non-finite amax, an overflowed step, is not recorded and leaves the scale), and
// sets the scale to the largest power of two s with max(ring)·s <= fmax / 2^margin, clamped to [2^-126, 2^127]; while
// the whole ring is 0 the scale stays. The scale after every update equals Fp8Scale's for the same amaxes, bit for
// bit: the exponent comes from frexp (exact) and the float from its bits, no log2 or pow.
#pragma once

#include "triaccel/train/fp8.h"

#include <ATen/Tensor.h>
#include <c10/core/Device.h>

namespace triaccel {

class Fp8DeviceScale {
 public:
  Fp8DeviceScale(Fp8Format format, Fp8ScaleOptions options, const c10::Device& device);

  // () float32 on the device: the scale the next quantization multiplies by (q = fp8(x·scale)).
  const at::Tensor& scale() const { return scale_; }
  // () float32: 1 / scale, exact (a power of two): what at::_scaled_mm takes to dequantize (x ≈ q · inverse).
  at::Tensor inverse() const;
  // amax: () float32 (or any floating dtype) on the device. In place, tensor ops only.
  void update(const at::Tensor& amax);

  Fp8Format format() const { return format_; }
  const Fp8ScaleOptions& options() const { return options_; }

 private:
  Fp8Format format_;
  Fp8ScaleOptions options_;
  at::Tensor ring_;   // (history) float32
  at::Tensor next_;   // () int64 in [0, history)
  at::Tensor scale_;  // () float32
};

}  // namespace triaccel
