#include "triaccel/methods/backprop.h"

#include "triaccel/control/baoc_controller.h"
#include "triaccel/control/curvature_controller.h"
#include "triaccel/control/elastic_batch.h"
#include "triaccel/control/measure_window.h"
#include "triaccel/control/memory_model.h"
#include "triaccel/control/precision_controller.h"
#include "triaccel/core/context_trace.h"
#include "triaccel/core/device.h"
#include "triaccel/core/errors.h"
#include "triaccel/core/profile.h"
#include "triaccel/models/model.h"
#include "triaccel/optim/baoc_optimizer.h"
#include "triaccel/run/component_options.h"
#include "triaccel/run/memory_setup.h"
#include "triaccel/run/rank_rows.h"
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

constexpr double kGB = 1e9;

// A skipped step's samples are retried; after this many skipped attempts in a row on the same samples they are
// dropped (counted in dropped_samples, logged) so that a sample that always yields NaN cannot stall the run.
constexpr int64_t kSkipRetryLimit = 8;

// Lockstep curvature rounds after the first stop after this many power-iteration passes (each unit's λ then sits
// within a few % of its converged value from the last round's vector): in a 15-epoch ResNet-18 run on the H100 warm
// Fisher rounds to --curv-tol took 6–11 passes, more than the budget allowed every 3 epochs.
constexpr int kLockstepWarmPasses = 4;

NamedTensors scaler_state(const LossScaler& s) {
  return {{"scale", s.scale_tensor()}, {"growth_tracker", s.growth_tracker()}, {"skipped", s.skipped_steps()}};
}

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

LoaderOptions placed(LoaderOptions o, DataPlacement placement) {
  o.placement = placement;
  return o;
}

double mean_of_last(const std::vector<double>& v, size_t n) {
  if (v.empty()) return 0;
  const size_t k = std::min(n, v.size());
  return std::accumulate(v.end() - static_cast<long>(k), v.end(), 0.0) / static_cast<double>(k);
}

// The controllers' states, merged by key: controllers that share a key write disjoint fields of one object.
Json controller_states(const std::vector<std::unique_ptr<StepController>>& controllers) {
  Json out = Json::object();
  for (const auto& c : controllers) {
    Json& slot = out[c->state_key()];
    if (slot.is_null()) slot = Json::object();
    const Json state = c->state();
    for (const auto& [k, v] : state.items()) slot[k] = v;
  }
  return out;
}

}  // namespace

struct Trainer::Progress {
  // The controllers' state keys a checkpoint stores.
  static constexpr const char* kControllerKeys[] = {"tri_accel", "baoc", "memory_plan"};
  int64_t step = 0;          // optimizer steps done
  int64_t epoch = 0;         // current epoch (0-based)
  int64_t epoch_offset = 0;  // samples of the current epoch already trained
  double elapsed_s = 0;      // the run's time when the checkpoint was written
  double epoch_train_s = 0;  // training time spent in the current epoch so far
  std::vector<double> epoch_times;  // finished epochs' training seconds
  double peak_vram_gb = 0;
  int64_t batch = 0;         // the batch size in use (smaller than batch_size after an out-of-memory retry)
  Json last_epoch;           // the last epoch event's fields
  Json controllers;          // state_key → state (Tri-Accel's under "tri_accel", BAOC's under "baoc")
  double peak_vram_warmup_gb = -1;  // adamw/baoc: the peak up to step plan_warmup (then the peak restarts)
  // Faults (docs/reliability.md), over the whole run: out-of-memory retries, skipped (inf/NaN) attempts that were
  // retried, samples dropped after kSkipRetryLimit skips in a row, and faults injected by inject_faults.
  int64_t oom_retries = 0;
  int64_t skip_retries = 0;
  int64_t dropped_samples = 0;
  int64_t injected_faults = 0;

  Json fault_counters() const {
    return Json{{"oom_retries", oom_retries}, {"skip_retries", skip_retries}, {"dropped_samples", dropped_samples},
                {"injected_faults", injected_faults}};
  }
  Json to_json() const {
    Json j{{"step", step}, {"epoch", epoch}, {"epoch_offset", epoch_offset}, {"elapsed_s", elapsed_s},
           {"epoch_train_s", epoch_train_s}, {"epoch_times", epoch_times}, {"peak_vram_gb", peak_vram_gb},
           {"batch", batch}, {"last_epoch", last_epoch}};
    for (const char* key : kControllerKeys) j[key] = controllers.value(key, Json());
    j["peak_vram_warmup_gb"] = peak_vram_warmup_gb;
    const Json faults = fault_counters();
    for (const auto& [k, v] : faults.items()) j[k] = v;
    return j;
  }
  static Progress from_json(const Json& j, const std::string& path) {
    Progress p;
    try {
      p.step = j.at("step").get<int64_t>();
      p.epoch = j.at("epoch").get<int64_t>();
      p.epoch_offset = j.at("epoch_offset").get<int64_t>();
      p.elapsed_s = j.at("elapsed_s").get<double>();
      p.epoch_train_s = j.at("epoch_train_s").get<double>();
      p.epoch_times = j.at("epoch_times").get<std::vector<double>>();
      p.peak_vram_gb = j.at("peak_vram_gb").get<double>();
      p.batch = j.value("batch", int64_t{0});
      p.last_epoch = j.at("last_epoch");
      p.controllers = Json::object();
      for (const char* key : kControllerKeys) {
        if (j.contains(key) && !j[key].is_null()) p.controllers[key] = j[key];
      }
      p.peak_vram_warmup_gb = j.value("peak_vram_warmup_gb", -1.0);
      p.oom_retries = j.value("oom_retries", int64_t{0});  // absent in checkpoints before fault counters
      p.skip_retries = j.value("skip_retries", int64_t{0});
      p.dropped_samples = j.value("dropped_samples", int64_t{0});
      p.injected_faults = j.value("injected_faults", int64_t{0});
    } catch (const Json::exception&) {
      throw UserError("checkpoint " + path + " has an unreadable progress record");
    }
    return p;
  }
};

