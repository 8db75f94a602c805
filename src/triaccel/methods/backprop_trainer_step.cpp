// The BackpropTrainer's loop (methods/backprop_trainer.h): epochs of steps, each step with its recovery (an
// out-of-memory error through run/step_recovery.h, with several ranks agreed by all; a skipped inf/NaN step, injected
// faults), the controllers after every step, and the readings the controllers take through the BackpropTrainer.
#include "triaccel/methods/backprop_trainer.h"
#include "triaccel/methods/backprop_trainer_progress.h"

#include "triaccel/control/optimizer_state/baoc_controller.h"
#include "triaccel/control/curvature/curvature_controller.h"
#include "triaccel/control/batch/elastic_batch_controller.h"
#include "triaccel/control/measure_window_controller.h"
#include "triaccel/control/memory/memory_model.h"
#include "triaccel/control/precision/precision_controller.h"
#include "triaccel/core/bytes.h"
#include "triaccel/core/context_trace.h"
#include "triaccel/core/device.h"
#include "triaccel/core/errors.h"
#include "triaccel/core/profile.h"
#include "triaccel/models/model.h"
#include "triaccel/optim/baoc_optimizer.h"
#include "triaccel/run/component_options.h"
#include "triaccel/run/memory_setup.h"
#include "triaccel/run/step_recovery.h"
#include "triaccel/train/checkpoint.h"
#include "triaccel/train/param_shards.h"
#include "triaccel/train/rng.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cmath>
#include <cstdio>
#include <numeric>

