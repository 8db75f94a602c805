// BAOC's risk model (docs/baoc.md): per-unit gradient-stream and state statistics → the risk of running the unit in
// each state format. Pure functions: signals in, risks out (testable with made-up signals).
#pragma once

#include "triaccel/optim/state_format.h"

#include <cstdint>
#include <vector>

namespace triaccel {

// One unit's statistics over a window. Cosines in [-1, 1]; errors are relative L2 errors of the AdamW update
// direction u = m̂ / (√v̂ + ε) (0 = exact); see docs/baoc.md for each definition.
struct UnitSignals {
  int64_t params = 0;
  double cos_successive = 1;   // directional stability: cos(g_t, g_t-1), summed over the window
  double cos_momentum = 1;     // cos(g_t, m_t-1)
  double snr = 0;              // Σ m̂² / Σ (v̂ − m̂²)₊: signal-to-noise of the gradient, per element
  double log_v_spread = 0;     // std of ln v̂ over the unit's elements (scale anisotropy, reported)
  double precond_error = 0;    // ‖u − u_scalar‖ / ‖u‖, v̂ replaced by its mean per tensor (the SGD formats' k)
  double factor_error = 0;     // ‖u − u_rank1‖ / ‖u‖, v̂ replaced by its row/column factorization (matrices)
  double quant_error_bf16 = 0; // ‖u − u_bf16‖ / ‖u‖, m and v rounded to bfloat16
  double quant_error_8bit = 0; // ‖u − u_8bit‖ / ‖u‖, m and v through the 8-bit block-wise codec
};

struct RiskOptions {
  double w_quant = 1.0;     // weight of quantization errors
  double w_factor = 1.0;    // weight of the factorization error
  double w_momentum = 1.0;  // weight of removing the first moment
  double w_precond = 1.0;   // weight of dropping per-element preconditioning
  double unit_floor = 1.0;  // the part of a unit's weight that every unit gets whatever its size (see risk_weighted)
};

// The risk of removing the first moment: ((1 − cos_successive)/2 + (1 − cos_momentum)/2) / 2 / (1 + snr), in [0, 1].
double risk_momentum_loss(const UnitSignals& s);

// The unit's risk in format f before weighting by its size: 0 for kAdamW32; see docs/baoc.md.
double risk_unit_format(StateFormat f, const UnitSignals& s, const RiskOptions& o = {});

// risk_unit_format × the unit's weight (1 − u)·params / total_params + u / num_units, u = o.unit_floor (default 1:
// every unit weighs the same, whatever its size). Size underrates small units that every sample passes through (an
// embedding, a stem, a head): weighted by size only (u = 0) or half by size (u = 0.5), the char-GPT's embedding (1 %
// of the parameters) went to plain SGD at 25 % and its validation loss ended 5.7–6.8 % above fp32 AdamW's; with
// u = 1 the plan keeps it in fp32 and puts one block on factored instead (docs/baoc.md, Risk).
double risk_weighted(StateFormat f, const UnitSignals& s, int64_t total_params, int64_t num_units,
                     const RiskOptions& o = {});

}  // namespace triaccel
