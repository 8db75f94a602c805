// The training step: forward under autocast (per the precision mode, or per-unit precisions), cross-entropy, scaled
// backward, non-finite check and unscale, the optimizer's fused update, loss-scale update, and device-side metric
// accumulation — no host sync anywhere. On CUDA the step at the graph's batch size runs through a StepGraph
// (train/step_graph.h: warm-up, capture, replay, recovery); other batch sizes (an epoch's last, shorter batch) run
// eagerly. Invariants the graph relies on: optimizer state, the lr scalar and the static inputs keep their addresses
// for the life of the TrainStep; gradients are released before every step (set to None, as PyTorch's zero_grad does)
// and, inside the graph, live in its private pool at fixed addresses. The first batch at the graph size is kept as
// the static input: pass the same tensors every step (the trainer and the benchmark do) to avoid a copy.
// Memory levers (the memory planner's, docs/memory-planner.md), both inside the graph: the batch is split into
// micro-batches whose gradients accumulate before the one optimizer step (each micro-batch's mean loss weighted by
// its share of the batch, so the update is the whole batch's; BatchNorm normalizes per micro-batch), and chosen units
// are recomputed in backward instead of keeping their activations (train/recompute.h). A third, for a step of one
// micro-batch: the update in backward — each parameter updated as soon as backward has made its gradient, which is
// then freed, so the step never holds more than a gradient or two instead of all of them (an optimizer whose update is
// per tensor, SGD; no loss scaling, gradient statistics, data parallelism or fault injection). Its non-finite check
// is the loss's before backward, then each gradient's before its update: an inf/NaN gradient under a finite loss (rare
// without fp16) skips its update and every one after it in that backward, the parameters updated before it keep
// theirs, and the step reports skipped.
#pragma once

#include "triaccel/core/named_tensors.h"
#include "triaccel/models/model.h"
#include "triaccel/optim/optimizer.h"
#include "triaccel/train/faults.h"
#include "triaccel/train/fp8.h"
#include "triaccel/train/grad_buckets.h"
#include "triaccel/train/grad_stats.h"
#include "triaccel/train/loss_scaler.h"
#include "triaccel/train/objective.h"
#include "triaccel/train/precision.h"
#include "triaccel/train/step_graph.h"

#include <ATen/Tensor.h>
#include <c10/core/Device.h>

#include <functional>
#include <string>
#include <memory>
#include <vector>

namespace triaccel {

class Fp8Linears;  // train/fp8_linear.h

struct StepOptions {
  PrecisionMode precision = PrecisionMode::kFP32;
  Fp8ScaleOptions fp8;  // amp-fp8: the delayed scales of its linear layers
  bool cuda_graphs = true;
  int64_t graph_batch_size = 0;   // the batch size to capture (0: none)
  int64_t warmup_steps = 3;       // eager steps at graph_batch_size before capture
  // Tests only: called inside the capture, after capture_begin (e.g. to raise an out-of-memory error there).
  std::function<void()> during_capture;
  // Tests only: called inside the last warm-up step's run in the capture's pool (StepGraph::pool_ooms).
  std::function<void()> during_pool_warmup;
  double label_smoothing = 0.0;
  // The loss and metric (train/objective.h); null: cross-entropy and accuracy.
  std::shared_ptr<const Objective> objective;
  int64_t micro_batch = 0;        // samples per forward/backward pass (0: the whole batch at once)
  // Data parallelism: the ranks' gradients summed, each rank's weighted by its share of the global batch, in
  // buckets started while the last micro-batch's backward runs (train/grad_buckets.h), all of them waited for before
  // the non-finite check, so an inf/NaN on any rank skips the step on every rank. Set (grad_reduce.start): gradients
  // are always defined (zeros where this rank's batch left none, even an empty one), and every step runs eagerly
  // unless grad_reduce.capturable.
  struct GradReduce {
    GradBucketStart start;           // one bucket's sum over the ranks (Dist::all_reduce_sum_start)
    std::function<double()> weight;  // this rank's share of the global batch in the step about to run
    GradBucketsOptions buckets;
    bool capturable = false;  // start only enqueues work on the stream (NCCL): graphs stay on
    std::function<int(int)> agree_capture;  // with capturable: every rank's capture outcome (StepGraphOptions)
  } grad_reduce;
  // Data parallelism with the optimizer state sharded (train/param_shards.h): runs after the optimizer's update, on
  // every rank (the owners' parameters broadcast); inside the captured graph when grad_reduce.capturable.
  std::function<void()> after_update;
  // --inject-faults: the step multiplies its loss by a device factor and adds a device value to the first gradient
  // (both neutral unless set_fault() arms them), so NaN/inf faults reach graph replays too. Off: neither op exists
  // (but the loss factor under data parallelism, for run_failed).
  bool fault_injection = false;
};

// Whether no parameter in `params` carries a post-accumulate-grad hook (the slot the update in backward takes; a
// Python model's own register_post_accumulate_grad_hook holds it) and each requires a gradient.
bool post_accumulate_grad_hooks_free(const std::vector<at::Tensor>& params);

class TrainStep {
 public:
  TrainStep(Model& model, Optimizer& optimizer, LossScaler& scaler, StepOptions options, const c10::Device& device);
  ~TrainStep();

