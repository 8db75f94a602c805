// Backprop: the BackpropTrainer. On a Session (run/session.h) it builds the loaders, the optimizer, the loss scaler,
// the schedule, the step engine (train/step.h) and the list of controllers the configuration asks for (Tri-Accel's
// curvature, precision and elastic batch; BAOC's format plan; the measurement window of AdamW and BAOC runs), then runs
// epochs of steps with recovery (out-of-memory retries, skipped inf/NaN steps, injected faults), evaluation,
// checkpoints and the summary. Every sample of an epoch is trained exactly once, whatever the batch size does. Under a
// vram_budget (on CUDA), or when the user fixes a memory lever, the memory planner
// (control/memory/memory_plan_controller.h) plans the run before the loaders exist (where the data lives), and its
// controller keeps the step engine on the plan; an out-of-memory error is then a planning error, retried on the same
// samples at the same batch with a new plan. Data parallel (Session::dist() active, docs/distributed.md): batch_size is
// the global batch; each step every rank trains its contiguous share of the same batch of the same seeded order, the
// gradients are summed across ranks (weighted by share) before the non-finite check and the update, so every rank makes
// the same update; evaluation is sharded too, with rank 0's BatchNorm statistics; only rank 0 writes events,
// checkpoints and model.pt.
#pragma once

#include "triaccel/control/batch/batch_policy.h"
#include "triaccel/control/controller.h"
#include "triaccel/control/memory/memory_plan_controller.h"
#include "triaccel/core/device.h"
#include "triaccel/core/json.h"
#include "triaccel/data/loader.h"
#include "triaccel/models/batch_norm.h"
#include "triaccel/optim/optimizer.h"
#include "triaccel/run/memory_setup.h"
#include "triaccel/run/session.h"
#include "triaccel/run/step_recovery.h"
#include "triaccel/train/faults.h"
#include "triaccel/train/loss_scaler.h"
#include "triaccel/train/schedule.h"
#include "triaccel/train/step.h"

#include <array>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

namespace triaccel {

class ParamShards;
class PrecisionController;

class BackpropTrainer : private MemoryMeter {
 public:
  explicit BackpropTrainer(Session& session);
  ~BackpropTrainer() override;
  BackpropTrainer(const BackpropTrainer&) = delete;
  BackpropTrainer& operator=(const BackpropTrainer&) = delete;

  // Trains to the end (or to max_steps) and returns the summary event's fields (the stop event's when stopped).
  Json run();

  // The progress record a checkpoint stores (step, epoch, data cursor, times, peaks, fault counters, controllers).
  struct Progress;

 private:
  struct EvalResult {
    double loss = 0;
    double acc = 0;       // percent
    double acc_tta = -1;  // percent with flip test-time augmentation; -1 when not measured
  };
  enum class Attempt { kTrained, kRetry, kDropped };

  // Set-up.
  void budget_floor_check() const;
  void restore();
  void controllers_build();
  void sync_bn_start();
  // Data parallelism: the gradients' sum over the ranks, in buckets overlapped with backward (train/grad_buckets.h).
  void grad_reduce_set(StepOptions::GradReduce& reduce);
  void memory_cap();
  // The loop.
  bool epoch();                            // false: stopped inside the epoch
  Attempt step_with_recovery(int64_t count);
  // A step that ran out of memory (on this rank, or as every rank agreed: data parallel): every rank stops with one
  // line when a failing rank could not make its step a skipped one; else, after every rank put back what the failed
  // step changed (TrainStep::failed_step_restore), the retry every rank makes alike: a released graph, a precision
  // raise refused, a new plan or a smaller batch.
  Attempt on_out_of_memory(FaultKind fault, int64_t count, const StepOutcome& oom);
  Attempt on_skipped_step(FaultKind fault, int64_t count);
  void after_step(int64_t count);
  void fp8_say();  // amp-fp8, after the first step: how many linear layers compute in FP8
  // This rank's share of the test set at `batch_size`, with the model as it is: {summed loss, correct predictions,
  // correct with flip TTA, label elements} (one sync).
  std::array<double, 4> evaluate_share(int64_t batch_size);
  // The test set's result over the ranks: rank 0's model, each rank's share retried alone at a smaller batch when it
  // runs out of memory.
  EvalResult evaluate_within_budget();
  void epoch_end(double train_s);
  void checkpoint(const std::string& file = kCheckpointFile);
  std::string curvature_checkpoint();  // curv_checkpoint: writes curvature-step-N.pt, returns its path
  void checkpoint_mid_epoch(const std::string& file);  // the epoch's clock paused while it is written
  Json stop();
  Json summary();
  // Data parallelism (one process: the whole batch, no-ops); this rank's part of a batch is Dist::share's.
  // With several ranks and --sync-bn an out-of-memory error in training is not retried (the other ranks' forward
  // passes make collectives this rank cannot make up): UserError naming the rank and the batch. A no-op with one
  // process.
  void dist_out_of_memory_check() const;
  // Helpers.
  void batch_set(int64_t batch);
  Json memory_plan_brief() const;          // the plan in force, for epoch and summary events (null: none)
  double schedule_position() const;
  void train_time_pause();                 // the epoch clock stops (evaluation, a checkpoint)
  // TRIACCEL_TRACE_PEAK=1 (a developer's diagnostic): one stderr line whenever the allocator's peak rose by over
  // 1 MB since the last look, naming the step and the phase that raised it (after a step, after the controllers,
  // after a checkpoint, after an evaluation).
  void peak_trace(const char* phase);
  MemoryStats window() override;           // MemoryMeter
  void restart() override;
  double room_bytes() override;
  double measure(const std::function<void()>& fn) override;
  // The allocator's peak since its last reset, with what measure() and window() reset away since the epoch's start.
  int64_t peak_now() const;
  // The training steps' peak in this session so far: measure()'s transients and evaluations left out.
  int64_t steps_peak_now() const;
  void peak_reset();                       // the allocator's peak and the carried peaks, for a new period

