// Dynamic loss scaling with GradScaler semantics (torch.amp.GradScaler defaults): initial scale 2^16; after
// growth_interval (2000) consecutive clean steps the scale doubles; a step with an inf/NaN gradient is skipped and
// the scale halves. All state lives in device tensors and every operation is a device op, so the whole update can be
// captured in a CUDA graph. With scaling disabled (fp32, bf16) the scale stays 1 but non-finite gradients are still
// detected and their steps skipped: one policy for NaN/inf in every precision mode.
#pragma once

#include <ATen/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <vector>

namespace triaccel {

struct LossScalerOptions {
  bool enabled = false;  // true for amp-fp16
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;

  void validate() const;
};

class LossScaler {
 public:
  LossScaler(LossScalerOptions options, const c10::Device& device);

  // loss × scale (a device multiply; no sync).
  at::Tensor scale(const at::Tensor& loss) const;

  // Unscales grads in place and sets found_inf() to 1 if any is inf/NaN (0 otherwise). Device ops only.
  void unscale_and_check(const std::vector<at::Tensor>& grads);

  // The update in backward (train/step.h), scaling off: found_inf() set to 0 before the step, then raised to 1 by
  // check() of any tensor with an inf/NaN value (the loss, then each gradient before its update). Device ops only.
  void found_inf_reset();
  void check(const std::vector<at::Tensor>& tensors);

  // After the optimizer step: grows/backs off the scale (when enabled) and counts skipped steps. Device ops only.
  void update();
  // Puts back what the last update() changed (data parallelism: a step that every rank skipped because one rank ran
  // out of memory is retried, not counted). Device ops only.
  void update_undo();

  const at::Tensor& found_inf() const { return found_inf_; }        // (1) float32
  const at::Tensor& scale_tensor() const { return scale_; }         // (1) float32
  const at::Tensor& growth_tracker() const { return growth_tracker_; }  // (1) int32
  const at::Tensor& skipped_steps() const { return skipped_; }      // (1) float32, running count
  const LossScalerOptions& options() const { return options_; }

  // Checkpoint support: copies values in (shapes must match).
  void load(const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& skipped);

 private:
  LossScalerOptions options_;
  at::Tensor scale_;
  at::Tensor inv_scale_;
  at::Tensor growth_tracker_;
  at::Tensor found_inf_;
  at::Tensor skipped_;
  at::Tensor scale_before_, growth_before_;  // before the last update() (when enabled)
};

}  // namespace triaccel
