// FP8 delayed scaling on the device (issue 58): the rule of Fp8Scale (train/fp8.h) kept in tensors on the tensor's
// device and updated by tensor ops alone, so that a step captured in a CUDA graph replays it with no host sync.
//
// State: a (history) float32 ring of amaxes, zeros at first (amaxes are >= 0, so a ring not yet full has the max of
// the amaxes recorded), the () int64 position of the next amax, and the () float32 scale, 1 at first. update(amax)
// records |amax| when it is finite (a non-finite amax, an overflowed step, is not recorded and leaves the scale), and
// sets the scale to the largest power of two s with max(ring)·s <= fmax / 2^margin, clamped to [2^-126, 2^127]; while
// the whole ring is 0 the scale stays. The scale after every update equals Fp8Scale's for the same amaxes, bit for
// bit: the exponent comes from frexp (exact) and the float from its bits, no log2 or pow. On CUDA the update is one
// kernel of one thread and quantize() one pass (kernels/fp8_quantize.h); elsewhere both are tensor ops.
#pragma once

#include "triaccel/core/named_tensors.h"
#include "triaccel/train/fp8.h"

#include <ATen/Tensor.h>
#include <c10/core/Device.h>

namespace triaccel {

// A tensor quantized under a device scale: the FP8 bytes, and 1 / the scale they were made with (() float32 on the
// device: what at::_scaled_mm takes to dequantize, q · inverse ≈ x; a later update does not change it).
struct Fp8ScaledTensor {
  at::Tensor data;
  at::Tensor inverse;
  at::Tensor data_t;  // quantize_transposed: data's transpose, contiguous (else undefined)
};

class Fp8DeviceScale {
 public:
  Fp8DeviceScale(Fp8Format format, Fp8ScaleOptions options, const c10::Device& device);

  // () float32 on the device: the scale the next quantization multiplies by (q = fp8(x·scale)).
  const at::Tensor& scale() const { return scale_; }
  // () float32: 1 / scale, exact (a power of two): what at::_scaled_mm takes to dequantize (x ≈ q · inverse).
  at::Tensor inverse() const;
  // amax: () float32 (or any floating dtype) on the device. In place, no host sync.
  void update(const at::Tensor& amax);
  // x (float32, bfloat16 or float16, on the device) quantized under the current scale, then x's amax recorded by
  // update (delayed scaling): the bytes of fp8_quantize_scaled(x, scale(), format()).
  Fp8ScaledTensor quantize(const at::Tensor& x);
  // quantize for a matrix x (R, C), with data_t (C, R) the same bytes transposed (on CUDA from the same pass).
  Fp8ScaledTensor quantize_transposed(const at::Tensor& x);

  Fp8Format format() const { return format_; }
  const Fp8ScaleOptions& options() const { return options_; }
  // The state a checkpoint keeps, the live tensors by name ("ring", "next", "scale"): copying into them restores it.
  NamedTensors tensors() const { return {{"ring", ring_}, {"next", next_}, {"scale", scale_}}; }

 private:
  // CUDA: the update kernel on amax_ (which it zeroes), and quantize's one pass (with the transpose or without).
  void update_from_amax();
  Fp8ScaledTensor quantize_on_device(const at::Tensor& x, bool transposed);

  Fp8Format format_;
  Fp8ScaleOptions options_;
  at::Tensor ring_;   // (history) float32
  at::Tensor next_;   // () int64 in [0, history)
  at::Tensor scale_;  // () float32
  at::Tensor amax_;   // () float32, CUDA: the amax the quantize kernel joins and the update kernel reads and zeroes
};

}  // namespace triaccel
