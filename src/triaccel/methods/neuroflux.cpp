// The NeuroFlux runner; see neuroflux.h and docs/neuroflux.md.
// Invariants: every unit trains on a detached input, so no gradient crosses a unit boundary; block b reads its
// training input only from the loader (b = 0) or the cache written by block b-1, never by running earlier blocks;
// every random choice (held-out split, head initialization, per-block data order and flips) is a pure function of
// (seed, block, epoch), so a run resumed at a block boundary ends with the same weights as an uninterrupted one.
// A checkpoint inside a block (a stop request, checkpoint_every, checkpoint_minutes) also holds the block's position
// (epoch, offset, batch), its SGD momenta, its running local-loss sums and the generators: resumed there, the block
// continues with the next step as if it had not stopped.
#include "triaccel/methods/neuroflux.h"

#include "triaccel/control/batch_controller.h"
#include "triaccel/control/memory_profile.h"
#include "triaccel/control/partitioner.h"
#include "triaccel/core/bytes.h"
#include "triaccel/core/device.h"
#include "triaccel/core/errors.h"
#include "triaccel/core/io.h"
#include "triaccel/core/profile.h"
#include "triaccel/data/dataset.h"
#include "triaccel/data/loader.h"
#include "triaccel/methods/activation_cache.h"
#include "triaccel/models/registry.h"
#include "triaccel/optim/sgd.h"
#include "triaccel/run/component_options.h"
#include "triaccel/run/rank_rows.h"
#include "triaccel/train/checkpoint.h"
#include "triaccel/train/grad_buckets.h"
#include "triaccel/train/precision.h"
#include "triaccel/train/rng.h"
#include "triaccel/train/schedule.h"
#include "triaccel/train/step_graph.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/autograd.h>
#include <torch/utils.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <mutex>
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
constexpr const char* kBlockSums = "neuroflux_block.";  // a block in progress: its loss sums in the optimizer state
// Under a vram_budget the dataset streams from pinned host memory when its images would take more than this share.
constexpr double kHostDataShare = 0.25;

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

namespace {

// An out-of-memory event's reading of the allocator, and the error's first line (what was asked for, what was free).
Json oom_reading(const c10::OutOfMemoryError& e, const c10::Device& device) {
  const MemoryStats m = memory_stats(device);
  std::string what = e.what_without_backtrace();
  what = what.substr(0, std::min(what.find('\n'), size_t{400}));
  return Json{{"allocated_gb", static_cast<double>(m.allocated_bytes) / kGB},
              {"reserved_gb", static_cast<double>(m.reserved_bytes) / kGB}, {"error", what}};
}

// An oom event's reason for the `ooms`-th error of a block beside its CUDA graph's pool: from the second on the block
// stays eager.
const char* beside_pool_reason(int64_t ooms) {
  return ooms > 1 ? "beside the CUDA graph's pool again: eager from here" : "beside the CUDA graph's pool";
}

Json cache_place_or_null(const std::unique_ptr<ActivationCache>& cache) {
  return cache ? Json(cache_place_name(cache->place())) : Json(nullptr);
}

// Data parallel: rank 0's plan on every rank (a measured profile reads each GPU's own allocator, and every rank must
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

// What one block's training leaves for its event.
struct BlockResult {
  int64_t final_batch = 0;
  int64_t steps = 0;
  int64_t short_steps = 0;  // steps below the planned batch (only after an out-of-memory retry)
  double train_s = 0;
  at::Tensor loss_sum, correct;  // per unit of the block, summed over the last epoch
  bool cuda_graph = false;
  int64_t capture_ooms = 0;
  std::string capture_error;
  bool relaxed = false;
  ActivationCache::IoStats train_io;
  Json input_place;  // where the block's input cache lives ("device", "host"); null for block 0 (the data)
  int64_t alloc_retries_before = 0;  // the allocator's retries when the block started
  Json replan;                       // the block's batch re-planned at its start from the allocator (null: as planned)
  Json calibration;                  // the measured step it was re-planned from (null: none; the CPU, a resume); its
                                     // seconds ("s") are in train_s
  double train_peak_gb = 0;          // the allocator's peak over the block's training (before its cache pass)
  bool stopped = false;              // stopped inside the block (a stop request); its checkpoint is written
};

class BlockTrainer;

// The NeuroFlux run on a session: the phases in the order they run.
class NeuroFluxRun {
 public:
  explicit NeuroFluxRun(Session& session);
  Json run();