  Session& session_;
  const Config& config_;
  const c10::Device device_;
  std::unique_ptr<MemorySetup> memory_;     // declared before the loaders: they are built where it says
  Loader train_loader_;
  Loader test_loader_;
  std::unique_ptr<Optimizer> optimizer_;
  LossScaler scaler_;
  PrecisionMode eval_precision_;
  ScheduleOptions schedule_;
  const FaultPlan faults_;
  std::unique_ptr<Progress> progress_;
  std::unique_ptr<TrainStep> step_;
  std::unique_ptr<BatchNormSyncScope> bn_sync_;  // --sync-bn across the ranks (docs/distributed.md)
  std::unique_ptr<ParamShards> param_shards_;      // optimizer state sharded across the ranks (ZeRO stage 1)
  BatchPolicyOptions batch_rules_;     // out-of-memory halving and the elastic batch share these
  std::vector<std::unique_ptr<StepController>> controllers_;
  MemoryPlanController* memory_planner_ = nullptr;  // one of controllers_, when the memory is planned
  PrecisionController* precision_controller_ = nullptr;  // one of controllers_: Tri-Accel precision under a plan
  int64_t eval_batch_ = 0;  // the evaluation batch: planned at the first evaluation, then the one that fit (0: not yet)
  at::Tensor batch_images_, batch_labels_;  // the step's input buffers (the graph's static inputs)
  int64_t shard_offset_ = 0, shard_count_ = 0;  // this rank's samples of the current step, in the batch
  double grad_weight_ = 1;                  // this rank's share of the current global batch
  double comm_s_ = 0;                       // this epoch's host time waiting for the gradient collectives
  // Within the current session of the run.
  int64_t samples_this_epoch_ = 0;         // trained this epoch in this session
  int64_t samples_since_log_ = 0;
  bool trace_peak_ = std::getenv("TRIACCEL_TRACE_PEAK") != nullptr;  // peak_trace() prints
  // TRIACCEL_MEMORY_HISTORY: peak_trace() writes the allocator's snapshot to <it>.<phase> when the phase's highest
  // peak so far rises (history_peaks_), with the events of that phase only, so each file holds its phase's peak.
  std::string memory_history_;
  std::map<std::string, int64_t> history_peaks_;
  int64_t history_capture_ooms_ = 0;  // the step graph's capture_ooms() at the last snapshot of a failed capture
  int64_t window_carry_ = 0;     // the current window's peak that measure() reset away
  int64_t transient_carry_ = 0;  // measure()'s peaks this epoch
  int64_t steps_peak_ = 0;       // the training steps' peak before the allocator's last reset (steps_peak_now())
  int64_t traced_peak_ = 0;     // the peak peak_trace() last saw
  double t_epoch_ = 0, t_log_ = 0;         // session clock at the epoch's (or last pause's) start, last log line
  double last_lr_ = 0;
  bool retried_at_min_ = false;            // an out-of-memory retry at the minimum batch is allowed once in a row
  int64_t attempt_ = 0;                    // attempts at the current step (retries keep its samples)
  int64_t skips_in_a_row_ = 0;             // skipped attempts at the current samples
  StepRecovery recovery_{session_};         // the step's out-of-memory recovery; data parallel: its stop agreement
  bool stopped_ = false;
  std::string stop_reason_;                // why it stopped early: max_steps, sigint, sigterm
};

}  // namespace triaccel
