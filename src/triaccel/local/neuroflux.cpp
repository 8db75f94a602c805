// The NeuroFlux runner; see neuroflux.h and docs/neuroflux.md.
// Invariants: every unit trains on a detached input, so no gradient crosses a unit boundary; block b reads its
// training input only from the loader (b = 0) or the cache written by block b-1, never by running earlier blocks;
// every random choice (held-out split, head initialization, per-block data order and flips) is a pure function of
// (seed, block, epoch), so a run resumed at a block boundary ends with the same weights as an uninterrupted one.
#include "triaccel/local/neuroflux.h"

#include "triaccel/core/device.h"
#include "triaccel/core/errors.h"
#include "triaccel/core/io.h"
#include "triaccel/data/dataset.h"
#include "triaccel/data/loader.h"
#include "triaccel/local/activation_cache.h"
#include "triaccel/local/aux_head.h"
#include "triaccel/local/memory_profile.h"
#include "triaccel/local/partitioner.h"
#include "triaccel/memory/batch_controller.h"
#include "triaccel/models/model.h"
#include "triaccel/train/checkpoint.h"
#include "triaccel/train/schedule.h"
#include "triaccel/train/sgd.h"
#include "triaccel/train/step.h"
#include "triaccel/train/telemetry.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/autograd.h>
#include <torch/utils.h>
#ifdef TRIACCEL_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <numeric>
#include <optional>
#include <unordered_set>

namespace triaccel {
namespace {

constexpr double kGB = 1e9;
constexpr uint64_t kHoldoutStream = 0x4e46486f6c64ULL;  // independent seed streams (seed_mix)
constexpr uint64_t kHeadStream = 0x4e4648656164ULL;
constexpr uint64_t kBlockStream = 0x4e46426c6f63ULL;
constexpr const char* kAuxPrefix = "neuroflux_aux.";  // head entries in the checkpoint's model state

at::Tensor permutation(int64_t n, uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randperm(n, gen, at::TensorOptions().dtype(at::kLong));
}

Dataset dataset_rows(const Dataset& d, const at::Tensor& index) {
  Dataset out;
  out.name = d.name;
  out.images = d.images.index_select(0, index).contiguous();
  out.labels = d.labels.index_select(0, index).contiguous();
  out.num_classes = d.num_classes;
  return out;
}

// One split's input to the current block: the ordered, unaugmented loader (block 0) or the previous block's cache.
struct SplitInput {
  std::unique_ptr<Loader> loader;
  std::unique_ptr<ActivationCache> cache;
  at::Tensor labels;  // (N) int64 on the device, row order

  int64_t size() const { return labels.size(0); }
  at::Tensor rows(int64_t offset, int64_t count, bool channels_last) const {
    if (cache) return layout(cache->read_range(offset, count), channels_last);
    return loader->batch(offset, count).first;
  }
  static at::Tensor layout(const at::Tensor& x, bool channels_last) {
    return channels_last && x.dim() == 4 ? x.contiguous(at::MemoryFormat::ChannelsLast) : x;
  }
};

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

// Median images/s of `forward` on a zero batch (eval mode, no grad), after warm-up, synchronized.
double inference_throughput(const std::function<at::Tensor(const at::Tensor&)>& forward, const at::Tensor& batch,
                            const c10::Device& device) {
  const torch::NoGradGuard no_grad;
  constexpr int kWarmup = 2, kRepeats = 5, kIters = 3;
  for (int i = 0; i < kWarmup; ++i) forward(batch);
  std::vector<double> rates;
  for (int r = 0; r < kRepeats; ++r) {
    device_synchronize(device);
    const double t0 = time_since_start_s();
    for (int i = 0; i < kIters; ++i) forward(batch);
    device_synchronize(device);
    rates.push_back(static_cast<double>(kIters * batch.size(0)) / std::max(time_since_start_s() - t0, 1e-9));
  }
  std::sort(rates.begin(), rates.end());
  return rates[rates.size() / 2];
}

Json plan_to_json(const Partition& plan) {
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

void log_line(const TrainOptions& options, const std::string& text) {
  if (options.progress == "off") return;
  std::fprintf(stderr, "%s\n", text.c_str());
  std::fflush(stderr);
}

}  // namespace

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

// A NeuroFlux block's training step in a CUDA graph: eager for kWarmup steps at the planned batch, then captured
// (the caller's first batch becomes the static input) and replayed; other shapes run eagerly. A capture that runs
// out of memory leaves the block eager (that step runs eagerly: a capture runs nothing); refuse() drops the graph for
// good (an eager out-of-memory retry changes the batch); drop() frees it to be captured again (an eager step that
// did not fit beside its pool).
struct BlockGraph {
  static constexpr int kWarmup = 3;
  bool enabled = false;
  int warm = 0;
  int64_t capture_ooms = 0;
  std::string capture_error;  // the first capture that failed by an error (not out of memory): its first line
  bool relaxed = false;       // after such an error the block captures in relaxed mode (cuda_graph_capture)
#ifdef TRIACCEL_WITH_CUDA
  std::unique_ptr<at::cuda::CUDAGraph> graph;
#endif
  at::Tensor x, y;  // static inputs of the graph

