// Each option a component reads has its default in that component's options struct, and the configuration's field
// is initialized from it: a default Config (resolved, as every run's) builds exactly the default options of every
// component it feeds (run/component_options.h), so a component built in C++ runs what the CLI and Python run. Each
// test compares every field the configuration feeds and names the field on a mismatch; what a caller sets as the
// run starts (the clock, the probe's samples, the device's rates, the budget's bytes) is not the configuration's.
#include "triaccel/models/registry.h"
#include "triaccel/run/component_options.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace triaccel {
namespace {

// One field of the options built from a default Config against the same field of a default-constructed `Options`.
#define EXPECT_FIELD_DEFAULT(built, Options, field) \
  EXPECT_EQ((built).field, Options{}.field) << #Options "::" #field ": a default Config builds another value"

Config config_default() {
  Config config;
  config.resolve();
  return config;
}

std::shared_ptr<Model> small_cnn_make() {
  torch::manual_seed(0);
  ModelOptions options;
  options.name = "small-cnn";
  options.in_channels = 1;
  options.image_size = 28;
  return model_create(options);
}

TEST(OptionDefaultsTest, CurvatureProbe) {
  const CurvatureOptions built = curvature_options(config_default(), *small_cnn_make());
  EXPECT_FIELD_DEFAULT(built, CurvatureOptions, top_k);
  EXPECT_FIELD_DEFAULT(built, CurvatureOptions, max_iters);
  EXPECT_FIELD_DEFAULT(built, CurvatureOptions, tol);
  EXPECT_FIELD_DEFAULT(built, CurvatureOptions, batch);
  EXPECT_FIELD_DEFAULT(built, CurvatureOptions, every_steps);
  EXPECT_FIELD_DEFAULT(built, CurvatureOptions, seed);
  EXPECT_FIELD_DEFAULT(built, CurvatureOptions, cuda_graphs);
  EXPECT_FIELD_DEFAULT(built, CurvatureOptions, cudnn);  // curv_cudnn auto on a model without grouped convolutions
  EXPECT_FIELD_DEFAULT(built, CurvatureOptions, chunk);
  EXPECT_FIELD_DEFAULT(built, CurvatureOptions, estimator);
}

TEST(OptionDefaultsTest, CurvatureController) {
  const CurvatureControllerOptions built = curvature_controller_options(config_default(), *small_cnn_make());
  EXPECT_FIELD_DEFAULT(built, CurvatureControllerOptions, ctrl_every);
  EXPECT_FIELD_DEFAULT(built, CurvatureControllerOptions, budget);
  EXPECT_FIELD_DEFAULT(built, CurvatureControllerOptions, alpha);
  EXPECT_FIELD_DEFAULT(built, CurvatureControllerOptions, lr_scaling);
  EXPECT_FIELD_DEFAULT(built, CurvatureControllerOptions, lr_mean_one);
  EXPECT_FIELD_DEFAULT(built, CurvatureControllerOptions, lockstep);
  EXPECT_FIELD_DEFAULT(built, CurvatureControllerOptions, lockstep_rounds());
  EXPECT_FIELD_DEFAULT(built, CurvatureControllerOptions, probe.top_k);
  EXPECT_FIELD_DEFAULT(built, CurvatureControllerOptions, probe.tol);
  EXPECT_FIELD_DEFAULT(built, CurvatureControllerOptions, probe.chunk);
  EXPECT_FIELD_DEFAULT(built, CurvatureControllerOptions, probe.estimator);
}

TEST(OptionDefaultsTest, PrecisionPolicy) {
  const PrecisionPolicyOptions built = precision_policy_options(config_default());
  EXPECT_FIELD_DEFAULT(built, PrecisionPolicyOptions, tau_low);
  EXPECT_FIELD_DEFAULT(built, PrecisionPolicyOptions, tau_high);
  EXPECT_FIELD_DEFAULT(built, PrecisionPolicyOptions, tau_curv);
}

TEST(OptionDefaultsTest, BaocController) {
  const BaocControllerOptions built = baoc_controller_options(config_default());
  EXPECT_FIELD_DEFAULT(built, BaocControllerOptions, memory_budget);
  EXPECT_FIELD_DEFAULT(built, BaocControllerOptions, time_budget);
  EXPECT_FIELD_DEFAULT(built, BaocControllerOptions, formats);
  EXPECT_FIELD_DEFAULT(built, BaocControllerOptions, time_table);
  EXPECT_FIELD_DEFAULT(built, BaocControllerOptions, risk_floor);
  EXPECT_FIELD_DEFAULT(built, BaocControllerOptions, plan_warmup);
  EXPECT_FIELD_DEFAULT(built, BaocControllerOptions, replan_every);
}

// The batch range follows batch_size and the training split: the default batch on a split of 4096 samples or more.
TEST(OptionDefaultsTest, BatchController) {
  const BatchPolicyOptions built = batch_policy_options(config_default(), 60000);
  EXPECT_FIELD_DEFAULT(built, BatchPolicyOptions, budget_bytes);
  EXPECT_FIELD_DEFAULT(built, BatchPolicyOptions, min_batch);
  EXPECT_FIELD_DEFAULT(built, BatchPolicyOptions, max_batch);
  EXPECT_FIELD_DEFAULT(built, BatchPolicyOptions, lr_rule);
}

TEST(OptionDefaultsTest, NeuroFluxPartition) {
  const PartitionOptions built = partition_options(config_default());
  EXPECT_FIELD_DEFAULT(built, PartitionOptions, epochs);
  EXPECT_FIELD_DEFAULT(built, PartitionOptions, max_batch);
  EXPECT_FIELD_DEFAULT(built, PartitionOptions, target_batch);
}

TEST(OptionDefaultsTest, Optimizers) {
  const Config config = config_default();
  const OptimizerOptions built = config.optim.optimizer_options();
  EXPECT_FIELD_DEFAULT(built, OptimizerOptions, weight_decay);
  EXPECT_FIELD_DEFAULT(built, OptimizerOptions, momentum);
  EXPECT_FIELD_DEFAULT(built, OptimizerOptions, nesterov);
  EXPECT_FIELD_DEFAULT(built, OptimizerOptions, beta1);
  EXPECT_FIELD_DEFAULT(built, OptimizerOptions, beta2);
  EXPECT_FIELD_DEFAULT(built, OptimizerOptions, eps);
  const SgdOptions sgd = sgd_options(config);  // NeuroFlux's blocks
  EXPECT_FIELD_DEFAULT(sgd, SgdOptions, momentum);
  EXPECT_FIELD_DEFAULT(sgd, SgdOptions, nesterov);
  EXPECT_FIELD_DEFAULT(sgd, SgdOptions, weight_decay);
}

// One step per epoch: the default epochs and warm-up make the schedule's default length and warm-up.
TEST(OptionDefaultsTest, Schedule) {
  const ScheduleOptions built = schedule_options(config_default(), 1);
  EXPECT_FIELD_DEFAULT(built, ScheduleOptions, base_lr);
  EXPECT_FIELD_DEFAULT(built, ScheduleOptions, decay);
  EXPECT_FIELD_DEFAULT(built, ScheduleOptions, total_steps);
  EXPECT_FIELD_DEFAULT(built, ScheduleOptions, warmup_steps);
}

TEST(OptionDefaultsTest, StepLossScalerAndGradBuckets) {
  const Config config = config_default();
  const StepOptions step = step_options(config);
  EXPECT_FIELD_DEFAULT(step, StepOptions, precision);
  EXPECT_FIELD_DEFAULT(step, StepOptions, cuda_graphs);
  EXPECT_FIELD_DEFAULT(step, StepOptions, label_smoothing);
  const LossScalerOptions scaler = loss_scaler_options(config);
  EXPECT_FIELD_DEFAULT(scaler, LossScalerOptions, enabled);
  const GradBucketsOptions buckets = grad_buckets_options(config);
  EXPECT_FIELD_DEFAULT(buckets, GradBucketsOptions, bucket_bytes);
  EXPECT_FIELD_DEFAULT(buckets, GradBucketsOptions, tail_bytes);
  EXPECT_FIELD_DEFAULT(buckets, GradBucketsOptions, wire);
}

}  // namespace
}  // namespace triaccel
