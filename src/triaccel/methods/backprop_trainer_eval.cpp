// The BackpropTrainer's evaluation (within the budget), epoch end, checkpoints, stop and summary
// (methods/backprop_trainer.h).
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

std::array<double, 4> BackpropTrainer::evaluate_share(int64_t batch_size) {
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

BackpropTrainer::EvalResult BackpropTrainer::evaluate_within_budget() {
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
      // budget ran at batches small enough to fit there, several times slower; docs/results/memory-planner.md).
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

void BackpropTrainer::epoch_end(double train_s) {
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

std::string BackpropTrainer::curvature_checkpoint() {
  const std::string file = "curvature-step-" + std::to_string(progress_->step) + ".pt";
  checkpoint_mid_epoch(file);
  return session_.out_file(file);
}

void BackpropTrainer::checkpoint_mid_epoch(const std::string& file) {
  train_time_pause();
  checkpoint(file);
  t_epoch_ = session_.clock().now_s();  // the epoch's clock runs again from here
}

void BackpropTrainer::checkpoint(const std::string& file) {
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
  for (auto& entry : step_->fp8_state()) c.scaler.push_back(std::move(entry));  // amp-fp8's delayed scales
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

void BackpropTrainer::peak_trace(const char* phase) {
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

Json BackpropTrainer::stop() {
  const Progress& p = *progress_;
  checkpoint();
  // The peak so far (a run stopped mid-epoch has not read this epoch's yet), the samples dropped and the final
  // memory plan with its own steps' peak: judged like the summary's (bench/budget_grid.py's --max-steps runs).
  const double peak_gb = std::max(p.peak_vram_gb, static_cast<double>(peak_now()) / kGB);
  const Json fields{{"reason", stop_reason_},
                    {"epoch", p.epoch},
                    {"epoch_offset", p.epoch_offset},
                    {"peak_vram_gb", peak_gb},
                    {"dropped_samples", p.dropped_samples},
                    {"memory_plan", memory_plan_brief()}};
  session_.profile_end();
  session_.event(event::kStop, p.step, fields);
  session_.printer().line(stop_line(stop_reason_, p.step, config_.output.out));
  return fields;
}

Json BackpropTrainer::summary() {
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
               {"fp8_layers", fp8_linears(config_.execution.precision) ? Json(step_->fp8_layers()) : Json(nullptr)},
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

}  // namespace triaccel