  bool captured() const {
#ifdef TRIACCEL_WITH_CUDA
    return graph != nullptr;
#else
    return false;
#endif
  }
  void refuse() {
    enabled = false;
    drop();
  }
  void drop() {  // frees the graph and its pool; steps at the planned batch warm up and capture again
#ifdef TRIACCEL_WITH_CUDA
    graph.reset();
#endif
    x = at::Tensor();
    y = at::Tensor();
    warm = 0;
  }
  void run(const std::function<void(const at::Tensor&, const at::Tensor&)>& body, const at::Tensor& xb,
           const at::Tensor& yb, bool planned_batch) {
#ifdef TRIACCEL_WITH_CUDA
    if (enabled && planned_batch) {
      if (graph) {
        x.copy_(xb);
        y.copy_(yb);
        graph->replay();
        return;
      }
      if (warm >= kWarmup) {
        x = xb;
        y = yb;
        std::string error;
        graph = cuda_graph_capture([this, &body]() { body(x, y); }, &error, relaxed);
        if (graph) {
          graph->replay();  // the capture ran nothing: this performs the step
          return;
        }
        if (error.empty()) {
          ++capture_ooms;
        } else if (capture_error.empty()) {
          capture_error = error;
        }
        if (!error.empty() && !relaxed) {
          // A call global mode refuses (EfficientNet-B0 blocks at batch 512 under 0.4-0.5 GB; which call is not
          // established): warm up and capture once more in relaxed mode before the block stays eager.
          relaxed = true;
          drop();
        } else {
          refuse();
        }
      } else {
        ++warm;
      }
    }
#endif
    body(xb, yb);
  }
};

Json neuroflux_run(const TrainOptions& options, const TrainHooks& hooks) {
  options.validate();
  TRIACCEL_CHECK_INPUT(options.precision != PrecisionMode::kAmpFP16,
                       "--method neuroflux supports --precision fp32 or amp-bf16, got amp-fp16");
  // Declared first, so destroyed last: after the caches have given their host memory back to the pool, it is freed.
  struct HostPoolRelease {
    ~HostPoolRelease() { ActivationCache::host_pool_release(); }
  } host_pool_release;
  const double t_start = time_since_start_s();
  const c10::Device device = device_resolve(options.device);
  directory_prepare_writable(options.out, "--out");

  std::string ckpt_file;
  std::optional<Checkpoint> ckpt = checkpoint_for_resume(options.resume, options.model, &ckpt_file);
  if (ckpt) {
    TRIACCEL_CHECK_INPUT(ckpt->progress.contains("neuroflux"), "checkpoint ", ckpt_file,
                         " is not a NeuroFlux checkpoint");
  }
#ifdef TRIACCEL_WITH_CUDA
  std::optional<c10::cuda::CUDAStreamGuard> stream_guard;
  if (device.is_cuda()) {
    stream_guard.emplace(c10::cuda::getStreamFromPool(false, device.index()));
    // As the trainer: cuDNN autotuning's workspace tries would fill a --vram-budget, so heuristics under a budget
    // unless --cudnn-autotune on.
    at::globalContext().setBenchmarkCuDNN(options.cudnn_autotune_enabled());
  }
#endif
  torch::manual_seed(options.seed);

  // Data: the training split minus a seeded held-out part (for choosing the exit), and the test split.
  const DatasetSplits data = dataset_load(options.dataset, options.data_dir);
  const int64_t n_all = data.train.size();
  const int64_t n_hold = std::min(options.nf_holdout, n_all / 10);
  const at::Tensor split = permutation(n_all, seed_mix(options.seed, kHoldoutStream));
  const Dataset train_set = dataset_rows(data.train, std::get<0>(split.narrow(0, n_hold, n_all - n_hold).sort()));
  const Dataset hold_set = dataset_rows(data.train, std::get<0>(split.narrow(0, 0, n_hold).sort()));
  LoaderOptions plain_lo;
  plain_lo.batch_size = options.batch_size;
  plain_lo.shuffle = false;
  plain_lo.augment = false;
  plain_lo.image_size = options.image_size;
  plain_lo.seed = options.seed;
  plain_lo.channels_last = device.is_cuda() && options.channels_last;
  LoaderOptions train_lo = plain_lo;
  train_lo.shuffle = true;
  train_lo.augment = options.augment_enabled();
  train_lo.cutout = options.cutout;
  const auto make_input = [&](const Dataset& d) {
    SplitInput in;
    in.loader = std::make_unique<Loader>(d, data.mean, data.std, plain_lo, device);
    in.loader->epoch_begin(0);
    in.labels = d.labels.to(device);
    return in;
  };
  SplitInput hold_in = make_input(hold_set);
  SplitInput test_in = make_input(data.test);
  SplitInput train_in;  // set before each block: loader for block 0 (built on demand), else the cache
  train_in.labels = train_set.labels.to(device);
  const int64_t n_train = train_set.size();
  const std::vector<int64_t> sample_shape{data.train.channels(), test_in.loader->image_height(),
                                          test_in.loader->image_width()};
  const auto resident_of = [](const Dataset& d) { return static_cast<double>(d.images.numel() + 16 * d.size()); };
  const double resident = resident_of(train_set) + resident_of(hold_set) + resident_of(data.test);

  // Model, memory profile, budget, plan.
  ModelOptions mo;
  mo.name = options.model;
  mo.num_classes = data.train.num_classes;
  mo.in_channels = data.train.channels();
  mo.image_size = sample_shape[1];
  const std::shared_ptr<Model> model = model_create(mo);
  model->to(device);
  model->train();
  const auto layout_params = [&](torch::nn::Module& module) {  // channels_last weights on CUDA, as the trainer does
    if (!plain_lo.channels_last) return;
    const torch::NoGradGuard no_grad;
    for (auto& p : module.parameters()) {
      if (p.dim() == 4) p.set_data(p.contiguous(at::MemoryFormat::ChannelsLast));
    }
  };
  layout_params(*model);
  const auto& units = model->units();
  const auto n_units = static_cast<int64_t>(units.size());
  TRIACCEL_CHECK_INPUT(options.nf_profile != "measured" || device.is_cuda(),
                       "--nf-profile measured needs a CUDA device; use model (or auto) on the CPU");
  const ProfileSource source =
      device.is_cuda() && options.nf_profile != "model" ? ProfileSource::kMeasured : ProfileSource::kModel;
  const double t_profile = time_since_start_s();
  const MemoryProfile profile = [&]() {  // under the run's precision: bf16 activations take half the bytes
    const AutocastScope autocast(device, options.precision);
    return memory_profile(*model, sample_shape, mo.num_classes, source, device);
  }();
  const double profile_s = time_since_start_s() - t_profile;
  const bool explicit_budget = options.vram_budget_bytes() > 0;
  // Backprop keeps the whole training split (held-out part included) and the test split resident.
  const double budget = explicit_budget ? static_cast<double>(options.vram_budget_bytes())
                                        : profile.backprop_bytes(options.batch_size) + resident;
  PartitionOptions po;
  po.budget_bytes = budget;
  po.base_bytes = resident;
  po.samples = n_train;
  po.epochs = options.epochs;
  po.max_batch = options.nf_max_batch;
  po.target_batch = options.batch_size;
  if (!device.is_cuda()) {  // the CPU: slower, saturated at small batches, and its "host cache" is just memory
    po.bytes_per_s = 5e9;
    po.sat_batch = 32;
    po.host_bytes_per_s = 0;
  }
  const Partition plan = ckpt ? plan_from_json(ckpt->progress.at("plan"), n_units, ckpt_file) : partition_plan(profile, po);
  const int64_t backprop_batch = profile.backprop_max_batch(po.safety * budget - resident);

  // One aux head per unit but the last (the classifier is its own exit), at its block's ladder level.
  torch::manual_seed(seed_mix(options.seed, kHeadStream));
  std::vector<AuxHead> heads;
  std::vector<int64_t> block_of(static_cast<size_t>(n_units), 0);
  for (size_t b = 0; b < plan.blocks.size(); ++b) {
    for (int64_t u = plan.blocks[b].first; u < plan.blocks[b].end; ++u) block_of[static_cast<size_t>(u)] = static_cast<int64_t>(b);
  }
  for (int64_t u = 0; u + 1 < n_units; ++u) {
    const UnitProfile& up = profile.units[static_cast<size_t>(u)];
    const int64_t level = plan.blocks[static_cast<size_t>(block_of[static_cast<size_t>(u)])].head_level;
    AuxHead head(up.out_shape, aux_filters(up.out_shape[0], level), mo.num_classes);
    head->to(device);
    head->train();
    layout_params(*head);
    heads.push_back(head);
  }
  const auto live_state = [&]() {
    auto state = model_state(*model);
    for (auto& entry : head_state(heads, *model, kAuxPrefix)) state.push_back(entry);
    return state;
  };

  // Progress (restored from the checkpoint when resuming at a block boundary).
  int64_t blocks_done = 0, step = 0;
  double elapsed_before = 0, peak_gb = 0;
  std::vector<double> block_seconds;  // training + cache pass, per block
  if (ckpt) {
    named_tensors_load(live_state(), ckpt->model, "model", ckpt_file);
    try {
      const Json& p = ckpt->progress;
      blocks_done = p.at("blocks_done").get<int64_t>();
      step = p.at("step").get<int64_t>();
      elapsed_before = p.at("elapsed_s").get<double>();
      peak_gb = p.at("peak_vram_gb").get<double>();
      block_seconds = p.at("block_seconds").get<std::vector<double>>();
    } catch (const Json::exception&) {
      throw UserError("checkpoint " + ckpt_file + " has an unreadable NeuroFlux progress record");
    }
  }
  const auto now = [&]() { return elapsed_before + (time_since_start_s() - t_start); };

  const std::string events_path = (std::filesystem::path(options.out) / "events.jsonl").string();
  const bool append = ckpt.has_value() && file_exists(events_path);
  EventLog events(events_path, append);
  Json unit_names = Json::array();
  for (const auto& u : units) unit_names.push_back(u.name);
  const Json resolved{{"options", options.to_json()},
                      {"device", device_long_name(device)},
                      {"params", model->parameter_count()},
                      {"units", unit_names},
                      {"train_samples", n_train},
                      {"holdout_samples", n_hold},
                      {"test_samples", data.test.size()},
                      {"augment", train_lo.augment},
                      {"torch_version", TORCH_VERSION}};
  if (append) {
    events.write("resume", step, now(), Json{{"from", ckpt_file}, {"blocks_done", blocks_done}, {"config", resolved}});
  } else {
    events.write("config", step, now(), resolved);
  }
  {
    Json blocks = Json::array();
    for (const auto& b : plan.blocks) {
      Json names = Json::array(), filters = Json::array();
      for (int64_t u = b.first; u < b.end; ++u) {
        names.push_back(units[static_cast<size_t>(u)].name);
        if (u + 1 < n_units) filters.push_back(heads[static_cast<size_t>(u)]->filters());
      }
      blocks.push_back(Json{{"units", names}, {"batch", b.batch}, {"head_level", b.head_level},
                            {"head_filters", filters}, {"predicted_gb", b.bytes / kGB},
                            {"predicted_s", b.time_s}});
    }
    Json unit_profiles = Json::array();
    for (const auto& up : profile.units) {
      unit_profiles.push_back(Json{{"unit", up.name}, {"params", up.params}, {"out_shape", up.out_shape},
                                   {"train_fixed_bytes", up.train.fixed_bytes},
                                   {"train_bytes_per_sample", up.train.per_sample_bytes}});
    }
    events.write("plan", step, now(),
                 Json{{"method", "neuroflux"}, {"budget_gb", budget / kGB}, {"budget_from", explicit_budget ? "--vram-budget" : "backprop at --batch-size"},
                      {"profile", source == ProfileSource::kMeasured ? "measured" : "model"}, {"profile_s", profile_s},
                      {"resident_gb", resident / kGB}, {"blocks", blocks}, {"predicted_s", plan.time_s},
                      {"backprop_max_batch", backprop_batch},
                      {"backprop_gb_at_batch", profile.backprop_bytes(options.batch_size) / kGB},
                      {"units", unit_profiles}});
  }
  log_line(options, c10::str("triaccel: neuroflux ", options.model, " on ", options.dataset, " (", n_train, " train / ",
                             n_hold, " held out / ", data.test.size(), " test), ", plan.blocks.size(), " blocks, budget ",
                             budget / kGB, " GB, ", device_long_name(device)));
  std::optional<MemoryCapScope> memory_cap;  // lifted again when the run ends
  if (device.is_cuda() && explicit_budget) {
    memory_cache_release(device);  // the profile's cached blocks, before the cap counts them
    memory_cap.emplace(device, options.vram_budget_bytes());
  }
  memory_stats_reset_peak(device);
  // The first two cache passes' host caches are faulted in on background threads while block 0 trains (a cache
  // whose splits together exceed the budget cannot go to the GPU; ActivationCache::host_pool_prefill).
  if (device.is_cuda() && blocks_done == 0 && plan.blocks.size() > 1) {
    std::vector<int64_t> numels;
    for (size_t b = 0; b < std::min<size_t>(2, plan.blocks.size() - 1); ++b) {
      const std::vector<int64_t>& shape = profile.units[static_cast<size_t>(plan.blocks[b].end - 1)].out_shape;
      const int64_t n_all = n_train + n_hold + data.test.size();
      if (static_cast<double>(ActivationCache::bytes_for(n_all, shape)) <= budget) continue;
      for (const int64_t n : {n_hold, data.test.size(), n_train}) numels.push_back(ActivationCache::bytes_for(n, shape) / 2);
    }
    if (!numels.empty()) ActivationCache::host_pool_prefill(numels);
  }

  // Per-unit exit accuracies on the held-out and test splits, filled as blocks finish.
  std::vector<double> hold_acc(static_cast<size_t>(n_units), 0), test_acc(static_cast<size_t>(n_units), 0);
  const auto logits_of = [&](int64_t u, const at::Tensor& h) {
    return u + 1 < n_units ? heads[static_cast<size_t>(u)]->forward(h) : h;
  };

  // Runs block b's units (eval, no grad) over every split's input: exit accuracies of its units; when the block is
  // not the last, its outputs become the next block's input caches. Returns the seconds spent.
  ActivationCache::IoStats pass_io;  // host caches' transfers in the last advance
  const auto io_json = [](const ActivationCache::IoStats& a) {
    return Json{{"host_copy_s", a.host_copy_s}, {"wait_s", a.wait_s}, {"gb_to_device", static_cast<double>(a.bytes_to_device) / kGB},
                {"gb_to_host", static_cast<double>(a.bytes_to_host) / kGB}};
  };
  const auto advance = [&](size_t b) {
    const double t0 = time_since_start_s();
    pass_io = ActivationCache::IoStats{};
    const BlockPlan& bp = plan.blocks[b];
    const bool last = b + 1 == plan.blocks.size();
    const torch::NoGradGuard no_grad;
    model->eval();
    for (auto& h : heads) h->eval();
    const std::vector<int64_t>& out_shape = profile.units[static_cast<size_t>(bp.end - 1)].out_shape;
    if (!last && b == 0) train_in.loader = std::make_unique<Loader>(train_set, data.mean, data.std, plain_lo, device);
    if (!last && train_in.loader) train_in.loader->epoch_begin(0);
    // The new caches go to the GPU when they, what is allocated now and the next block's training all fit.
    CachePlace place = CachePlace::kHost;
    if (!last && device.is_cuda()) {
      const double cache_bytes = static_cast<double>(ActivationCache::bytes_for(n_train + n_hold + data.test.size(), out_shape));
      const double next = plan.blocks[b + 1].bytes - resident;
      if (static_cast<double>(memory_stats(device).allocated_bytes) + cache_bytes + next <= po.safety * budget) {
        place = CachePlace::kDevice;
      }
    }
    SplitInput* inputs[3] = {&hold_in, &test_in, &train_in};
    std::vector<double>* accs[3] = {&hold_acc, &test_acc, nullptr};
    for (int s = 0; s < 3; ++s) {
      SplitInput& in = *inputs[s];
      if (last && s == 2) break;  // the last block writes no cache, and exits are not scored on the training split
      const int64_t n = in.size();
      const ActivationCache::IoStats in_before = in.cache ? in.cache->io_stats() : ActivationCache::IoStats{};
      std::unique_ptr<ActivationCache> out;
      if (!last) out = std::make_unique<ActivationCache>(n, out_shape, place, device, plain_lo.channels_last);
      at::Tensor correct = at::zeros({bp.end - bp.first}, at::TensorOptions().dtype(at::kFloat).device(device));
      int64_t pass_batch = bp.batch;  // halved when a batch of the pass runs out of memory (it is then redone)
      for (int64_t offset = 0; offset < n;) {
        const int64_t count = std::min(pass_batch, n - offset);
        // A short last batch runs as the window of pass_batch rows that ends the split (the rows before `offset` are
        // computed again, neither scored nor written twice): every batch then has the training step's shape, whose
        // cuDNN plans exist. A new shape costs plan building in every convolution (docs/neuroflux.md).
        const int64_t skip = pass_skip(offset, count, n, pass_batch);
        try {
          const at::Tensor labels = in.labels.narrow(0, offset, count);
          const AutocastScope autocast(device, options.precision);
          at::Tensor h = in.rows(offset - skip, count + skip, plain_lo.channels_last);
          std::vector<at::Tensor> hits;
          for (int64_t u = bp.first; u < bp.end; ++u) {
            h = units[static_cast<size_t>(u)].forward(h);
            if (accs[s]) hits.push_back(logits_of(u, h).narrow(0, skip, count).argmax(1).eq(labels).sum().to(at::kFloat));
          }
          if (out) out->write(offset, h.narrow(0, skip, count));
          for (size_t k = 0; k < hits.size(); ++k) correct[static_cast<int64_t>(k)].add_(hits[k]);
        } catch (const c10::OutOfMemoryError&) {
          TRIACCEL_CHECK_INPUT(pass_batch > 2, "out of memory in NeuroFlux block ", b,
                               "'s cache pass at batch 2; raise --vram-budget");
          memory_cache_release(device);
          events.write("oom", step, now(), Json{{"block", b}, {"pass", true}, {"batch", pass_batch},
                                                {"retry_batch", pass_batch / 2}});
          pass_batch /= 2;
          continue;
        }
        offset += count;
      }
      if (accs[s] && n > 0) {
        const at::Tensor c = correct.cpu();
        for (int64_t u = bp.first; u < bp.end; ++u) {
          (*accs[s])[static_cast<size_t>(u)] = 100.0 * c[u - bp.first].item<double>() / static_cast<double>(n);
        }
      }
      if (in.cache) pass_io += in.cache->io_stats() - in_before;
      if (out) {
        out->flush();
        pass_io += out->io_stats();
        in.loader.reset();
        in.cache = std::move(out);
      }
    }
    model->train();
    for (auto& h : heads) h->train();
    device_synchronize(device);
    return std::make_pair(time_since_start_s() - t0, place);
  };

  // A run resumed after block k rebuilds the caches by one forward pass through blocks [0, k).
  for (size_t b = 0; b < static_cast<size_t>(blocks_done); ++b) advance(b);

  SgdOptions so;
  so.momentum = options.momentum;
  so.nesterov = options.nesterov;
  so.weight_decay = options.weight_decay;
  const LrBatchRule lr_rule = lr_batch_rule_parse(options.lr_batch_rule);
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  bool stopped = false;
  for (size_t b = static_cast<size_t>(blocks_done); b < plan.blocks.size() && !stopped; ++b) {
    const BlockPlan& bp = plan.blocks[b];
    const int64_t n_block = bp.end - bp.first;
    const uint64_t block_seed = seed_mix(options.seed, kBlockStream + b);
    torch::manual_seed(block_seed);
    memory_stats_reset_peak(device);
    const int64_t retries_before = memory_stats(device).alloc_retries;

    std::vector<std::pair<std::string, at::Tensor>> named;
    std::vector<at::Tensor> params;
    for (int64_t u = bp.first; u < bp.end; ++u) {
      const Unit& unit = units[static_cast<size_t>(u)];
      for (size_t m = 0; m < unit.modules.size(); ++m) {
        for (const auto& item : unit.modules[m]->named_parameters()) {
          named.emplace_back(c10::str(unit.name, "/", m, ".", item.key()), item.value());
        }
      }
      if (u + 1 < n_units) {
        for (const auto& item : heads[static_cast<size_t>(u)]->named_parameters()) {
          named.emplace_back(kAuxPrefix + unit.name + "." + item.key(), item.value());
        }
      }
    }
    for (const auto& [name, p] : named) params.push_back(p);
    Sgd sgd(named, so);

    std::unique_ptr<Loader> train_aug;  // block 0: shuffled, augmented batches from the data
    if (b == 0) {
      LoaderOptions lo = train_lo;
      lo.batch_size = bp.batch;
      train_aug = std::make_unique<Loader>(train_set, data.mean, data.std, lo, device);
    }
    const int64_t steps_per_epoch = (n_train + bp.batch - 1) / bp.batch;
    ScheduleOptions sched;
    sched.base_lr = options.lr * lr_scale_for_batch(lr_rule, bp.batch, options.batch_size);
    sched.decay = lr_decay_parse(options.lr_decay);
    sched.total_steps = steps_per_epoch * options.epochs;
    sched.warmup_steps = static_cast<int64_t>(
        std::llround(options.warmup_epochs_resolved() * static_cast<double>(steps_per_epoch)));
    sched.validate();
    at::Tensor lr = at::zeros({1}, f32);
    const at::Tensor found_inf = at::zeros({1}, f32);
    at::Tensor loss_sum = at::zeros({n_block}, f32), correct = at::zeros({n_block}, f32);
    std::vector<double> epoch_times;
    int64_t block_step = 0;
    int64_t short_steps = 0;  // steps below the planned batch (only after an out-of-memory retry)
    int64_t batch = bp.batch;  // smaller than planned only after an out-of-memory retry

    // One training step of the block on (x, y): local losses, one backward, the fused SGD step (lr read on the
    // device). On CUDA, steps at the planned batch are captured once in a CUDA graph after kGraphWarmup eager ones
    // and replayed (static input buffers), as the trainer's step does. The epoch's short last batch is filled up to
    // the planned batch with the epoch's first samples (they train twice that epoch, and count twice in the local
    // loss and accuracy): every step has one shape, so it replays the graph, and cuDNN builds plans for no second
    // shape (on EfficientNet-B0 that building cost seconds per block; docs/neuroflux.md). Only after an
    // out-of-memory retry (a batch below the planned one) do steps run eagerly with a short last batch.
    const auto grads_release = [&params]() {
      for (const auto& p : params) {
        if (p.grad().defined()) const_cast<at::Tensor&>(p).mutable_grad().reset();
      }
    };
    const auto body = [&](const at::Tensor& xb, const at::Tensor& yb) {
      grads_release();
      at::Tensor loss;
      {
        const AutocastScope autocast(device, options.precision);
        loss = neuroflux_block_loss(*model, heads, bp.first, bp.end, xb, yb, options.label_smoothing, &loss_sum,
                                    &correct);
      }
      loss.backward();
      sgd.step(lr, found_inf);
    };
    BlockGraph graph;
    graph.enabled = device.is_cuda() && options.cuda_graphs;
    // The input cache's transfers while the block trains: its counters now, subtracted when it has trained.
    const ActivationCache::IoStats train_before =
        train_in.cache ? train_in.cache->io_stats() : ActivationCache::IoStats{};
    for (int64_t epoch = 0; epoch < options.epochs; ++epoch) {
      const uint64_t epoch_seed = seed_mix(block_seed, static_cast<uint64_t>(epoch));
      at::Tensor order, order_dev, flip;
      if (train_aug) {
        train_aug->epoch_begin(epoch);
      } else {
        order = permutation(n_train, epoch_seed);
        order_dev = order.to(device);  // once per epoch: a per-step copy of the index would wait for the GPU
        if (train_lo.augment && train_in.cache && profile.units[static_cast<size_t>(bp.first)].in_shape.size() == 3) {
          // Cached feature maps get the horizontal flip (crops do not survive the cache; docs/neuroflux.md).
          at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed_mix(epoch_seed, 1));
          flip = at::rand({n_train}, gen).lt(0.5).to(device);
        }
      }
      loss_sum.zero_();
      correct.zero_();
      device_synchronize(device);
      const double t_epoch = time_since_start_s();
      for (int64_t offset = 0; offset < n_train;) {
        const int64_t count = std::min(batch, n_train - offset);
        const int64_t fill = epoch_fill(offset, count, n_train, batch, bp.batch);
        at::Tensor x, y;
        // The schedule follows the data position (on the planned batch's step grid), the lr the batch actually used.
        const int64_t position = (epoch * n_train + offset) / bp.batch;
        lr.fill_(schedule_lr(sched, position) * lr_scale_for_batch(lr_rule, batch, bp.batch));
        try {
          if (train_aug) {
            std::tie(x, y) = train_aug->batch(offset, count);
            if (fill > 0) {
              const auto [x0, y0] = train_aug->batch(0, fill);
              x = at::cat({x, x0});
              y = at::cat({y, y0});
            }
          } else {
            const auto rows_of = [&](const at::Tensor& idx) {
              return fill > 0 ? at::cat({idx.narrow(0, offset, count), idx.narrow(0, 0, fill)}) : idx.narrow(0, offset, count);
            };
            const at::Tensor index_dev = rows_of(order_dev);
            const bool host = train_in.cache->place() == CachePlace::kHost;
            x = SplitInput::layout(train_in.cache->read(host ? rows_of(order) : index_dev),
                                   plain_lo.channels_last);  // (count + fill, C, H, W) float32
            y = train_in.labels.index_select(0, index_dev);
            if (flip.defined()) x = at::where(flip.index_select(0, index_dev).view({-1, 1, 1, 1}), x.flip({3}), x);
          }
          graph.run(body, x, y, count + fill == bp.batch);
          if (count + fill < bp.batch) ++short_steps;
        } catch (const c10::OutOfMemoryError&) {
          x = at::Tensor();
          y = at::Tensor();
          if (graph.captured()) {
            // An eager step (the epoch's short last batch) beside the graph's pool: drop the graph (it is captured
            // again after the warm-up) and retry the same samples at the same batch.
            graph.drop();
            memory_cache_release(device);
            events.write("oom", step, now(), Json{{"block", b}, {"batch", count}, {"retry_batch", count},
                                                  {"reason", "beside the CUDA graph's pool"}});
            continue;
          }
          // The plan was off (fragmentation, workspaces): the same samples again at half the batch, eagerly.
          TRIACCEL_CHECK_INPUT(batch > 2, "out of memory in NeuroFlux block ", b, " at batch 2; raise --vram-budget");
          graph.refuse();
          memory_cache_release(device);
          events.write("oom", step, now(), Json{{"block", b}, {"batch", batch}, {"retry_batch", batch / 2}});
          batch /= 2;
          continue;
        }
        offset += count;
        ++block_step;
        ++step;
        if (hooks.after_step) hooks.after_step(step);
      }
      device_synchronize(device);
      epoch_times.push_back(time_since_start_s() - t_epoch);
      log_line(options, c10::str("block ", b + 1, "/", plan.blocks.size(), " epoch ", epoch + 1, "/", options.epochs,
                                 ": local loss ", loss_sum[n_block - 1].item<double>() / static_cast<double>(n_train),
                                 ", ", epoch_times.back(), " s, ", memory_stats(device).alloc_retries - retries_before,
                                 " allocator retries"));
    }
    train_aug.reset();
    const Json input_place = train_in.cache ? Json(cache_place_name(train_in.cache->place())) : Json(nullptr);
    const double train_s = std::accumulate(epoch_times.begin(), epoch_times.end(), 0.0);
    const ActivationCache::IoStats train_io =
        train_in.cache ? train_in.cache->io_stats() - train_before : ActivationCache::IoStats{};
    // The graph's pool goes back before the cache pass, which needs the room (a 0.45 GB ResNet-18 run ran out of
    // memory in its first pass beside it).
    const bool cuda_graph_at_end = graph.captured();
    // The block's gradients were allocated in the graph's pool: while they live, its segments cannot be freed (an
    // EfficientNet-B0 run at 0.5 GB ran out of memory in a later pass at batch 2 with the finished blocks' pools held).
    grads_release();
    graph.drop();
    memory_cache_release(device);
    const auto [cache_s, place] = advance(b);
    const MemoryStats mem = memory_stats(device);
    const double block_peak_gb = static_cast<double>(mem.peak_allocated_bytes) / kGB;
    peak_gb = std::max(peak_gb, block_peak_gb);
    block_seconds.push_back(train_s + cache_s);

    Json names = Json::array(), local = Json::array();
    const at::Tensor loss_cpu = loss_sum.cpu(), correct_cpu = correct.cpu();
    for (int64_t u = bp.first; u < bp.end; ++u) {
      names.push_back(units[static_cast<size_t>(u)].name);
      local.push_back(Json{{"unit", units[static_cast<size_t>(u)].name},
                           {"train_loss", loss_cpu[u - bp.first].item<double>() / static_cast<double>(n_train)},
                           {"train_acc", 100.0 * correct_cpu[u - bp.first].item<double>() / static_cast<double>(n_train)},
                           {"holdout_acc", hold_acc[static_cast<size_t>(u)]},
                           {"test_acc", test_acc[static_cast<size_t>(u)]}});
    }
    const bool last = b + 1 == plan.blocks.size();
    events.write("block", step, now(),
                 Json{{"block", b}, {"units", names}, {"batch", bp.batch}, {"final_batch", batch}, {"head_level", bp.head_level},
                      {"epochs", options.epochs}, {"steps", block_step},
                      {"short_steps", short_steps}, {"train_s", train_s},
                      {"epoch_s", train_s / static_cast<double>(options.epochs)}, {"cache_s", cache_s},
                      {"input", b == 0 ? "data" : "cache"},
                      {"input_cache_place", input_place},
                      {"output_cache_place", last ? Json(nullptr) : Json(cache_place_name(place))},
                      {"peak_vram_gb", block_peak_gb}, {"predicted_gb", bp.bytes / kGB},
                      {"alloc_retries", mem.alloc_retries - retries_before}, {"cuda_graph", cuda_graph_at_end},
                      {"graph_capture_ooms", graph.capture_ooms},
                      {"graph_capture_error", graph.capture_error.empty() ? Json(nullptr) : Json(graph.capture_error)},
                      {"graph_capture_mode", graph.relaxed ? "relaxed" : "global"},
                      {"train_io", io_json(train_io)},
                      {"cache_io", io_json(pass_io)}, {"local", local}});
    blocks_done = static_cast<int64_t>(b) + 1;

    // Checkpoint at the block boundary: weights of every unit and head, the plan and the progress.
    Checkpoint c;
    c.config = options.to_json();
    c.model_arch = options.model;
    c.model = live_state();
    c.rng = {{"cpu", at::detail::getDefaultCPUGenerator().get_state()}};
    c.progress = Json{{"neuroflux", true}, {"blocks_done", blocks_done}, {"step", step}, {"elapsed_s", now()},
                      {"peak_vram_gb", peak_gb}, {"block_seconds", block_seconds}, {"plan", plan_to_json(plan)}};
    const std::string ckpt_path = (std::filesystem::path(options.out) / kCheckpointFile).string();
    checkpoint_write(ckpt_path, c);
    events.write("checkpoint", step, now(), Json{{"path", ckpt_path}, {"blocks_done", blocks_done}});
    if (options.max_steps > 0 && step >= options.max_steps && !last) stopped = true;
  }

