// FP8 quantization with per-tensor delayed scaling (issue 58): the formats, the quantize / dequantize pair and the
// scale that an amax history sets. The CPU path is the reference (torch ops); on CUDA builds a CUDA tensor goes
// through kernels/fp8_quantize.cu, which writes the same bytes.
//
// Quantize: q = fp8(sat(x·scale)), with x·scale one float32 multiply, sat() the clamp to ±fmax (±inf included), and
// fp8() the cast with round-to-nearest-even. torch's own cast turns values past fmax into NaN for e4m3fn (470 →
// NaN) and into inf for e5m2, so the clamp comes first. A NaN in x gives the canonical NaN byte 0x7f in both formats
// (sign dropped), in the reference and the kernel alike. Dequantize: x' = float(q) / scale.
//
// Scale (Fp8Scale): scale = the largest power of two s with (max of the amax history)·s ≤ fmax / 2^margin, clamped to
// [2^-126, 2^127]. A power of two rather than fmax / amax exactly: multiplying by it only moves the exponent, so
// x·scale and float(q) / scale add no rounding of their own (the FP8 cast is the one rounding), dequantize inverts
// the scale exactly, and it is what the delayed-scaling recipes use. At most a factor of 2 of range is given up.
// amax of 0 (an all-zero tensor) enters the history; while the whole history is 0 the scale stays as it was. A
// non-finite amax (inf / NaN: an overflowed step) is not recorded at all and leaves the scale unchanged.
#pragma once

#include "triaccel/core/enum_names.h"
#include "triaccel/core/json.h"

#include <ATen/Tensor.h>

#include <cstdint>
#include <vector>

namespace triaccel {

// E4M3 (no infinities, one NaN pattern per sign) for forward tensors; E5M2 (IEEE-like, inf and NaN) for gradients.
enum class Fp8Format { kE4M3, kE5M2 };

template <>
struct EnumNames<Fp8Format> {
  static constexpr EnumName<Fp8Format> kNames[] = {{Fp8Format::kE4M3, "e4m3"}, {Fp8Format::kE5M2, "e5m2"}};
};

// The scale's exponents: it stays a normal float32 power of two.
constexpr int kFp8ScaleMinExponent = -126;
constexpr int kFp8ScaleMaxExponent = 127;

// Largest finite value: 448 (e4m3fn: 1.75·2^8) or 57344 (e5m2: 1.75·2^15).
double fp8_max(Fp8Format format);
// The dtypes a quantization takes: float32, bfloat16, float16.
bool fp8_quantizable(at::ScalarType t);
// at::kFloat8_e4m3fn or at::kFloat8_e5m2.
at::ScalarType fp8_dtype(Fp8Format format);

struct Fp8ScaleOptions {
  int history = 16;   // amaxes remembered (the last `history` finite ones)
  double margin = 0;  // headroom in powers of two: the history's max lands at ≤ fmax / 2^margin

  void validate() const;
};

// The delayed-scaling state of one tensor. update(amax) records the amax of a step quantized with scale(); the
// scale() after it is the one for the next step.
class Fp8Scale {
 public:
  Fp8Scale(Fp8Format format, Fp8ScaleOptions options);

  float scale() const { return scale_; }  // 1 until a non-zero finite amax is recorded
  void update(float amax);

  // The recorded amaxes, oldest first (at most options().history).
  std::vector<float> history() const;
  int64_t updates() const { return updates_; }     // update() calls that recorded an amax
  int64_t ignored() const { return ignored_; }     // update() calls with a non-finite amax
  Fp8Format format() const { return format_; }
  const Fp8ScaleOptions& options() const { return options_; }

  // Checkpoint support. restore() takes a state() of the same format; with a shorter history now, the newest amaxes
  // are kept. Throws UserError on an unreadable state.
  Json state() const;
  void restore(const Json& state);

 private:
  Fp8Format format_;
  Fp8ScaleOptions options_;
  std::vector<float> ring_;  // ring buffer of the history, at most options_.history entries
  size_t next_ = 0;          // where the next amax goes once the ring is full
  float scale_ = 1.f;
  int64_t updates_ = 0;
  int64_t ignored_ = 0;
};

// The power-of-two scale for an amax (the rule above); `previous` when amax is 0 or not finite.
float fp8_scale_for_amax(float amax, Fp8Format format, double margin, float previous);

struct Fp8Quantized {
  at::Tensor data;  // x's shape, fp8_dtype(format), contiguous, on x's device
  at::Tensor amax;  // () float32 on x's device: max |x| before scaling; NaN when x holds a NaN, 0 when x is empty
};

// x: float32, bfloat16 or float16. scale: finite and > 0. CUDA tensors use the kernel on CUDA builds.
at::Tensor fp8_quantize(const at::Tensor& x, float scale, Fp8Format format);
// The same bytes, and x's amax from the same pass (a separate reduction on the CPU).
Fp8Quantized fp8_quantize_amax(const at::Tensor& x, float scale, Fp8Format format);
// The spec, in torch ops, on any device: what the kernel must equal byte for byte.
Fp8Quantized fp8_quantize_reference(const at::Tensor& x, float scale, Fp8Format format);
// The same bytes for a scale held on the device, () float32 (Fp8DeviceScale): torch ops on x's device, no host sync.
at::Tensor fp8_quantize_scaled(const at::Tensor& x, const at::Tensor& scale, Fp8Format format);
// q: float8_e4m3fn or float8_e5m2 → float(q) / scale, as `dtype`.
at::Tensor fp8_dequantize(const at::Tensor& q, float scale, at::ScalarType dtype);

}  // namespace triaccel
