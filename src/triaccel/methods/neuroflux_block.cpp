#include "triaccel/methods/neuroflux_block.h"

namespace triaccel {
namespace neuroflux {

at::Tensor permutation(int64_t n, uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randperm(n, gen, at::TensorOptions().dtype(at::kLong));
}

const char* beside_pool_reason(int64_t ooms) {
  return ooms > 1 ? "beside the CUDA graph's pool again: eager from here" : "beside the CUDA graph's pool";
}

Json cache_place_or_null(const std::unique_ptr<ActivationCache>& cache) {
  return cache ? Json(cache_place_name(cache->place())) : Json(nullptr);
}

// Data parallel: rank 0's plan on every rank (a measured profile reads each GPU's own allocator, and every rank must

BlockTrainer::BlockTrainer(Session& session, const BlockPlan& bp, size_t b, size_t n_blocks,
                           const std::vector<AuxHead>& heads, const Dataset& train_set, SplitInput& train_in,
                           const LoaderOptions& train_lo, const LoaderOptions& plain_lo, const MemoryProfile& profile,
                           const PartitionOptions& po, int64_t* run_step)
    : session_(session),
      config_(session.config()),
      bp_(bp),
      b_(b),
      n_blocks_(n_blocks),
      heads_(heads),
      train_in_(train_in),
      train_lo_(train_lo),
      plain_lo_(plain_lo),
      profile_(profile),
      po_(po),
      run_step_(run_step),
      n_train_(train_set.size()),
      block_seed_(seed_mix(session.config().execution.seed, kBlockStream + b)),
      graph_([&] {
        // Steps at the planned batch are captured once after the warm-up and replayed (static input buffers), as
        // the trainer's are; a capture refused by an error is retried once in relaxed mode.
        StepGraphOptions g;
        // Data parallel: NCCL's all-reduce is ordered on the stream and captured with the step (Gloo's is not).
        g.enabled = session.device().is_cuda() && session.config().execution.cuda_graphs &&
                    (!session.dist().active() || session.dist().nccl());
        g.batch = bp.batch;
        g.relaxed_retry = true;
        if (g.enabled && session.dist().active()) g.agree_capture = capture_agreement(session.dist());
        return g;
      }()),
      batch_(bp.batch) {
  const c10::Device& device = session_.device();
  torch::manual_seed(block_seed_);
  fixed_bytes_ = static_cast<double>(memory_stats(device).allocated_bytes) + block_own_fixed_bytes(profile, po, bp);
  memory_stats_reset_peak(device);
  retries_before_ = memory_stats(device).alloc_retries;
  r_.alloc_retries_before = retries_before_;
  const Model& model = session_.model();
  const auto& units = model.units();
  const auto n_units = static_cast<int64_t>(units.size());
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (int64_t u = bp.first; u < bp.end; ++u) {
    const Unit& unit = units[static_cast<size_t>(u)];
    for (size_t m = 0; m < unit.modules.size(); ++m) {
      for (const auto& item : unit.modules[m]->named_parameters()) {
        named.emplace_back(c10::str(unit.name, "/", m, ".", item.key()), item.value());
      }
    }
    if (u + 1 < n_units) {
      for (const auto& item : heads_[static_cast<size_t>(u)]->named_parameters()) {
        named.emplace_back(kAuxPrefix + unit.name + "." + item.key(), item.value());
      }
    }
  }
  for (const auto& [name, p] : named) params_.push_back(p);
  Dist& dist = session_.dist();
  if (dist.active()) {  // each rank trains on its share of every step's batch; the gradients are summed as it goes
    buckets_ = std::make_unique<GradBuckets>(params_, grad_buckets_options(config_),
                                             [&dist](const at::Tensor& flat) { return dist.all_reduce_sum_start(flat); });
  }
  sgd_ = std::make_unique<Sgd>(named, sgd_options(config_));
  if (b == 0) {
    LoaderOptions lo = train_lo_;
    lo.batch_size = bp.batch;
    train_aug_ = std::make_unique<Loader>(train_set, session_.data().mean, session_.data().std, lo, device);
  }
  const int64_t steps_per_epoch = (n_train_ + bp.batch - 1) / bp.batch;
  sched_ = schedule_options(config_, steps_per_epoch);
  sched_.base_lr *= lr_scale_for_batch(config_.schedule.lr_batch_rule, bp.batch, config_.schedule.batch_size);
  sched_.validate();
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  lr_ = at::zeros({1}, f32);
  skip_ = at::zeros({1}, f32);
  if (buckets_) {
    step_loss_ = at::zeros({bp.end - bp.first}, f32);
    step_correct_ = at::zeros({bp.end - bp.first}, f32);
    keep_ = at::zeros({1}, f32);
  }
  r_.loss_sum = at::zeros({bp.end - bp.first}, f32);
  r_.correct = at::zeros({bp.end - bp.first}, f32);
  r_.input_place = cache_place_or_null(train_in_.cache);
}

void BlockTrainer::grads_release() { triaccel::grads_release(params_); }

// One training step of the block on (x, y): local losses, one backward, the fused SGD step (lr read on the device).
// Data parallel: this rank's share of the rows, its loss weighted by the share's part of the batch (as the backprop
// step's: one multiply, not a pass over each bucket) and its gradients summed over the ranks during backward (so
// every rank takes one process's step).
// Data parallel: then whether any rank ran out of memory in the step (skip_), which skips the update on every rank and
// keeps the step out of the loss sums.
void BlockTrainer::body(const at::Tensor& x, const at::Tensor& y) {
  phase_ = 0;
  grads_release();
  at::Tensor xs = x, ys = y;
  at::Tensor* loss_sum = &r_.loss_sum;
  at::Tensor* correct = &r_.correct;
  double share = 1.0;
  if (buckets_) {
    const auto [first, count] = session_.dist().share(x.size(0));
    xs = x.narrow(0, first, count);
    ys = y.narrow(0, first, count);
    share = static_cast<double>(count) / static_cast<double>(x.size(0));
    buckets_->arm();
    step_loss_.zero_();
    step_correct_.zero_();
    loss_sum = &step_loss_;
    correct = &step_correct_;
  }
  if (xs.size(0) > 0) {
    at::Tensor loss;
    {
      const AutocastScope autocast(session_.device(), config_.execution.precision);
      loss = neuroflux_block_loss(session_.model(), heads_, bp_.first, bp_.end, xs, ys, config_.optim.label_smoothing,
                                  loss_sum, correct);
    }
    (share != 1.0 ? loss * share : loss).backward();
  }
  if (buckets_) {
    buckets_->finish();  // a rank without rows sends zeros
    phase_ = 1;
    session_.dist().all_reduce_sum(skip_);
    phase_ = 2;
  }
  sgd_->step(lr_, skip_);
  if (buckets_) {
    keep_.copy_(skip_).clamp_max_(1).neg_().add_(1);
    r_.loss_sum.addcmul_(step_loss_, keep_);
    r_.correct.addcmul_(step_correct_, keep_);
  }
}

bool BlockTrainer::step_failed() {
  if (phase_ == 2) return false;  // the update had begun: every rank stops
  skip_.fill_(1);
  if (phase_ == -1 && graph_.captured()) {
    // The other ranks replay their graphs (their steps are all at its batch; the ranks' graphs are alike): so does
    // this rank, on the last step's inputs, its flag set (NCCL: a captured collective is every rank's or none's).
    graph_.replay_as_is();
    return true;
  }
  if (phase_ <= 0) {
    grads_release();  // this rank's part of the sum: zeros (every rank skips the update)
    buckets_->finish();
  }
  session_.dist().all_reduce_sum(skip_);
  return true;
}

bool BlockTrainer::step_retry(const StepOutcome& oom, int64_t count) {
  const bool dist = buckets_ != nullptr;
  // A rank proposes its batch beside the graph's pool and a smaller one otherwise (oom_retry_batch), so the batch
  // the ranks agree on says which.
  const int64_t retry = oom.batch;
  const bool same_batch = retry == batch_;
  if (dist) {  // every rank's update was skipped
    skip_.zero_();
    grads_release();
  }
  TRIACCEL_CHECK_INPUT(dist || retry > 0, "out of memory in NeuroFlux block ", b_, " at batch ", batch_, " with ",
                       bytes_format(fixed_bytes_), " needed at any batch; raise ", option_ref("vram_budget"));
  const int64_t batch = same_batch && !dist ? count : batch_;  // the event's; one process: beside the pool, its samples
  Json fields = oom.own ? oom.own->fields() : Json::object();  // data parallel: rank 0's own reading, when it ran out
  fields.update(Json{{"block", b_}, {"batch", batch}, {"retry_batch", same_batch ? batch : retry}});
  if (dist) fields["ranks"] = oom.ranks;
  if (same_batch) fields["reason"] = beside_pool_reason(beside_pool_ooms_ + 1);
  if (oom.must_stop) {
    recovery_.stop(*run_step_, fields, str_cat(oom.who, " ran out of GPU memory in NeuroFlux block ", b_, " after the "
                   "step's update had begun (the ranks' weights may differ); resume from the last checkpoint with a "
                   "larger ", option_ref("vram_budget"), ": ", option_ref("resume"), " ", config_.output.out));
  }
  if (retry <= 0) {
    const int world = session_.dist().world_size();
    recovery_.stop(*run_step_, fields, str_cat(oom.who, " ran out of GPU memory in NeuroFlux block ", b_, " at batch ",
                   batch_, " (", (batch_ + world - 1) / world, " per rank) and no smaller batch fits; resume from the "
                   "last checkpoint with a larger ", option_ref("vram_budget"), " or on more GPUs: ",
                   option_ref("resume"), " ", config_.output.out, " ", option_ref("nproc"), " N"));
  }
  session_.event(event::kOom, *run_step_, fields);
  // Every rank's graph as the rank that ran out left its own (NCCL: a captured collective is every rank's or none's).
  // A smaller batch steps eagerly. Beside the captured graph's pool the graph goes and the same samples run again at
  // the same batch: the first time the graph is captured again after the warm-up, the second time the block stays
  // eager (a graph captured again tends only to run out of memory again: without the limit a block captures and
  // drops its graph every few steps).
  if (!same_batch) {
    graph_.refuse();
    batch_ = retry;
  } else {
    graph_.drop();
    if (++beside_pool_ooms_ > 1) graph_.refuse();
  }
  memory_cache_release(session_.device());
  return false;
}

Json BlockTrainer::progress() const {
  return Json{{"block", b_},         {"epoch", epoch_},          {"offset", offset_},
              {"batch", batch_},     {"steps", r_.steps},        {"short_steps", r_.short_steps},
              {"epoch_times", epoch_times_},
              {"epoch_s", epoch_before_s_ + (session_.clock().now_s() - t_epoch_)}};
}

NamedTensors BlockTrainer::state() const {
  NamedTensors out = sgd_->state_tensors();
  at::Tensor loss_sum = r_.loss_sum, correct = r_.correct;
  if (buckets_) {
    loss_sum = loss_sum.clone();
    correct = correct.clone();
    session_.dist().all_reduce_sum(loss_sum);
    session_.dist().all_reduce_sum(correct);
  }
  out.emplace_back(std::string(kBlockSums) + "loss_sum", loss_sum);
  out.emplace_back(std::string(kBlockSums) + "correct", correct);
  return out;
}

void BlockTrainer::resume(const Json& progress, const NamedTensors& state, const std::string& path) {
  try {
    TRIACCEL_CHECK_INPUT(progress.at("block").get<size_t>() == b_, "checkpoint ", path, " holds block ",
                         progress.at("block").get<size_t>(), " in progress, not block ", b_);
    epoch_ = progress.at("epoch").get<int64_t>();
    offset_ = progress.at("offset").get<int64_t>();
    batch_ = progress.at("batch").get<int64_t>();
    r_.steps = progress.at("steps").get<int64_t>();
    r_.short_steps = progress.at("short_steps").get<int64_t>();
    epoch_times_ = progress.at("epoch_times").get<std::vector<double>>();
    epoch_before_s_ = progress.at("epoch_s").get<double>();
  } catch (const Json::exception&) {
    throw UserError("checkpoint " + path + " has an unreadable NeuroFlux block record");
  }
  TRIACCEL_CHECK_INPUT(epoch_ >= 0 && epoch_ < config_.schedule.epochs && offset_ >= 0 && offset_ <= n_train_ &&
                           batch_ > 0 && batch_ <= bp_.batch,
                       "checkpoint ", path, " has a NeuroFlux block position outside this run's plan");
  NamedTensors momenta, sums;
  for (const auto& entry : state) (entry.first.rfind(kBlockSums, 0) == 0 ? sums : momenta).push_back(entry);
  sgd_->state_load(momenta, path);
  named_tensors_load({{std::string(kBlockSums) + "loss_sum", r_.loss_sum},
                      {std::string(kBlockSums) + "correct", r_.correct}},
                     sums, "NeuroFlux block", path);
  if (session_.dist().rank() != 0) {  // the sums over every rank: rank 0's to continue from
    r_.loss_sum.zero_();
    r_.correct.zero_();
  }
  if (batch_ < bp_.batch) graph_.refuse();  // an out-of-memory retry had left the planned batch
}

BlockResult BlockTrainer::train() {
  // The input cache's transfers while the block trains: its counters now, subtracted when it has trained.
  const ActivationCache::IoStats before = train_in_.cache ? train_in_.cache->io_stats() : ActivationCache::IoStats{};
  for (; epoch_ < config_.schedule.epochs; ++epoch_) {
    epoch(epoch_);
    if (r_.stopped) return r_;
    offset_ = 0;
    epoch_before_s_ = 0;
  }
  train_aug_.reset();
  if (buckets_) {  // the last epoch's sums over every rank's shares
    session_.dist().all_reduce_sum(r_.loss_sum);
    session_.dist().all_reduce_sum(r_.correct);
  }
  r_.train_s = std::accumulate(epoch_times_.begin(), epoch_times_.end(), 0.0);
  if (train_in_.cache) r_.train_io = train_in_.cache->io_stats() - before;
  r_.final_batch = batch_;
  r_.train_peak_gb = static_cast<double>(memory_stats(session_.device()).peak_allocated_bytes) / kGB;
  r_.cuda_graph = graph_.captured();
  r_.capture_ooms = graph_.capture_ooms();
  r_.capture_error = graph_.capture_error();
  r_.relaxed = graph_.relaxed();
  // The graph's pool goes back before the cache pass, which needs the room (under a tight budget the pass runs out
  // of memory beside it). The block's gradients were allocated in the graph's pool: while they live, its segments
  // cannot be freed, and the finished blocks' pools, held together, leave a later pass no room even at its smallest
  // batch (measured: docs/results/neuroflux.md).
  grads_release();
  graph_.drop();
  memory_cache_release(session_.device());
  return r_;
}

// The epoch's short last batch is filled up to the planned batch with the epoch's first samples (they train twice
// that epoch, and count twice in the local loss and accuracy): every step has one shape, so it replays the graph,
// and cuDNN builds plans for no second shape (on EfficientNet-B0 that building cost seconds per block;
// docs/neuroflux.md). Only after an out-of-memory retry (a batch below the planned one) do steps run eagerly with a
// short last batch.
void BlockTrainer::epoch(int64_t e) {
  const c10::Device& device = session_.device();
  const uint64_t epoch_seed = seed_mix(block_seed_, static_cast<uint64_t>(e));
  at::Tensor order, order_dev, flip;
  if (train_aug_) {
    train_aug_->epoch_begin(e);
  } else {
    order = permutation(n_train_, epoch_seed);
    order_dev = order.to(device);  // once per epoch: a per-step copy of the index would wait for the GPU
    if (train_lo_.augment && train_in_.cache && profile_.units[static_cast<size_t>(bp_.first)].in_shape.size() == 3) {
      // Cached feature maps get the horizontal flip (crops do not survive the cache; docs/neuroflux.md).
      at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed_mix(epoch_seed, 1));
      flip = at::rand({n_train_}, gen).lt(0.5).to(device);
    }
  }
  if (offset_ == 0) {  // a resumed epoch keeps its sums
    r_.loss_sum.zero_();
    r_.correct.zero_();
  }
  device_synchronize(device);
  t_epoch_ = session_.clock().now_s();
  while (offset_ < n_train_) {
    const int64_t count = std::min(batch_, n_train_ - offset_);
    const int64_t fill = epoch_fill(offset_, count, n_train_, batch_, bp_.batch);
    session_.profile_step(*run_step_);
    if (!step_at(e, offset_, count, fill, order, order_dev, flip)) continue;
    offset_ += count;
    ++r_.steps;
    ++*run_step_;
    if (session_.hooks().after_step) session_.hooks().after_step(*run_step_);
    if (after_step_ && after_step_(*this)) {
      r_.stopped = true;
      return;
    }
  }
  device_synchronize(device);
  epoch_times_.push_back(epoch_before_s_ + (session_.clock().now_s() - t_epoch_));
  at::Tensor loss_sum = r_.loss_sum;
  if (buckets_) {
    loss_sum = loss_sum.clone();
    session_.dist().all_reduce_sum(loss_sum);
  }
  session_.printer().line(c10::str(
      "block ", b_ + 1, "/", n_blocks_, " epoch ", e + 1, "/", config_.schedule.epochs, ": local loss ",
      loss_sum[bp_.end - bp_.first - 1].item<double>() / static_cast<double>(n_train_), ", ", epoch_times_.back(),
      " s, ", memory_stats(device).alloc_retries - retries_before_, " allocator retries"));
}

bool BlockTrainer::step_at(int64_t e, int64_t offset, int64_t count, int64_t fill, const at::Tensor& order,
                           const at::Tensor& order_dev, const at::Tensor& flip) {
  // The schedule follows the data position (on the planned batch's step grid), the lr the batch actually used.
  const int64_t position = (e * n_train_ + offset) / bp_.batch;
  lr_.fill_(schedule_lr(sched_, position) * lr_scale_for_batch(config_.schedule.lr_batch_rule, batch_, bp_.batch));
  at::Tensor x, y;
  phase_ = -1;
  RecoverableStep step;
  step.body = [&] {
    if (session_.hooks().before_step) session_.hooks().before_step(*run_step_, count + fill);
    if (train_aug_) {
      std::tie(x, y) = train_aug_->batch(offset, count);
      if (fill > 0) {
        const auto [x0, y0] = train_aug_->batch(0, fill);
        x = at::cat({x, x0});
        y = at::cat({y, y0});
      }
    } else {
      const auto rows_of = [&](const at::Tensor& idx) {
        return fill > 0 ? at::cat({idx.narrow(0, offset, count), idx.narrow(0, 0, fill)}) : idx.narrow(0, offset, count);
      };
      const at::Tensor index_dev = rows_of(order_dev);
      const bool host = train_in_.cache->place() == CachePlace::kHost;
      x = SplitInput::layout(train_in_.cache->read(host ? rows_of(order) : index_dev),
                             plain_lo_.channels_last);  // (count + fill, C, H, W) float32
      y = train_in_.labels.index_select(0, index_dev);
      if (flip.defined()) x = at::where(flip.index_select(0, index_dev).view({-1, 1, 1, 1}), x.flip({3}), x);
    }
    {
      TRIACCEL_PROFILE_RANGE("triaccel::step");
      graph_.run([this](const at::Tensor& xb, const at::Tensor& yb) { body(xb, yb); }, x, y);
    }
    phase_ = 2;  // a replay made every collective
    if (count + fill < bp_.batch) ++r_.short_steps;
  };
  step.failure = [&] {
    x = at::Tensor();
    y = at::Tensor();
    // A step's input or an eager step (the epoch's short last batch) beside the graph's pool: the same batch again
    // (step_retry). Otherwise the plan was off (fragmentation, workspaces): the batch re-planned with the per-sample
    // bytes the failure shows (oom_retry_batch), not a cascade of halvings.
    const bool beside_pool = graph_.captured();
    return StepFailure{beside_pool, beside_pool ? batch_ : oom_retry_batch(batch_, fixed_bytes_, po_)};
  };
  step.failed_collectives = [this] { return step_failed(); };
  const StepOutcome outcome = recovery_.run(*run_step_ + 1, step);
  return outcome.out_of_memory ? step_retry(outcome, count) : true;
}

}  // namespace neuroflux
}  // namespace triaccel
