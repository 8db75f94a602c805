#include "triaccel/optim/risk.h"

#include <algorithm>

namespace triaccel {

double risk_momentum_loss(const UnitSignals& s) {
  const double cs = std::clamp(s.cos_successive, -1.0, 1.0);
  const double cm = std::clamp(s.cos_momentum, -1.0, 1.0);
  return ((1 - cs) / 2 + (1 - cm) / 2) / 2 / (1 + std::max(0.0, s.snr));
}

double risk_unit_format(StateFormat f, const UnitSignals& s, const RiskOptions& o) {
  const double momentum = o.w_momentum * risk_momentum_loss(s);
  const double precond = o.w_precond * std::max(0.0, s.precond_error);
  switch (f) {
    case StateFormat::kAdamW32: return 0;
    case StateFormat::kAdamW16: return o.w_quant * std::max(0.0, s.quant_error_bf16);
    case StateFormat::kAdamW8: return o.w_quant * std::max(0.0, s.quant_error_8bit);
    case StateFormat::kFactored: return o.w_factor * std::max(0.0, s.factor_error) + momentum;
    case StateFormat::kNoMomentum: return momentum;
    case StateFormat::kSgdMomentum: return precond;
    case StateFormat::kSgd: return precond + momentum;
  }
  return 0;
}

double risk_weighted(StateFormat f, const UnitSignals& s, int64_t total_params, int64_t num_units,
                     const RiskOptions& o) {
  const double share = total_params > 0 ? static_cast<double>(s.params) / static_cast<double>(total_params) : 0.0;
  const double each = num_units > 0 ? 1.0 / static_cast<double>(num_units) : 0.0;
  const double u = std::clamp(o.unit_floor, 0.0, 1.0);
  return ((1 - u) * share + u * each) * risk_unit_format(f, s, o);
}

}  // namespace triaccel
