// Warm-up + cosine schedule: exact values at the landmarks.
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

TEST(ScheduleTest, ValidateNamesTheProblem) {
  ScheduleOptions o{0.1, 20, 10, 0.0};
  try {
    o.validate();
    FAIL() << "expected UserError";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("--warmup-epochs"), std::string::npos);
  }
}

}  // namespace
}  // namespace triaccel