  if (stopped) {
    const Json fields{{"reason", "max_steps"}, {"blocks_done", blocks_done}};
    events.write("stop", step, now(), fields);
    log_line(options, c10::str("stopped after block ", blocks_done, " at step ", step,
                               " (--max-steps); continue with --resume ", options.out));
    return fields;
  }

  // Exits: the prefix up to unit u plus its head. Chosen on held-out data: the fewest parameters among the exits
  // whose held-out accuracy is within --nf-exit-tolerance points of the full network's (the last exit); the full
  // network when nothing is held out.
  std::vector<int64_t> exit_params(static_cast<size_t>(n_units), 0);
  int64_t prefix = 0;
  for (int64_t u = 0; u < n_units; ++u) {
    prefix += units[static_cast<size_t>(u)].parameter_count();
    exit_params[static_cast<size_t>(u)] = prefix + (u + 1 < n_units ? heads[static_cast<size_t>(u)]->parameter_count() : 0);
  }
  const int64_t chosen = n_hold > 0 ? exit_choose(hold_acc, exit_params, options.nf_exit_tolerance) : n_units - 1;

  // Export: the full network (model.pt) and the early-exit prefix (exit_model.pt: the kept units' torchvision names
  // plus the head as "exit.*"; exit.json describes it).
  const std::filesystem::path out_dir(options.out);
  const std::string model_path = (out_dir / "model.pt").string();
  const std::string exit_path = (out_dir / kExitModelFile).string();
  model_export_state_dict(*model, model_path);
  std::vector<at::Tensor> kept_params;
  std::unordered_set<const c10::TensorImpl*> kept;
  for (int64_t u = 0; u <= chosen; ++u) {
    for (const auto& m : units[static_cast<size_t>(u)].modules) {
      for (const auto& p : m->parameters()) {
        kept.insert(p.unsafeGetTensorImpl());
        kept_params.push_back(p);
      }
      for (const auto& t : m->buffers()) kept.insert(t.unsafeGetTensorImpl());
    }
  }
  std::vector<std::pair<std::string, at::Tensor>> exit_state;
  for (const auto& [name, t] : model_state(*model)) {
    if (kept.count(t.unsafeGetTensorImpl()) != 0) exit_state.emplace_back(name, t);
  }
  Json head_json = nullptr;
  if (chosen + 1 < n_units) {
    AuxHead head = heads[static_cast<size_t>(chosen)];
    for (const auto& item : head->named_parameters()) {
      exit_state.emplace_back("exit." + item.key(), item.value());
      kept_params.push_back(item.value());
    }
    for (const auto& item : head->named_buffers()) exit_state.emplace_back("exit." + item.key(), item.value());
    head_json = Json{{"filters", head->filters()}, {"pool", kAuxPool}, {"params", head->parameter_count()},
                     {"layers", head->filters() > 0 ? "conv3x3(no bias) -> bn -> relu -> adaptive_avg_pool(2) -> flatten -> fc"
                                                    : "adaptive_avg_pool(2) -> flatten -> fc"}};
  }
  state_dict_write(exit_state, kept_params, exit_path);

