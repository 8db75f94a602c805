// BaocOptimizer: one optimizer whose every parameter tensor has its own state format (optim/state_format.h): AdamW with
// fp32 / bf16 / 8-bit states, factored second moment, no first moment, SGD with momentum, plain SGD. `--optimizer
// adamw` is this class with every tensor in kAdamW32 (the same trajectory as torch::optim::AdamW); `--optimizer baoc`
// lets its format plan (control/optimizer_state/format_plan.h) choose the formats and convert between them.
//
// Invariants. step() on CUDA never synchronizes: per-tensor step counts (for bias correction) live in a device tensor
// and are advanced on the device when found_inf = 0; the fused kernels (kernels/adam_step.cu, one launch per format
// group; kernels/adam8_step.cu for 8-bit; kernels/factored_step.cu, four launches, for factored matrices) read lr,
// counts and found_inf there. State tensors keep their addresses between steps; formats_set() replaces the state of the
// tensors whose format changes (callers drop captured CUDA graphs after it). Moments survive a conversion (re-encoded
// in the new format, up to its rounding); a moment the old format lacked starts at zero with its step count at zero.
// Weight decay is decoupled and, as for SGD, not applied to tensors of dim ≤ 1. The CPU path runs
// baoc_tensor_step_reference, the spec the CUDA kernels are tested against. Sharded state (ZeRO stage 1,
// Optimizer::set_owned): a tensor's moments, its statistics and its SGD scale are its owner's; what a plan reads (the
// window's sums, the signals, the SGD scales after a conversion) is summed over the ranks through set_sum_over_ranks,
// each tensor's share coming from its owner alone, so every rank plans as one process would.
#pragma once

#include "triaccel/optim/state_format.h"
#include "triaccel/optim/optimizer.h"

#include <ATen/Tensor.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace triaccel {

struct BaocOptions {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;  // decoupled (AdamW); 0 on norms and biases

  void validate() const;
};

// One tensor's state in its format (only the fields the format uses are defined).
struct BaocTensorState {
  StateFormat format = StateFormat::kAdamW32;
  at::Tensor m;         // kAdamW32, kSgdMomentum: float32, param shape; kAdamW16: bfloat16; kAdamW8: (numel) uint8
  at::Tensor v;         // kAdamW32, kNoMomentum, kFactored (1-D): float32; kAdamW16: bfloat16; kAdamW8: uint8 codes
  at::Tensor m_absmax;  // kAdamW8: (ceil(numel / 256)) float32
  at::Tensor v_absmax;  // kAdamW8
  at::Tensor v_row;     // kFactored matrices: (R) float32 row means of g² (EMA)
  at::Tensor v_col;     // kFactored matrices: (C) float32 column means of g² (EMA)
  float sgd_scale = 1;  // k of the SGD formats (state_format.h)
};

// Gradient-stream sums per tensor, accumulated over the steps of a statistics window (columns of
// stream_stats_take()). "Pairs" are successive non-skipped steps inside the window.
constexpr int64_t kStreamDotPrev = 0;  // Σ <g_t, g_t-1>       over pairs
constexpr int64_t kStreamSqPrev = 1;   // Σ |g_t-1|²           over pairs
constexpr int64_t kStreamSqCur = 2;    // Σ |g_t|²             over pairs
constexpr int64_t kStreamDotMom = 3;   // Σ <g_t, m_t-1>       over steps where the tensor has a first moment
constexpr int64_t kStreamSqMom = 4;    // Σ |m_t-1|²           same steps
constexpr int64_t kStreamSqGradM = 5;  // Σ |g_t|²             same steps
constexpr int64_t kStreamColumns = 6;

class BaocOptimizer final : public Optimizer {
 public:
  BaocOptimizer(const std::vector<std::pair<std::string, at::Tensor>>& named_params, BaocOptions options,
                StateFormat initial = StateFormat::kAdamW32);

  void step(const at::Tensor& lr, const at::Tensor& found_inf) override;
  // One tensor's update (the update in backward): while no gradient statistics are gathered, which read every
  // gradient of a step together.
  bool steps_one() const override { return !stats_on_; }
  void step_one(size_t i, const at::Tensor& grad, const at::Tensor& lr, const at::Tensor& found_inf) override;
  NamedTensors state_tensors() override;
  void state_load(const NamedTensors& stored, const std::string& path) override;

