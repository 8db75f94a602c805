// Each component's options from the run's configuration: the one place that maps option keys onto the fields of the
// components' options structs. The defaults live in those structs (Config's fields are initialized from them), so a
// default Config builds each component's default options (tests/test_option_defaults.cpp). What a run learns only as
// it starts (the device, the loader's samples, the clock, the budget's bytes left for a plan) its caller sets on the
// result.
#pragma once

#include "triaccel/control/optimizer_state/baoc_controller.h"
#include "triaccel/control/batch/batch_policy.h"
#include "triaccel/control/curvature/curvature_controller.h"
#include "triaccel/control/curvature/curvature_probe.h"
#include "triaccel/control/memory/partitioner.h"
#include "triaccel/control/precision/precision_policy.h"
#include "triaccel/models/model.h"
#include "triaccel/optim/sgd.h"
#include "triaccel/run/config.h"
#include "triaccel/train/grad_buckets.h"
#include "triaccel/train/loss_scaler.h"
#include "triaccel/train/schedule.h"
#include "triaccel/train/step.h"

#include <cstdint>

namespace triaccel {

// curv_top_k, curv_max_iters, curv_tol, curv_batch, curv_every, curv_chunk, curv_estimator, the run's seed and
// cuda_graphs; curv_cudnn auto resolved for `model` (probe_cudnn_auto). The caller sets clock and warm_passes.
CurvatureOptions curvature_options(const Config& config, const Model& model);

// ctrl_every, curv_budget, curv_alpha, ta_curvature, curv_lr_mean, curv_lockstep and the probe's options. The caller
// sets probe_samples, total_steps and share_step_pool.
CurvatureControllerOptions curvature_controller_options(const Config& config, const Model& model);

PrecisionPolicyOptions precision_policy_options(const Config& config);  // tau_low, tau_high, tau_curv

// optim_memory_budget, optim_time_budget, optim_formats, optim_time_table, optim_risk_floor, plan_warmup, replan_every.
BaocControllerOptions baoc_controller_options(const Config& config);

// lr_batch_rule, the vram_budget, and the batch range: from min(16, batch_size) to max(batch_size, min(4096,
// train_samples)).
BatchPolicyOptions batch_policy_options(const Config& config, int64_t train_samples);

// nf_max_batch, epochs, and batch_size as the batch a block's heads aim for. The caller sets the budget, the bytes
// always allocated, the samples and the device's rates.
PartitionOptions partition_options(const Config& config);

// lr, lr_decay, and the warm-up and length in steps of `steps_per_epoch`.
ScheduleOptions schedule_options(const Config& config, int64_t steps_per_epoch);

// On for amp-fp16, and for tri-accel (whose precision policy may put units in fp16 at any window).
LossScalerOptions loss_scaler_options(const Config& config);

// precision, cuda_graphs, label_smoothing. The caller sets the batch to capture, the objective and the hooks.
StepOptions step_options(const Config& config);

SgdOptions sgd_options(const Config& config);  // momentum, nesterov, weight_decay

// The gradient buckets of data parallelism as the configuration asks: their size (grad_bucket_mb) and what goes on
// the wire (grad_compression: bf16, or the gradients' own dtype).
GradBucketsOptions grad_buckets_options(const Config& config);

}  // namespace triaccel
