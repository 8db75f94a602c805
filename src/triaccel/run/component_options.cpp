#include "triaccel/run/component_options.h"

#include <algorithm>
#include <cmath>

namespace triaccel {

CurvatureOptions curvature_options(const Config& config, const Model& model) {
  const TriAccelConfig& ta = config.tri_accel;
  CurvatureOptions o;
  o.top_k = static_cast<int>(ta.curv_top_k);
  o.max_iters = static_cast<int>(ta.curv_max_iters);
  o.tol = ta.curv_tol;
  o.batch = ta.curv_batch;
  o.every_steps = ta.curv_every;
  o.seed = config.execution.seed;
  o.cuda_graphs = config.execution.cuda_graphs;
  o.chunk = ta.curv_chunk;
  o.estimator = ta.curv_estimator;
  o.cudnn = ta.curv_cudnn == Toggle::kAuto ? probe_cudnn_auto(model, ta.curv_estimator) : ta.curv_cudnn == Toggle::kOn;
  return o;
}

CurvatureControllerOptions curvature_controller_options(const Config& config, const Model& model) {
  const TriAccelConfig& ta = config.tri_accel;
  CurvatureControllerOptions o;
  o.ctrl_every = ta.ctrl_every;
  o.budget = ta.curv_budget;
  o.alpha = ta.curv_alpha;
  o.lr_scaling = ta.ta_curvature;
  o.lr_mean_one = ta.curv_lr_mean;
  o.lockstep = ta.curv_lockstep;
  o.probe = curvature_options(config, model);
  return o;
}

PrecisionPolicyOptions precision_policy_options(const Config& config) {
  PrecisionPolicyOptions o;
  o.tau_low = config.tri_accel.tau_low;
  o.tau_high = config.tri_accel.tau_high;
  o.tau_curv = config.tri_accel.tau_curv;
  // amp-fp8: the ladder's bottom level is FP8 (precision_policy.h), the level that pays on Hopper, so FP8 is where
  // most units go and the variance finds the exceptions: τ_low the 0.85 quantile (with the hysteresis margin about
  // three units in four), τ_high the 0.95 (fp16's ladder: the paper's quarter of the units at the bottom).
  if (fp8_linears(config.execution.precision)) {
    o.low_precision = Precision::kFP8;
    o.low_quantile = 0.85;
    o.high_quantile = 0.95;
  }
  return o;
}

BaocControllerOptions baoc_controller_options(const Config& config) {
  const BaocConfig& b = config.baoc;
  BaocControllerOptions o;
  o.memory_budget = b.optim_memory_budget;
  o.time_budget = b.optim_time_budget;
  o.formats = b.optim_formats;
  o.time_table = b.optim_time_table;
  o.risk_floor = b.optim_risk_floor;
  o.plan_warmup = b.plan_warmup;
  o.replan_every = b.replan_every;
  return o;
}

BatchPolicyOptions batch_policy_options(const Config& config, int64_t train_samples) {
  const int64_t batch = config.schedule.batch_size;
  BatchPolicyOptions o;
  o.min_batch = std::min<int64_t>(o.min_batch, batch);
  o.max_batch = std::max<int64_t>(batch, std::min<int64_t>(4096, train_samples));
  o.budget_bytes = config.execution.vram_budget_bytes();
  o.lr_rule = config.schedule.lr_batch_rule;
  return o;
}

PartitionOptions partition_options(const Config& config) {
  PartitionOptions o;
  o.epochs = config.schedule.epochs;
  o.max_batch = config.neuroflux.nf_max_batch;
  o.target_batch = config.schedule.batch_size;
  return o;
}

ScheduleOptions schedule_options(const Config& config, int64_t steps_per_epoch) {
  ScheduleOptions o;
  o.base_lr = config.optim.lr;
  o.decay = config.schedule.lr_decay;
  o.total_steps = steps_per_epoch * config.schedule.epochs;
  o.warmup_steps = static_cast<int64_t>(
      std::llround(config.schedule.warmup_epochs_resolved() * static_cast<double>(steps_per_epoch)));
  return o;
}

LossScalerOptions loss_scaler_options(const Config& config) {
  LossScalerOptions o;
  o.enabled = config.execution.precision == PrecisionMode::kAmpFP16 || config.execution.method == Method::kTriAccel;
  return o;
}

StepOptions step_options(const Config& config) {
  StepOptions o;
  o.precision = config.execution.precision;
  o.cuda_graphs = config.execution.cuda_graphs;
  o.label_smoothing = config.optim.label_smoothing;
  return o;
}

SgdOptions sgd_options(const Config& config) {
  SgdOptions o;
  o.momentum = config.optim.momentum;
  o.nesterov = config.optim.nesterov;
  o.weight_decay = config.optim.weight_decay;
  return o;
}

GradBucketsOptions grad_buckets_options(const Config& config) {
  GradBucketsOptions o;
  o.bucket_bytes = static_cast<int64_t>(config.execution.grad_bucket_mb * 1024 * 1024);
  // The last gradients of backward, up to 1 MiB (DDP's first bucket's size, at the other end), reduce on their own:
  // else the last bucket holds whatever the cap left over (for ResNet-18 most of a bucket), reduced after backward with
  // the GPU otherwise idle; with it only this small bucket is left after backward. Over a fast link the step's time
  // may not change, the all-reduce beside backward slowing backward as much (measured: docs/results/data-parallel.md).
  o.tail_bytes = std::min<int64_t>(int64_t{1} << 20, o.bucket_bytes / 4);
  o.wire = config.execution.grad_compression == GradCompression::kBf16 ? at::kBFloat16
                                                                        : at::ScalarType::Undefined;
  return o;
}

}  // namespace triaccel