  const BaocOptions& options() const { return options_; }
  std::vector<StateFormat> formats() const;
  const BaocTensorState& state(size_t i) const { return states_[i]; }
  // (T, 2) float64 on the device: per tensor, steps taken by its first and its second moment.
  const at::Tensor& counts() const { return counts_; }
  bool state_initialized() const { return initialized_; }
  // Allocates the state (zeros) if the first step has not yet.
  void state_init() override;
  // Converts every tensor whose format changes, keeping its moments (see the invariants above).
  void formats_set(const std::vector<StateFormat>& formats);
  // Exact bytes of the current formats' state (state_format_bytes summed).
  int64_t state_bytes() const override;

  // A tensor's moments as float32 in the parameter's shape, decoded from its format (a factored v is
  // reconstructed as r cᵀ / mean(r)); undefined if the format has none or the state is not initialized.
  // Not bias-corrected. May alias the live state (fp32 formats): read only.
  at::Tensor m_float(size_t i) const;
  at::Tensor v_float(size_t i) const;

  // Gradient-stream statistics (docs/baoc.md): while enabled, every step adds its sums (kStream*) on the device and
  // keeps a float32 copy of the previous gradient (memory: one parameter set, during the window only; sharded: the
  // owned tensors' only).
  void stream_stats_enable(bool on);
  bool stream_stats_enabled() const { return stats_on_; }
  // (T, kStreamColumns) float64 on the CPU (syncs; sharded: summed over the ranks, a collective); resets the sums.
  at::Tensor stream_stats_take();

  // Sharded state: `sum` adds a tensor over the ranks in place (every rank calls it at the same point). Required
  // before a statistics window or a conversion of sharded state.
  using SumOverRanks = std::function<void(at::Tensor&)>;
  void set_sum_over_ranks(SumOverRanks sum) { sum_over_ranks_ = std::move(sum); }
  // `values` summed over the ranks (unchanged when not sharded); float64 through a tensor on the state's device.
  std::vector<double> sum_over_ranks(std::vector<double> values) const;

  // The 8-bit maps on the parameters' device: (256) float32 each, and (255) midpoints.
  const at::Tensor& map_signed() const { return map_signed_; }
  const at::Tensor& map_unsigned() const { return map_unsigned_; }

 private:
  BaocTensorState state_make(size_t i, StateFormat f, const at::Tensor& m32, const at::Tensor& v32) const;
  // Tensor i's state in its format, zero, on the host (sharded state: what a checkpoint gathers its owner's into).
  BaocTensorState state_host_temporary(size_t i) const;
  // The update of the tensors `indices` (owned) from `grads` (one each), their step counts already advanced: on CUDA
  // one kernel per state format, found_inf read on the device; elsewhere the reference, skipped when found_inf.
  void update(const std::vector<size_t>& indices, const std::vector<at::Tensor>& grads, const at::Tensor& lr,
              const at::Tensor& found_inf);
  void stream_stats_add(const std::vector<at::Tensor>& grads, const at::Tensor& found_inf);
  // The state's entries by name; with `for_checkpoint` and sharded state, the window's sums summed over the ranks
  // (a collective) and another rank's previous gradients as host temporaries, which the checkpoint gathers.
  NamedTensors state_entries(bool for_checkpoint);
  void sum_in_place(at::Tensor& t) const;

  BaocOptions options_;
  std::vector<StateFormat> pending_formats_;  // formats before the state exists
  std::vector<BaocTensorState> states_;
  bool initialized_ = false;
  at::Tensor counts_;  // (T, 2) float64
  at::Tensor map_signed_, map_unsigned_, mids_signed_, mids_unsigned_;
  bool stats_on_ = false;
  at::Tensor stats_have_prev_;           // (1) float64 on the device: 1 once a previous gradient is stored
  std::vector<at::Tensor> stats_prev_;  // previous gradients, float32
  at::Tensor stats_sum_;                // (T, kStreamColumns) float64 on the device; sharded: owned rows only
  SumOverRanks sum_over_ranks_;
};

// The spec of one tensor's update in plain ATen (any device; synchronizes). p, g: float32, same shape; the step
// counts are those after this step's increment; lr_eff = lr · lr scale; wd: this tensor's weight decay.
// map_signed / map_unsigned: the 8-bit maps (used by kAdamW8 only).
void baoc_tensor_step_reference(BaocTensorState& s, const at::Tensor& p, const at::Tensor& g, double lr_eff,
                                double wd, double count_m, double count_v, const BaocOptions& o,
                                const at::Tensor& map_signed, const at::Tensor& map_unsigned);

}  // namespace triaccel