// --- set-up ---

Trainer::Trainer(Session& session)
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

Trainer::~Trainer() = default;

void Trainer::grad_reduce_set(StepOptions::GradReduce& reduce) {
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

void Trainer::sync_bn_start() {
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

void Trainer::budget_floor_check() const {
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

void Trainer::restore() {
  if (!session_.checkpoint()) return;
  const Checkpoint& ckpt = *session_.checkpoint();
  const std::string& file = session_.checkpoint_file();
  named_tensors_load(model_state(session_.model()), ckpt.model, "model", file);
  optimizer_->state_load(ckpt.optimizer, file);
  named_tensors_load(scaler_state(scaler_), ckpt.scaler, "loss scaler", file);
  *progress_ = Progress::from_json(ckpt.progress, file);
  rng_restore(ckpt.rng, device_);
  TRIACCEL_CHECK_INPUT(progress_->epoch_offset <= train_loader_.size(), "checkpoint ", file,
                       " has a data cursor beyond the dataset (", progress_->epoch_offset, " > ",
                       train_loader_.size(), ")");
}

void Trainer::controllers_build() {
  const TriAccelConfig& ta = config_.tri_accel;
  PrecisionController* precision_controller = nullptr;
  if (config_.execution.method == Method::kTriAccel) {
    if (ta.ta_curvature || ta.ta_precision) {
      // The fixed curvature batch: the first b_curv samples of epoch 0's (seeded) order.
      train_loader_.epoch_begin(0);
      const int64_t curv_count = std::min(ta.curv_batch, train_loader_.size());
      auto [images, labels] = train_loader_.batch(0, curv_count);
      CurvatureControllerOptions co = curvature_controller_options(config_, session_.model());
      co.probe_samples = train_loader_.sample_indices(0, curv_count);
      co.probe.clock = &session_.clock();
      co.probe.warm_passes = kLockstepWarmPasses;
      // Under a budget the plan fills it with the steps: the rounds take the step graph's pool as scratch.
      co.share_step_pool = co.lockstep_rounds() && config_.execution.vram_budget_bytes() > 0 && device_.is_cuda() &&
                           config_.execution.cuda_graphs;
      co.total_steps = config_.schedule.max_steps > 0 ? std::min(schedule_.total_steps, config_.schedule.max_steps)
                                                      : schedule_.total_steps;
      controllers_.push_back(std::make_unique<CurvatureController>(co, session_.model(), *optimizer_, *step_,
                                                                   images, labels));
    }
    if (ta.ta_precision) {
      auto precision = std::make_unique<PrecisionController>(precision_policy_options(config_), ta.ctrl_every,
                                                             session_.model(), *optimizer_, *step_, device_);
      precision_controller = precision.get();
      controllers_.push_back(std::move(precision));
    }
  }
  if (config_.optim.optimizer == OptimizerKind::kBaoc) {
    controllers_.push_back(std::make_unique<BaocController>(baoc_controller_options(config_), session_.model(),
                                                            static_cast<BaocOptimizer&>(*optimizer_),
                                                            [this]() { step_->invalidate_graph(); }, progress_->step + 1));
  }
  if (config_.optim.optimizer != OptimizerKind::kSgd) {
    controllers_.push_back(std::make_unique<MeasureWindowController>(config_.baoc.plan_warmup, *step_));
  }
  // Batch sizes: bucketed halving after out of memory; under a vram_budget, Tri-Accel's elastic batch (the paper's
  // rule on the measured peak) every control window. The lr follows the batch by lr_batch_rule.
  const int64_t budget = config_.execution.vram_budget_bytes();
  batch_rules_ = batch_controller_options(config_, train_loader_.size());
  const bool elastic = config_.execution.method == Method::kTriAccel && ta.ta_batch && budget > 0 &&
                       config_.execution.batch_policy == BatchPolicy::kElastic &&
                       (device_.is_cuda() || session_.hooks().memory_signal);
  if (elastic) {
    controllers_.push_back(std::make_unique<ElasticBatchController>(batch_rules_, ta.ctrl_every,
                                                                    config_.schedule.batch_size,
                                                                    session_.hooks().memory_signal));
  }
  // The memory planner runs last: it sees this step's precision decisions.
  if (memory_->planned) {
    MemorySetup& m = *memory_;
    auto planner = std::make_unique<MemoryPlanController>(
        m.model, m.plan, m.limits, *step_, [this](const std::vector<Precision>& precisions) {
          MemoryModelInputs in = memory_->inputs;
          in.unit_precisions = precisions;
          // Traced in the captured step's pool, whose scratch is idle between steps (as for the evaluation): beside
          // it, under a budget, the trace's few MB did not fit (Tri-Accel ResNet-18 at 0.35 and 0.4 GB on the H100
          // ended with an out-of-memory error at its first precision decision).
          MemoryModel rebuilt;
          step_->in_graph_pool(
              [&]() { rebuilt = memory_model_build(session_.model(), memory_->sample, in, device_); });
          if (const auto agree = memory_agree_over_ranks(session_)) memory_model_agree(rebuilt, agree);
          return rebuilt;
        });
    planner->set_agree(memory_agree_over_ranks(session_));
    memory_planner_ = planner.get();
    controllers_.push_back(std::move(planner));
    if (precision_controller != nullptr) {  // a promotion no plan can pay for is refused, not fatal
      precision_controller_ = precision_controller;
      precision_controller->set_memory_check(
          [planner = memory_planner_](const std::vector<Precision>& p) { return planner->fits(p); },
          /*hold_curvature=*/config_.execution.vram_budget_bytes() > 0);
      memory_planner_->set_capture_oom_undo([precision_controller]() { return precision_controller->revert_raise(); });
    }
  }
  for (auto& c : controllers_) {
    if (progress_->controllers.contains(c->state_key())) c->restore(progress_->controllers[c->state_key()]);
  }
  if (memory_planner_) {
    session_.event(event::kMemoryPlan, progress_->step, memory_planner_->plan_fields("start"));
    const MemoryPlan& plan = memory_planner_->plan();
    session_.printer().line(c10::str(
        "memory plan: micro-batch ", plan.micro_batch, " x ", plan.accumulation, ", ",
        plan.recompute_names(memory_planner_->model()).size(), " units recomputed, data on the ",
        enum_name(plan.data_placement), ", predicted peak ", plan.predicted_peak_bytes / kGB, " GB",
        plan.budget_bytes > 0 ? c10::str(" of ", static_cast<double>(plan.budget_bytes) / kGB, " GB planned") : ""));
  }
}

void Trainer::memory_cap() {
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

// --- the loop ---

Json Trainer::run() {
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

bool Trainer::epoch() {
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
    // Data parallel: agreed with the step's out-of-memory agreement (step_agreed), in its one round trip.
    const auto [stop, checkpoint_due] = agreed_ ? *std::exchange(agreed_, std::nullopt) : session_.stop_agreed(p.step);
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

Trainer::Attempt Trainer::step_with_recovery(int64_t count) {
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
  agreed_.reset();
  const bool dist = session_.dist().active();
  bool failed = false;
  try {  // loading the batch allocates too (resize, augmentation): under a budget it can run out of memory
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
    // (train/step_graph.h): beside it, under a budget, it did not fit (ResNet-18 b96 at 0.4 GB on the H100: out of
    // memory even in passes of one sample), and releasing the graph cost a capture an epoch (0.96× at 0.8 GB).
    {
      TRIACCEL_PROFILE_RANGE("triaccel::step");
      step_->run(images, labels, lr);
    }
    context_trace("a training step");
  } catch (const c10::OutOfMemoryError&) {
    // --sync-bn: the other ranks' forward passes make collectives this rank cannot make up; it stops them all.
    if (bn_sync_) dist_out_of_memory_check();
    failed = true;
  }
  // An eager step of another size beside the graph's private pool: not the plan's error.
  const bool beside_pool = failed && memory_planner_ && step_->graph().captured() &&
                           shard_count_ != step_->graph_batch_size();
  if (!dist && failed) return on_out_of_memory(fault, count, OomSeen{beside_pool, Json()});
  if (dist) {
    // The other ranks' steps went on: this rank makes its step's collectives, so that every rank skips the update.
    const MemoryStats at_failure = failed ? memory_stats(device_) : MemoryStats{};
    const bool unskippable = failed && !step_->run_failed(images, labels, lr);
    if (const auto seen = step_agreed(failed, unskippable, beside_pool, at_failure)) {
      return on_out_of_memory(fault, count, *seen);
    }
  }
  retried_at_min_ = false;
  peak_trace("step");
  // Only under inject_faults: reading found_inf is a host sync after every step. Without injected faults a
  // non-finite step is skipped on the device as GradScaler does (counted in skipped_steps, samples not retried).
  if (!faults_.empty() && step_->last_step_skipped()) return on_skipped_step(fault, count);
  attempt_ = 0;
  skips_in_a_row_ = 0;
  return Attempt::kTrained;
}

std::optional<Trainer::OomSeen> Trainer::step_agreed(bool failed, bool unskippable, bool beside_pool,
                                                     const MemoryStats& at_failure) {
  const Progress& p = *progress_;
  // Per rank {ran out of memory, could not skip, beside the graph's pool, allocated GB, reserved GB}.
  const std::vector<double> own{failed ? 1.0 : 0.0, unskippable ? 1.0 : 0.0, beside_pool ? 1.0 : 0.0,
                                static_cast<double>(at_failure.allocated_bytes) / kGB,
                                static_cast<double>(at_failure.reserved_bytes) / kGB};
  std::vector<std::vector<double>> rows;
  agreed_ = session_.stop_agreed(p.step + 1, own, &rows);  // the step after_step is about to count
  const RanksOutOfMemory out = ranks_out_of_memory(rows, /*allocated=*/3);
  if (out.ranks.empty()) return std::nullopt;
  agreed_.reset();  // a stop or a checkpoint waits for a step that ran
  OomSeen seen;
  seen.ranks = out.ranks;
  bool stop = false;
  for (const auto& row : rows) {
    if (row[0] == 0) continue;
    stop = stop || row[1] > 0;
    seen.beside_pool = seen.beside_pool || row[2] > 0;
  }
  if (stop) {
    session_.event(event::kOom, p.step, Json{{"epoch", p.epoch}, {"epoch_offset", p.epoch_offset}, {"batch", p.batch},
                                             {"ranks", seen.ranks}, {"action", "stopped"}});
    throw UserError(str_cat(out.who, " ran out of GPU memory in training after the step's update had begun (the ranks' weights "
                            "may differ); resume from the last checkpoint with a smaller ", option_ref("batch_size"),
                            " or on more GPUs: ", option_ref("resume"), " ", config_.output.out, " ",
                            option_ref("nproc"), " N"));
  }
  step_->failed_step_restore();
  return seen;
}

Trainer::Attempt Trainer::on_out_of_memory(FaultKind fault, int64_t count, const OomSeen& seen) {
  Progress& p = *progress_;
  attempt_ += fault == FaultKind::kOom ? 1 : 0;  // the injected error came before the increment
  p.oom_retries += 1;
  Json where{{"epoch", p.epoch}, {"epoch_offset", p.epoch_offset}, {"injected", fault == FaultKind::kOom}};
  if (!seen.ranks.is_null()) where["ranks"] = seen.ranks;
  // The failed attempt allocated up to the cap: its peak counts for the run, not as the retry's calibration reading.
  if (memory_planner_) window();
  if (seen.beside_pool) {
    // Not the plan's error: the graph gives its pool back; the next full batches capture it again.
    Json fields{{"batch", p.batch}, {"retry_batch", count}, {"action", "graph released"}};
    for (const auto& [k, v] : where.items()) fields[k] = v;
    session_.event(event::kOom, p.step, fields);
    step_->graph_release();
    memory_cache_release(device_);
    return Attempt::kRetry;
  }
  if (precision_controller_ && precision_controller_->revert_raise()) {
    // The last precision window's promotion, priced by the plan but not paid for: its units go back (refused) and the
    // plan that ran before it stays, instead of a smaller plan for the promotion (micro-batches: a cliff).
    Json fields{{"batch", p.batch}, {"retry_batch", p.batch}, {"action", "precision raise refused"}};
    for (const auto& [k, v] : where.items()) fields[k] = v;
    session_.event(event::kOom, p.step, fields);
    memory_cache_release(device_);
    return Attempt::kRetry;
  }
  if (memory_planner_) {
    // A planning error: the model under-predicted. A larger activation scale, a new plan, the same samples at the
    // same batch (UserError when no plan fits any more).
    Json fields{{"batch", p.batch}, {"retry_batch", p.batch}};
    for (const auto& [k, v] : where.items()) fields[k] = v;
    session_.event(event::kOom, p.step, fields);
    memory_cache_release(device_);
    const Event replanned = memory_planner_->on_out_of_memory();
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
    Json fields{{"batch", p.batch}, {"retry_batch", p.batch}};
    for (const auto& [k, v] : where.items()) fields[k] = v;
    session_.event(event::kOom, p.step, fields);
    step_->set_graph_batch_size(session_.dist().share(p.batch).second);
    return Attempt::kRetry;
  }
  const int64_t smaller = batch_after_oom(batch_rules_, p.batch);
  Json fields{{"batch", p.batch}, {"retry_batch", smaller}};
  for (const auto& [k, v] : where.items()) fields[k] = v;
  session_.event(event::kOom, p.step, fields);
  // The elastic batch never grows back to a size that ran out of memory.
  batch_rules_.max_batch = std::max(batch_rules_.min_batch, std::min(batch_rules_.max_batch, p.batch - 1));
  batch_set(smaller);
  memory_cache_release(device_);
  return Attempt::kRetry;
}

Trainer::Attempt Trainer::on_skipped_step(FaultKind fault, int64_t count) {
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

void Trainer::after_step(int64_t count) {
  Progress& p = *progress_;
  const RunHooks& hooks = session_.hooks();
  if (hooks.on_batch) hooks.on_batch(p.epoch, p.epoch_offset + shard_offset_, shard_count_);
  p.epoch_offset += count;
  p.step += 1;
  samples_this_epoch_ += count;
  samples_since_log_ += count;
  if (hooks.after_step) hooks.after_step(p.step);
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

void Trainer::train_time_pause() {
  device_synchronize(device_);
  progress_->epoch_train_s += session_.clock().now_s() - t_epoch_;
  for (auto& c : controllers_) c->pause();
}

std::array<double, 4> Trainer::evaluate_share(int64_t batch_size) {
  const torch::NoGradGuard no_grad;
  Model& model = session_.model();
  model.eval();
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device_);
  at::Tensor loss_sum = at::zeros({1}, f32);
  at::Tensor correct = at::zeros({1}, f32);
  at::Tensor correct_tta = at::zeros({1}, f32);
  const bool flip_tta = config_.execution.tta == Tta::kFlip;
  double predictions = 0;  // label elements: samples, or samples × T for a language model
  const Dist& dist = session_.dist();
  const int64_t n_test = test_loader_.size();
  const int64_t first = n_test * dist.rank() / dist.world_size();
  const int64_t end = n_test * (dist.rank() + 1) / dist.world_size();
  for (int64_t offset = first; offset < end; offset += batch_size) {
    const int64_t count = std::min(batch_size, end - offset);
    auto [images, labels] = test_loader_.batch(offset, count);
    const AutocastScope autocast(device_, eval_precision_);
    if (const Objective* objective = session_.hooks().objective.get()) {  // the program's, weighted by samples
      const ObjectiveTerms terms = objective_terms(objective, model.forward(images), labels, 0.0);
      loss_sum.add_(terms.loss * static_cast<double>(terms.counted));
      correct.add_(terms.metric);
      predictions += static_cast<double>(terms.counted);
      continue;
    }
    // (count, classes), or (count, T, V) flattened to (count · T, V) for a language model
    const at::Tensor logits = model.forward(images).to(at::kFloat).flatten(0, -2);
    const at::Tensor targets = labels.flatten();
    predictions += static_cast<double>(targets.numel());
    loss_sum.add_(at::cross_entropy_loss(logits, targets, {}, at::Reduction::Sum));
    correct.add_(logits.argmax(1).eq(targets).sum().to(at::kFloat));
    if (flip_tta) {
      const at::Tensor both = logits + model.forward(images.flip({3})).to(at::kFloat);
      correct_tta.add_(both.argmax(1).eq(labels).sum().to(at::kFloat));
    }
  }
  model.train();
  return {loss_sum.item<double>(), correct.item<double>(), correct_tta.item<double>(), predictions};
}

Trainer::EvalResult Trainer::evaluate_within_budget() {
  // A planned run's evaluation batch fits what the plan leaves; halving remains for a model that under-predicts,
  // and the batch that then fit is kept for the later evaluations (one out-of-memory error a run, not one an epoch).
  step_->grads_release();  // the last step's gradients (the size of the weights) are not needed to evaluate
  if (eval_batch_ == 0) {
    // Planned once, on what the first evaluation finds held: the cache of other plans' calibration steps is
    // returned first (what stays is the graph's pool and the live tensors). Later evaluations reuse the segments
    // the first one added, at the same batch.
    if (memory_->budgeted()) memory_cache_release(device_);
    const int64_t micro =
        step_->micro_batch() > 0 ? step_->micro_batch() : session_.dist().share(progress_->batch).second;
    eval_batch_ = memory_->eval_batch(config_.execution.eval_batch_size, memory_stats(device_).reserved_bytes, micro);
  }
  // Data parallel: every rank evaluates rank 0's model (its BatchNorm statistics) on its share of the test set. The
  // broadcast comes before any retry and the sums' reduction after, so a rank retries its own share alone.
  Dist& dist = session_.dist();
  if (dist.active()) {
    std::vector<at::Tensor> buffers;
    for (const auto& b : session_.model().buffers()) buffers.push_back(b);
    dist.broadcast(buffers, 0);
  }
  const int64_t planned = eval_batch_;
  std::array<double, 4> own{};
  for (int64_t batch = eval_batch_;; batch = (batch + 1) / 2) {
    try {  // under a vram_budget, an evaluation batch that does not fit is halved, not fatal
      // In the training graph's pool: its scratch memory is idle between epochs (beside it, evaluation under a
      // budget ran at batches small enough to fit there, 5× slower).
      step_->in_graph_pool([&]() { own = evaluate_share(batch); });
      eval_batch_ = batch;  // the batch that fit, for the later evaluations
      break;
    } catch (const c10::OutOfMemoryError&) {
      TRIACCEL_CHECK_INPUT(batch > 1, dist.active() ? str_cat("rank ", dist.rank(), " of ", dist.world_size(), " ran")
                                                     : std::string("ran"),
                           " out of memory evaluating one sample: raise ", option_ref("vram_budget"));
      session_.event(event::kOom, progress_->step,
                     Json{{"phase", "eval"}, {"batch", batch}, {"retry_batch", (batch + 1) / 2}});
      memory_cache_release(device_);
    }
  }
  // The sums over the ranks, and each rank's batch before and after its retries, so that rank 0's events name another
  // rank's retries.
  const int world = dist.world_size();
  std::vector<double> sums(own.begin(), own.end());
  sums.resize(own.size() + 2 * static_cast<size_t>(world), 0.0);
  const size_t slot = own.size() + 2 * static_cast<size_t>(dist.rank());
  sums[slot] = static_cast<double>(planned);
  sums[slot + 1] = static_cast<double>(eval_batch_);
  sums = dist.all_reduce_sum(std::move(sums));
  for (int r = 1; r < world; ++r) {
    const size_t at = own.size() + 2 * static_cast<size_t>(r);
    if (sums[at + 1] < sums[at]) {
      session_.event(event::kOom, progress_->step,
                     Json{{"phase", "eval"}, {"rank", r}, {"batch", static_cast<int64_t>(sums[at])},
                          {"retry_batch", static_cast<int64_t>(sums[at + 1])}});
    }
  }
  const double tta = config_.execution.tta == Tta::kFlip ? 100.0 * sums[2] / static_cast<double>(test_loader_.size()) : -1;
  return {sums[0] / sums[3], 100.0 * sums[1] / sums[3], tta};
}

void Trainer::epoch_end(double train_s) {
  Progress& p = *progress_;
  // Peak VRAM is the training peak (the measured period); evaluation's own peak is reported beside it.
  // This epoch's training steps (since the reset after the last evaluation); peak_vram_gb is the run's so far, which
  // holds the memory planner's calibration steps (other plans) in its first epoch.
  const double epoch_peak_gb = static_cast<double>(peak_now()) / kGB;
  p.peak_vram_gb = std::max(p.peak_vram_gb, epoch_peak_gb);
  steps_peak_ = steps_peak_now();  // before the evaluation, whose peak is not the steps'
  peak_reset();
  const double t_eval = session_.clock().now_s();
  const EvalResult test = evaluate_within_budget();
  const double eval_s = session_.clock().now_s() - t_eval;
  const double eval_peak_gb = static_cast<double>(memory_stats(device_).peak_allocated_bytes) / kGB;
  peak_trace("evaluation");
  peak_reset();
  const double seen = static_cast<double>(std::max<int64_t>(samples_this_epoch_, 1));
  const bool tokens = session_.data().train.kind == DatasetKind::kTokens;
  double overhead_s = 0;
  for (const auto& c : controllers_) overhead_s += c->overhead_s();
  const bool tri = config_.execution.method == Method::kTriAccel;
  const StepGraph& graph = step_->graph();
  // Summed over the ranks (each holds its shares'); samples_this_epoch_ counts the global batches.
  const std::vector<double> train_sums =
      session_.dist().all_reduce_sum({step_->loss_sum().item<double>(), step_->correct_sum().item<double>()});
  // Every rank's training peak and time in the gradient collective (rank r's in slot r; one process: its own).
  Dist& dist = session_.dist();
  const size_t world = static_cast<size_t>(dist.world_size()), rank = static_cast<size_t>(dist.rank());
  std::vector<double> per_rank(2 * world, 0.0);
  per_rank[rank] = p.peak_vram_gb;
  per_rank[world + rank] = comm_s_;
  per_rank = dist.all_reduce_sum(per_rank);
  const std::vector<double> rank_peaks(per_rank.begin(), per_rank.begin() + static_cast<long>(world));
  const std::vector<double> rank_comm(per_rank.begin() + static_cast<long>(world), per_rank.end());
  comm_s_ = 0;
  p.epoch_times.push_back(train_s);
  p.last_epoch = Json{
      {"epoch", p.epoch + 1},
      {"train_loss", train_sums[0] / seen},
      {"train_acc", 100.0 * train_sums[1] / seen},
      {"test_loss", test.loss},
      {"val_loss", tokens ? Json(test.loss) : Json(nullptr)},
      {"test_acc", test.acc},
      {"test_acc_tta", test.acc_tta >= 0 ? Json(test.acc_tta) : Json(nullptr)},
      {"epoch_s", train_s},
      {"eval_s", eval_s},
      {"images_per_s", static_cast<double>(samples_this_epoch_) / std::max(train_s, 1e-9)},
      {"tokens_per_s", tokens ? Json(static_cast<double>(samples_this_epoch_ * session_.data().train.images.size(1)) /
                                     std::max(train_s, 1e-9))
                              : Json(nullptr)},
      {"samples", samples_this_epoch_},  // trained this epoch in this session
      {"lr", last_lr_},
      {"batch", p.batch},
      {"peak_vram_gb", p.peak_vram_gb},
      {"epoch_peak_vram_gb", epoch_peak_gb},
      {"eval_peak_vram_gb", eval_peak_gb},
      {"eval_batch", eval_batch_},
      {"alloc_retries", memory_stats(device_).alloc_retries},  // since the start (core/device.h)
      {"skipped_steps", scaler_.skipped_steps().item<double>()},
      {"faults", p.fault_counters()},
      {"loss_scale", scaler_.scale_tensor().item<double>()},
      {"cuda_graph", graph.captured()},
      {"graph_captures", graph.captures()},
      {"graph_capture_ooms", graph.capture_ooms()},
      {"graph_capture_error", graph.capture_error().empty() ? Json(nullptr) : Json(graph.capture_error())},
      {"probe_s_total", tri ? Json(overhead_s) : Json(nullptr)},
      {"memory_plan", memory_plan_brief()},
      {"world_size", dist.world_size()},
      {"rank_peak_vram_gb", dist.active() ? Json(rank_peaks) : Json(nullptr)},
      // Host time in the gradient collective this epoch, per rank (null with NCCL: it runs on the GPU's stream).
      {"rank_comm_s", dist.active() && !dist.nccl() ? Json(rank_comm) : Json(nullptr)}};
  session_.event(event::kEpoch, p.step, p.last_epoch);
  session_.printer().line(c10::str("epoch ", p.epoch + 1, "/", config_.schedule.epochs, ": train loss ",
                                   p.last_epoch["train_loss"].get<double>(), ", test acc ", test.acc, " %, ", train_s,
                                   " s"));
  p.epoch += 1;
  p.epoch_offset = 0;
  p.epoch_train_s = 0;
  if (config_.output.checkpoint_every == 0 || p.epoch == config_.schedule.epochs) checkpoint();
}

std::string Trainer::curvature_checkpoint() {
  const std::string file = "curvature-step-" + std::to_string(progress_->step) + ".pt";
  checkpoint_mid_epoch(file);
  return session_.out_file(file);
}

void Trainer::checkpoint_mid_epoch(const std::string& file) {
  train_time_pause();
  checkpoint(file);
  t_epoch_ = session_.clock().now_s();  // the epoch's clock runs again from here
}

void Trainer::checkpoint(const std::string& file) {
  NamedTensors optimizer_state;
  if (param_shards_) {  // every owner sends rank 0 the state of its parameters
    optimizer_state = optimizer_->state_tensors();
    param_shards_->gather(optimizer_state, optimizer_->names());
  }
  if (!session_.writer()) return;  // rank 0's: every rank holds the same weights (and state, once gathered)
  Checkpoint c;
  c.config = config_.to_json();
  c.model_arch = config_.model.model;
  c.model = model_state(session_.model());
  c.optimizer = param_shards_ ? std::move(optimizer_state) : optimizer_->state_tensors();
  c.scaler = scaler_state(scaler_);
  c.rng = rng_state(device_);
  Progress p = *progress_;
  p.elapsed_s = session_.now();
  p.controllers = controller_states(controllers_);
  c.progress = p.to_json();
  const std::string path = session_.out_file(file);
  checkpoint_write(path, c);
  session_.checkpoint_written();
  session_.event(event::kCheckpoint, progress_->step,
                 Json{{"path", path}, {"epoch", progress_->epoch}, {"epoch_offset", progress_->epoch_offset}});
  peak_trace("checkpoint");
}

void Trainer::peak_trace(const char* phase) {
  if (!trace_peak_) return;
  const int64_t peak = peak_now();
  if (peak > traced_peak_ + static_cast<int64_t>(1e6)) {
    std::fprintf(stderr, "peak trace: step %lld epoch %lld offset %lld after %s: peak %.6f GB (was %.6f), now %.6f GB\n",
                 static_cast<long long>(progress_->step), static_cast<long long>(progress_->epoch),
                 static_cast<long long>(progress_->epoch_offset), phase, static_cast<double>(peak) / kGB,
                 static_cast<double>(traced_peak_) / kGB,
                 static_cast<double>(memory_stats(device_).allocated_bytes) / kGB);
    traced_peak_ = peak;
  }
  if (memory_history_.empty()) return;
  // A capture that ran out of memory in this phase: its events (the capture's allocations, the refused one) go to
  // <it>.capture_oom.<n>, to hold against the eager step's peak (bench/memory_peak.py --compare).
  if (step_ && step_->graph().capture_ooms() > history_capture_ooms_) {
    history_capture_ooms_ = step_->graph().capture_ooms();
    memory_history_write(device_, str_cat(memory_history_, ".capture_oom.", history_capture_ooms_));
  }
  // The recorded events are this phase's alone (cleared after the last one), so a rise of the peak happened in them.
  int64_t& highest = history_peaks_[phase];
  if (peak > highest) {
    highest = peak;
    memory_history_write(device_, str_cat(memory_history_, ".", phase));
  }
  memory_history_clear(device_);
}

Json Trainer::stop() {
  const Progress& p = *progress_;
  checkpoint();
  const Json fields{{"reason", stop_reason_}, {"epoch", p.epoch}, {"epoch_offset", p.epoch_offset}};
  session_.profile_end();
  session_.event(event::kStop, p.step, fields);
  session_.printer().line(stop_line(stop_reason_, p.step, config_.output.out));
  return fields;
}

Json Trainer::summary() {
  const Progress& p = *progress_;
  const std::string model_path = session_.out_file("model.pt");
  if (session_.writer()) model_export_state_dict(session_.model(), model_path);
  const double epoch_s = mean_of_last(p.epoch_times, 5);
  const double acc = p.last_epoch.value("test_acc", 0.0);
  const int64_t params = session_.model().parameter_count();
  const bool tri = config_.execution.method == Method::kTriAccel;
  const bool sgd = config_.optim.optimizer == OptimizerKind::kSgd;
  double overhead_s = 0;
  for (const auto& c : controllers_) overhead_s += c->overhead_s();
  const double train_s = std::accumulate(p.epoch_times.begin(), p.epoch_times.end(), 0.0);
  Json summary{{"test_acc", acc},
               {"test_acc_tta", p.last_epoch.value("test_acc_tta", Json(nullptr))},
               {"test_loss", p.last_epoch.value("test_loss", 0.0)},
               {"epoch_s", epoch_s},
               {"peak_vram_gb", p.peak_vram_gb},
               {"peak_vram_includes_dataset", true},
               {"peak_vram_phase", "training steps (evaluation's peak is in each epoch event)"},
               {"eff_score", (epoch_s > 0 && p.peak_vram_gb > 0) ? Json(acc / (epoch_s * p.peak_vram_gb))
                                                                 : Json(nullptr)},
               {"params", params},
               {"method", enum_name(config_.execution.method)},
               {"optimizer", enum_name(config_.optim.optimizer)},
               {"optim_state_bytes", optimizer_->state_bytes()},  // this rank's, with sharded state
               {"optim_state_sharded", param_shards_ != nullptr},
               {"adamw_fp32_state_bytes", 8 * params},
               {"peak_vram_warmup_gb", p.peak_vram_warmup_gb >= 0 ? Json(p.peak_vram_warmup_gb) : Json(nullptr)},
               {"peak_vram_from_step", sgd ? 0 : config_.baoc.plan_warmup},
               {"model", config_.model.model},
               {"dataset", config_.data.dataset},
               {"precision", tri ? std::string("adaptive") : std::string(enum_name(config_.execution.precision))},
               {"probe_share", tri ? Json(overhead_s / std::max(1e-9, train_s)) : Json(nullptr)},
               {"batch_size", config_.schedule.batch_size},
               {"epochs", config_.schedule.epochs},
               {"steps", p.step},
               {"skipped_steps", scaler_.skipped_steps().item<double>()},
               {"oom_retries", p.oom_retries},
               {"skip_retries", p.skip_retries},
               {"dropped_samples", p.dropped_samples},
               {"injected_faults", p.injected_faults},
               {"total_s", session_.now()},
               {"device", device_long_name(device_)},
               {"vram_budget_gb", config_.execution.vram_budget_bytes() > 0
                                      ? Json(static_cast<double>(config_.execution.vram_budget_bytes()) / kGB)
                                      : Json(nullptr)},
               {"memory_plan", memory_plan_brief()},
               {"world_size", session_.dist().world_size()},
               {"input_mean", session_.data().mean},
               {"input_std", session_.data().std},
               {"model_path", model_path}};
  session_.profile_end();
  session_.event(event::kSummary, p.step, summary);
  if (session_.writer()) {
    session_.printer().line(c10::str("done: test acc ", acc, " %, ", epoch_s, " s/epoch, peak ", p.peak_vram_gb,
                                     " GB; events in ", session_.events().path()));
  }
  return summary;
}

// --- helpers ---

void Trainer::dist_out_of_memory_check() const {
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

Json Trainer::memory_plan_brief() const {
  if (!memory_planner_) return Json(nullptr);
  const MemoryPlan& plan = memory_planner_->plan();
  return Json{{"micro_batch", plan.micro_batch},
              {"accumulation", plan.accumulation},
              {"recompute", plan.recompute_names(memory_planner_->model())},
              {"data_placement", enum_name(plan.data_placement)},
              {"predicted_peak_gb", plan.predicted_peak_bytes / kGB},
              {"measured_peak_gb", memory_planner_->plan_measured_peak_bytes() > 0
                                       ? Json(memory_planner_->plan_measured_peak_bytes() / kGB)
                                       : Json(nullptr)}};
}

void Trainer::batch_set(int64_t batch) {
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
double Trainer::schedule_position() const {
  return static_cast<double>(progress_->epoch * train_loader_.steps_per_epoch()) +
         static_cast<double>(progress_->epoch_offset) / static_cast<double>(config_.schedule.batch_size);
}

MemoryStats Trainer::window() {
  MemoryStats m = memory_stats(device_);
  m.peak_allocated_bytes = std::max(m.peak_allocated_bytes, window_carry_);
  progress_->peak_vram_gb = std::max(progress_->peak_vram_gb, static_cast<double>(m.peak_allocated_bytes) / kGB);
  steps_peak_ = std::max(steps_peak_, m.peak_allocated_bytes);
  memory_stats_reset_peak(device_);
  window_carry_ = 0;
  return m;
}

void Trainer::restart() {
  Progress& p = *progress_;
  p.peak_vram_warmup_gb = std::max(p.peak_vram_gb, static_cast<double>(peak_now()) / kGB);
  p.peak_vram_gb = 0;
  steps_peak_ = steps_peak_now();
  peak_reset();
}

int64_t Trainer::peak_now() const {
  return std::max({memory_stats(device_).peak_allocated_bytes, window_carry_, transient_carry_});
}

// Since the allocator's last reset only steps ran: every transient (measure()) and every evaluation resets it after.
int64_t Trainer::steps_peak_now() const {
  return std::max({steps_peak_, window_carry_, memory_stats(device_).peak_allocated_bytes});
}

void Trainer::peak_reset() {
  memory_stats_reset_peak(device_);
  window_carry_ = 0;
  transient_carry_ = 0;
  traced_peak_ = 0;
}

double Trainer::room_bytes() {
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

double Trainer::measure(const std::function<void()>& fn) {
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
