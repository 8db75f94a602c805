// The NeuroFlux runner; see neuroflux.h and docs/neuroflux.md.
// Invariants: every unit trains on a detached input, so no gradient crosses a unit boundary; block b reads its
// training input only from the loader (b = 0) or the cache written by block b-1, never by running earlier blocks;
// every random choice (held-out split, head initialization, per-block data order and flips) is a pure function of
// (seed, block, epoch), so a run resumed at a block boundary ends with the same weights as an uninterrupted one.
// A checkpoint inside a block (a stop request, checkpoint_every, checkpoint_minutes) also holds the block's position
// (epoch, offset, batch), its SGD momenta, its running local-loss sums and the generators: resumed there, the block
// continues with the next step as if it had not stopped.
#include "triaccel/methods/neuroflux.h"

#include "triaccel/methods/neuroflux_run.h"
#include "triaccel/run/block_memory_setup.h"

namespace triaccel {
namespace neuroflux {
namespace {

constexpr uint64_t kHoldoutStream = 0x4e46486f6c64ULL;  // independent seed streams (seed_mix)
constexpr uint64_t kHeadStream = 0x4e4648656164ULL;

Dataset dataset_rows(const Dataset& d, const at::Tensor& index) {
  Dataset out;
  out.name = d.name;
  out.images = d.images.index_select(0, index).contiguous();
  out.labels = d.labels.index_select(0, index).contiguous();
  out.num_classes = d.num_classes;
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> head_state(const std::vector<AuxHead>& heads, const Model& model,
                                                           const std::string& prefix_of_unit) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (size_t u = 0; u < heads.size(); ++u) {
    const std::string prefix = prefix_of_unit + model.units()[u].name + ".";
    for (const auto& item : heads[u]->named_parameters()) out.emplace_back(prefix + item.key(), item.value());
    for (const auto& item : heads[u]->named_buffers()) out.emplace_back(prefix + item.key(), item.value());
  }
  return out;
}

Json format_plan_to_json(const Partition& plan) {
  Json blocks = Json::array();
  for (const auto& b : plan.blocks) {
    blocks.push_back(Json{{"first", b.first}, {"end", b.end}, {"batch", b.batch}, {"head_level", b.head_level},
                          {"bytes", b.bytes}, {"time_s", b.time_s}});
  }
  return Json{{"blocks", blocks}, {"time_s", plan.time_s}};
}

Partition plan_from_json(const Json& j, int64_t units, const std::string& path) {
  Partition p;
  try {
    p.time_s = j.at("time_s").get<double>();
    for (const auto& b : j.at("blocks")) {
      BlockPlan bp;
      bp.first = b.at("first").get<int64_t>();
      bp.end = b.at("end").get<int64_t>();
      bp.batch = b.at("batch").get<int64_t>();
      bp.head_level = b.at("head_level").get<int64_t>();
      bp.bytes = b.at("bytes").get<double>();
      bp.time_s = b.at("time_s").get<double>();
      p.blocks.push_back(bp);
    }
  } catch (const Json::exception&) {
    throw UserError("checkpoint " + path + " has an unreadable NeuroFlux plan");
  }
  TRIACCEL_CHECK_INPUT(!p.blocks.empty() && p.blocks.back().end == units, "checkpoint ", path,
                       " holds a NeuroFlux plan for another model");
  return p;
}

// The parameters and buffers of units [first, end) of `model` and of their aux heads.
void block_tensors(const Model& model, const std::vector<AuxHead>& heads, int64_t first, int64_t end,
                   std::vector<at::Tensor>* params, std::vector<at::Tensor>* buffers) {
  const auto add = [&](const torch::nn::Module& m) {
    if (params) for (const auto& t : m.parameters()) params->push_back(t);
    if (buffers) for (const auto& t : m.buffers()) buffers->push_back(t);
  };
  const auto n_units = static_cast<int64_t>(model.units().size());
  for (int64_t u = first; u < end; ++u) {
    for (const auto& m : model.units()[static_cast<size_t>(u)].modules) add(*m);
    if (u + 1 < n_units) add(*heads[static_cast<size_t>(u)]);
  }
}

// train the same blocks at the same batches).
Partition plan_agree(Dist& dist, const Partition& plan) {
  if (!dist.active()) return plan;
  const auto n = static_cast<size_t>(dist.rank0_values({static_cast<double>(plan.blocks.size())})[0]);
  std::vector<double> flat(1 + 6 * n, 0.0);
  if (plan.blocks.size() == n) {
    flat[0] = plan.time_s;
    for (size_t b = 0; b < n; ++b) {
      const BlockPlan& bp = plan.blocks[b];
      const double v[6] = {static_cast<double>(bp.first), static_cast<double>(bp.end), static_cast<double>(bp.batch),
                           static_cast<double>(bp.head_level), bp.bytes, bp.time_s};
      std::copy(v, v + 6, flat.begin() + static_cast<long>(1 + 6 * b));
    }
  }
  flat = dist.rank0_values(std::move(flat));
  Partition out;
  out.time_s = flat[0];
  for (size_t b = 0; b < n; ++b) {
    const double* v = flat.data() + 1 + 6 * b;
    BlockPlan bp;
    bp.first = static_cast<int64_t>(v[0]);
    bp.end = static_cast<int64_t>(v[1]);
    bp.batch = static_cast<int64_t>(v[2]);
    bp.head_level = static_cast<int64_t>(v[3]);
    bp.bytes = v[4];
    bp.time_s = v[5];
    out.blocks.push_back(bp);
  }
  return out;
}

Json io_json(const ActivationCache::IoStats& a) {
  return Json{{"host_copy_s", a.host_copy_s}, {"wait_s", a.wait_s},
              {"gb_to_device", static_cast<double>(a.bytes_to_device) / kGB},
              {"gb_to_host", static_cast<double>(a.bytes_to_host) / kGB}};
}

}  // namespace

NeuroFluxRun::NeuroFluxRun(Session& session)
    : session_(session),
      config_(session.config()),
      device_(session.device()),
      model_(session.model()),
      units_(session.model().units()),
      n_units_(static_cast<int64_t>(session.model().units().size())) {
  const auto& ckpt = session_.checkpoint();
  TRIACCEL_CHECK_INPUT(!ckpt || ckpt->progress.contains("neuroflux"), "checkpoint ", session_.checkpoint_file(),
                       " is not a NeuroFlux checkpoint");
  hold_acc_.assign(static_cast<size_t>(n_units_), 0);
  test_acc_.assign(static_cast<size_t>(n_units_), 0);
  // Before the first cuBLAS call (the profile's heads): every block holds the workspace.
  if (device_.is_cuda() && config_.execution.vram_budget_bytes() > 0) cublas_workspace_small();
  data_split();
  plan_make();
  heads_make();
  restore();
  events_open();
  if (device_.is_cuda() && explicit_budget_) {
    memory_cache_release(device_);  // the profile's cached blocks, before the cap counts them
    session_.memory_cap(config_.execution.vram_budget_bytes());
  }
  memory_stats_reset_peak(device_);
  host_prefill();
}

void NeuroFluxRun::data_split() {
  const DatasetSplits& data = session_.data();
  const int64_t n_all = data.train.size();
  // Under a tight vram_budget the images stay in pinned host memory and stream a batch at a time (data/loader.h):
  // resident, more than kNeuroFluxHostDataShare of the budget would go to them, and their upload can run out of memory
  // before the first step. Streamed: labels and the order stay, plus two uint8 staging batches of the largest block
  // batch (control/memory/partitioner.h: neuroflux_data, which method auto's preview reads too).
  const int64_t sample_elements = data.train.images.numel() / std::max<int64_t>(1, n_all);
  const NeuroFluxData kept = neuroflux_data(n_all, data.test.size(), sample_elements, config_.neuroflux.nf_holdout,
                                            config_.neuroflux.nf_max_batch,
                                            static_cast<double>(config_.execution.vram_budget_bytes()),
                                            device_.is_cuda());
  n_hold_ = kept.holdout;
  const at::Tensor split = permutation(n_all, seed_mix(config_.execution.seed, kHoldoutStream));
  train_set_ = dataset_rows(data.train, std::get<0>(split.narrow(0, n_hold_, n_all - n_hold_).sort()));
  hold_set_ = dataset_rows(data.train, std::get<0>(split.narrow(0, 0, n_hold_).sort()));
  plain_lo_ = session_.loader_options(LoaderRole::kPlain);
  train_lo_ = session_.loader_options(LoaderRole::kTrain);
  host_data_ = kept.host;
  if (host_data_) plain_lo_.placement = train_lo_.placement = DataPlacement::kHost;
  const auto make_input = [&](const Dataset& d) {
    SplitInput in;
    in.loader = std::make_unique<Loader>(d, data.mean, data.std, plain_lo_, device_);
    in.loader->epoch_begin(0);
    in.labels = d.labels.to(device_);
    return in;
  };
  hold_in_ = make_input(hold_set_);
  test_in_ = make_input(data.test);
  train_in_.labels = train_set_.labels.to(device_);
  n_train_ = train_set_.size();
  sample_shape_ = {data.train.channels(), test_in_.loader->image_height(), test_in_.loader->image_width()};
  resident_ = kept.resident_bytes();
}

void NeuroFluxRun::plan_make() {
  TRIACCEL_CHECK_INPUT(config_.neuroflux.nf_profile != ProfileChoice::kMeasured || device_.is_cuda(),
                       option_ref("nf_profile"), " measured needs a CUDA device; use model (or auto) on the CPU");
  source_ = device_.is_cuda() && config_.neuroflux.nf_profile != ProfileChoice::kModel ? ProfileSource::kMeasured
                                                                                       : ProfileSource::kModel;
  const double t_profile = session_.clock().now_s();
  {  // under the run's precision: bf16 activations take half the bytes
    const AutocastScope autocast(device_, config_.execution.precision);
    profile_ = memory_profile(model_, sample_shape_, session_.model_options().num_classes, source_, device_);
  }
  profile_s_ = session_.clock().now_s() - t_profile;
  const BlockMemorySetup memory = block_memory_setup(config_, device_.is_cuda(), profile_, resident_, n_train_);
  explicit_budget_ = memory.explicit_budget;
  budget_ = memory.budget_bytes;
  po_ = memory.options;
  backprop_batch_ = memory.backprop_batch;
  const auto& ckpt = session_.checkpoint();
  plan_ = ckpt ? plan_from_json(ckpt->progress.at("plan"), n_units_, session_.checkpoint_file())
               : plan_agree(session_.dist(), partition_plan(profile_, po_));
}

void NeuroFluxRun::heads_make() {
  // One aux head per unit but the last (the classifier is its own exit), at its block's ladder level.
  std::vector<int64_t> block_of(static_cast<size_t>(n_units_), 0);
  for (size_t b = 0; b < plan_.blocks.size(); ++b) {
    for (int64_t u = plan_.blocks[b].first; u < plan_.blocks[b].end; ++u) {
      block_of[static_cast<size_t>(u)] = static_cast<int64_t>(b);
    }
  }
  std::unique_lock<std::mutex> lock(model_build_mutex());  // released before the broadcast below
  torch::manual_seed(seed_mix(config_.execution.seed, kHeadStream));
  for (int64_t u = 0; u + 1 < n_units_; ++u) {
    const UnitProfile& up = profile_.units[static_cast<size_t>(u)];
    const int64_t level = plan_.blocks[static_cast<size_t>(block_of[static_cast<size_t>(u)])].head_level;
    AuxHead head(up.out_shape, aux_filters(up.out_shape[0], level), session_.model_options().num_classes);
    head->to(device_);
    head->train();
    session_.layout_params(*head);
    heads_.push_back(head);
  }
  lock.unlock();
  std::vector<const torch::nn::Module*> heads;  // every rank starts from rank 0's heads, as from its model
  for (const auto& h : heads_) heads.push_back(h.get());
  module_state_broadcast(session_.dist(), heads);
}

NamedTensors NeuroFluxRun::live_state() const {
  NamedTensors state = model_state(model_);
  for (auto& entry : head_state(heads_, model_, kAuxPrefix)) state.push_back(entry);
  return state;
}

at::Tensor NeuroFluxRun::logits_of(int64_t u, const at::Tensor& h) {
  return u + 1 < n_units_ ? heads_[static_cast<size_t>(u)]->forward(h) : h;
}

void NeuroFluxRun::restore() {
  const auto& ckpt = session_.checkpoint();
  if (!ckpt) return;
  named_tensors_load(live_state(), ckpt->model, "model", session_.checkpoint_file());
  try {
    const Json& p = ckpt->progress;
    blocks_done_ = p.at("blocks_done").get<int64_t>();
    step_ = p.at("step").get<int64_t>();
    peak_gb_ = p.at("peak_vram_gb").get<double>();
    block_seconds_ = p.at("block_seconds").get<std::vector<double>>();
    block_resume_ = p.value("block_in_progress", Json(nullptr));
  } catch (const Json::exception&) {
    throw UserError("checkpoint " + session_.checkpoint_file() + " has an unreadable NeuroFlux progress record");
  }
}

void NeuroFluxRun::events_open() {
  session_.events_open(Json{{"train_samples", n_train_},
                            {"holdout_samples", n_hold_},
                            {"test_samples", session_.data().test.size()},
                            {"augment", train_lo_.augment}});
  Json blocks = Json::array();
  for (const auto& b : plan_.blocks) {
    Json names = Json::array(), filters = Json::array();
    for (int64_t u = b.first; u < b.end; ++u) {
      names.push_back(units_[static_cast<size_t>(u)].name);
      if (u + 1 < n_units_) filters.push_back(heads_[static_cast<size_t>(u)]->filters());
    }
    blocks.push_back(Json{{"units", names}, {"batch", b.batch}, {"head_level", b.head_level},
                          {"head_filters", filters}, {"predicted_gb", b.bytes / kGB}, {"predicted_s", b.time_s}});
  }
  Json unit_profiles = Json::array();
  for (const auto& up : profile_.units) {
    unit_profiles.push_back(Json{{"unit", up.name}, {"params", up.params}, {"out_shape", up.out_shape},
                                 {"train_fixed_bytes", up.train.fixed_bytes},
                                 {"train_bytes_per_sample", up.train.per_sample_bytes}});
  }
  session_.event(event::kBlockPlan, step_,
                 Json{{"method", "neuroflux"}, {"budget_gb", budget_ / kGB},
                      {"budget_from", explicit_budget_ ? "vram_budget" : "backprop at batch_size"},
                      {"profile", source_ == ProfileSource::kMeasured ? "measured" : "model"},
                      {"profile_s", profile_s_}, {"resident_gb", resident_ / kGB},
                      {"data_placement", host_data_ ? "host" : "device"}, {"blocks", blocks},
                      {"predicted_s", plan_.time_s}, {"backprop_max_batch", backprop_batch_},
                      {"backprop_gb_at_batch", profile_.backprop_bytes(config_.schedule.batch_size) / kGB},
                      {"units", unit_profiles}});
  session_.printer().line(c10::str("triaccel: neuroflux ", config_.model.model, " on ", config_.data.dataset, " (",
                                   n_train_, " train / ", n_hold_, " held out / ", session_.data().test.size(),
                                   " test), ", plan_.blocks.size(), " blocks, budget ", budget_ / kGB, " GB, ",
                                   device_long_name(device_),
                                   session_.dist().active()
                                       ? c10::str(", ", session_.dist().world_size(), " processes")
                                       : std::string()));
}

void NeuroFluxRun::host_prefill() {
  // The first two cache passes' host caches are faulted in on background threads while block 0 trains (a cache
  // whose splits together exceed the budget cannot go to the GPU; ActivationCache::host_pool_prefill).
  if (!(device_.is_cuda() && blocks_done_ == 0 && plan_.blocks.size() > 1)) return;
  std::vector<int64_t> numels;
  const int64_t n_test = session_.data().test.size();
  for (size_t b = 0; b < std::min<size_t>(2, plan_.blocks.size() - 1); ++b) {
    const std::vector<int64_t>& shape = profile_.units[static_cast<size_t>(plan_.blocks[b].end - 1)].out_shape;
    if (static_cast<double>(ActivationCache::bytes_for(n_train_ + n_hold_ + n_test, shape)) <= budget_) continue;
    for (const int64_t n : {n_hold_, n_test, n_train_}) numels.push_back(ActivationCache::bytes_for(n, shape) / 2);
  }
  if (!numels.empty()) ActivationCache::host_pool_prefill(numels);
}

Json NeuroFluxRun::run() {
  // A run resumed after block k rebuilds the caches by one forward pass through blocks [0, k).
  CachePlace place = CachePlace::kHost;
  for (size_t b = 0; b < static_cast<size_t>(blocks_done_); ++b) cache_pass(b, &place);
  for (size_t b = static_cast<size_t>(blocks_done_); b < plan_.blocks.size(); ++b) {
    const BlockResult r = block_train(b);
    if (r.stopped) return stop(stop_reason_, static_cast<int64_t>(b));
    block_end(b, r);
    if (b + 1 == plan_.blocks.size()) break;
    // A request that came during the block's cache pass stops here, after the block-boundary checkpoint.
    if (const StopRequest s = session_.stop_agreed().first; s != StopRequest::kNone) return stop(stop_reason(s), -1);
    if (config_.schedule.max_steps > 0 && step_ >= config_.schedule.max_steps) return stop("max_steps", -1);
  }
  return summary(exits_export());
}

Json NeuroFluxRun::stop(const std::string& reason, int64_t block_in_progress) {
  Json fields{{"reason", reason}, {"blocks_done", blocks_done_}};
  if (block_in_progress >= 0) fields["block_in_progress"] = block_in_progress;
  session_.profile_end();
  session_.event(event::kStop, step_, fields);
  const std::string where = block_in_progress >= 0 ? str_cat("in block ", block_in_progress + 1)
                                                   : str_cat("after block ", blocks_done_);
  session_.printer().line(stop_line(reason, step_, config_.output.out, where));
  return fields;
}

BlockResult NeuroFluxRun::block_train(size_t b) {
  // The block's batch re-planned from what is allocated now (the modelled base and other weights replaced by the
  // reading), then from one measured step of the block at that batch (block_replan_measured). A resumed block keeps
  // its checkpoint's plan.
  Json replan, calibration;
  double calibrate_s = 0;
  if (block_resume_.is_null() && device_.is_cuda()) {
    const double t0 = session_.clock().now_s();
    const BlockPlan planned = plan_.blocks[b];
    Dist& dist = session_.dist();
    // Held: what is allocated now and, with several ranks, the gradient buckets the block's trainer will allocate
    // (uncounted, they put data-parallel blocks above their predictions; measured: docs/results/neuroflux.md).
    double held = static_cast<double>(memory_stats(device_).allocated_bytes);
    if (dist.active()) {
      std::vector<at::Tensor> params;
      block_tensors(model_, heads_, planned.first, planned.end, &params, nullptr);
      int64_t n = 0;
      for (const auto& p : params) n += p.numel();
      held += static_cast<double>(grad_buckets_bytes(n, grad_buckets_options(config_)));
    }
    BlockPlan now = block_replan_for_held(profile_, po_, planned, held);
    now.batch = std::max(now.batch, po_.min_batch);  // none fits: the first step's error names the budget
    // The probe at the batch that fits by the model; where it runs out of memory, at half as many rows.
    const std::vector<int64_t>& in_shape = profile_.units[static_cast<size_t>(planned.first)].in_shape;
    for (int64_t batch = now.batch; batch >= po_.min_batch; batch /= 2) {
      const int64_t rows = dist.share(batch).second;
      const double body = rows > 0 ? neuroflux_block_step_bytes(model_, heads_, planned.first, planned.end, in_shape,
                                                                rows, plain_lo_.channels_last,
                                                                config_.execution.precision,
                                                                config_.optim.label_smoothing, device_, &peak_gb_)
                                   : -1;
      if (body < 0) continue;
      const BlockPlan measured = block_replan_measured(profile_, po_, now, held, body, rows, dist.world_size());
      calibration = Json{{"rows", rows}, {"body_gb", body / kGB}, {"modelled_gb", now.bytes / kGB},
                         {"batch", measured.batch}};
      if (measured.batch > 0) now = measured;
      break;
    }
    calibrate_s = session_.clock().now_s() - t0;  // the probe's cuDNN plans serve the block's steps: its time counts
    if (!calibration.is_null()) calibration["s"] = calibrate_s;
    // Data parallel: the batch that fits every rank (each reads its own allocator).
    if (dist.active()) now.batch = static_cast<int64_t>(-dist.all_reduce_max({-static_cast<double>(now.batch)})[0]);
    if (now.batch != planned.batch || !calibration.is_null()) {
      replan = Json{{"planned_batch", planned.batch}, {"planned_gb", planned.bytes / kGB}, {"held_gb", held / kGB}};
      plan_.blocks[b] = now;
    }
  }
  BlockTrainer trainer(session_, plan_.blocks[b], b, plan_.blocks.size(), heads_, train_set_, train_in_, train_lo_,
                       plain_lo_, profile_, po_, &step_);
  if (!block_resume_.is_null()) {
    trainer.resume(block_resume_, session_.checkpoint()->optimizer, session_.checkpoint_file());
    rng_restore(session_.checkpoint()->rng, device_);
    block_resume_ = Json(nullptr);
  }
  trainer.on_step([this](const BlockTrainer& t) { return block_step_done(t); });
  BlockResult r = trainer.train();
  r.replan = replan;
  r.calibration = calibration;
  r.train_s += calibrate_s;
  if (!r.stopped) buffers_agree(b);
  return r;
}

void NeuroFluxRun::buffers_agree(size_t b) {
  Dist& dist = session_.dist();
  if (!dist.active()) return;
  std::vector<at::Tensor> buffers;
  block_tensors(model_, heads_, plan_.blocks[b].first, plan_.blocks[b].end, nullptr, &buffers);
  const torch::NoGradGuard no_grad;
  dist.broadcast(buffers);
}

bool NeuroFluxRun::block_step_done(const BlockTrainer& trainer) {
  // Data parallel: agreed with the step (every rank stops at the same step).
  const auto [stop, due] = trainer.agreed() ? *trainer.agreed() : session_.stop_agreed(step_);
  if (stop != StopRequest::kNone) {
    stop_reason_ = stop_reason(stop);
    checkpoint(&trainer);
    return true;
  }
  if (due) checkpoint(&trainer);
  return false;
}

// The checkpoint: every unit's and head's weights, the plan and the progress; inside a block (in_block) also the
// block's position, momenta, loss sums and the generators' states.
void NeuroFluxRun::checkpoint(const BlockTrainer* in_block) {
  // Every rank comes here at the same step (the block's sums are summed over the ranks); rank 0 writes.
  NamedTensors block_state;
  if (in_block) block_state = in_block->state();
  if (!session_.writer()) {
    session_.checkpoint_written();
    return;
  }
  Checkpoint c;
  c.config = config_.to_json();
  c.model_arch = config_.model.model;
  c.model = live_state();
  c.rng = rng_state(device_);
  c.progress = Json{{"neuroflux", true}, {"blocks_done", blocks_done_}, {"step", step_},
                    {"elapsed_s", session_.now()}, {"peak_vram_gb", peak_gb_}, {"block_seconds", block_seconds_},
                    {"plan", format_plan_to_json(plan_)}};
  if (in_block) {
    c.progress["block_in_progress"] = in_block->progress();
    c.optimizer = std::move(block_state);
  }
  const std::string path = session_.out_file(kCheckpointFile);
  checkpoint_write(path, c);
  session_.checkpoint_written();
  Json fields{{"path", path}, {"blocks_done", blocks_done_}};
  if (in_block) fields["block_in_progress"] = c.progress["block_in_progress"];
  session_.event(event::kCheckpoint, step_, fields);
}

void NeuroFluxRun::block_end(size_t b, const BlockResult& r) {
  const BlockPlan& bp = plan_.blocks[b];
  CachePlace place = CachePlace::kHost;
  const double cache_s = cache_pass(b, &place);
  const MemoryStats mem = memory_stats(device_);
  const double block_peak_gb = static_cast<double>(mem.peak_allocated_bytes) / kGB;
  peak_gb_ = std::max(peak_gb_, block_peak_gb);
  Dist& dist = session_.dist();
  std::vector<double> rank_peaks(static_cast<size_t>(dist.world_size()), 0.0);  // rank r in slot r
  rank_peaks[static_cast<size_t>(dist.rank())] = block_peak_gb;
  rank_peaks = dist.all_reduce_sum(std::move(rank_peaks));
  block_seconds_.push_back(r.train_s + cache_s);
  Json names = Json::array(), local = Json::array();
  const at::Tensor loss_cpu = r.loss_sum.cpu(), correct_cpu = r.correct.cpu();
  const auto n = static_cast<double>(n_train_);
  for (int64_t u = bp.first; u < bp.end; ++u) {
    const auto i = static_cast<size_t>(u);
    names.push_back(units_[i].name);
    local.push_back(Json{{"unit", units_[i].name},
                         {"train_loss", loss_cpu[u - bp.first].item<double>() / n},
                         {"train_acc", 100.0 * correct_cpu[u - bp.first].item<double>() / n},
                         {"holdout_acc", hold_acc_[i]},
                         {"test_acc", test_acc_[i]}});
  }
  const bool last = b + 1 == plan_.blocks.size();
  session_.event(
      event::kBlock, step_,
      Json{{"block", b}, {"units", names}, {"batch", bp.batch}, {"final_batch", r.final_batch},
           {"head_level", bp.head_level}, {"epochs", config_.schedule.epochs}, {"steps", r.steps},
           {"short_steps", r.short_steps}, {"train_s", r.train_s},
           {"epoch_s", r.train_s / static_cast<double>(config_.schedule.epochs)}, {"cache_s", cache_s},
           {"input", b == 0 ? "data" : "cache"},
           {"input_cache_place", r.input_place},
           {"output_cache_place", last ? Json(nullptr) : Json(cache_place_name(place))},
           {"peak_vram_gb", block_peak_gb}, {"predicted_gb", bp.bytes / kGB},
           {"rank_peak_vram_gb", dist.active() ? Json(rank_peaks) : Json(nullptr)},
           {"alloc_retries", mem.alloc_retries - r.alloc_retries_before}, {"cuda_graph", r.cuda_graph},
           {"graph_capture_ooms", r.capture_ooms},
           {"graph_capture_error", r.capture_error.empty() ? Json(nullptr) : Json(r.capture_error)},
           {"graph_capture_mode", r.relaxed ? "relaxed" : "global"}, {"train_io", io_json(r.train_io)},
           {"train_peak_gb", r.train_peak_gb}, {"cache_io", io_json(pass_io_)}, {"replan", r.replan},
           {"calibration", r.calibration}, {"pass_batch", pass_batch_},
           {"pass_rows", pass_rows_}, {"local", local}});
  blocks_done_ = static_cast<int64_t>(b) + 1;
  checkpoint(nullptr);  // at the block boundary
}

}  // namespace neuroflux

using neuroflux::block_tensors;
using neuroflux::SplitInput;

at::Tensor neuroflux_block_loss(const Model& model, const std::vector<AuxHead>& heads, int64_t first, int64_t end,
                                const at::Tensor& x, const at::Tensor& y, double label_smoothing, at::Tensor* loss_sum,
                                at::Tensor* correct) {
  const auto& units = model.units();
  const auto n_units = static_cast<int64_t>(units.size());
  TORCH_CHECK(first >= 0 && first < end && end <= n_units, "block [", first, ", ", end, ") is outside the model's ",
              n_units, " units");
  TORCH_CHECK(static_cast<int64_t>(heads.size()) == n_units - 1, "expected ", n_units - 1, " aux heads, got ", heads.size());
  at::Tensor loss;
  at::Tensor h = x;
  for (int64_t u = first; u < end; ++u) {
    h = units[static_cast<size_t>(u)].forward(h.detach());  // local learning: no gradient crosses units
    AuxHead head = u + 1 < n_units ? heads[static_cast<size_t>(u)] : AuxHead(nullptr);  // a shared handle
    const at::Tensor logits = (head ? head->forward(h) : h).to(at::kFloat);
    const at::Tensor unit_loss = at::cross_entropy_loss(logits, y, {}, at::Reduction::Mean, -100, label_smoothing);
    loss = loss.defined() ? loss + unit_loss : unit_loss;
    if (loss_sum) (*loss_sum)[u - first].add_(unit_loss.detach() * static_cast<double>(y.size(0)));
    if (correct) (*correct)[u - first].add_(logits.detach().argmax(1).eq(y).sum().to(at::kFloat));
  }
  return loss;
}

double neuroflux_block_step_bytes(const Model& model, const std::vector<AuxHead>& heads, int64_t first, int64_t end,
                                  const std::vector<int64_t>& in_shape, int64_t rows, bool channels_last,
                                  PrecisionMode precision, double label_smoothing, const c10::Device& device,
                                  double* peak_gb) {
  std::vector<at::Tensor> params, buffers;
  block_tensors(model, heads, first, end, &params, &buffers);
  const BuffersKept kept(std::move(buffers));
  std::vector<int64_t> shape{rows};
  shape.insert(shape.end(), in_shape.begin(), in_shape.end());
  double body = -1;
  try {
    const at::Tensor x =
        SplitInput::layout(at::zeros(shape, at::TensorOptions().dtype(at::kFloat).device(device)), channels_last);
    const at::Tensor y = at::zeros({rows}, at::TensorOptions().dtype(at::kLong).device(device));
    const auto step = [&] {
      at::Tensor loss;
      {
        const AutocastScope autocast(device, precision);
        loss = neuroflux_block_loss(model, heads, first, end, x, y, label_smoothing);
      }
      loss.backward();
    };
    body = std::max(0.0, step_peak_bytes(step, params, device));
    const double peak = static_cast<double>(memory_stats(device).peak_allocated_bytes) / kGB;
    if (peak_gb) *peak_gb = std::max(*peak_gb, peak);
  } catch (const c10::OutOfMemoryError&) {
    body = -1;
    grads_release(params);
  }
  memory_cache_release(device);
  return body;
}

int64_t pass_skip(int64_t offset, int64_t count, int64_t n, int64_t batch) {
  TORCH_CHECK(offset >= 0 && count > 0 && offset + count <= n && count <= batch, "short batch: bad rows");
  return count < batch && offset + count == n && n >= batch ? batch - count : 0;
}

int64_t epoch_fill(int64_t offset, int64_t count, int64_t n, int64_t batch, int64_t planned) {
  // The same widening as a pass's (rows from the epoch's start instead of before the batch), at the planned batch only.
  const int64_t rows = pass_skip(offset, count, n, batch);
  return batch == planned ? rows : 0;
}

int64_t exit_choose(const std::vector<double>& holdout_acc, const std::vector<int64_t>& params, double tolerance) {
  TORCH_CHECK(!holdout_acc.empty() && holdout_acc.size() == params.size(), "exit_choose: mismatched exits");
  const double reference = holdout_acc.back();
  auto chosen = static_cast<int64_t>(holdout_acc.size()) - 1;
  for (size_t u = 0; u < holdout_acc.size(); ++u) {
    if (holdout_acc[u] >= reference - tolerance && params[u] < params[static_cast<size_t>(chosen)]) {
      chosen = static_cast<int64_t>(u);
    }
  }
  return chosen;
}

Json neuroflux_train(Session& session) {
  neuroflux::NeuroFluxRun run(session);
  return run.run();
}

}  // namespace triaccel