  // One optimizer step on (images, labels) at learning rate lr.
  void run(const at::Tensor& images, const at::Tensor& labels, double lr);
  // The step's forward: each unit at its precision (its input cast to the unit's dtype), the recomputed units through
  // recompute_forward, which keeps the input as it came (the cast runs inside the recompute). Public for tests.
  at::Tensor forward(const at::Tensor& images);

  // Whether the last run() skipped its update (an inf/NaN gradient or loss: parameters and optimizer state are
  // unchanged). Reads one value from the device (a sync).
  bool last_step_skipped() const;
  // After a skipped step: puts the model's buffers (BatchNorm running statistics) back to their values before it,
  // so a skipped step leaves no trace at all (its forward updated them, possibly with NaN).
  void skipped_step_restore();
  // Data parallelism, on a rank whose step (or the loading of its batch before it) ran out of memory while the other
  // ranks' steps go on: the rest of the step's collectives, made so that every rank skips this update as one
  // process's skipped step does (the sums over the ranks come out NaN: the optimizer's found_inf rule; the metrics and
  // gradient statistics take nothing). A step that was to replay or capture its graph does so with its loss times NaN
  // (a replay allocates nothing; NCCL: a captured collective is every rank's or none's); an eager one sends what is
  // left of its gradient buckets with NaN in place of this rank's share. False when it cannot: the failed step's
  // update had begun, or every bucket had been sent (the other ranks' updates count: the ranks' weights now differ).
  bool run_failed(const at::Tensor& images, const at::Tensor& labels, double lr);
  // On every rank, once the ranks agreed that one of them failed the step (run_failed): the model's buffers and the
  // loss scaler as they were before it, so the retried step is the step one process would take.
  void failed_step_restore();
  // Arms a NaN/inf fault (kNanGrad, kInfGrad, kNanLoss) for the following run() calls; kNone disarms. Needs
  // StepOptions::fault_injection. kOom is the trainer's (it is raised before the step).
  void set_fault(FaultKind kind);

  // Device accumulators since metrics_reset() (skipped steps add nothing): summed per-sample loss, correct predictions, samples.
  const at::Tensor& loss_sum() const { return loss_sum_; }
  const at::Tensor& correct_sum() const { return correct_sum_; }
  const at::Tensor& last_loss() const { return last_loss_; }
  void metrics_reset();
  // The step's CUDA graph: whether one is captured, captures, failed captures (train/step_graph.h).
  const StepGraph& graph() const { return graph_; }
  // The graph itself, for a side graph in its pool (StepGraph::side_capture: Tri-Accel's curvature pass under a
  // budget) and eager calls in that pool.
  StepGraph& graph() { return graph_; }
  // A new memory plan: a batch size refused after an out-of-memory capture may be captured again.
  void graph_allow() { graph_.allow(); }
  // Every step eager from now on (the memory planner: no plan leaves room for the graph's pool).
  void graph_disable() { graph_.disable(); }
  // Frees the captured graph and its pool (an eager step of another size needs the memory); the graph's size warms
  // up and captures again when it next runs.
  void graph_release() { graph_.drop(); }
  // Runs `fn` (an evaluation) with its allocations from the captured graph's pool, as eager steps of another batch
  // size run (train/step_graph.h: in_pool); just `fn` when no graph is captured. `fn` must keep nothing it allocates.
  void in_graph_pool(const std::function<void()>& fn) { graph_.in_pool(fn); }

  // Tri-Accel: per-unit precision for the forward (empty: the uniform precision mode). A change drops the captured
  // graph (it is re-captured after one eager step).
  void set_unit_precisions(const std::vector<Precision>& precisions);
  const std::vector<Precision>& unit_precisions() const { return unit_precisions_; }
  // The memory planner's levers: samples per forward/backward pass (0: the whole batch), and the units whose
  // activations are recomputed in backward (empty: none). A change drops the captured graph.
  void set_micro_batch(int64_t micro_batch);
  int64_t micro_batch() const { return options_.micro_batch; }
  void set_recompute(const std::vector<bool>& recompute);
  const std::vector<bool>& recompute() const { return recompute_; }
  // The units whose saved activations are kept in FP8 (train/fp8_saved.h; empty: none; a unit also recomputed is
  // recomputed). Needs fp8_saved_available() when any is set. A change drops the captured graph. The tensors the last
  // forward stored so (0 when no unit was).
  void set_fp8_saved(const std::vector<bool>& fp8_saved);
  const std::vector<bool>& fp8_saved() const { return fp8_saved_; }
  int64_t fp8_saved_last_tensors() const { return fp8_saved_last_tensors_; }
  // The update in backward (see above) for the steps of one micro-batch; a change drops the captured graph.
  // set_update_in_backward(true) needs update_in_backward_possible(): the optimizer updates a tensor at a time, no
  // loss scaling, data parallelism, fault injection or gradient statistics, and no parameter has another
  // post-accumulate-grad hook (a Python model's own).
  bool update_in_backward_possible() const;
  void set_update_in_backward(bool on);
  bool update_in_backward() const { return update_in_backward_; }
  // Drops the captured graph, e.g. after the optimizer's per-tensor lr scales changed.
  void invalidate_graph();
  // The batch size whose step is captured (Tri-Accel's elastic batch changes it). A new size drops the old graph —
  // one graph at a time, so a --vram-budget never holds two graph pools — and captures after one eager step at the
  // new size (cuDNN picks its algorithms for the new shapes there).
  void set_graph_batch_size(int64_t batch) { graph_.set_batch(batch); }
  int64_t graph_batch_size() const { return graph_.batch(); }

