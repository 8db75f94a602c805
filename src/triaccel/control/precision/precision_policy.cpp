#include "triaccel/control/precision/precision_policy.h"

#include "triaccel/core/errors.h"

#include <algorithm>
#include <cmath>

namespace triaccel {

void PrecisionPolicyOptions::validate() const {
  TRIACCEL_CHECK_INPUT(beta >= 0 && beta < 1, "precision policy: beta must be in [0, 1), got ", beta);
  TRIACCEL_CHECK_INPUT(calibration_windows >= 1, "precision policy: calibration_windows must be >= 1, got ",
                       calibration_windows);
  TRIACCEL_CHECK_INPUT(low_quantile >= 0 && low_quantile <= high_quantile && high_quantile <= 1,
                       "precision policy: need 0 <= low_quantile <= high_quantile <= 1, got ", low_quantile, ", ",
                       high_quantile);
  TRIACCEL_CHECK_INPUT(curv_quantile >= 0 && curv_quantile <= 1, "precision policy: curv_quantile must be in [0, 1]");
  TRIACCEL_CHECK_INPUT(tau_low < 0 || tau_high < 0 || tau_low <= tau_high, option_ref("tau_low"), " (", tau_low,
                       ") must not exceed ", option_ref("tau_high"), " (", tau_high, ")");
  TRIACCEL_CHECK_INPUT(hysteresis >= 0 && hysteresis < 1, "precision policy: hysteresis must be in [0, 1), got ",
                       hysteresis);
  TRIACCEL_CHECK_INPUT(min_dwell_windows >= 0, "precision policy: min_dwell_windows must be >= 0");
  TRIACCEL_CHECK_INPUT(low_precision == Precision::kFP16 || low_precision == Precision::kFP8,
                       "precision policy: the ladder's bottom level is fp16 or fp8, got ", enum_name(low_precision));
}

double quantile(std::vector<double> values, double q) {
  TORCH_CHECK(!values.empty(), "quantile of no values");
  std::sort(values.begin(), values.end());
  const double pos = q * static_cast<double>(values.size() - 1);
  const auto lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, values.size() - 1);
  return values[lo] + (pos - static_cast<double>(lo)) * (values[hi] - values[lo]);
}

namespace {

// The class of v under the thresholds, without hysteresis; `low`: the ladder's bottom level (fp16, or fp8).
Precision classify(double v, double tau_low, double tau_high, Precision low) {
  if (v < tau_low) return low;
  if (v < tau_high) return Precision::kBF16;
  return Precision::kFP32;
}

// Moving up needs v to clear the thresholds raised by (1 + h); moving down, to fall below them lowered by (1 − h).
Precision classify_with_hysteresis(double v, Precision current, double tau_low, double tau_high, double h,
                                   Precision low) {
  const Precision raw = classify(v, tau_low, tau_high, low);
  if (raw > current) {
    const Precision up = classify(v, tau_low * (1 + h), tau_high * (1 + h), low);
    return up > current ? up : current;
  }
  if (raw < current) {
    const Precision down = classify(v, tau_low * (1 - h), tau_high * (1 - h), low);
    return down < current ? down : current;
  }
  return current;
}

// One level up the ladder: fp8 and fp16 to bf16 (the fp8 ladder has no fp16 level), bf16 to fp32.
Precision promote(Precision p) { return p <= Precision::kFP16 ? Precision::kBF16 : Precision::kFP32; }

}  // namespace

PrecisionState precision_policy_step(const PrecisionPolicyOptions& o, const PrecisionState& previous,
                                     const std::vector<UnitPrecisionSignal>& signals) {
  PrecisionState s = previous;
  const size_t n = signals.size();
  if (s.ema.empty()) {
    s.ema.assign(n, 0.0);
    s.lambda_max.assign(n, -1.0);
    s.base.assign(n, o.default_precision);
    s.precision.assign(n, o.default_precision);
    s.dwell.assign(n, o.min_dwell_windows);  // the first decision is free
    s.promoted.assign(n, false);
  }
  TORCH_CHECK(s.ema.size() == n, "precision_policy_step: ", n, " signals for ", s.ema.size(), " units");

  for (size_t i = 0; i < n; ++i) {
    const double v = signals[i].grad_variance;
    if (std::isfinite(v)) {
      s.ema[i] = s.windows == 0 ? v : o.beta * s.ema[i] + (1 - o.beta) * v;
    }
    if (signals[i].lambda_max >= 0 && std::isfinite(signals[i].lambda_max)) s.lambda_max[i] = signals[i].lambda_max;
  }
  s.windows += 1;

  // Thresholds: given by the user, or calibrated once at the end of the calibration windows.
  if (!s.calibrated) {
    if (o.tau_low >= 0 && o.tau_high >= 0) {
      s.tau_low = o.tau_low;
      s.tau_high = o.tau_high;
      s.calibrated = true;
    } else if (s.windows >= o.calibration_windows) {
      s.tau_low = o.tau_low >= 0 ? o.tau_low : quantile(s.ema, o.low_quantile);
      s.tau_high = o.tau_high >= 0 ? o.tau_high : std::max(s.tau_low, quantile(s.ema, o.high_quantile));
      s.calibrated = true;
    }
  }
  if (!s.curv_calibrated) {
    std::vector<double> seen;
    for (double l : s.lambda_max) {
      if (l >= 0) seen.push_back(l);
    }
    if (o.tau_curv >= 0) {
      s.tau_curv = o.tau_curv;
      s.curv_calibrated = true;
    } else if (seen.size() == n && n > 0) {
      s.tau_curv = quantile(seen, o.curv_quantile);
      s.curv_calibrated = true;
    }
  }

  for (size_t i = 0; i < n; ++i) {
    if (s.calibrated) {
      const Precision next = s.dwell[i] >= o.min_dwell_windows
                                 ? classify_with_hysteresis(s.ema[i], s.base[i], s.tau_low, s.tau_high, o.hysteresis,
                                                            o.low_precision)
                                 : s.base[i];
      if (next != s.base[i]) {
        s.base[i] = next;
        s.dwell[i] = 0;
      } else {
        s.dwell[i] += 1;
      }
    }
    // Strictly above τ_curv: the calibrating quantile itself does not promote the unit that defines it at q = 1.
    s.promoted[i] = s.curv_calibrated && s.lambda_max[i] > s.tau_curv && s.base[i] != Precision::kFP32;
    s.precision[i] = s.promoted[i] ? promote(s.base[i]) : s.base[i];
  }
  return s;
}

}  // namespace triaccel