 private:
  void data_split();
  void plan_make();
  void heads_make();
  void restore();
  void events_open();
  void host_prefill();
  double cache_pass(size_t b, CachePlace* place);
  void cache_pass_split(size_t b, SplitInput& in, std::vector<double>* accs, CachePlace place);
  BlockResult block_train(size_t b);
  // Data parallel: rank 0's buffers (BatchNorm's running statistics, gathered from its shares) of block b's units and
  // heads on every rank, as DDP broadcasts them, so the cache pass and the exits are one model's on every rank.
  void buffers_agree(size_t b);
  // After every step of a block: checkpoints inside it when one is due or a stop is requested; true: stop.
  bool block_step_done(const BlockTrainer& trainer);
  // Ends the run early for `reason` (its checkpoint is written): the stop event and line. block_in_progress: the
  // block stopped inside (-1: at a block boundary).
  Json stop(const std::string& reason, int64_t block_in_progress);
  void checkpoint(const BlockTrainer* in_block);
  void block_end(size_t b, const BlockResult& r);
  NamedTensors live_state() const;
  at::Tensor logits_of(int64_t u, const at::Tensor& h);
  Json exits_export();
  Json summary(const Json& chosen);

  // Declared first, so destroyed last: after the caches have given their host memory back to the pool, it is freed.
  struct HostPoolRelease {
    ~HostPoolRelease() { ActivationCache::host_pool_release(); }
  } host_pool_release_;
  Session& session_;
  const Config& config_;
  const c10::Device device_;
  Model& model_;
  const std::vector<Unit>& units_;
  const int64_t n_units_;
  // Data: the training split minus a seeded held-out part (for choosing the exit), and the test split.
  Dataset train_set_, hold_set_;
  int64_t n_train_ = 0, n_hold_ = 0;
  LoaderOptions plain_lo_, train_lo_;
  SplitInput hold_in_, test_in_, train_in_;  // train_in_: the loader for block 0 (built on demand), else the cache
  std::vector<int64_t> sample_shape_;
  double resident_ = 0;
  bool host_data_ = false;  // the images stream from pinned host memory (a tight vram_budget)
  // Plan.
  ProfileSource source_ = ProfileSource::kModel;
  MemoryProfile profile_;
  double profile_s_ = 0;
  bool explicit_budget_ = false;
  double budget_ = 0;
  PartitionOptions po_;
  Partition plan_;
  int64_t backprop_batch_ = 0;
  std::vector<AuxHead> heads_;
  // Progress (restored from the checkpoint when resuming at a block boundary).
  int64_t blocks_done_ = 0, step_ = 0;
  double peak_gb_ = 0;
  std::string stop_reason_;        // a stop request's reason (sigint, sigterm)
  Json block_resume_;              // the block in progress at the checkpoint resumed from (null: none)
  NamedTensors block_resume_state_;
  std::vector<double> block_seconds_;  // training + cache pass, per block
  // Per-unit exit accuracies on the held-out and test splits, filled as blocks finish.
  std::vector<double> hold_acc_, test_acc_;
  ActivationCache::IoStats pass_io_;  // host caches' transfers in the last cache pass
  int64_t pass_rows_ = 0;             // rows this rank ran through the block in the last cache pass
  int64_t pass_batch_ = 0;            // the cache pass's batch: the block's, lower after an out-of-memory retry
};

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
  n_hold_ = std::min(config_.neuroflux.nf_holdout, n_all / 10);
  const at::Tensor split = permutation(n_all, seed_mix(config_.execution.seed, kHoldoutStream));
  train_set_ = dataset_rows(data.train, std::get<0>(split.narrow(0, n_hold_, n_all - n_hold_).sort()));
  hold_set_ = dataset_rows(data.train, std::get<0>(split.narrow(0, 0, n_hold_).sort()));
  plain_lo_ = session_.loader_options(LoaderRole::kPlain);
  train_lo_ = session_.loader_options(LoaderRole::kTrain);
  // Under a tight vram_budget the images stay in pinned host memory and stream a batch at a time (data/loader.h):
  // resident, the training split alone took 138 of ResNet-18's 286 MiB at 0.3 GB on the H100 and its upload ran out
  // of memory before the first step.
  const double budget = static_cast<double>(config_.execution.vram_budget_bytes());
  const double images = static_cast<double>(data.train.images.numel() + data.test.images.numel());
  host_data_ = device_.is_cuda() && budget > 0 && images > kHostDataShare * budget;
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
  // Streamed: labels and the order stay, plus two uint8 staging batches of the largest block batch.
  const double staging = 2.0 * static_cast<double>(config_.neuroflux.nf_max_batch * data.train.images[0].numel());
  const auto resident_of = [&](const Dataset& d) {
    return host_data_ ? static_cast<double>(16 * d.size()) + staging
                      : static_cast<double>(d.images.numel() + 16 * d.size());
  };
  resident_ = resident_of(train_set_) + resident_of(hold_set_) + resident_of(data.test);
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
  explicit_budget_ = config_.execution.vram_budget_bytes() > 0;
  // Without a budget NeuroFlux trains in the memory backprop would use at batch_size; backprop keeps the whole
  // training split (held-out part included) and the test split resident.
  budget_ = explicit_budget_ ? static_cast<double>(config_.execution.vram_budget_bytes())
                             : profile_.backprop_bytes(config_.schedule.batch_size) + resident_;
  po_ = partition_options(config_);
  po_.budget_bytes = budget_;
  po_.base_bytes = resident_;
  po_.samples = n_train_;
  if (!device_.is_cuda()) {  // the CPU: slower, saturated at small batches, and its "host cache" is just memory
    po_.bytes_per_s = 5e9;
    po_.sat_batch = 32;
    po_.host_bytes_per_s = 0;
  }
  const auto& ckpt = session_.checkpoint();
  plan_ = ckpt ? plan_from_json(ckpt->progress.at("plan"), n_units_, session_.checkpoint_file())
               : plan_agree(session_.dist(), partition_plan(profile_, po_));
  backprop_batch_ = profile_.backprop_max_batch(po_.safety * budget_ - resident_);
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
  // through Gloo took longer than computing them (two H200s, ResNet-18 at 0.5 GB: block 0's pass 1.25 → 3.23 s).
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
      Json fields = oom_reading(e, device_);
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

// One block's training: its parameters (units and heads) under one fused SGD, its own batch, schedule and data
// order, its steps through a StepGraph.
class BlockTrainer {
 public:
  BlockTrainer(Session& session, const BlockPlan& bp, size_t b, size_t n_blocks, const std::vector<AuxHead>& heads,
               const Dataset& train_set, SplitInput& train_in, const LoaderOptions& train_lo,
               const LoaderOptions& plain_lo, const MemoryProfile& profile, const PartitionOptions& po,
               int64_t* run_step);
  // Called after every step; returning true stops the block there (its result has `stopped`).
  using AfterStep = std::function<bool(const BlockTrainer&)>;
  void on_step(AfterStep f) { after_step_ = std::move(f); }
  // Continues from a checkpoint written inside this block: `progress` and `state` as progress() and state() gave.
  void resume(const Json& progress, const NamedTensors& state, const std::string& path);
  // Trains every epoch (from the resumed position); the block's result for its event.
  BlockResult train();

