// LossScaler: GradScaler semantics (back-off on inf/NaN with the step flagged, growth after growth_interval clean
// steps, unscaling), and non-finite detection with scaling off.
#include "triaccel/train/loss_scaler.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace triaccel {
namespace {

TEST(LossScalerTest, BacksOffOnInfAndGrowsAfterInterval) {
  LossScalerOptions o;
  o.enabled = true;
  o.growth_interval = 3;
  LossScaler s(o, torch::kCPU);
  EXPECT_EQ(s.scale_tensor().item<float>(), 65536.f);
  EXPECT_EQ(s.scale(torch::full({}, 2.0)).item<float>(), 131072.f);

  std::vector<at::Tensor> grads = {torch::full({3}, 65536.f), torch::tensor({1.f, INFINITY})};
  s.unscale_and_check(grads);
  EXPECT_EQ(s.found_inf().item<float>(), 1.f);
  s.update();
  EXPECT_EQ(s.scale_tensor().item<float>(), 32768.f);
  EXPECT_EQ(s.skipped_steps().item<float>(), 1.f);

  for (int i = 0; i < 3; ++i) {
    std::vector<at::Tensor> clean = {torch::full({3}, 32768.f)};
    s.unscale_and_check(clean);
    EXPECT_EQ(s.found_inf().item<float>(), 0.f);
    EXPECT_FLOAT_EQ(clean[0][0].item<float>(), 1.f);  // unscaled in place
    s.update();
  }
  EXPECT_EQ(s.scale_tensor().item<float>(), 65536.f);  // grew after 3 clean steps
  EXPECT_EQ(s.skipped_steps().item<float>(), 1.f);
}

TEST(LossScalerTest, DisabledKeepsScaleOneButStillDetectsNaN) {
  LossScaler s(LossScalerOptions{}, torch::kCPU);
  const at::Tensor loss = torch::full({}, 3.0);
  EXPECT_TRUE(torch::equal(s.scale(loss), loss));
  std::vector<at::Tensor> grads = {torch::tensor({2.f, NAN})};
  s.unscale_and_check(grads);
  EXPECT_EQ(s.found_inf().item<float>(), 1.f);
  s.update();
  EXPECT_EQ(s.scale_tensor().item<float>(), 1.f);
  EXPECT_EQ(s.skipped_steps().item<float>(), 1.f);
  std::vector<at::Tensor> clean = {torch::tensor({2.f, 3.f})};
  s.unscale_and_check(clean);
  EXPECT_EQ(s.found_inf().item<float>(), 0.f);
  EXPECT_EQ(clean[0][1].item<float>(), 3.f);
}

}  // namespace
}  // namespace triaccel
