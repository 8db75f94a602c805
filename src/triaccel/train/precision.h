// Precision: the run's mode (fp32, or automatic mixed precision in bf16 or fp16 with fp32 master weights, or amp-fp8:
// amp-bf16 with the built-in models' linear layers in FP8, train/fp8_linear.h), the per-unit
// precisions Tri-Accel decides, autocast scoped to a block of code, and the forward of a model whose units run at
// their own precisions.
#pragma once

#include "triaccel/core/enum_names.h"
#include "triaccel/models/model.h"

#include <ATen/Tensor.h>
#include <c10/core/Device.h>

#include <functional>
#include <optional>
#include <vector>

namespace triaccel {

// A run's precision mode (the `precision` option).
enum class PrecisionMode { kFP32, kAmpBF16, kAmpFP16, kAmpFP8 };

template <>
struct EnumNames<PrecisionMode> {
  static constexpr EnumName<PrecisionMode> kNames[] = {{PrecisionMode::kFP32, "fp32"},
                                                       {PrecisionMode::kAmpBF16, "amp-bf16"},
                                                       {PrecisionMode::kAmpFP16, "amp-fp16"},
                                                       {PrecisionMode::kAmpFP8, "amp-fp8"},
                                                       {PrecisionMode::kAmpBF16, "bf16"},
                                                       {PrecisionMode::kAmpFP16, "fp16"},
                                                       {PrecisionMode::kAmpFP8, "fp8"}};
};

// One unit's compute precision (Tri-Accel's per-unit decision). Ordered: a promotion moves up. kFP8 is the level
// under amp-fp8 (Hopper, where fp16 runs as fast as bf16): the unit runs as amp-bf16 with its linear layers in FP8
// (train/fp8_linear.h). Its value is -1 so that the others keep the numbers checkpoints store them as.
enum class Precision { kFP8 = -1, kFP16 = 0, kBF16 = 1, kFP32 = 2 };

template <>
struct EnumNames<Precision> {
  static constexpr EnumName<Precision> kNames[] = {
      {Precision::kFP8, "fp8"}, {Precision::kFP16, "fp16"}, {Precision::kBF16, "bf16"}, {Precision::kFP32, "fp32"}};
};

// The 16-bit dtype a mode autocasts to (amp-fp8: bf16, around its FP8 linears); fp32: none (kFloat).
at::ScalarType autocast_dtype(PrecisionMode mode);
// Whether the mode runs the linear layers the FP8 product takes in FP8 (amp-fp8).
inline bool fp8_linears(PrecisionMode mode) { return mode == PrecisionMode::kAmpFP8; }

// The autocast mode of a unit precision (fp32: no autocast; fp8: amp-fp8, whose autocast is bf16's).
PrecisionMode precision_mode_of(Precision p);
// The dtype a unit of this precision computes in (its input is cast to it; fp8: bf16, the FP8 linears quantize from
// it).
at::ScalarType precision_dtype(Precision p);

// Sets autocast for the device from the precision mode for the scope's lifetime (and restores it after).
class AutocastScope {
 public:
  AutocastScope(const c10::Device& device, PrecisionMode precision);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  c10::DeviceType type_;
  bool prev_enabled_;
  at::ScalarType prev_dtype_;
  bool active_;
};

// A unit's forward as the training step runs it. With a unit precision (Tri-Accel's, as applied on the device:
// precision_applied) the unit's input is cast to that precision's dtype at its entry and `forward` runs under that
// precision's autocast; without one (nullopt), under the run's mode's autocast on its input as it comes. The cast
// matters for the ops autocast leaves alone: a residual add of a bf16 block output and an fp32 (or fp16) identity
// promotes to fp32, and the fp32 stream then runs on through every later unit of the stage, raising the memory peak
// above that of a run in bf16 throughout (measured: docs/results/memory-planner.md). The step's forward and its
// recomputes (train/step.cpp) and the memory model's traces (control/memory/memory_model.cpp) all run units through
// this one rule.
at::Tensor unit_forward_at(const std::optional<Precision>& unit, PrecisionMode run, const c10::Device& device,
                           const at::Tensor& x, const std::function<at::Tensor(const at::Tensor&)>& forward);
// The autocast mode unit_forward_at runs a unit in (amp-fp8 for an fp8 unit or an amp-fp8 run: its FP8 linears apply).
PrecisionMode unit_mode(const std::optional<Precision>& unit, PrecisionMode run);

// The precision a decision runs at on this device: CPUs have no fast fp16 convolutions (measured: ~15x slower than
// bf16 here), so fp16 decisions run as bf16 there.
Precision precision_applied(Precision decided, const c10::Device& device);
// Unit u's precision as unit_forward_at takes it: precisions[u] as applied on the device, or nullopt when no per-unit
// precisions are set (precisions empty: the run's mode).
std::optional<Precision> unit_precision_at(const std::vector<Precision>& precisions, size_t u,
                                           const c10::Device& device);

}  // namespace triaccel
