#include "triaccel/optim/risk.h"

#include <algorithm>

namespace triaccel {

double risk_momentum_loss(const UnitSignals& s) {
  const double cs = std::clamp(s.cos_successive, -1.0, 1.0);
  const double cm = std::clamp(s.cos_momentum, -1.0, 1.0);
  return ((1 - cs) / 2 + (1 - cm) / 2) / 2 / (1 + std::max(0.0, s.snr));
}

// The format's risk from its traits (state_format.h): the quantization error of its coarsest element-wise codec,
// the factorization error of a factored v, the momentum loss when it keeps no m, the preconditioner error when its
// step is SGD's.
double risk_unit_format(StateFormat f, const UnitSignals& s, const RiskOptions& o) {
  const StateFormatTraits& t = state_format_traits(f);
  const auto uses = [&](MomentCodec c) { return t.m == c || t.v == c; };
  double risk = 0;
  if (uses(MomentCodec::kQuant8)) {
    risk += o.w_quant * std::max(0.0, s.quant_error_8bit);
  } else if (uses(MomentCodec::kBFloat16)) {
    risk += o.w_quant * std::max(0.0, s.quant_error_bf16);
  }
  if (t.v == MomentCodec::kFactored) risk += o.w_factor * std::max(0.0, s.factor_error);
  if (t.sgd_scaled) risk += o.w_precond * std::max(0.0, s.precond_error);
  if (t.m == MomentCodec::kNone) risk += o.w_momentum * risk_momentum_loss(s);
  return risk;
}

double risk_weighted(StateFormat f, const UnitSignals& s, int64_t total_params, int64_t num_units,
                     const RiskOptions& o) {
  const double share = total_params > 0 ? static_cast<double>(s.params) / static_cast<double>(total_params) : 0.0;
  const double each = num_units > 0 ? 1.0 / static_cast<double>(num_units) : 0.0;
  const double u = std::clamp(o.unit_floor, 0.0, 1.0);
  return ((1 - u) * share + u * each) * risk_unit_format(f, s, o);
}

}  // namespace triaccel
