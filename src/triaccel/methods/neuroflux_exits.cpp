// NeuroFlux's exits (methods/neuroflux_run.h): the cache passes that score every unit's exit on the held-out and
// test splits and write the next block's input, the choice and export of the exit, and the run's summary.
#include "triaccel/methods/neuroflux_run.h"

namespace triaccel {
namespace neuroflux {
namespace {

// Median images/s of `forward` on a zero batch of `batch` samples from `make` (eval mode, no grad), after warm-up,
// synchronized. Under a vram_budget the batch halves until it fits (these phases come after training, with the
// caches still allocated); `used` receives it (0: not even one sample fits, and the rate is 0).
double inference_throughput(const std::function<at::Tensor(const at::Tensor&)>& forward,
                            const std::function<at::Tensor(int64_t)>& make, int64_t batch, const c10::Device& device,
                            const Clock& clock, int64_t* used) {
  const torch::NoGradGuard no_grad;
  constexpr int kWarmup = 2, kRepeats = 5, kIters = 3;
  for (; batch >= 1; batch /= 2) {
    try {
      const at::Tensor x = make(batch);
      for (int i = 0; i < kWarmup; ++i) forward(x);
      std::vector<double> rates;
      for (int r = 0; r < kRepeats; ++r) {
        device_synchronize(device);
        const double t0 = clock.now_s();
        for (int i = 0; i < kIters; ++i) forward(x);
        device_synchronize(device);
        rates.push_back(static_cast<double>(kIters * batch) / std::max(clock.now_s() - t0, 1e-9));
      }
      std::sort(rates.begin(), rates.end());
      *used = batch;
      return rates[rates.size() / 2];
    } catch (const c10::OutOfMemoryError&) {
      memory_cache_release(device);
    }
  }
  *used = 0;
  return 0;
}

}  // namespace

// Runs block b's units (eval, no grad) over every split's input: exit accuracies of its units; when the block is not
// the last, its outputs become the next block's input caches. Returns the seconds spent.
double NeuroFluxRun::cache_pass(size_t b, CachePlace* place) {
  const double t0 = session_.clock().now_s();
  pass_io_ = ActivationCache::IoStats{};
  pass_rows_ = 0;
  const BlockPlan& bp = plan_.blocks[b];
  pass_batch_ = bp.batch;
  const bool last = b + 1 == plan_.blocks.size();
  const torch::NoGradGuard no_grad;
  model_.eval();
  for (auto& h : heads_) h->eval();
  const DatasetSplits& data = session_.data();
  if (!last && b == 0) train_in_.loader = std::make_unique<Loader>(train_set_, data.mean, data.std, plain_lo_, device_);
  if (!last && train_in_.loader) train_in_.loader->epoch_begin(0);
  // The new caches go to the GPU when they, what is allocated now and the next block's training all fit.
  *place = CachePlace::kHost;
  if (!last && device_.is_cuda()) {
    const std::vector<int64_t>& out_shape = profile_.units[static_cast<size_t>(bp.end - 1)].out_shape;
    const double cache_bytes =
        static_cast<double>(ActivationCache::bytes_for(n_train_ + n_hold_ + data.test.size(), out_shape));
    const double next = plan_.blocks[b + 1].bytes - resident_;
    if (static_cast<double>(memory_stats(device_).allocated_bytes) + cache_bytes + next <= po_.safety * budget_) {
      *place = CachePlace::kDevice;
    }
    // Several ranks: on the GPU only where every rank's fits (a split pass broadcasts a GPU cache's rows: every rank
    // must make the same collectives).
    if (session_.dist().active() &&
        session_.dist().all_reduce_max({*place == CachePlace::kHost ? 1.0 : 0.0})[0] > 0) {
      *place = CachePlace::kHost;
    }
  }
  cache_pass_split(b, hold_in_, &hold_acc_, *place);
  cache_pass_split(b, test_in_, &test_acc_, *place);
  if (!last) cache_pass_split(b, train_in_, nullptr, *place);  // exits are not scored on the training split
  model_.train();
  for (auto& h : heads_) h->train();
  device_synchronize(device_);
  return session_.clock().now_s() - t0;
}

void NeuroFluxRun::cache_pass_split(size_t b, SplitInput& in, std::vector<double>* accs, CachePlace place) {
  const BlockPlan& bp = plan_.blocks[b];
  const bool last = b + 1 == plan_.blocks.size();
  const int64_t n = in.size();
  const ActivationCache::IoStats in_before = in.cache ? in.cache->io_stats() : ActivationCache::IoStats{};
  std::unique_ptr<ActivationCache> out;
  if (!last) {
    const std::vector<int64_t>& out_shape = profile_.units[static_cast<size_t>(bp.end - 1)].out_shape;
    out = std::make_unique<ActivationCache>(n, out_shape, place, device_, plain_lo_.channels_last);
  }
  at::Tensor correct = at::zeros({bp.end - bp.first}, at::TensorOptions().dtype(at::kFloat).device(device_));
  // A batch of the pass that runs out of memory is redone at a batch re-planned from what was held when the split's
  // pass started (oom_retry_batch); the later splits keep that batch.
  const auto held = static_cast<double>(memory_stats(device_).allocated_bytes);
  int64_t& pass_batch = pass_batch_;
  // Several ranks split the pass where passing its rows costs less than computing them: no output cache (the scores
  // alone), a cache on the GPU (NCCL), or a run on the CPU. Each rank runs its share of the rows (contiguous, in rank
  // order); the hits are summed and the output rows passed to every rank after the loop, so every rank ends with one
  // process's scores and whole caches. A host cache on a GPU is computed whole on every rank: passing its rows
  // through Gloo takes longer than computing them (measured: docs/results/neuroflux.md).
  Dist& dist = session_.dist();
  const bool split = dist.active() && (!out || !device_.is_cuda() || (place == CachePlace::kDevice && dist.nccl()));
  const auto [first, own] = split ? dist.share(n) : std::pair<int64_t, int64_t>{0, n};
  const int64_t end = first + own;
  for (int64_t offset = first; offset < end;) {
    const int64_t count = std::min(pass_batch, end - offset);
    // A short last batch runs as the window of pass_batch rows that ends the share (the rows before `offset` are
    // computed again, neither scored nor written twice): every batch then has the training step's shape, whose
    // cuDNN plans exist. A new shape costs plan building in every convolution (docs/neuroflux.md).
    const int64_t skip = pass_skip(offset, count, end, pass_batch);
    try {
      const at::Tensor labels = in.labels.narrow(0, offset, count);
      const AutocastScope autocast(device_, config_.execution.precision);
      at::Tensor h = in.rows(offset - skip, count + skip, plain_lo_.channels_last);
      std::vector<at::Tensor> hits;
      for (int64_t u = bp.first; u < bp.end; ++u) {
        h = units_[static_cast<size_t>(u)].forward(h);
        if (accs) hits.push_back(logits_of(u, h).narrow(0, skip, count).argmax(1).eq(labels).sum().to(at::kFloat));
      }
      if (out) out->write(offset, h.narrow(0, skip, count));
      for (size_t k = 0; k < hits.size(); ++k) correct[static_cast<int64_t>(k)].add_(hits[k]);
      pass_rows_ += count + skip;
    } catch (const c10::OutOfMemoryError& e) {
      Json fields = oom_reading(e, device_).fields();
      const int64_t retry = oom_retry_batch(pass_batch, held, po_);
      TRIACCEL_CHECK_INPUT(retry > 0, "out of memory in NeuroFlux block ", b, "'s cache pass at batch ", pass_batch,
                           " with ", bytes_format(held), " held; raise ", option_ref("vram_budget"));
      memory_cache_release(device_);
      fields.update(Json{{"block", b}, {"pass", true}, {"batch", pass_batch}, {"retry_batch", retry}});
      session_.event(event::kOom, step_, fields);
      pass_batch = retry;
      continue;
    }
    offset += count;
  }
  if (split && accs) dist.all_reduce_sum(correct);
  if (accs && n > 0) {
    const at::Tensor c = correct.cpu();
    for (int64_t u = bp.first; u < bp.end; ++u) {
      (*accs)[static_cast<size_t>(u)] = 100.0 * c[u - bp.first].item<double>() / static_cast<double>(n);
    }
  }
  if (in.cache) pass_io_ += in.cache->io_stats() - in_before;
  if (out) {
    out->flush();
    for (int r = 0; split && r < dist.world_size(); ++r) {  // rank r's rows from rank r
      const auto [lo, rows_of_r] = dist.share(n, r);
      if (rows_of_r == 0) continue;
      std::vector<at::Tensor> rows{out->stored_rows(lo, rows_of_r)};
      dist.broadcast(rows, r);
    }
    pass_io_ += out->io_stats();
    in.loader.reset();
    in.cache = std::move(out);
  }
}

// Writes the full network (model.pt) and the exit up to unit `chosen` (exit_path: the kept units' state names plus
// the head as "exit.*"); the head's description (null when the exit is the full network).
Json NeuroFluxRun::exit_models_write(int64_t chosen, const std::string& exit_path) {
  const auto c = static_cast<size_t>(chosen);
  const std::string model_path = session_.out_file("model.pt");
  if (session_.writer()) model_export_state_dict(model_, model_path);  // data parallel: every rank holds these weights
  std::vector<at::Tensor> kept_params;
  std::unordered_set<const c10::TensorImpl*> kept;
  for (int64_t u = 0; u <= chosen; ++u) {
    for (const auto& m : units_[static_cast<size_t>(u)].modules) {
      for (const auto& p : m->parameters()) {
        kept.insert(p.unsafeGetTensorImpl());
        kept_params.push_back(p);
      }
      for (const auto& t : m->buffers()) kept.insert(t.unsafeGetTensorImpl());
    }
  }
  NamedTensors exit_state;
  for (const auto& [name, t] : model_state(model_)) {
    if (kept.count(t.unsafeGetTensorImpl()) != 0) exit_state.emplace_back(name, t);
  }
  Json head_json = nullptr;
  if (chosen + 1 < n_units_) {
    const AuxHead& head = heads_[c];
    for (const auto& item : head->named_parameters()) {
      exit_state.emplace_back("exit." + item.key(), item.value());
      kept_params.push_back(item.value());
    }
    for (const auto& item : head->named_buffers()) exit_state.emplace_back("exit." + item.key(), item.value());
    head_json = Json{{"filters", head->filters()}, {"pool", kAuxPool}, {"params", head->parameter_count()},
                     {"layers", head->filters() > 0
                                    ? "conv3x3(no bias) -> bn -> relu -> adaptive_avg_pool(2) -> flatten -> fc"
                                    : "adaptive_avg_pool(2) -> flatten -> fc"}};
  }
  if (session_.writer()) state_dict_write(exit_state, kept_params, exit_path);
  return head_json;
}

// Inference throughput of the exit up to unit `chosen` and of the full network, eval mode, on a zero batch.
NeuroFluxRun::ExitRates NeuroFluxRun::exit_rates(int64_t chosen) {
  model_.eval();
  for (auto& h : heads_) h->eval();
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device_);
  const auto probe = [&](int64_t n) {
    return SplitInput::layout(at::zeros({n, sample_shape_[0], sample_shape_[1], sample_shape_[2]}, f32),
                              plain_lo_.channels_last);
  };
  const int64_t probe_batch = device_.is_cuda() ? 256 : 8;
  const PrecisionMode precision = config_.execution.precision;
  ExitRates r;
  r.exit_rate = inference_throughput(
      [&](const at::Tensor& x) {
        const AutocastScope autocast(device_, precision);
        at::Tensor h = x;
        for (int64_t u = 0; u <= chosen; ++u) h = units_[static_cast<size_t>(u)].forward(h);
        return logits_of(chosen, h);
      },
      probe, probe_batch, device_, session_.clock(), &r.exit_batch);
  r.full_rate = inference_throughput(
      [&](const at::Tensor& x) {
        const AutocastScope autocast(device_, precision);
        return model_.forward(x);
      },
      probe, probe_batch, device_, session_.clock(), &r.full_batch);
  return r;
}

// Exits: the prefix up to unit u plus its head, chosen on held-out data (the fewest parameters among the exits whose
// held-out accuracy is within nf_exit_tolerance points of the full network's; the full network when nothing is held
// out). Exports the full network (model.pt) and the exit (exit_model.pt: the kept units' torchvision names plus the
// head as "exit.*"; exit.json describes it), measures both models' inference throughput, and returns the exit's
// description (the exit event's "chosen").
Json NeuroFluxRun::exits_export() {
  std::vector<int64_t> exit_params(static_cast<size_t>(n_units_), 0);
  int64_t prefix = 0;
  for (int64_t u = 0; u < n_units_; ++u) {
    prefix += units_[static_cast<size_t>(u)].parameter_count();
    exit_params[static_cast<size_t>(u)] =
        prefix + (u + 1 < n_units_ ? heads_[static_cast<size_t>(u)]->parameter_count() : 0);
  }
  const int64_t chosen =
      n_hold_ > 0 ? exit_choose(hold_acc_, exit_params, config_.neuroflux.nf_exit_tolerance) : n_units_ - 1;
  const auto c = static_cast<size_t>(chosen);
  const std::string exit_path = session_.out_file(kExitModelFile);
  const Json head_json = exit_models_write(chosen, exit_path);
  const ExitRates rates = exit_rates(chosen);
  const int64_t full_params = model_.parameter_count();
  Json exits = Json::array();
  for (int64_t u = 0; u < n_units_; ++u) {
    const auto i = static_cast<size_t>(u);
    exits.push_back(Json{{"unit", units_[i].name}, {"index", u}, {"params", exit_params[i]},
                         {"holdout_acc", hold_acc_[i]}, {"test_acc", test_acc_[i]}});
  }
  Json kept_units = Json::array();
  for (int64_t u = 0; u <= chosen; ++u) kept_units.push_back(units_[static_cast<size_t>(u)].name);
  const Json chosen_json{
      {"unit", units_[c].name},
      {"index", chosen},
      {"units_kept", kept_units},
      {"head", head_json},
      {"params", exit_params[c]},
      {"params_ratio", static_cast<double>(full_params) / static_cast<double>(exit_params[c])},
      {"holdout_acc", hold_acc_[c]},
      {"test_acc", test_acc_[c]},
      {"images_per_s", rates.exit_rate},
      {"full_images_per_s", rates.full_rate},
      {"throughput_batch", rates.exit_batch},
      {"full_throughput_batch", rates.full_batch},
      {"path", exit_path}};
  session_.event(event::kExit, step_,
                 Json{{"exits", exits}, {"chosen", chosen_json}, {"tolerance", config_.neuroflux.nf_exit_tolerance},
                      {"selected_on", n_hold_ > 0 ? "holdout" : "none (full network)"}, {"full_params", full_params}});
  const DatasetSplits& data = session_.data();
  Json exit_doc{{"model", config_.model.model}, {"dataset", config_.data.dataset}, {"input_shape", sample_shape_},
                {"num_classes", session_.model_options().num_classes}, {"mean", data.mean}, {"std", data.std},
                {"full_params", full_params}};
  for (const auto& item : chosen_json.items()) exit_doc[item.key()] = item.value();
  if (session_.writer()) file_write_atomic(session_.out_file(kExitJsonFile), exit_doc.dump(2) + "\n");
  return chosen_json;
}

Json NeuroFluxRun::summary(const Json& chosen) {
  const double total_train_s = std::accumulate(block_seconds_.begin(), block_seconds_.end(), 0.0);
  const double epoch_s = total_train_s / static_cast<double>(config_.schedule.epochs);
  const double acc = test_acc_[static_cast<size_t>(n_units_ - 1)];
  Json block_batches = Json::array();
  for (const auto& b : plan_.blocks) block_batches.push_back(b.batch);
  Json summary{{"test_acc", acc},
               {"epoch_s", epoch_s},
               {"train_s", total_train_s},
               {"peak_vram_gb", peak_gb_},
               {"peak_vram_includes_dataset", true},
               {"eff_score", epoch_s > 0 && peak_gb_ > 0 ? Json(acc / (epoch_s * peak_gb_)) : Json(nullptr)},
               {"params", model_.parameter_count()},
               {"method", "neuroflux"},
               {"model", config_.model.model},
               {"dataset", config_.data.dataset},
               {"precision", enum_name(config_.execution.precision)},
               {"budget_gb", budget_ / kGB},
               {"blocks", plan_.blocks.size()},
               {"block_batches", block_batches},
               {"backprop_max_batch", backprop_batch_},
               {"exit_unit", chosen["unit"]},
               {"exit_params", chosen["params"]},
               {"exit_test_acc", chosen["test_acc"]},
               {"exit_images_per_s", chosen["images_per_s"]},
               {"epochs", config_.schedule.epochs},
               {"steps", step_},
               {"world_size", session_.dist().world_size()},
               {"total_s", session_.now()},
               {"device", device_long_name(device_)},
               {"input_mean", session_.data().mean},
               {"input_std", session_.data().std},
               {"model_path", session_.out_file("model.pt")},
               {"exit_model_path", chosen["path"]}};
  session_.profile_end();
  session_.event(event::kSummary, step_, summary);
  if (session_.writer()) {  // the other ranks have no events file
    session_.printer().line(c10::str("done: test acc ", acc, " % (exit ", chosen["unit"].get<std::string>(), ": ",
                                     chosen["test_acc"].get<double>(), " %, ", chosen["params"].get<int64_t>(),
                                     " params), ", epoch_s, " s/epoch, peak ", peak_gb_, " GB; events in ",
                                     session_.events().path()));
  }
  return summary;
}

}  // namespace neuroflux
}  // namespace triaccel
