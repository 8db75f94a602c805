// The BackpropTrainer's set-up (methods/backprop_trainer.h): the memory plan, loaders, optimizer, step and controllers,
// a resumed run's state; the loop is in backprop_trainer_step.cpp, evaluation, checkpoints and the summary in
// backprop_trainer_eval.cpp.
#include "triaccel/methods/backprop_trainer.h"
#include "triaccel/methods/backprop_trainer_progress.h"
#include "triaccel/methods/controller_registry.h"

#include "triaccel/control/memory/memory_model.h"
#include "triaccel/core/bytes.h"
#include "triaccel/core/context_trace.h"
#include "triaccel/core/device.h"
#include "triaccel/core/errors.h"
#include "triaccel/core/profile.h"
#include "triaccel/models/model.h"
#include "triaccel/optim/baoc_optimizer.h"
#include "triaccel/run/component_options.h"
#include "triaccel/run/memory_setup.h"
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

LoaderOptions placed(LoaderOptions o, DataPlacement placement) {
  o.placement = placement;
  return o;
}

}  // namespace

// --- set-up ---

BackpropTrainer::BackpropTrainer(Session& session)
    : session_(session),
      config_(session.config()),
      device_(session.device()),
      memory_(memory_setup_make(session)),
      train_loader_(session.data().train, session.data().mean, session.data().std,
                    placed(session.loader_options(LoaderRole::kTrain), memory_->placement), session.device()),
      test_loader_(session.data().test, session.data().mean, session.data().std,
                   placed(session.loader_options(LoaderRole::kEval), memory_->placement), session.device()),
      scaler_(loss_scaler_options(config_), session.device()),
      // Evaluation (and Tri-Accel's calibration phase) uses bf16 for tri-accel, the chosen mode otherwise.
      eval_precision_(config_.execution.method == Method::kTriAccel ? PrecisionMode::kAmpBF16
                                                                    : config_.execution.precision),
      faults_(config_.execution.inject_faults),
      progress_(std::make_unique<Progress>()) {
  context_trace("memory plan and loaders");
  if (const char* path = std::getenv("TRIACCEL_MEMORY_HISTORY"); path && *path) {
    const char* entries = std::getenv("TRIACCEL_MEMORY_HISTORY_ENTRIES");  // a count; unset or not one: 20,000
    const unsigned long n = entries ? std::strtoul(entries, nullptr, 10) : 0;
    memory_history_start(device_, n > 0 ? n : 20000);
    memory_history_ = session_.dist().active() ? str_cat(path, ".rank", session_.dist().rank()) : path;
    trace_peak_ = true;
  }
  std::vector<std::pair<std::string, at::Tensor>> named_params;
  for (const auto& item : session_.model().named_parameters()) named_params.emplace_back(item.key(), item.value());
  optimizer_ = optimizer_create(config_.optim.optimizer, named_params, config_.optim.optimizer_options());
  if (memory_->shard_optimizer && session_.dist().active()) {
    // The layout the memory planner priced (the optimizer's parameters are the model's, in its order).
    Dist& dist = session_.dist();
    const ShardLayout& layout = memory_->shards;
    TORCH_CHECK(layout.owners.size() == optimizer_->params().size(), "the shard layout has ", layout.owners.size(),
                " owners for ", optimizer_->params().size(), " parameters");
    param_shards_ =
        std::make_unique<ParamShards>(optimizer_->params(), layout.owners, dist, layout.sizes.bucket_bytes);
    optimizer_->set_owned(param_shards_->owned());
    if (auto* baoc = dynamic_cast<BaocOptimizer*>(optimizer_.get())) {
      // Its plans read statistics and moments each rank holds only for what it owns (optim/baoc_optimizer.h).
      baoc->set_sum_over_ranks([&dist](at::Tensor& t) { dist.all_reduce_sum(t); });
    }
  }
  budget_floor_check();

  const int64_t steps_per_epoch = train_loader_.steps_per_epoch();
  schedule_ = schedule_options(config_, steps_per_epoch);
  schedule_.validate();
  restore();

  session_.events_open(Json{{"train_samples", train_loader_.size()},
                            {"test_samples", test_loader_.size()},
                            {"steps_per_epoch", steps_per_epoch},
                            {"total_steps", schedule_.total_steps},
                            {"warmup_steps", schedule_.warmup_steps},
                            {"augment", train_loader_.options().augment},
                            {"dataset_resident_gb", static_cast<double>(train_loader_.resident_bytes() +
                                                                        test_loader_.resident_bytes()) / kGB}});
  const Progress& p = *progress_;
  session_.printer().line(c10::str(
      "triaccel: ", config_.model.model, " on ", config_.data.dataset, " (", train_loader_.size(), " train / ",
      test_loader_.size(), " test), ", session_.model().parameter_count(), " params, ",
      enum_name(config_.execution.precision), ", batch ", config_.schedule.batch_size, ", ",
      device_long_name(device_),
      session_.dist().active() ? c10::str(", ", session_.dist().world_size(), " processes") : std::string(),
      session_.checkpoint() ? ", resumed at step " + std::to_string(p.step) : ""));

  StepOptions so = step_options(config_);
  so.graph_batch_size = session_.dist().share(config_.schedule.batch_size).second;  // this rank's share
  so.objective = session_.hooks().objective;
  so.fault_injection = !faults_.empty();
  if (session_.dist().active()) grad_reduce_set(so.grad_reduce);
  if (param_shards_) so.after_update = [this] { param_shards_->sync(); };
  step_ = std::make_unique<TrainStep>(session_.model(), *optimizer_, scaler_, so, device_);
  if (session_.checkpoint()) {
    step_->fp8_restore(fp8_entries(session_.checkpoint()->scaler, true), session_.checkpoint_file());
  }
  context_trace("train step built");
  if (config_.execution.sync_bn && session_.dist().active()) sync_bn_start();
  controllers_build();

  // Peak VRAM: allocator peak since here, resident dataset included (it stays allocated for the whole run).
  memory_stats_reset_peak(device_);
  if (progress_->batch <= 0) progress_->batch = config_.schedule.batch_size;
  memory_cap();
  step_->set_graph_batch_size(session_.dist().share(progress_->batch).second);
  const int64_t world = session_.dist().world_size();  // a rank's share is at most ceil(batch / world)
  const int64_t largest = std::max(config_.schedule.batch_size, progress_->batch);
  batch_images_ = train_loader_.batch_images_empty((largest + world - 1) / world);
  batch_labels_ = train_loader_.batch_labels_empty(batch_images_.size(0));
  last_lr_ = schedule_lr(schedule_, schedule_position());
}

