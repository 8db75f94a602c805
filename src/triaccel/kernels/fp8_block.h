// Block-scaled FP8 on CUDA (issue 58's activation storage, train/fp8_saved.h): a tensor's elements in blocks of
// kFp8BlockElements, each block E4M3 with its own power-of-two scale. The spec is fp8_block_quantize_reference
// (train/fp8_saved.h); these kernels write the same bytes and scales and read them back to the same values.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>

namespace triaccel {

constexpr int64_t kFp8BlockElements = 128;

// x: float32, bfloat16 or float16, a contiguous (n) vector on a CUDA device. out: (n) uint8, scales: (ceil(n / 128))
// float32, both contiguous on x's device; overwritten with block b's bytes e4m3(sat(x·s_b)) (round to nearest even,
// 0x7f for a NaN) and s_b. Runs on the current stream; n may be 0.
void fp8_block_quantize_cuda(const at::Tensor& x, const at::Tensor& out, const at::Tensor& scales);

// The inverse: out (n) float32 / bfloat16 / float16, contiguous, overwritten with float(q) / s_b in out's dtype.
void fp8_block_dequantize_cuda(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& out);

}  // namespace triaccel
