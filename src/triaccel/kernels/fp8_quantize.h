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

}  // namespace triaccel
