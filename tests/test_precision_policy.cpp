// PrecisionPolicy on made-up signals: the variance rule, self-calibrated thresholds, hysteresis, dwell, curvature
// promotion. Each expectation is a decision a wrong controller would get wrong.
#include "triaccel/core/errors.h"
#include "triaccel/control/precision/precision_policy.h"

#include <gtest/gtest.h>

namespace triaccel {
namespace {

std::vector<UnitPrecisionSignal> variances(const std::vector<double>& v) {
  std::vector<UnitPrecisionSignal> out;
  for (double x : v) out.push_back({x, -1});
  return out;
}

TEST(PrecisionPolicyTest, FixedThresholdsFollowThePaperRule) {
  PrecisionPolicyOptions o;
  o.tau_low = 1.0;
  o.tau_high = 10.0;
  o.beta = 0.0;  // no smoothing: the EMA is the last value
  o.hysteresis = 0.0;
  o.min_dwell_windows = 0;
  const PrecisionState s = precision_policy_step(o, {}, variances({0.5, 1.0, 9.9, 10.0, 50.0}));
  EXPECT_EQ(s.precision, (std::vector<Precision>{Precision::kFP16, Precision::kBF16, Precision::kBF16,
                                                 Precision::kFP32, Precision::kFP32}));
}

TEST(PrecisionPolicyTest, CalibratesThresholdsFromQuantilesAfterTheCalibrationWindows) {
  PrecisionPolicyOptions o;  // defaults: 3 windows, quantiles 0.25 / 0.9
  o.beta = 0.0;
  PrecisionState s;
  const std::vector<double> v = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  for (int w = 0; w < 2; ++w) {
    s = precision_policy_step(o, s, variances(v));
    EXPECT_FALSE(s.calibrated);
    for (Precision p : s.precision) EXPECT_EQ(p, Precision::kBF16);  // default while calibrating
  }
  s = precision_policy_step(o, s, variances(v));
  ASSERT_TRUE(s.calibrated);
  EXPECT_DOUBLE_EQ(s.tau_low, 3.25);   // 0.25 quantile of 1..10
  EXPECT_DOUBLE_EQ(s.tau_high, 9.1);   // 0.9 quantile
  EXPECT_EQ(s.precision.front(), Precision::kFP16);  // 1 < 3.25 · (1 − 0.25): leaves bf16
  EXPECT_EQ(s.precision.back(), Precision::kBF16);   // 10 ≥ τ_high = 9.1 but < 9.1 · 1.25: hysteresis holds bf16
}

TEST(PrecisionPolicyTest, HysteresisAndDwellStopFlapping) {
  PrecisionPolicyOptions o;
  o.tau_low = 1.0;
  o.tau_high = 10.0;
  o.beta = 0.0;
  o.hysteresis = 0.25;
  o.min_dwell_windows = 2;
  PrecisionState s = precision_policy_step(o, {}, variances({5.0}));
  ASSERT_EQ(s.precision[0], Precision::kBF16);
  // Just above τ_high but inside the margin (10 · 1.25 = 12.5): stays bf16.
  s = precision_policy_step(o, s, variances({11.0}));
  EXPECT_EQ(s.precision[0], Precision::kBF16);
  s = precision_policy_step(o, s, variances({13.0}));
  EXPECT_EQ(s.precision[0], Precision::kFP32);
  // Right after a switch the dwell time holds the class even though the signal dropped far below.
  s = precision_policy_step(o, s, variances({5.0}));
  EXPECT_EQ(s.precision[0], Precision::kFP32);
  s = precision_policy_step(o, s, variances({5.0}));
  EXPECT_EQ(s.precision[0], Precision::kFP32);
  s = precision_policy_step(o, s, variances({5.0}));
  EXPECT_EQ(s.precision[0], Precision::kBF16);
}

TEST(PrecisionPolicyTest, EmaSmoothsTheSignal) {
  PrecisionPolicyOptions o;
  o.tau_low = 1.0;
  o.tau_high = 10.0;
  o.beta = 0.9;
  o.hysteresis = 0.0;
  o.min_dwell_windows = 0;
  PrecisionState s = precision_policy_step(o, {}, variances({2.0}));
  EXPECT_DOUBLE_EQ(s.ema[0], 2.0);  // first window initializes
  s = precision_policy_step(o, s, variances({100.0}));
  EXPECT_DOUBLE_EQ(s.ema[0], 0.9 * 2.0 + 0.1 * 100.0);  // 11.8: one spike crosses τ_high only through the EMA
  EXPECT_EQ(s.precision[0], Precision::kFP32);
}

TEST(PrecisionPolicyTest, CurvaturePromotesOneLevelWhileAboveTauCurv) {
  PrecisionPolicyOptions o;
  o.tau_low = 1.0;
  o.tau_high = 10.0;
  o.tau_curv = 50.0;
  o.beta = 0.0;
  o.hysteresis = 0.0;
  o.min_dwell_windows = 0;
  PrecisionState s = precision_policy_step(o, {}, {{0.5, 100.0}, {5.0, 100.0}, {5.0, 10.0}});
  EXPECT_EQ(s.precision[0], Precision::kBF16);  // fp16 promoted
  EXPECT_EQ(s.precision[1], Precision::kFP32);  // bf16 promoted
  EXPECT_EQ(s.precision[2], Precision::kBF16);  // flat: not promoted
  EXPECT_TRUE(s.promoted[0]);
  // No new probe: the last λ_max still holds. A new, flat probe ends the promotion.
  s = precision_policy_step(o, s, {{0.5, -1}, {5.0, 1.0}, {5.0, -1}});
  EXPECT_EQ(s.precision[0], Precision::kBF16);
  EXPECT_EQ(s.precision[1], Precision::kBF16);
}

// amp-fp8's ladder (Hopper): fp8, bf16, fp32. A low-variance unit goes to fp8, not fp16; it comes back up to bf16
// when its variance rises past τ_low's margin, and curvature promotes it to bf16 (there is no fp16 level to stop at).
TEST(PrecisionPolicyTest, TheFp8LadderDemotesLowVarianceUnitsAndTakesThemBackUp) {
  PrecisionPolicyOptions o;
  o.tau_low = 1.0;
  o.tau_high = 10.0;
  o.tau_curv = 50.0;
  o.beta = 0.0;
  o.hysteresis = 0.25;
  o.min_dwell_windows = 0;
  o.low_precision = Precision::kFP8;
  PrecisionState s = precision_policy_step(o, {}, {{0.5, -1}, {5.0, -1}, {50.0, -1}, {0.5, 100.0}});
  EXPECT_EQ(s.precision, (std::vector<Precision>{Precision::kFP8, Precision::kBF16, Precision::kFP32,
                                                 Precision::kBF16}));
  EXPECT_EQ(s.base[3], Precision::kFP8);  // unit 3 is low-variance, promoted by its curvature to bf16
  EXPECT_TRUE(s.promoted[3]);
  // Unit 0's variance rises inside the margin (1.1 < 1.25): it stays in fp8; past it, up to bf16.
  s = precision_policy_step(o, s, {{1.1, -1}, {5.0, -1}, {50.0, -1}, {0.5, 1.0}});
  EXPECT_EQ(s.precision[0], Precision::kFP8);
  EXPECT_EQ(s.precision[3], Precision::kFP8);  // a flat probe ends the promotion: back to fp8
  s = precision_policy_step(o, s, {{2.0, -1}, {5.0, -1}, {50.0, -1}, {0.5, -1}});
  EXPECT_EQ(s.precision[0], Precision::kBF16);
  // And down again once it falls below τ_low · (1 − h).
  s = precision_policy_step(o, s, {{0.7, -1}, {5.0, -1}, {50.0, -1}, {0.5, -1}});
  EXPECT_EQ(s.precision[0], Precision::kFP8);
}

TEST(PrecisionPolicyTest, TheLaddersBottomIsFp16OrFp8) {
  PrecisionPolicyOptions o;
  o.low_precision = Precision::kBF16;
  EXPECT_THROW(o.validate(), UserError);
  o.low_precision = Precision::kFP8;
  EXPECT_NO_THROW(o.validate());
}

TEST(PrecisionPolicyTest, ValidateNamesTheFlag) {
  PrecisionPolicyOptions o;
  o.tau_low = 5;
  o.tau_high = 1;
  try {
    o.validate();
    FAIL();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("tau_low (5) must not exceed tau_high (1)"), std::string::npos);
  }
  EXPECT_DOUBLE_EQ(quantile({4, 1, 3, 2}, 0.5), 2.5);
}

}  // namespace
}  // namespace triaccel
