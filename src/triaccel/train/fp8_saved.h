// FP8 storage of saved activations (issue 58; the memory planner's lever beside recompute, docs/memory-planner.md):
// while an Fp8SavedScope is open on a thread, the tensors autograd saves for backward there are kept as block-scaled
// FP8 (E4M3, one power-of-two scale per kFp8BlockElements elements in memory order) and dequantized, to their own
// dtype, sizes and strides, when backward reads them. A unit so stored keeps about half of its 16-bit activations
// (a quarter of fp32 ones) and pays one quantize pass in forward and one dequantize pass in backward; its gradients
// are computed from the dequantized values (what the test bounds), not recomputed.
//
// What is stored in FP8: a floating tensor (float32, bfloat16, float16) that is dense in memory, of at least
// kFp8SavedMinElements elements, and neither a leaf (the step's input, a parameter) nor a direct cast of a leaf (a
// weight's 16-bit autocast copy: a weight's error would reach every sample's gradient). Everything else is saved as
// autograd saves it. A tensor saved by several nodes of one store (a ReLU's output that the next convolution saves
// as its input) is quantized once and shared.
//
// How: autograd asks its default engine for the hooks of every tensor it saves (torch::autograd::SavedVariable). In a
// C++ program that engine is LibTorch's base engine, which has none; fp8_saved_available() installs, once, an engine
// of the same behaviour that returns this file's hooks while a scope is open. Where another engine is already the
// default (Python's, inside the Python module) it installs nothing and returns false: the lever is not offered there.
// The block format's reference is fp8_block_quantize_reference (torch ops, any device); on CUDA builds a CUDA tensor
// goes through kernels/fp8_block.cu, which writes the same bytes and scales.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <memory>

namespace triaccel {

constexpr int64_t kFp8SavedMinElements = 4096;

struct Fp8Blocks {
  at::Tensor data;    // (n) uint8: E4M3 bytes of x's elements in memory order
  at::Tensor scales;  // (ceil(n / kFp8BlockElements)) float32: each block's scale s (the bytes hold x·s)
};

// x: float32, bfloat16 or float16, dense. CUDA tensors use the kernel on CUDA builds.
Fp8Blocks fp8_block_quantize(const at::Tensor& x);
// The spec in torch ops: per block, s = the largest power of two with amax·s ≤ 448 (amax = max |x| over the block,
// NaN ignored; s = 1 for an amax of 0 or inf; exponent clamped to [-126, 127]); bytes e4m3(clamp(x·s, ±448)), 0x7f
// for a NaN.
Fp8Blocks fp8_block_quantize_reference(const at::Tensor& x);
// The values back: float(q) / s into `out` (dense, of the quantized tensor's numel, float32 / bfloat16 / float16), in
// memory order.
void fp8_block_dequantize_into(const Fp8Blocks& q, const at::Tensor& out);
void fp8_block_dequantize_reference_into(const Fp8Blocks& q, const at::Tensor& out);

// The tensors one forward stored (counters for tests and the cost model's trace).
class Fp8SavedStore {
 public:
  Fp8SavedStore();
  ~Fp8SavedStore();
  Fp8SavedStore(const Fp8SavedStore&) = delete;
  Fp8SavedStore& operator=(const Fp8SavedStore&) = delete;

  int64_t stored_tensors() const;    // tensors quantized (each once)
  int64_t stored_bytes() const;      // their FP8 bytes and scales
  int64_t original_bytes() const;    // what they held at their own dtype
  int64_t largest_original_bytes() const;  // the largest of them at its own dtype (what one unpack makes again)
  int64_t passed_tensors() const;    // saved tensors left as they were (leaves, casts of leaves, small, not floating)

  struct State;

 private:
  friend class Fp8SavedScope;
  std::shared_ptr<State> state_;
};

// While alive, tensors saved for backward on this thread go to `store` (nested scopes: the innermost). Requires
// fp8_saved_available().
class Fp8SavedScope {
 public:
  explicit Fp8SavedScope(Fp8SavedStore& store);
  ~Fp8SavedScope();
  Fp8SavedScope(const Fp8SavedScope&) = delete;
  Fp8SavedScope& operator=(const Fp8SavedScope&) = delete;

 private:
  std::shared_ptr<Fp8SavedStore::State> previous_;
};

// True when scopes take effect in this process (the engine is installed, or was): see the header's note.
bool fp8_saved_available();

}  // namespace triaccel