  // Inference throughput of the exit model and of the full network, eval mode, on a zero batch.
  model->eval();
  for (auto& h : heads) h->eval();
  const at::Tensor probe = SplitInput::layout(
      at::zeros(std::vector<int64_t>{device.is_cuda() ? 256 : 8, sample_shape[0], sample_shape[1], sample_shape[2]}, f32),
      plain_lo.channels_last);
  const double exit_rate = inference_throughput(
      [&](const at::Tensor& x) {
        const AutocastScope autocast(device, options.precision);
        at::Tensor h = x;
        for (int64_t u = 0; u <= chosen; ++u) h = units[static_cast<size_t>(u)].forward(h);
        return logits_of(chosen, h);
      },
      probe, device);
  const double full_rate = inference_throughput(
      [&](const at::Tensor& x) {
        const AutocastScope autocast(device, options.precision);
        return model->forward(x);
      },
      probe, device);
  const int64_t full_params = model->parameter_count();
  Json exits = Json::array();
  for (int64_t u = 0; u < n_units; ++u) {
    exits.push_back(Json{{"unit", units[static_cast<size_t>(u)].name}, {"index", u},
                         {"params", exit_params[static_cast<size_t>(u)]},
                         {"holdout_acc", hold_acc[static_cast<size_t>(u)]},
                         {"test_acc", test_acc[static_cast<size_t>(u)]}});
  }
  Json kept_units = Json::array();
  for (int64_t u = 0; u <= chosen; ++u) kept_units.push_back(units[static_cast<size_t>(u)].name);
  const Json chosen_json{{"unit", units[static_cast<size_t>(chosen)].name},
                         {"index", chosen},
                         {"units_kept", kept_units},
                         {"head", head_json},
                         {"params", exit_params[static_cast<size_t>(chosen)]},
                         {"params_ratio", static_cast<double>(full_params) / static_cast<double>(exit_params[static_cast<size_t>(chosen)])},
                         {"holdout_acc", hold_acc[static_cast<size_t>(chosen)]},
                         {"test_acc", test_acc[static_cast<size_t>(chosen)]},
                         {"images_per_s", exit_rate},
                         {"full_images_per_s", full_rate},
                         {"throughput_batch", probe.size(0)},
                         {"path", exit_path}};
  events.write("exit", step, now(),
               Json{{"exits", exits}, {"chosen", chosen_json}, {"tolerance", options.nf_exit_tolerance},
                    {"selected_on", n_hold > 0 ? "holdout" : "none (full network)"}, {"full_params", full_params}});
  Json exit_doc{{"model", options.model}, {"dataset", options.dataset}, {"input_shape", sample_shape},
                {"num_classes", mo.num_classes}, {"mean", data.mean}, {"std", data.std},
                {"full_params", full_params}};
  for (const auto& item : chosen_json.items()) exit_doc[item.key()] = item.value();
  file_write_atomic((out_dir / kExitJsonFile).string(), exit_doc.dump(2) + "\n");