BackpropTrainer::~BackpropTrainer() = default;

void BackpropTrainer::grad_reduce_set(StepOptions::GradReduce& reduce) {
  const bool nccl = session_.dist().nccl();
  reduce.buckets = grad_buckets_options(config_);
  reduce.weight = [this] { return grad_weight_; };
  reduce.start = [this, nccl](const at::Tensor& flat) {
    DistWork work = session_.dist().all_reduce_sum_start(flat);
    if (nccl) return work;  // ordered on the GPU's stream: no host time to count
    // A host collective: what counts is this rank's wait for it, the part backward did not hide.
    return DistWork([this, work]() mutable {
      const double t0 = session_.clock().now_s();
      work.wait();
      comm_s_ += session_.clock().now_s() - t0;
    });
  };
  // NCCL's all-reduce is ordered on the stream: the graph captures it (with the full batch's constant weight).
  reduce.capturable = nccl;
  if (nccl) reduce.agree_capture = capture_agreement(session_.dist());
}

void BackpropTrainer::sync_bn_start() {
  // Each BatchNorm sums its statistics over the ranks in every training forward: every rank must run one forward per
  // step, so no batch may leave a rank without samples.
  const int64_t world = session_.dist().world_size();
  const int64_t batch = config_.schedule.batch_size;
  const int64_t last = train_loader_.size() % batch;
  TRIACCEL_CHECK_INPUT(last == 0 || last >= world, option_ref("sync_bn"), ": the last batch of each epoch holds ", last,
                       " samples, fewer than the ", world, " processes, so a process would have none to synchronize; "
                       "use a ", option_ref("batch_size"), " that leaves at least ", world, " (", train_loader_.size(),
                       " training samples)");
  BatchNormSync sync;
  sync.sum = [this](at::Tensor& t) { session_.dist().all_reduce_sum(t); };
  bn_sync_ = std::make_unique<BatchNormSyncScope>(std::move(sync));
}

void BackpropTrainer::budget_floor_check() const {
  const int64_t budget = config_.execution.vram_budget_bytes();
  if (budget <= 0) return;
  // The floor no batch size can go under, on any device: fp32 weights and gradients, the optimizer's state and the
  // resident datasets. Activations and workspaces come on top, so a budget just above it still fails later (on
  // CUDA, with the measured figure in memory_cap); this check names the number before anything runs.
  const int64_t n = session_.model().parameter_count();
  const int64_t state = optimizer_->state_bytes() / std::max<int64_t>(n, 1);
  const int64_t weights = n * (4 + 4 + state);
  const int64_t resident = train_loader_.resident_bytes() + test_loader_.resident_bytes();
  const int64_t minimum = weights + resident;
  TRIACCEL_CHECK_INPUT(budget >= minimum, option_ref("vram_budget"), " ", config_.execution.vram_budget,
                       " is below this run's minimum of ", minimum, " bytes (", static_cast<double>(minimum) / 1e6,
                       " MB: weights, gradients and ", enum_name(config_.optim.optimizer), " state of ", n,
                       " parameters take ", static_cast<double>(weights) / 1e6, " MB, the resident dataset ",
                       static_cast<double>(resident) / 1e6, " MB; activations come on top); raise the budget");
}

