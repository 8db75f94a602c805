// Tri-Accel precision policy (paper §3.1–3.2): per-unit precision from an EMA of the unit's gradient variance, with
// promotion when the unit's curvature (λ_max) is high. A pure controller: signals and the previous state in, the
// next state (holding the decision) out; the trainer applies it (per-unit autocast dtype at the unit's forward).
//
//   v_l ← β·v_l + (1 − β)·Var[∇_l]
//   p_l = FP16 if v_l < τ_low;  BF16 if τ_low ≤ v_l < τ_high;  FP32 if v_l ≥ τ_high
//   p_l promoted one level (FP16 → BF16 → FP32) while λ_max,l > τ_curv
// Under amp-fp8 (low_precision fp8) the ladder is FP8 / BF16 / FP32: on Hopper fp16 is no faster than bf16, FP8 is
// the level that is (twice the tensor-core rate); an FP8 unit computes its linear layers in FP8, the rest in bf16,
// and a promotion moves it to BF16.
//
// No manual tuning: unset thresholds (< 0) calibrate themselves. During the first `calibration_windows` windows every
// unit runs at `default_precision`; at the end of the last one τ_low and τ_high become quantiles (low_quantile,
// high_quantile) of the units' EMA values, and τ_curv the `curv_quantile` quantile of the first probe's λ_max values.
// Hysteresis: a unit leaves its class only when the EMA crosses the threshold by a relative margin, and stays in a
// class at least `min_dwell_windows` windows, so decisions do not flap.
#pragma once

#include "triaccel/train/precision.h"

#include <cstdint>
#include <string>
#include <vector>

namespace triaccel {


struct PrecisionPolicyOptions {
  double beta = 0.9;
  double tau_low = -1;          // < 0: calibrate
  double tau_high = -1;         // < 0: calibrate
  double tau_curv = -1;         // < 0: calibrate from the first curvature probe
  int calibration_windows = 3;
  double low_quantile = 0.25;   // calibrated τ_low: this quantile of the units' EMA
  double high_quantile = 0.9;   // calibrated τ_high
  double curv_quantile = 0.9;   // calibrated τ_curv
  double hysteresis = 0.25;     // relative margin beyond a threshold needed to change class
  int min_dwell_windows = 2;
  Precision default_precision = Precision::kBF16;
  Precision low_precision = Precision::kFP16;  // the bottom level: kFP16, or kFP8 under amp-fp8

  void validate() const;
};

struct UnitPrecisionSignal {
  double grad_variance = 0;  // Var[∇_l] over the unit's gradient elements this window
  double lambda_max = -1;    // the unit's largest Hessian eigenvalue if probed this window, else < 0 (no news)
};

struct PrecisionState {
  int64_t windows = 0;                 // windows seen
  bool calibrated = false;
  bool curv_calibrated = false;
  double tau_low = -1, tau_high = -1, tau_curv = -1;
  std::vector<double> ema;             // per unit
  std::vector<double> lambda_max;      // last probed λ_max per unit (< 0: never)
  std::vector<Precision> base;         // class from the variance rule (with hysteresis)
  std::vector<Precision> precision;    // decision: base, promoted by curvature
  std::vector<int> dwell;              // windows since the base class last changed
  std::vector<bool> promoted;          // curvature promotion active
};

// One control window. `signals` has one entry per unit (the same count every call).
PrecisionState precision_policy_step(const PrecisionPolicyOptions& options, const PrecisionState& previous,
                                     const std::vector<UnitPrecisionSignal>& signals);

// The q-quantile (linear interpolation) of values; values must not be empty.
double quantile(std::vector<double> values, double q);

}  // namespace triaccel