  // Where the block is, for a checkpoint: its index, epoch, offset in the epoch, batch, steps, epoch times.
  Json progress() const;
  // Data parallel: the stop request and the checkpoint due after the step that just ran, agreed with that step
  // (step_agreed); empty in one process.
  const std::optional<std::pair<StopRequest, bool>>& agreed() const { return agreed_; }
  // The block's SGD momenta and running loss sums (data parallel: summed over the ranks, a collective every rank
  // makes; resume() gives them back to rank 0).
  NamedTensors state() const;

 private:
  void epoch(int64_t e);
  // One step at [offset, offset + count) of epoch order `order` (fill: rows from the epoch's start); false: retry.
  bool step_at(int64_t e, int64_t offset, int64_t count, int64_t fill, const at::Tensor& order,
               const at::Tensor& order_dev, const at::Tensor& flip);
  // Data parallel, on a rank whose step ran out of memory: its part of the step's collectives (so every rank stays in
  // step, and every rank's update is skipped through skip_); `reading` and the batch it proposes wait for step_agreed.
  bool step_failed(Json reading, int64_t proposal);
  // Data parallel, after every step on every rank, in the step's stop agreement (agreed()): true when it ran on every
  // rank. Otherwise every rank retries the same samples at the smallest batch a rank proposed (rank 0 writes the oom
  // event), or stops with one line when a rank proposes none.
  bool step_agreed(bool ran);
  void grads_release();
  void body(const at::Tensor& x, const at::Tensor& y);

