// The element-wise update rules the fused optimizer kernels implement (kernels/adam_step.cu). The kernel layer owns
// this enum so that it never includes the optimizer layer: the optimizer maps its state formats onto a rule
// (kAdamW32 → kAdamW, kAdamW16 → kAdamWBf16, ...); formats served by kernels of their own (8-bit states, factored
// matrices) map to none.
#pragma once

namespace triaccel {

enum class UpdateRule {
  kAdamW,        // m, v float32
  kAdamWBf16,    // m, v stored as bfloat16 (updated in float32, rounded to nearest even)
  kNoMomentum,   // v float32, no first moment
  kSgdMomentum,  // m float32 (AdamW's EMA), bias-corrected, times the tensor's constant k
  kSgd,          // no state: the gradient times the tensor's constant k
};

}  // namespace triaccel
