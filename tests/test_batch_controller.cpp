// BatchController on made-up memory signals: the paper's grow/shrink rule, the growth guard, buckets, OOM back-off,
// the lr rule.
#include "triaccel/core/errors.h"
#include "triaccel/control/batch/batch_policy.h"

#include <gtest/gtest.h>

#include <cmath>

namespace triaccel {
namespace {

BatchPolicyOptions options_1gb() {
  BatchPolicyOptions o;
  o.budget_bytes = 1'000'000'000;
  return o;  // rho 0.70 / 0.90, steps 32, bucket 16, batch in [16, 4096]
}

TEST(BatchControllerTest, GrowsShrinksAndHolds) {
  const auto o = options_1gb();
  // 200 MB static + 2 MB per sample at batch 96 = 392 MB < 700 MB: grow to 128 (predicted 456 MB).
  BatchDecision d = batch_policy_step(o, 96, {392'000'000, 200'000'000});
  EXPECT_EQ(d.batch, 128);
  EXPECT_EQ(d.reason, "grow");
  EXPECT_NEAR(d.predicted_peak_bytes, 456e6, 1.0);
  d = batch_policy_step(o, 256, {950'000'000, 200'000'000});  // above 900 MB: shrink by 32
  EXPECT_EQ(d.batch, 224);
  EXPECT_EQ(d.reason, "shrink");
  d = batch_policy_step(o, 256, {800'000'000, 200'000'000});  // between: hold
  EXPECT_FALSE(d.changed);
  EXPECT_EQ(d.reason, "hold");
}

TEST(BatchControllerTest, GrowthNeverPlansPastRhoHigh) {
  const auto o = options_1gb();
  // 100 MB static + 6 MB/sample at 96 = 676 MB < 700 MB; at 128 the model predicts 868 MB ≤ 900 MB: grow.
  BatchDecision d = batch_policy_step(o, 96, {676'000'000, 100'000'000});
  EXPECT_EQ(d.batch, 128);
  // 50 MB static + 10 MB/sample at 64 = 690 MB < 700 MB, but 96 would need 1010 MB > 900 MB: hold.
  d = batch_policy_step(o, 64, {690'000'000, 50'000'000});
  EXPECT_NEAR(d.predicted_peak_bytes, 1010e6, 1.0);
  EXPECT_FALSE(d.changed);
  EXPECT_EQ(d.reason, "hold: growth would pass rho_high");
}

TEST(BatchControllerTest, BucketsAndBounds) {
  auto o = options_1gb();
  EXPECT_EQ(batch_bucket(o, 100), 96);
  EXPECT_EQ(batch_bucket(o, 5), 16);
  o.max_batch = 128;
  const BatchDecision d = batch_policy_step(o, 128, {300'000'000, 200'000'000});
  EXPECT_FALSE(d.changed);
  EXPECT_EQ(d.reason, "hold: at max_batch");
}

TEST(BatchControllerTest, OomHalvesUntilTheMinimumThenSaysWhatIsNeeded) {
  const auto o = options_1gb();
  EXPECT_EQ(batch_after_oom(o, 96), 48);
  EXPECT_EQ(batch_after_oom(o, 40), 16);
  EXPECT_EQ(batch_after_oom(o, 17), 16);
  try {
    batch_after_oom(o, 16);
    FAIL();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("the vram_budget is below what this model needs"), std::string::npos);
  }
}

TEST(BatchControllerTest, LearningRateFollowsTheBatch) {
  EXPECT_DOUBLE_EQ(lr_scale_for_batch(LrBatchRule::kLinear, 192, 96), 2.0);
  EXPECT_DOUBLE_EQ(lr_scale_for_batch(LrBatchRule::kSqrt, 384, 96), 2.0);
  EXPECT_DOUBLE_EQ(lr_scale_for_batch(LrBatchRule::kNone, 384, 96), 1.0);
  EXPECT_EQ(enum_parse<LrBatchRule>("sqrt", "lr_batch_rule"), LrBatchRule::kSqrt);
  EXPECT_THROW(enum_parse<LrBatchRule>("cubic", "lr_batch_rule"), UserError);
}

}  // namespace
}  // namespace triaccel