  Session& session_;
  const Config& config_;
  const BlockPlan& bp_;
  const size_t b_;
  const size_t n_blocks_;
  const std::vector<AuxHead>& heads_;
  SplitInput& train_in_;
  const LoaderOptions& train_lo_;
  const LoaderOptions& plain_lo_;
  const MemoryProfile& profile_;
  const PartitionOptions& po_;
  double fixed_bytes_ = 0;  // what a step needs at any batch: held at the block's start + the block's own fixed bytes
  int64_t* run_step_;
  const int64_t n_train_;
  const uint64_t block_seed_;
  std::vector<at::Tensor> params_;
  std::unique_ptr<Sgd> sgd_;
  std::unique_ptr<GradBuckets> buckets_;  // data parallel: the gradients' sum over the ranks (null: one process)
  std::unique_ptr<Loader> train_aug_;  // block 0: shuffled, augmented batches from the data
  ScheduleOptions sched_;
  at::Tensor lr_;
  // Nonzero skips the update. Data parallel: the ranks' sum, made in every step, of 1 from each rank that ran out of
  // memory in it (step_failed); the ranks' loss sums take the step's only where it is 0.
  at::Tensor skip_;
  at::Tensor step_loss_, step_correct_, keep_;  // data parallel: the step's sums, and 1 - min(skip_, 1)
  // Data parallel: how far the step came on this rank (-1: before its body, 0: in it, 1: the gradients summed, 2:
  // skip_ too).
  int phase_ = -1;
  int64_t proposal_ = 0;  // data parallel: the batch this rank proposes after running out of memory (0: none fits)
  Json own_oom_;          // and its reading
  std::optional<std::pair<StopRequest, bool>> agreed_;  // data parallel: the last step's stop agreement
  StepGraph graph_;
  std::vector<double> epoch_times_;
  int64_t retries_before_ = 0;
  BlockResult r_;
  int64_t batch_ = 0;  // smaller than planned only after an out-of-memory retry
  int64_t beside_pool_ooms_ = 0;  // out-of-memory errors beside the CUDA graph's pool in this block
  AfterStep after_step_;
  // Position: the epoch and offset of the next step; the current epoch's training time before this session.
  int64_t epoch_ = 0, offset_ = 0;
  double epoch_before_s_ = 0, t_epoch_ = 0;
};

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

bool BlockTrainer::step_failed(Json reading, int64_t proposal) {
  own_oom_ = std::move(reading);
  proposal_ = proposal;
  if (phase_ == 2) return false;  // the update had begun: step_agreed stops every rank
  skip_.fill_(1);
  if (phase_ == -1 && graph_.captured()) {
    // The other ranks replay their graphs (their steps are all at its batch; the ranks' graphs are alike): so does
    // this rank, on the last step's inputs, its flag set (NCCL: a captured collective is every rank's or none's).
    graph_.replay_as_is();
    return false;
  }
  if (phase_ <= 0) {
    grads_release();  // this rank's part of the sum: zeros (every rank skips the update)
    buckets_->finish();
  }
  session_.dist().all_reduce_sum(skip_);
  return false;
}

bool BlockTrainer::step_agreed(bool ran) {
  const int world = session_.dist().world_size();
  // In the step's stop agreement (one round trip): per rank {ran out of memory, the batch it proposes, it stops,
  // allocated GB, reserved GB}.
  std::vector<double> own(5, 0.0);
  own[1] = static_cast<double>(ran ? batch_ : proposal_);
  if (!ran) {
    own[0] = 1.0;
    own[2] = phase_ == 2 ? 1.0 : 0.0;
    own[3] = own_oom_.value("allocated_gb", 0.0);
    own[4] = own_oom_.value("reserved_gb", 0.0);
  }
  std::vector<std::vector<double>> rows;
  agreed_ = session_.stop_agreed(*run_step_ + 1, own, &rows);
  const auto [ranks, who] = ranks_out_of_memory(rows, /*allocated=*/3);
  int64_t retry = batch_;
  bool stop = false;
  for (const auto& row : rows) {
    retry = std::min(retry, static_cast<int64_t>(row[1]));
    stop = stop || (row[0] != 0 && row[2] > 0);
  }
  if (ranks.empty()) return true;
  agreed_.reset();  // a stop or a checkpoint waits for a step that ran
  skip_.zero_();
  grads_release();
  Json fields = ran ? Json::object() : own_oom_;  // rank 0's own reading, when it ran out
  fields.update(Json{{"block", b_}, {"batch", batch_}, {"retry_batch", retry}, {"ranks", ranks}});
  if (retry == batch_) fields["reason"] = beside_pool_reason(beside_pool_ooms_ + 1);
  if (stop || retry <= 0) fields["action"] = "stopped";
  session_.event(event::kOom, *run_step_, fields);
  TRIACCEL_CHECK_INPUT(!stop, who, " ran out of GPU memory in NeuroFlux block ", b_, " after the step's update "
                       "had begun (the ranks' weights may differ); resume from the last checkpoint with a larger ",
                       option_ref("vram_budget"), ": ", option_ref("resume"), " ", config_.output.out);
  TRIACCEL_CHECK_INPUT(retry > 0, who, " ran out of GPU memory in NeuroFlux block ", b_, " at batch ", batch_, " (",
                       (batch_ + world - 1) / world, " per rank) and no smaller batch fits; resume from the last "
                       "checkpoint with a larger ", option_ref("vram_budget"), " or on more GPUs: ",
                       option_ref("resume"), " ", config_.output.out, " ", option_ref("nproc"), " N");
  // Every rank's graph as the rank that ran out left its own (NCCL: a captured collective is every rank's or none's):
  // a smaller batch steps eagerly; beside a captured graph, the graph goes and is captured again after the warm-up,
  // and the second time the block stays eager (as in one process).
  if (retry < batch_) {
    graph_.refuse();
    batch_ = retry;
  } else {  // retried at the batch: the error came beside a captured graph (the ranks' graphs are alike)
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
  // The graph's pool goes back before the cache pass, which needs the room (a 0.45 GB ResNet-18 run ran out of
  // memory in its first pass beside it). The block's gradients were allocated in the graph's pool: while they live,
  // its segments cannot be freed (an EfficientNet-B0 run at 0.5 GB ran out of memory in a later pass at batch 2 with
  // the finished blocks' pools held).
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
    const bool ran = step_at(e, offset_, count, fill, order, order_dev, flip);
    if (!(buckets_ ? step_agreed(ran) : ran)) continue;
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
  const c10::Device& device = session_.device();
  // The schedule follows the data position (on the planned batch's step grid), the lr the batch actually used.
  const int64_t position = (e * n_train_ + offset) / bp_.batch;
  lr_.fill_(schedule_lr(sched_, position) * lr_scale_for_batch(config_.schedule.lr_batch_rule, batch_, bp_.batch));
  at::Tensor x, y;
  phase_ = -1;
  try {
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
  } catch (const c10::OutOfMemoryError& e) {
    // Data parallel: the retry below is this rank's proposal; step_agreed makes it every rank's (or stops them all).
    Json fields = oom_reading(e, device);
    x = at::Tensor();
    y = at::Tensor();
    if (graph_.captured()) {
      // A step's input or an eager step (the epoch's short last batch) beside the graph's pool: drop the graph and
      // retry the same samples at the same batch. The first time the graph is captured again after the warm-up; the
      // second time the block stays eager (a graph captured again only ran out of memory again: an H100 ResNet-18 run
      // at 0.35 GB captured and dropped it every 4 steps of a block). Data parallel: every rank's graph goes, and
      // comes back, together (step_agreed).
      if (buckets_) return step_failed(fields, batch_);
      graph_.drop();
      if (++beside_pool_ooms_ > 1) graph_.refuse();
      memory_cache_release(device);
      fields.update(Json{{"block", b_}, {"batch", count}, {"retry_batch", count},
                         {"reason", beside_pool_reason(beside_pool_ooms_)}});
      session_.event(event::kOom, *run_step_, fields);
      return false;
    }
    // The plan was off (fragmentation, workspaces): the same samples again, eagerly, at the batch re-planned with the
    // per-sample bytes the failure shows (oom_retry_batch), not a cascade of halvings.
    const int64_t retry = oom_retry_batch(batch_, fixed_bytes_, po_);
    if (buckets_) return step_failed(fields, retry);  // step_agreed refuses every rank's graph and frees the cache
    TRIACCEL_CHECK_INPUT(retry > 0, "out of memory in NeuroFlux block ", b_, " at batch ", batch_, " with ",
                         bytes_format(fixed_bytes_), " needed at any batch; raise ", option_ref("vram_budget"));
    graph_.refuse();
    memory_cache_release(device);
    fields.update(Json{{"block", b_}, {"batch", batch_}, {"retry_batch", retry}});
    session_.event(event::kOom, *run_step_, fields);
    batch_ = retry;
    return false;
  }
  return true;
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
    // Held: what is allocated now and, with several ranks, the gradient buckets the block's trainer will allocate.
    // Two H200s, ResNet-18 at 0.35 GB, before they were counted: blocks at 1.02-1.16 of their predictions (one GPU:
    // 1.00-1.01); the buckets (up to 19 MB a block) are part of those 2-30 MB.
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
                    {"plan", plan_to_json(plan_)}};
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
  const std::string model_path = session_.out_file("model.pt");
  const std::string exit_path = session_.out_file(kExitModelFile);
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

  // Inference throughput of the exit model and of the full network, eval mode, on a zero batch.
  model_.eval();
  for (auto& h : heads_) h->eval();
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device_);
  const auto probe = [&](int64_t n) {
    return SplitInput::layout(at::zeros({n, sample_shape_[0], sample_shape_[1], sample_shape_[2]}, f32),
                              plain_lo_.channels_last);
  };
  const int64_t probe_batch = device_.is_cuda() ? 256 : 8;
  const PrecisionMode precision = config_.execution.precision;
  int64_t exit_batch = 0, full_batch = 0;
  const double exit_rate = inference_throughput(
      [&](const at::Tensor& x) {
        const AutocastScope autocast(device_, precision);
        at::Tensor h = x;
        for (int64_t u = 0; u <= chosen; ++u) h = units_[static_cast<size_t>(u)].forward(h);
        return logits_of(chosen, h);
      },
      probe, probe_batch, device_, session_.clock(), &exit_batch);
  const double full_rate = inference_throughput(
      [&](const at::Tensor& x) {
        const AutocastScope autocast(device_, precision);
        return model_.forward(x);
      },
      probe, probe_batch, device_, session_.clock(), &full_batch);
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
      {"images_per_s", exit_rate},
      {"full_images_per_s", full_rate},
      {"throughput_batch", exit_batch},
      {"full_throughput_batch", full_batch},
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

}  // namespace

Json neuroflux_train(Session& session) {
  NeuroFluxRun run(session);
  return run.run();
}

}  // namespace triaccel