void BackpropTrainer::restore() {
  if (!session_.checkpoint()) return;
  const Checkpoint& ckpt = *session_.checkpoint();
  const std::string& file = session_.checkpoint_file();
  named_tensors_load(model_state(session_.model()), ckpt.model, "model", file);
  optimizer_->state_load(ckpt.optimizer, file);
  // The scaler's group holds amp-fp8's delayed scales too: the step loads them once it is built.
  named_tensors_load(scaler_state(scaler_), fp8_entries(ckpt.scaler, false), "loss scaler", file);
  *progress_ = Progress::from_json(ckpt.progress, file);
  rng_restore(ckpt.rng, device_);
  TRIACCEL_CHECK_INPUT(progress_->epoch_offset <= train_loader_.size(), "checkpoint ", file,
                       " has a data cursor beyond the dataset (", progress_->epoch_offset, " > ",
                       train_loader_.size(), ")");
}

void BackpropTrainer::controllers_build() {
  // The out-of-memory halving and the elastic batch share the batch rules.
  batch_rules_ = batch_policy_options(config_, train_loader_.size());
  ControllerParts parts{config_, session_, *optimizer_, *step_, train_loader_, device_};
  parts.next_step = progress_->step + 1;
  parts.total_steps = schedule_.total_steps;
  parts.batch_rules = &batch_rules_;
  parts.memory = memory_.get();
  parts.memory_model_rebuild = [this](const std::vector<Precision>& precisions) {
    MemoryModelInputs in = memory_->inputs;
    in.unit_precisions = precisions;
    // Traced in the captured step's pool, whose scratch is idle between steps (as for the evaluation): beside it,
    // under a budget, the trace's few MB need not fit, and the run then ends with an out-of-memory error at its first
    // precision decision (measured: docs/results/memory-planner.md). A transient (measure): the trace reads the
    // allocator's peak over each unit's backward, so the window's peak before it is carried, and the trace's own
    // peak is no step's.
    MemoryModel rebuilt;
    (void)measure([&]() {
      step_->in_graph_pool([&]() { rebuilt = memory_model_build(session_.model(), memory_->sample, in, device_); });
    });
    if (const auto agree = memory_agree_over_ranks(session_)) memory_model_agree(rebuilt, agree);
    return rebuilt;
  };
  controllers_ = controllers_make(parts);
  memory_planner_ = parts.memory_planner;
  if (memory_planner_ != nullptr) precision_controller_ = parts.precision;  // its promotions priced by the plan
  for (auto& c : controllers_) {
    if (progress_->controllers.contains(c->state_key())) c->restore(progress_->controllers[c->state_key()]);
  }
  if (memory_planner_) {
    session_.event(event::kMemoryPlan, progress_->step, memory_planner_->plan_fields("start"));
    const MemoryPlan& plan = memory_planner_->plan();
    session_.printer().line(c10::str(
        "memory plan: micro-batch ", plan.micro_batch, " x ", plan.accumulation, ", ",
        plan.recompute_names(memory_planner_->model()).size(), " units recomputed, ",
        plan.fp8_saved_names(memory_planner_->model()).size(), " stored in FP8, ",
        plan.update_in_backward ? "updates in backward, " : "", "data on the ",
        enum_name(plan.data_placement), ", predicted peak ", plan.predicted_peak_bytes / kGB, " GB",
        plan.budget_bytes > 0 ? c10::str(" of ", static_cast<double>(plan.budget_bytes) / kGB, " GB planned") : ""));
  }
}

void BackpropTrainer::memory_cap() {
  const int64_t budget = config_.execution.vram_budget_bytes();
  if (budget <= 0) return;
  if (device_.is_cuda()) {
    const MemoryStats m = memory_stats(device_);
    TRIACCEL_CHECK_INPUT(m.allocated_bytes < budget, option_ref("vram_budget"), " ", config_.execution.vram_budget,
                         " is below this run's minimum: the resident dataset and the weights alone take ",
                         static_cast<double>(m.allocated_bytes) / kGB,
                         " GB before gradients, optimizer state and activations; raise the budget");
    session_.memory_cap(budget);
  } else if (!session_.hooks().memory_signal) {
    session_.printer().line("note: the vram_budget applies to CUDA devices; this run is on the CPU and ignores it");
  }
}

}  // namespace triaccel