  const double total_train_s = std::accumulate(block_seconds.begin(), block_seconds.end(), 0.0);
  const double epoch_s = total_train_s / static_cast<double>(options.epochs);
  const double acc = test_acc[static_cast<size_t>(n_units - 1)];
  Json summary{{"test_acc", acc},
               {"epoch_s", epoch_s},
               {"train_s", total_train_s},
               {"peak_vram_gb", peak_gb},
               {"peak_vram_includes_dataset", true},
               {"eff_score", epoch_s > 0 && peak_gb > 0 ? Json(acc / (epoch_s * peak_gb)) : Json(nullptr)},
               {"params", full_params},
               {"method", "neuroflux"},
               {"model", options.model},
               {"dataset", options.dataset},
               {"precision", precision_mode_name(options.precision)},
               {"budget_gb", budget / kGB},
               {"blocks", plan.blocks.size()},
               {"block_batches", [&]() { Json a = Json::array(); for (const auto& b : plan.blocks) a.push_back(b.batch); return a; }()},
               {"backprop_max_batch", backprop_batch},
               {"exit_unit", units[static_cast<size_t>(chosen)].name},
               {"exit_params", exit_params[static_cast<size_t>(chosen)]},
               {"exit_test_acc", test_acc[static_cast<size_t>(chosen)]},
               {"exit_images_per_s", exit_rate},
               {"epochs", options.epochs},
               {"steps", step},
               {"total_s", now()},
               {"device", device_long_name(device)},
               {"model_path", model_path},
               {"exit_model_path", exit_path}};
  events.write("summary", step, now(), summary);
  log_line(options, c10::str("done: test acc ", acc, " % (exit ", units[static_cast<size_t>(chosen)].name, ": ",
                             test_acc[static_cast<size_t>(chosen)], " %, ", exit_params[static_cast<size_t>(chosen)],
                             " params), ", epoch_s, " s/epoch, peak ", peak_gb, " GB; events in ", events_path));
  return summary;
}

}  // namespace triaccel