  // Tri-Accel: accumulate per-unit gradient statistics (core/grad_stats.h) of every non-skipped step, inside the
  // step (and so inside the graph). `layout` must follow sgd.params() order.
  void grad_stats_enable(GradStatsLayout layout);
  // The window's per-unit mean statistics, (U, kGradStatsColumns) float32 on the CPU (syncs), and resets the sums.
  at::Tensor grad_stats_take();

  // amp-fp8: the linear layers that ran in FP8 so far (0 in other modes), and their delayed scales for a checkpoint
  // (Fp8Linears::state: empty in other modes) and back (before the first step; UserError naming `path`).
  size_t fp8_layers() const;
  NamedTensors fp8_state() const;
  void fp8_restore(const NamedTensors& stored, const std::string& path);

  // Drops the parameters' gradients (zero_grad(set_to_none=True)); every step makes fresh ones. Between epochs this
  // frees what the last step left (its gradients, in the graph's pool after a short batch) for the evaluation.
  void grads_release();

 private:
  enum class Phase { kIdle, kPass, kUpdate };  // run(): outside body, in its passes, past the gradients' sums

  void body(const at::Tensor& images, const at::Tensor& labels);
  // body's end, after the gradients (summed over the ranks): the non-finite check, gradient statistics, the update,
  // the loss scale and the metrics (n samples whose mean loss and correct predictions are given).
  void update(const at::Tensor& loss_total, const at::Tensor& correct_total, int64_t n, double labels_per_sample);
  // run_failed's eager part: `phase` is where the failed step stopped.
  bool run_failed_eagerly(Phase phase);
  // One unit's forward at its precision (autocast set inside, so that a recompute in backward sets it again).
  at::Tensor unit_forward(size_t u, const at::Tensor& x) const;
  // The update in backward of parameter i (optimizer order) once its gradient is accumulated: on autograd's thread.
  void update_one(size_t i, const at::Tensor& param);

  Model& model_;
  Optimizer& optimizer_;
  LossScaler& scaler_;
  StepOptions options_;
  c10::Device device_;
  at::Tensor lr_;           // (1) float32 on device
  at::Tensor loss_sum_;     // (1) float32
  at::Tensor correct_sum_;  // (1) float32
  at::Tensor last_loss_;    // (1) float32
  std::vector<at::Tensor> buffers_;          // the model's buffers (BatchNorm running statistics)
  std::vector<at::Tensor> buffers_before_;   // their values before the current step, same shapes and dtypes
  at::Tensor loss_factor_;  // (1) float32: 1, or NaN (fault injection, a data-parallel rank's failed step)
  at::Tensor grad_fault_;   // (1) float32: 0, NaN or +inf (fault injection only)
  FaultKind fault_ = FaultKind::kNone;
  Phase phase_ = Phase::kIdle;
  std::vector<Precision> unit_precisions_;
  std::vector<bool> recompute_;
  std::vector<bool> fp8_saved_;
  int64_t fp8_saved_last_tensors_ = 0;
  bool update_in_backward_ = false;  // asked (set_update_in_backward)
  bool updates_in_backward_hooked_ = false;  // the parameters carry update_one's hooks (removed by the destructor)
  bool updating_in_backward_ = false;  // the backward under way updates (read by the hooks, on autograd's thread)
  bool updated_in_backward_ = false;   // the step under way took its update in backward
  std::vector<std::vector<at::Tensor>> unit_params_, unit_buffers_;  // per unit, for recompute
  bool grad_stats_enabled_ = false;
  GradStatsLayout grad_stats_layout_;
  at::Tensor grad_stats_sum_;    // (U, kGradStatsColumns) float32 on device
  at::Tensor grad_stats_steps_;  // (1) float32: non-skipped steps summed
  std::unique_ptr<GradBuckets> grad_buckets_;  // data parallelism (options_.grad_reduce.start set)
  // amp-fp8: the FP8 linear layers' states (created at each layer's first forward, an eager one before the capture),
  // installed around every forward. A recomputed unit's second forward records its amaxes again.
  std::unique_ptr<Fp8Linears> fp8_;
  StepGraph graph_;
};

}  // namespace triaccel
