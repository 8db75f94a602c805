// FP8 quantize on CUDA (issue 58): out = fp8(sat(x·scale)) with round-to-nearest-even, and amax = max |x| in the
// same pass. The spec is fp8_quantize_reference (train/fp8.h); the kernel writes the same bytes: one float32
// multiply, saturation to ±fmax (±inf included), the canonical NaN byte 0x7f for a NaN in x.
#pragma once

#include <ATen/Tensor.h>

namespace triaccel {

// x: float32, bfloat16 or float16, contiguous, CUDA. out: x's numel, at::kFloat8_e4m3fn or at::kFloat8_e5m2 (the
// format), contiguous, on x's device. amax: undefined (not computed), or a float32 tensor of one element on x's
// device, overwritten with max |x| (NaN when x holds a NaN; 0 when x is empty). scale: finite, > 0. Runs on the
// current stream.
void fp8_quantize_cuda(const at::Tensor& x, float scale, const at::Tensor& out, const at::Tensor& amax);

// The same bytes for a scale kept on the device (train/fp8_device_scale.h), in one pass with no host sync: scale, amax
// and inverse are one float32 element each on x's device. amax is joined with max |x| (it keeps the larger: the
// caller zeroes it, fp8_scale_update_cuda does after reading it); inverse is overwritten with 1 / scale, the scale the
// bytes were made with. x may be empty (then only inverse is written).
void fp8_quantize_device_scale_cuda(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& out,
                                    const at::Tensor& amax, const at::Tensor& inverse);

// fp8_quantize_device_scale_cuda for a matrix x (R, C), writing its bytes twice in one pass: out (R, C) and its
// transpose out_t (C, R), both contiguous (the FP8 product takes its operands row-major only, so a layer's backward
// needs each operand transposed too).
void fp8_quantize_transpose_cuda(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& out,
                                  const at::Tensor& out_t, const at::Tensor& amax, const at::Tensor& inverse);

// Fp8DeviceScale::update's rule in one kernel of one thread: |amax| recorded at ring[next] when finite (next moves
// on), amax zeroed, and scale set to 2^e for the largest e with max(ring)·2^e <= g·2^t (target_fraction g in [0.5, 1),
// target_exponent t: frexp of fmax / 2^margin), e clamped to [-126, 127]; the scale stays while the ring is all 0.
// ring (history) float32, next () int64, scale and amax () float32, all on one CUDA device.
void fp8_scale_update_cuda(const at::Tensor& ring, const at::Tensor& next, const at::Tensor& scale,
                           const at::Tensor& amax, int target_exponent, double target_fraction);

}  // namespace triaccel
