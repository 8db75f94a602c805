// 8-bit block-wise quantization of optimizer state with dynamic (exponent-spaced) maps.
// A map is 256 float32 values sorted ascending in [-1, 1] (signed) or [0, 1] (unsigned). Our generator: the
// magnitudes are split into decades (10^-(e+1), 10^-e], e = 0, 1, ...; decade e holds 2^(B-1-e) evenly spaced
// values (B magnitude bits: 7 signed, 8 unsigned), so precision is relative: fine near the block maximum, coarse
// but present down to 1e-7 (signed) / 1e-8 (unsigned) of it. The signed map mirrors the magnitudes around zero
// (zero appears twice, which keeps 256 entries). A tensor is cut into blocks of kQuantBlock elements in memory order
// (the last one may be short); each block stores its absmax a and, per element, the index of the map value nearest
// to x / a (ties to the lower index). Dequantization: map[code] · a. A block of zeros has a = 0.
// a is stored as a bfloat16, rounded UP from the float32 absmax (so |x| / a ≤ 1 still holds): 2 bytes per block
// instead of 4, which brings the format to 2.0156 bytes per element (m and v) and lets a model whose largest units
// are all 8-bit fit in 25 % of fp32 AdamW's state once its embedding takes a smaller format. Rounding up costs at
// most a relative 2^-8 in the scale, below the map's own spacing near 1 (about 2^-6 for the signed map).
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>

namespace triaccel {

// (256) float32 on the CPU.
at::Tensor quant8_map(bool is_signed);
// (255) float32: midpoints between successive map values (the decision boundaries of nearest rounding).
at::Tensor quant8_midpoints(const at::Tensor& map);

constexpr int64_t kQuant8ChunkElements = int64_t{1} << 16;  // a multiple of kQuantBlock
constexpr int64_t kQuant8ChunkBytesPerElement = 32;

struct Quantized8 {
  at::Tensor codes;   // (numel) uint8
  at::Tensor absmax;  // (ceil(numel / 256)) bfloat16
};

// float32 absmax → bfloat16 scale, rounded up (non-negative finite input).
at::Tensor quant8_absmax_round_up(const at::Tensor& absmax);
// x: float32, any shape (read in memory order of x.contiguous()). Reference implementation in ATen.
// Encoded (and decoded) kQuant8ChunkElements at a time, whole blocks each: the temporaries are about
// kQuant8ChunkBytesPerElement bytes an element of a chunk, whatever the tensor (run/memory_setup.h prices them).
Quantized8 quant8_encode(const at::Tensor& x, const at::Tensor& map);
// The float32 tensor of `shape` (contiguous) that q encodes.
at::Tensor quant8_decode(const Quantized8& q, const at::Tensor& map, at::IntArrayRef shape);

}  // namespace triaccel
