// A linear layer computed in FP8 (issue 58): y = x·Wᵀ + b with x and W quantized to E4M3 under per-tensor delayed
// scales, the product by at::_scaled_mm (fp32 accumulation, the output in x's dtype); in backward the output's
// gradient quantized to E5M2 under its own delayed scale, dgrad = g·W and wgrad = gᵀ·x from the FP8 tensors saved in
// forward (so a unit in FP8 keeps its linear inputs in 1 byte, not 2), the bias gradient from g as it came.
//
// Each scale is an Fp8DeviceScale: the quantization uses the scale from the amaxes of earlier steps, and the amax of
// this step's tensor is recorded after it (delayed scaling); everything stays on the device, so a captured step
// replays it. Master weights stay as they are (fp32); W is quantized at every forward.
//
// On CUDA, at::_scaled_mm needs every dimension of both products a multiple of 16 (fp8_linear_applies); the CPU has
// no such limit (its _scaled_mm is the reference the tests compare with).
#pragma once

#include "triaccel/models/linear.h"
#include "triaccel/train/fp8_device_scale.h"

#include <ATen/Tensor.h>
#include <c10/core/Device.h>

#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace triaccel {

// The three delayed scales of one linear layer.
struct Fp8LinearState {
  Fp8LinearState(const Fp8ScaleOptions& options, const c10::Device& device);

  Fp8DeviceScale input;   // E4M3
  Fp8DeviceScale weight;  // E4M3
  Fp8DeviceScale grad;    // E5M2: the output's gradient
};

// CUDA's _scaled_mm: every dimension of both operands a multiple of this.
constexpr int64_t kFp8ScaledMmMultiple = 16;

// Whether fp8_linear can compute this layer: x (..., K) float32 / bfloat16 / float16 on the weight's device, weight
// (N, K); on CUDA, K, N and the rows of x (the product of its leading dimensions) multiples of 16.
bool fp8_linear_applies(const at::Tensor& x, const at::Tensor& weight);

// x (..., K), weight (N, K), bias (N) or undefined → (..., N) in out_dtype (default: x's), differentiable in x,
// weight and bias (x's gradient in x's dtype). The forward product uses Hopper's fast FP8 accumulation, the two
// gradient products full-precision accumulation; a bias of the output's 16-bit dtype is added in the product's
// epilogue. `state` must outlive the backward of the graph this call records.
at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, Fp8LinearState& state,
                      std::optional<at::ScalarType> out_dtype = std::nullopt);

// The linear layers in FP8 while installed (LinearOverrideScope, models/linear.h): the built-in models' and a Python
// model's nn.Linear (the module routes them here). Each layer that fp8_linear applies to gets its own Fp8LinearState
// the first time it runs (so its first forward should be an eager one, before a CUDA graph's capture), kept for as
// long as this object lives, keyed by the layer's weight (the same tensor at every call); the others run their own
// forward.
// Under autocast the output has autocast's dtype, as autocast's linear gives; the input is quantized from its own
// dtype (a LayerNorm's float32 output there) with no cast before.
class Fp8Linears final : public LinearOverride {
 public:
  explicit Fp8Linears(Fp8ScaleOptions options) : options_(options) { options_.validate(); }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) override;
  size_t layers() const { return states_.size(); }  // the layers that ran in FP8 so far
  const Fp8LinearState* state_of(const at::Tensor& weight) const;

  // Checkpoints: the layers of `model` by their weights' names in it less ".weight" ("blocks.0.mlp.fc1"), once,
  // before state() or restore(); any 2-d parameter may be a linear layer's weight.
  void layers_name(torch::nn::Module& model);
  // The scales of the layers that ran, "fp8.<layer>.<input|weight|grad>.<ring|next|scale>" (live tensors).
  NamedTensors state() const;
  // The scales state() gave, each layer's state made now (on its weight's device) and loaded; UserError naming
  // `path` for an entry no linear layer of the model has.
  void restore(const NamedTensors& stored, const std::string& path);

 private:
  using Key = const c10::TensorImpl*;  // the layer's weight
  Fp8LinearState& state_for(Key weight, const c10::Device& device);

  Fp8ScaleOptions options_;
  std::unordered_map<Key, std::unique_ptr<Fp8LinearState>> states_;
  // layers_name's: each candidate weight and its layer's name, in the model's order (the key: the weight's TensorImpl).
  std::vector<std::pair<at::Tensor, std::string>> names_;
};

}  // namespace triaccel
