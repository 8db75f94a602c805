// The element-wise update rules the fused optimizer kernel implements (kernels/adam_step.cu), each for float32 or
// bfloat16 moment storage. The kernel layer owns this enum so that it never includes the optimizer layer: the
// optimizer derives a rule from a state format's traits (which moments it keeps); formats served by kernels of their
// own (8-bit states, factored matrices) use none.
#pragma once

namespace triaccel {

enum class UpdateRule {
  kAdamW,        // m, v
  kNoMomentum,   // v, no first moment
  kSgdMomentum,  // m (AdamW's EMA), bias-corrected, times the tensor's constant k
  kSgd,          // no state: the gradient times the tensor's constant k
};

constexpr bool update_rule_has_m(UpdateRule r) { return r == UpdateRule::kAdamW || r == UpdateRule::kSgdMomentum; }
constexpr bool update_rule_has_v(UpdateRule r) { return r == UpdateRule::kAdamW || r == UpdateRule::kNoMomentum; }

// The rule that keeps exactly these moments.
constexpr UpdateRule update_rule_for(bool has_m, bool has_v) {
  return has_m ? (has_v ? UpdateRule::kAdamW : UpdateRule::kSgdMomentum)
               : (has_v ? UpdateRule::kNoMomentum : UpdateRule::kSgd);
}

}  // namespace triaccel