namespace triaccel {
namespace {

// A skipped step's samples are retried; after this many skipped attempts in a row on the same samples they are
// dropped (counted in dropped_samples, logged) so that a sample that always yields NaN cannot stall the run.
constexpr int64_t kSkipRetryLimit = 8;

// --inject-faults oom: raises the error where a real one comes from. On CUDA the caching allocator is asked for
// 1 PiB, more than any GPU holds: its own out-of-memory path runs (cached blocks released, the error built and
// thrown) and the trainer catches a genuine c10::OutOfMemoryError. On the CPU (whose allocator reports failure as a
// plain c10::Error) the same error type is thrown directly.
[[noreturn]] void fault_raise_oom(const c10::Device& device) {
  if (device.is_cuda()) {
    const at::Tensor huge = at::empty({int64_t{1} << 50}, at::TensorOptions().dtype(at::kByte).device(device));
  }
  TORCH_CHECK_WITH(OutOfMemoryError, false, "injected out of memory (inject_faults)");
}


}  // namespace

Json BackpropTrainer::run() {
  Progress& p = *progress_;
  while (p.epoch < config_.schedule.epochs && !stopped_) {
    if (!epoch()) break;  // stopped inside the epoch
    // A request that came during the evaluation stops here, not after the next epoch's first step.
    if (const StopRequest r = session_.stop_agreed().first; r != StopRequest::kNone && stop_reason_.empty()) {
      stop_reason_ = stop_reason(r);
      stopped_ = true;
    }
  }
  if (stopped_ && p.epoch < config_.schedule.epochs) return stop();
  return summary();
}

bool BackpropTrainer::epoch() {
  Progress& p = *progress_;
  train_loader_.epoch_begin(p.epoch);
  step_->metrics_reset();
  samples_this_epoch_ = 0;
  device_synchronize(device_);
  t_epoch_ = session_.clock().now_s();
  t_log_ = t_epoch_;
  samples_since_log_ = 0;
  while (p.epoch_offset < train_loader_.size()) {
    const int64_t count = std::min(p.batch, train_loader_.size() - p.epoch_offset);
    session_.profile_step(p.step);
    const Attempt a = step_with_recovery(count);
    if (a == Attempt::kRetry) continue;
    if (a == Attempt::kDropped) continue;
    after_step(count);
    const bool last_in_epoch = p.epoch_offset >= train_loader_.size();
    if (config_.schedule.max_steps > 0 && p.step >= config_.schedule.max_steps) stop_reason_ = "max_steps";
    // Data parallel: agreed with the step's outcome (StepRecovery), in its one round trip.
    const auto [stop, checkpoint_due] = recovery_.agreed() ? *recovery_.agreed() : session_.stop_agreed(p.step);
    if (stop != StopRequest::kNone) stop_reason_ = stop_reason(stop);
    if (!stop_reason_.empty()) {
      stopped_ = true;
      if (!last_in_epoch) break;
    }
    if (!last_in_epoch && checkpoint_due) {
      checkpoint_mid_epoch(kCheckpointFile);
    }
  }
  train_time_pause();
  if (stopped_ && p.epoch_offset < train_loader_.size()) return false;
  epoch_end(p.epoch_train_s);
  return true;
}

BackpropTrainer::Attempt BackpropTrainer::step_with_recovery(int64_t count) {
  Progress& p = *progress_;
  // A shorter batch (the epoch's last, or after an out-of-memory retry) uses the front of the full-size buffers:
  // dim 0 is outermost in NCHW and channels_last alike, so the view stays dense and nothing is allocated.
  // Data parallel: this rank's share of the batch (all of it with one process).
  std::tie(shard_offset_, shard_count_) = session_.dist().share(count);
  grad_weight_ = static_cast<double>(shard_count_) / static_cast<double>(count);
  const int64_t local = shard_count_;
  at::Tensor images = local == batch_images_.size(0) ? batch_images_ : batch_images_.narrow(0, 0, local);
  at::Tensor labels = local == batch_labels_.size(0) ? batch_labels_ : batch_labels_.narrow(0, 0, local);
  const double lr = schedule_lr(schedule_, schedule_position()) *
                    lr_scale_for_batch(batch_rules_.lr_rule, p.batch, config_.schedule.batch_size);
  last_lr_ = lr;
  FaultKind fault = FaultKind::kNone;
  RecoverableStep step;
  step.body = [&] {  // loading the batch allocates too (resize, augmentation): under a budget it can run out of memory
    if (local > 0) {
      TRIACCEL_PROFILE_RANGE("triaccel::batch");
      train_loader_.batch_into(p.epoch_offset + shard_offset_, local, images, labels);
    }
    if (session_.hooks().before_step) session_.hooks().before_step(p.step, count);
    if (!faults_.empty()) {
      fault = faults_.fault_at(p.step, attempt_);
      if (fault != FaultKind::kNone) p.injected_faults += 1;
      if (fault == FaultKind::kOom) fault_raise_oom(device_);
      step_->set_fault(fault);
    }
    attempt_ += 1;
    // An eager step of another size (the epoch's short last batch) takes its memory from the captured graph's pool
    // (train/step_graph.h): beside it, under a budget, it need not fit (out of memory even in passes of one sample),
    // and releasing the graph costs a capture an epoch (measured: docs/results/memory-planner.md).
    {
      TRIACCEL_PROFILE_RANGE("triaccel::step");
      step_->run(images, labels, lr);
    }
    context_trace("a training step");
  };
  // An eager step of another size beside the graph's private pool: not the plan's error.
  step.failure = [&] {
    StepFailure f;
    f.beside_pool = memory_planner_ && step_->graph().captured() && shard_count_ != step_->graph_batch_size();
    f.in_pool_warmup = step_->graph().ran_out_in_pool();
    return f;
  };
  step.failed_collectives = [&] {
    // --sync-bn: the other ranks' forward passes make collectives this rank cannot make up; it stops them all.
    if (bn_sync_) dist_out_of_memory_check();
    return step_->run_failed(images, labels, lr);
  };
  const StepOutcome outcome = recovery_.run(p.step + 1, step);  // the step after_step is about to count
  if (outcome.out_of_memory) return on_out_of_memory(fault, count, outcome);
  retried_at_min_ = false;
  peak_trace("step");
  // Only under inject_faults: reading found_inf is a host sync after every step. Without injected faults a
  // non-finite step is skipped on the device as GradScaler does (counted in skipped_steps, samples not retried).
  if (!faults_.empty() && step_->last_step_skipped()) return on_skipped_step(fault, count);
  attempt_ = 0;
  skips_in_a_row_ = 0;
  return Attempt::kTrained;
}

BackpropTrainer::Attempt BackpropTrainer::on_out_of_memory(FaultKind fault, int64_t count, const StepOutcome& oom) {
  Progress& p = *progress_;
  if (oom.must_stop) {
    recovery_.stop(p.step, Json{{"epoch", p.epoch}, {"epoch_offset", p.epoch_offset}, {"batch", p.batch},
                                {"ranks", oom.ranks}},
                   str_cat(oom.who, " ran out of GPU memory in training after the step's update had begun (the ranks' "
                           "weights may differ); resume from the last checkpoint with a smaller ",
                           option_ref("batch_size"), " or on more GPUs: ", option_ref("resume"), " ",
                           config_.output.out, " ", option_ref("nproc"), " N"));
  }
  if (session_.dist().active()) step_->failed_step_restore();  // every rank puts back what the failed step changed
  attempt_ += fault == FaultKind::kOom ? 1 : 0;  // the injected error came before the increment
  p.oom_retries += 1;
  // TRIACCEL_MEMORY_HISTORY: the failed step's events (the refused allocation, what the step held) as <it>.oom.<n>.
  if (!memory_history_.empty()) memory_history_write(device_, str_cat(memory_history_, ".oom.", p.oom_retries));
  Json where{{"epoch", p.epoch}, {"epoch_offset", p.epoch_offset}, {"injected", fault == FaultKind::kOom}};
  if (!oom.ranks.is_null()) where["ranks"] = oom.ranks;
  const auto oom_event = [&](Json fields) {  // what is retried, then where
    for (const auto& [k, v] : where.items()) fields[k] = v;
    session_.event(event::kOom, p.step, fields);
  };
  // The failed attempt allocated up to the cap: its peak counts for the run, not as the retry's calibration reading;
  // the planner reads from it how far the model was off (an injected error's attempt ran nothing: no reading).
  double failed_peak = 0;
  if (memory_planner_) {
    const double peak = static_cast<double>(window().peak_allocated_bytes);
    if (fault != FaultKind::kOom) failed_peak = peak;
  }
  if (oom.beside_pool) {
    // Not the plan's error: the graph gives its pool back; the next full batches capture it again.
    oom_event(Json{{"batch", p.batch}, {"retry_batch", count}, {"action", "graph released"}});
    step_->graph_release();
    memory_cache_release(device_);
    return Attempt::kRetry;
  }
  if (precision_controller_ && precision_controller_->revert_raise()) {
    // The last precision window's promotion, priced by the plan but not paid for: its units go back (refused) and the
    // plan that ran before it stays, instead of a smaller plan for the promotion (micro-batches: a cliff).
    oom_event(Json{{"batch", p.batch}, {"retry_batch", p.batch}, {"action", "precision raise refused"}});
    memory_cache_release(device_);
    return Attempt::kRetry;
  }
  if (memory_planner_) {
    // A planning error: the model under-predicted. A larger activation scale, a new plan, the same samples at the
    // same batch (UserError when no plan fits any more).
    oom_event(Json{{"batch", p.batch}, {"retry_batch", p.batch}});
    memory_cache_release(device_);
    const Event replanned =
        oom.in_pool_warmup ? memory_planner_->on_pool_out_of_memory() : memory_planner_->on_out_of_memory(failed_peak);
    session_.event(replanned.name, p.step, replanned.fields);
    return Attempt::kRetry;
  }
  // Retry the same samples at a smaller batch: nothing is skipped or repeated. At the minimum batch, one retry at the
  // same size after releasing the cache and the graph (a transient peak: a re-capture, a probe), and only a second
  // failure in a row is the budget's fault (batch_after_oom throws then).
  if (p.batch <= batch_rules_.min_batch && !retried_at_min_) {
    retried_at_min_ = true;
    step_->set_graph_batch_size(0);
    memory_cache_release(device_);
    oom_event(Json{{"batch", p.batch}, {"retry_batch", p.batch}});
    step_->set_graph_batch_size(session_.dist().share(p.batch).second);
    return Attempt::kRetry;
  }
  const int64_t smaller = batch_after_oom(batch_rules_, p.batch);
  oom_event(Json{{"batch", p.batch}, {"retry_batch", smaller}});
  // The elastic batch never grows back to a size that ran out of memory.
  batch_rules_.max_batch = std::max(batch_rules_.min_batch, std::min(batch_rules_.max_batch, p.batch - 1));
  batch_set(smaller);
  memory_cache_release(device_);
  return Attempt::kRetry;
}

BackpropTrainer::Attempt BackpropTrainer::on_skipped_step(FaultKind fault, int64_t count) {
  Progress& p = *progress_;
  // An inf/NaN gradient or loss: parameters and optimizer state did not change (the optimizer's found_inf rule),
  // the buffers are put back, and the same samples are tried again — up to kSkipRetryLimit times in a row.
  step_->skipped_step_restore();
  skips_in_a_row_ += 1;
  const bool drop = skips_in_a_row_ >= kSkipRetryLimit;
  const bool injected = fault == FaultKind::kNanGrad || fault == FaultKind::kInfGrad || fault == FaultKind::kNanLoss;
  std::string reason = fault_kind_name(fault);
  if (!injected) reason = std::isfinite(step_->last_loss().item<double>()) ? "non-finite-grad" : "non-finite-loss";
  session_.event(event::kSkip, p.step,
                 Json{{"reason", reason}, {"injected", injected}, {"action", drop ? "drop" : "retry"},
                      {"attempt", skips_in_a_row_}, {"batch", count}, {"epoch", p.epoch},
                      {"epoch_offset", p.epoch_offset}, {"loss_scale", scaler_.scale_tensor().item<double>()}});
  if (!drop) {
    p.skip_retries += 1;
    return Attempt::kRetry;
  }
  session_.printer().line(c10::str("warning: samples ", p.epoch_offset, "..", p.epoch_offset + count - 1, " of epoch ",
                                   p.epoch + 1, " gave inf/NaN ", kSkipRetryLimit,
                                   " times in a row; dropped for this epoch"));
  p.dropped_samples += count;
  p.epoch_offset += count;
  skips_in_a_row_ = 0;  // attempt keeps counting: the step count did not advance (--inject-faults xN spans it)
  return Attempt::kDropped;
}

void BackpropTrainer::fp8_say() {
  if (config_.execution.method == Method::kTriAccel) {
    session_.printer().line("tri-accel with amp-fp8: the ladder is fp8, bf16, fp32; units whose gradient variance is "
                            "low compute their linear layers in FP8 (fp8 in the precision events), the rest in bf16");
    return;
  }
  const size_t layers = step_->fp8_layers();
  session_.printer().line(
      layers > 0 ? c10::str("amp-fp8: ", layers, " linear layers of ", config_.model.model, " compute in FP8, the "
                            "rest in bf16")
                 : c10::str("note: amp-fp8 found no linear layer of ", config_.model.model, " to compute in FP8 (it "
                            "takes linear layers, the built-in models' and a Python model's nn.Linear, whose sizes "
                            "and batch rows are multiples of 16 on a GPU; convolutions stay bf16): this run is "
                            "amp-bf16"));
}

void BackpropTrainer::after_step(int64_t count) {
  Progress& p = *progress_;
  const RunHooks& hooks = session_.hooks();
  if (hooks.on_batch) hooks.on_batch(p.epoch, p.epoch_offset + shard_offset_, shard_count_);
  p.epoch_offset += count;
  p.step += 1;
  samples_this_epoch_ += count;
  samples_since_log_ += count;
  if (hooks.after_step) hooks.after_step(p.step);
  if (p.step == 1 && fp8_linears(config_.execution.precision)) fp8_say();
  StepContext ctx;
  ctx.step = p.step;
  ctx.batch = p.batch;
  ctx.now_s = session_.clock().now_s();
  ctx.memory = this;
  if (session_.dist().active()) {
    ctx.agree = [&dist = session_.dist()](std::vector<double> values) { return dist.rank0_values(std::move(values)); };
  }
  for (auto& c : controllers_) {
    for (Event& e : c->after_step(ctx)) {
      // curv_checkpoint: the weights the probe saw, beside its eigenvalues, for checking them independently.
      const bool probe = std::string(e.name) == event::kCurvature && e.fields.contains("probed");
      if (config_.tri_accel.curv_checkpoint && probe) {
        e.fields["checkpoint"] = curvature_checkpoint();
      }
      session_.event(e.name, p.step, e.fields);
    }
  }
  if (ctx.batch != p.batch) batch_set(ctx.batch);
  peak_trace("controllers");
  const bool last_in_epoch = p.epoch_offset >= train_loader_.size();
  if (p.step % config_.output.log_every == 0 || last_in_epoch) {
    const double loss = step_->last_loss().item<double>();  // syncs
    const double t = session_.clock().now_s();
    const int64_t b = config_.schedule.batch_size;
    session_.printer().step(p.epoch, config_.schedule.epochs, (p.epoch_offset + b - 1) / b,
                            train_loader_.steps_per_epoch(), loss, last_lr_,
                            static_cast<double>(samples_since_log_) / std::max(t - t_log_, 1e-9));
    t_log_ = t;
    samples_since_log_ = 0;
  }
}

void BackpropTrainer::train_time_pause() {
  device_synchronize(device_);
  progress_->epoch_train_s += session_.clock().now_s() - t_epoch_;
  for (auto& c : controllers_) c->pause();
}

// --- helpers ---

void BackpropTrainer::dist_out_of_memory_check() const {
  const Dist& dist = session_.dist();
  if (!dist.active()) return;
  const int64_t batch = config_.schedule.batch_size;
  const int64_t share = (batch + dist.world_size() - 1) / dist.world_size();
  throw UserError(str_cat("rank ", dist.rank(), " of ", dist.world_size(), " ran out of GPU memory in training at ",
                          option_ref("batch_size"), " ", batch, " (", share, " per rank) with ", option_ref("sync_bn"),
                          "; resume from the last checkpoint on more GPUs (a smaller share per rank, the same batch): ",
                          option_ref("resume"), " ", config_.output.out, " ", option_ref("nproc"),
                          " N, or start again with a smaller ", option_ref("batch_size")));
}

Json BackpropTrainer::memory_plan_brief() const {
  if (!memory_planner_) return Json(nullptr);
  const MemoryPlan& plan = memory_planner_->plan();
  return Json{{"micro_batch", plan.micro_batch},
              {"accumulation", plan.accumulation},
              {"recompute", plan.recompute_names(memory_planner_->model())},
              {"fp8_saved", plan.fp8_saved_names(memory_planner_->model())},
              {"update_in_backward", plan.update_in_backward},
              {"data_placement", enum_name(plan.data_placement)},
              {"predicted_peak_gb", plan.predicted_peak_bytes / kGB},
              {"measured_peak_gb", memory_planner_->plan_measured_peak_bytes() > 0
                                       ? Json(memory_planner_->plan_measured_peak_bytes() / kGB)
                                       : Json(nullptr)}};
}

void BackpropTrainer::batch_set(int64_t batch) {
  progress_->batch = batch;
  step_->set_graph_batch_size(session_.dist().share(batch).second);
  const int64_t world = session_.dist().world_size();
  const int64_t local_max = (batch + world - 1) / world;  // a rank's largest share
  if (local_max > batch_images_.size(0)) {  // grow the input buffers (the old graph, which used them, is gone)
    batch_images_ = at::Tensor();
    batch_labels_ = at::Tensor();
    batch_images_ = train_loader_.batch_images_empty(local_max);
    batch_labels_ = train_loader_.batch_labels_empty(local_max);
  }
}

// The schedule's position in units of the initial batch: equal to the step count while the batch is unchanged, and
// it still ends with the data when the batch changes.
double BackpropTrainer::schedule_position() const {
  return static_cast<double>(progress_->epoch * train_loader_.steps_per_epoch()) +
         static_cast<double>(progress_->epoch_offset) / static_cast<double>(config_.schedule.batch_size);
}

MemoryStats BackpropTrainer::window() {
  MemoryStats m = memory_stats(device_);
  m.peak_allocated_bytes = std::max(m.peak_allocated_bytes, window_carry_);
  progress_->peak_vram_gb = std::max(progress_->peak_vram_gb, static_cast<double>(m.peak_allocated_bytes) / kGB);
  steps_peak_ = std::max(steps_peak_, m.peak_allocated_bytes);
  memory_stats_reset_peak(device_);
  window_carry_ = 0;
  return m;
}

void BackpropTrainer::restart() {
  Progress& p = *progress_;
  p.peak_vram_warmup_gb = std::max(p.peak_vram_gb, static_cast<double>(peak_now()) / kGB);
  p.peak_vram_gb = 0;
  steps_peak_ = steps_peak_now();
  peak_reset();
}

int64_t BackpropTrainer::peak_now() const {
  return std::max({memory_stats(device_).peak_allocated_bytes, window_carry_, transient_carry_});
}

// Since the allocator's last reset only steps ran: every transient (measure()) and every evaluation resets it after.
int64_t BackpropTrainer::steps_peak_now() const {
  return std::max({steps_peak_, window_carry_, memory_stats(device_).peak_allocated_bytes});
}

void BackpropTrainer::peak_reset() {
  memory_stats_reset_peak(device_);
  window_carry_ = 0;
  transient_carry_ = 0;
  traced_peak_ = 0;
}

double BackpropTrainer::room_bytes() {
  if (!device_.is_cuda()) return -1;
  if (memory_planner_ == nullptr) {
    // No plan: a transient is sized to stay inside the peak the training steps reached (to its prediction's error).
    const int64_t steps = steps_peak_now();
    if (steps <= 0) return -1;
    return static_cast<double>(steps - memory_stats(device_).allocated_bytes);
  }
  // Under a budget the cap binds what the allocator reserves (the graph's pool included; the cache of free blocks is
  // returned first); without one the limit is AMP's predicted peak, of allocated bytes as the run's peak is.
  const bool budgeted = memory_->budgeted();
  if (budgeted) memory_cache_release(device_);
  const MemoryStats m = memory_stats(device_);
  const auto held = static_cast<double>(budgeted ? m.reserved_bytes : m.allocated_bytes);
  return static_cast<double>(memory_planner_->limit_bytes()) - held;
}

double BackpropTrainer::measure(const std::function<void()>& fn) {
  if (!device_.is_cuda()) {
    fn();
    return 0;
  }
  device_synchronize(device_);
  const MemoryStats before = memory_stats(device_);
  window_carry_ = std::max(window_carry_, before.peak_allocated_bytes);
  memory_stats_reset_peak(device_);
  const auto fold = [&]() {
    const int64_t peak = memory_stats(device_).peak_allocated_bytes;
    transient_carry_ = std::max(transient_carry_, peak);
    progress_->peak_vram_gb = std::max(progress_->peak_vram_gb, static_cast<double>(peak) / kGB);
    memory_stats_reset_peak(device_);
    return peak;
  };
  try {
    fn();
  } catch (...) {
    fold();
    throw;
  }
  device_synchronize(device_);
  return static_cast<double>(fold() - before.allocated_bytes);
}

}  // namespace triaccel
