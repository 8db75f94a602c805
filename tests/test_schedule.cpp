// Warm-up + cosine (or linear) schedule: exact values at the landmarks.
#include "triaccel/core/errors.h"
#include "triaccel/train/schedule.h"

#include <gtest/gtest.h>

namespace triaccel {
namespace {

TEST(ScheduleTest, WarmupThenCosine) {
  ScheduleOptions o{0.4, 4, 104, 0.0};
  EXPECT_DOUBLE_EQ(schedule_lr(o, 0), 0.1);
  EXPECT_DOUBLE_EQ(schedule_lr(o, 3), 0.4);      // last warm-up step reaches the peak
  EXPECT_DOUBLE_EQ(schedule_lr(o, 4), 0.4);      // cosine starts at the peak
  EXPECT_NEAR(schedule_lr(o, 54), 0.2, 1e-12);   // half way: half the peak
  EXPECT_NEAR(schedule_lr(o, 104), 0.0, 1e-12);
  EXPECT_NEAR(schedule_lr(o, 500), 0.0, 1e-12);
  EXPECT_LT(schedule_lr(o, 80), schedule_lr(o, 30));
}

TEST(ScheduleTest, NoWarmupAndMinRatio) {
  ScheduleOptions o{1.0, 0, 10, 0.1};
  EXPECT_DOUBLE_EQ(schedule_lr(o, 0), 1.0);
  EXPECT_NEAR(schedule_lr(o, 10), 0.1, 1e-12);
}

TEST(ScheduleTest, WarmupThenLinear) {
  ScheduleOptions o{0.4, 4, 104, 0.0, LrDecay::kLinear};
  EXPECT_DOUBLE_EQ(schedule_lr(o, 0), 0.1);       // the warm-up is the same
  EXPECT_DOUBLE_EQ(schedule_lr(o, 4), 0.4);
  EXPECT_NEAR(schedule_lr(o, 29), 0.3, 1e-12);    // a quarter of the way: 3/4 of the peak (cosine: 0.341)
  EXPECT_NEAR(schedule_lr(o, 54), 0.2, 1e-12);
  EXPECT_NEAR(schedule_lr(o, 79), 0.1, 1e-12);
  EXPECT_NEAR(schedule_lr(o, 103.5), 0.002, 1e-12);  // fractional positions (batch changes) too
  EXPECT_NEAR(schedule_lr(o, 104), 0.0, 1e-12);
  EXPECT_NEAR(schedule_lr(o, 500), 0.0, 1e-12);
  const ScheduleOptions m{1.0, 0, 10, 0.1, LrDecay::kLinear};
  EXPECT_DOUBLE_EQ(schedule_lr(m, 0), 1.0);
  EXPECT_NEAR(schedule_lr(m, 5), 0.55, 1e-12);
  EXPECT_NEAR(schedule_lr(m, 10), 0.1, 1e-12);
  EXPECT_EQ(enum_parse<LrDecay>("linear", "lr_decay"), LrDecay::kLinear);
  EXPECT_EQ(enum_parse<LrDecay>("cosine", "lr_decay"), LrDecay::kCosine);
  try {
    enum_parse<LrDecay>("step", "lr_decay");
    FAIL() << "expected UserError";
  } catch (const UserError& e) {
    EXPECT_EQ(std::string(e.what()), "lr_decay must be cosine or linear, got 'step'");
    // A front end spells the option its own way (the CLI: its flag).
    EXPECT_EQ(e.message([](const std::string& key) { return "--" + key; }), "--lr_decay must be cosine or linear, got 'step'");
  }
}

TEST(ScheduleTest, ValidateNamesTheProblem) {
  ScheduleOptions o{0.1, 20, 10, 0.0};
  try {
    o.validate();
    FAIL() << "expected UserError";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("lower warmup_epochs"), std::string::npos);
  }
}

}  // namespace
}  // namespace triaccel
