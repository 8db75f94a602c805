#include "triaccel/train/trainer.h"

#include "triaccel/core/device.h"
#include "triaccel/core/errors.h"
#include "triaccel/core/io.h"
#include "triaccel/data/dataset.h"
#include "triaccel/data/loader.h"
#include "triaccel/local/neuroflux.h"
#include "triaccel/memory/batch_controller.h"
#include "triaccel/models/model.h"
#include "triaccel/optim/baoc_driver.h"
#include "triaccel/optim/baoc_optimizer.h"
#include "triaccel/train/checkpoint.h"
#include "triaccel/train/faults.h"
#include "triaccel/train/loss_scaler.h"
#include "triaccel/train/schedule.h"
#include "triaccel/train/sgd.h"
#include "triaccel/train/step.h"
#include "triaccel/train/telemetry.h"
#include "triaccel/train/tri_accel.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/autograd.h>
#include <torch/utils.h>
#ifdef TRIACCEL_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <numeric>
#include <optional>

namespace triaccel {
namespace {

constexpr double kGB = 1e9;

// Keys that define what is being trained: a resumed run may not change them.
const std::vector<std::string> kIdentityKeys = {"method", "model", "dataset", "batch_size", "lr", "momentum",
                                                "nesterov", "weight_decay", "warmup_epochs", "lr_decay", "label_smoothing",
                                                "precision", "augment", "cutout", "image_size", "seed", "block_size",
                                                "optimizer", "adam_beta1", "adam_beta2", "adam_eps"};

struct Progress {
  int64_t step = 0;          // optimizer steps done
  int64_t epoch = 0;         // current epoch (0-based)
  int64_t epoch_offset = 0;  // samples of the current epoch already trained
  double elapsed_s = 0;      // wall time of earlier sessions of this run
  double epoch_train_s = 0;  // training time spent in the current epoch so far
  std::vector<double> epoch_times;  // finished epochs' training seconds
  double peak_vram_gb = 0;
  int64_t batch = 0;         // the batch size in use (smaller than --batch-size after an out-of-memory retry)
  Json last_epoch;           // the last epoch event's fields
  Json tri_accel;            // TriAccelDriver state (null for other methods)
  Json baoc;                 // BaocDriver state (null for other optimizers)
  double peak_vram_warmup_gb = -1;  // adamw/baoc: the peak up to step --plan-warmup (then the peak is reset)
  // Faults (docs/reliability.md), over the whole run: out-of-memory retries, skipped (inf/NaN) attempts that were
  // retried, samples dropped after kSkipRetryLimit skips in a row, and faults injected by --inject-faults.
  int64_t oom_retries = 0;
  int64_t skip_retries = 0;
  int64_t dropped_samples = 0;
  int64_t injected_faults = 0;

  Json to_json() const {
    return Json{{"step", step}, {"epoch", epoch}, {"epoch_offset", epoch_offset}, {"elapsed_s", elapsed_s},
                {"epoch_train_s", epoch_train_s}, {"epoch_times", epoch_times}, {"peak_vram_gb", peak_vram_gb},
                {"batch", batch}, {"last_epoch", last_epoch}, {"tri_accel", tri_accel}, {"baoc", baoc},
                {"peak_vram_warmup_gb", peak_vram_warmup_gb}, {"oom_retries", oom_retries},
                {"skip_retries", skip_retries}, {"dropped_samples", dropped_samples},
                {"injected_faults", injected_faults}};
  }
  Json fault_counters() const {
    return Json{{"oom_retries", oom_retries}, {"skip_retries", skip_retries}, {"dropped_samples", dropped_samples},
                {"injected_faults", injected_faults}};
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
      p.tri_accel = j.value("tri_accel", Json());
      p.baoc = j.value("baoc", Json());
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

NamedTensors scaler_state(const LossScaler& s) {
  return {{"scale", s.scale_tensor()}, {"growth_tracker", s.growth_tracker()}, {"skipped", s.skipped_steps()}};
}

NamedTensors rng_state(const c10::Device& device) {
  NamedTensors out{{"cpu", at::detail::getDefaultCPUGenerator().get_state()}};
#ifdef TRIACCEL_WITH_CUDA
  if (device.is_cuda()) out.emplace_back("cuda", at::cuda::detail::getDefaultCUDAGenerator(device.index()).get_state());
#endif
  return out;
}

void rng_restore(const NamedTensors& rng, const c10::Device& device) {
  for (const auto& [name, state] : rng) {
    // Generators are shared handles: a copy sets the default generator's state.
    if (name == "cpu") {
      at::Generator gen = at::detail::getDefaultCPUGenerator();
      gen.set_state(state);
    }
#ifdef TRIACCEL_WITH_CUDA
    if (name == "cuda" && device.is_cuda()) {
      at::Generator gen = at::cuda::detail::getDefaultCUDAGenerator(device.index());
      gen.set_state(state);
    }
#endif
  }
}

// A skipped step's samples are retried; after this many skipped attempts in a row on the same samples they are
// dropped (counted in dropped_samples, logged) so that a sample that always yields NaN cannot stall the run.
constexpr int64_t kSkipRetryLimit = 8;

// --inject-faults oom: raises the error where a real one comes from. On CUDA the caching allocator is asked for
// 1 PiB, more than any GPU holds: its own out-of-memory path runs (cached blocks released, the error built and
// thrown) and the trainer catches a genuine c10::OutOfMemoryError. On the CPU (whose allocator reports failure as a
// plain c10::Error) the same error type is thrown directly.
[[noreturn]] void fault_raise_oom(const c10::Device& device) {
  if (device.is_cuda()) {
    const at::Tensor huge = at::empty({int64_t{1} << 50}, at::TensorOptions().dtype(at::kByte).device(device));
  }
  TORCH_CHECK_WITH(OutOfMemoryError, false, "injected out of memory (--inject-faults)");
}

double mean_of_last(const std::vector<double>& v, size_t n) {
  if (v.empty()) return 0;
  const size_t k = std::min(n, v.size());
  return std::accumulate(v.end() - static_cast<long>(k), v.end(), 0.0) / static_cast<double>(k);
}

struct EvalResult {
  double loss = 0;
  double acc = 0;      // percent
  double acc_tta = -1;  // percent with flip test-time augmentation; -1 when not measured
};

EvalResult evaluate(Model& model, const Loader& loader, const c10::Device& device, PrecisionMode precision,
                    int64_t batch_size, bool flip_tta) {
  const torch::NoGradGuard no_grad;
  model.eval();
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  at::Tensor loss_sum = at::zeros({1}, f32);
  at::Tensor correct = at::zeros({1}, f32);
  at::Tensor correct_tta = at::zeros({1}, f32);
  double predictions = 0;  // label elements: samples, or samples × T for a language model
  for (int64_t offset = 0; offset < loader.size(); offset += batch_size) {
    const int64_t count = std::min(batch_size, loader.size() - offset);
    auto [images, labels] = loader.batch(offset, count);
    const AutocastScope autocast(device, precision);
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
  const double n = static_cast<double>(loader.size());
  return {loss_sum.item<double>() / predictions, 100.0 * correct.item<double>() / predictions,
          flip_tta ? 100.0 * correct_tta.item<double>() / n : -1.0};
}

// Progress output: a bar redrawn in place on a terminal, or a plain line every log_every steps.
class ProgressPrinter {
 public:
  explicit ProgressPrinter(const std::string& mode) {
    const bool tty = ::isatty(STDERR_FILENO) != 0;
    bar_ = mode == "bar" || (mode == "auto" && tty);
    off_ = mode == "off";
  }
  void step(int64_t epoch, int64_t epochs, int64_t done, int64_t total, double loss, double lr, double img_s) {
    if (off_) return;
    if (bar_) {
      const int width = 30;
      const int filled = total > 0 ? static_cast<int>(width * done / total) : 0;
      std::fprintf(stderr, "\repoch %lld/%lld [%s%s] %lld/%lld loss %.4f lr %.4g %.0f img/s   ",
                   static_cast<long long>(epoch + 1), static_cast<long long>(epochs),
                   std::string(filled, '#').c_str(), std::string(width - filled, '.').c_str(),
                   static_cast<long long>(done), static_cast<long long>(total), loss, lr, img_s);
    } else {
      std::fprintf(stderr, "epoch %lld/%lld step %lld/%lld loss %.4f lr %.4g %.0f img/s\n",
                   static_cast<long long>(epoch + 1), static_cast<long long>(epochs), static_cast<long long>(done),
                   static_cast<long long>(total), loss, lr, img_s);
    }
    std::fflush(stderr);
  }
  void line(const std::string& text) {
    if (off_) return;
    std::fprintf(stderr, "%s%s\n", bar_ ? "\r" : "", text.c_str());
    std::fflush(stderr);
  }

 private:
  bool bar_ = false;
  bool off_ = false;
};

}  // namespace

TrainOptions resume_options(const TrainOptions& given, const std::vector<std::string>& explicit_keys) {
  const std::string path = checkpoint_path(given.resume);
  TRIACCEL_CHECK_INPUT(file_exists(path), "--resume ", given.resume, ": no checkpoint at ", path,
                       " (train with --out first)");
  const Checkpoint ckpt = checkpoint_read(path);
  TrainOptions stored = TrainOptions::from_json(ckpt.config);
  Json merged = stored.to_json();
  const Json given_json = given.to_json();
  for (const auto& key : explicit_keys) {
    if (!given_json.contains(key) || key == "resume") continue;
    if (std::find(kIdentityKeys.begin(), kIdentityKeys.end(), key) != kIdentityKeys.end()) {
      TRIACCEL_CHECK_INPUT(given_json[key] == merged[key], "--", key, " ", given_json[key].dump(),
                           " differs from the checkpoint's ", merged[key].dump(), " (", path,
                           "); drop the flag to resume, or start a new run");
      continue;
    }
    merged[key] = given_json[key];
  }
  TrainOptions out = TrainOptions::from_json(merged);
  out.resume = given.resume;
  if (std::find(explicit_keys.begin(), explicit_keys.end(), "out") == explicit_keys.end()) {
    std::error_code ec;
    out.out = std::filesystem::is_directory(given.resume, ec)
                  ? given.resume
                  : std::filesystem::path(given.resume).parent_path().string();
  }
  // A resumed run continues to the end unless the user sets a new limit.
  if (std::find(explicit_keys.begin(), explicit_keys.end(), "max_steps") == explicit_keys.end()) out.max_steps = 0;
  return out;
}

Json train_run(const TrainOptions& options, const TrainHooks& hooks) {
  options.validate();
  if (options.method == "neuroflux") return neuroflux_run(options, hooks);  // local/neuroflux.h: its own loop
  const double t_start = time_since_start_s();
  const c10::Device device = device_resolve(options.device);
  directory_prepare_writable(options.out, "--out");
  // Temporary files of a process killed mid-write (the files they were to replace are intact).
  file_remove_stale_temps((std::filesystem::path(options.out) / kCheckpointFile).string());
  file_remove_stale_temps((std::filesystem::path(options.out) / "model.pt").string());

  std::string ckpt_file;
  const std::optional<Checkpoint> ckpt = checkpoint_for_resume(options.resume, options.model, &ckpt_file);

#ifdef TRIACCEL_WITH_CUDA
  // All work on one non-default stream (graph capture needs one, and the legacy stream serializes everything).
  std::optional<c10::cuda::CUDAStreamGuard> stream_guard;
  if (device.is_cuda()) {
    stream_guard.emplace(c10::cuda::getStreamFromPool(false, device.index()));
    // cuDNN autotuning tries algorithms with workspaces of gigabytes; under a --vram-budget those tries fill the
    // budget (the elastic batch then reads them as the step's need) and can run out of memory: heuristics instead.
    at::globalContext().setBenchmarkCuDNN(options.cudnn_autotune_enabled());
  }
#endif

  torch::manual_seed(options.seed);

  // Data.
  const DatasetSplits data = dataset_load(options.dataset, options.data_dir, options.block_size);
  LoaderOptions train_lo;
  train_lo.batch_size = options.batch_size;
  train_lo.shuffle = true;
  train_lo.augment = options.augment_enabled();
  train_lo.cutout = options.cutout;
  train_lo.image_size = options.image_size;
  train_lo.channels_last = device.is_cuda() && options.channels_last;
  train_lo.seed = options.seed;
  LoaderOptions test_lo = train_lo;
  test_lo.shuffle = false;
  test_lo.augment = false;
  test_lo.cutout = 0;
  test_lo.batch_size = options.eval_batch_size;
  Loader train_loader(data.train, data.mean, data.std, train_lo, device);
  Loader test_loader(data.test, data.mean, data.std, test_lo, device);

  // Model and optimizer.
  ModelOptions mo;
  mo.name = options.model;
  mo.num_classes = data.train.num_classes;
  mo.in_channels = data.train.channels();
  mo.image_size = train_loader.image_height();
  if (data.train.kind == DatasetKind::kTokens) mo.block_size = data.train.images.size(1);  // vocab = num_classes
  const std::shared_ptr<Model> model = model_create(mo);
  model->to(device);
  if (train_lo.channels_last) {
    const torch::NoGradGuard no_grad;
    for (auto& p : model->parameters()) {
      if (p.dim() == 4) p.set_data(p.contiguous(at::MemoryFormat::ChannelsLast));
    }
  }
  model->train();
  std::vector<std::pair<std::string, at::Tensor>> named_params;
  for (const auto& item : model->named_parameters()) named_params.emplace_back(item.key(), item.value());
  std::unique_ptr<Optimizer> optimizer_owner;
  BaocOptimizer* baoc_optimizer = nullptr;  // set for --optimizer adamw|baoc
  if (options.optimizer == "sgd") {
    SgdOptions so;
    so.momentum = options.momentum;
    so.nesterov = options.nesterov;
    so.weight_decay = options.weight_decay;
    optimizer_owner = std::make_unique<Sgd>(named_params, so);
  } else {
    BaocOptions bo;
    bo.beta1 = options.adam_beta1;
    bo.beta2 = options.adam_beta2;
    bo.eps = options.adam_eps;
    bo.weight_decay = options.weight_decay;
    auto owned = std::make_unique<BaocOptimizer>(named_params, bo, StateFormat::kAdamW32);
    baoc_optimizer = owned.get();
    optimizer_owner = std::move(owned);
  }
  Optimizer& optimizer = *optimizer_owner;
  if (!options.vram_budget.empty()) {
    // The floor no batch size can go under, on any device: fp32 weights and gradients, the optimizer's state
    // (SGD momentum 4 bytes per parameter; AdamW/BAOC start with fp32 AdamW, 8) and the resident datasets.
    // Activations and workspaces come on top, so a budget just above it still fails later (on CUDA, with the
    // measured figure below); this check names the number before anything runs.
    const int64_t n = model->parameter_count();
    const int64_t state = options.optimizer == "sgd" ? (options.momentum > 0 ? 4 : 0) : 8;
    const int64_t weights = n * (4 + 4 + state);
    const int64_t resident = train_loader.resident_bytes() + test_loader.resident_bytes();
    const int64_t minimum = weights + resident;
    TRIACCEL_CHECK_INPUT(options.vram_budget_bytes() >= minimum, "--vram-budget ", options.vram_budget,
                         " is below this run's minimum of ", minimum, " bytes (", static_cast<double>(minimum) / 1e6,
                         " MB: weights, gradients and ", options.optimizer, " state of ", n, " parameters take ",
                         static_cast<double>(weights) / 1e6, " MB, the resident dataset ",
                         static_cast<double>(resident) / 1e6, " MB; activations come on top); raise the budget");
  }
  LossScalerOptions lso;
  const bool tri = options.method == "tri-accel";
  // Tri-Accel may put units in fp16 at any window: the loss scaler runs from the start.
  lso.enabled = options.precision == PrecisionMode::kAmpFP16 || tri;
  LossScaler scaler(lso, device);
  // Evaluation (and Tri-Accel's calibration phase) uses bf16 for tri-accel, the chosen mode otherwise.
  const PrecisionMode eval_precision = tri ? PrecisionMode::kAmpBF16 : options.precision;

  const int64_t steps_per_epoch = train_loader.steps_per_epoch();
  ScheduleOptions sched;
  sched.base_lr = options.lr;
  sched.decay = lr_decay_parse(options.lr_decay);
  sched.total_steps = steps_per_epoch * options.epochs;
  sched.warmup_steps = static_cast<int64_t>(std::llround(options.warmup_epochs_resolved() * static_cast<double>(steps_per_epoch)));
  sched.validate();

  Progress progress;
  if (ckpt) {
    named_tensors_load(model_state(*model), ckpt->model, "model", ckpt_file);
    optimizer.state_load(ckpt->optimizer, ckpt_file);
    named_tensors_load(scaler_state(scaler), ckpt->scaler, "loss scaler", ckpt_file);
    progress = Progress::from_json(ckpt->progress, ckpt_file);
    rng_restore(ckpt->rng, device);
    TRIACCEL_CHECK_INPUT(progress.epoch_offset <= train_loader.size(), "checkpoint ", ckpt_file,
                         " has a data cursor beyond the dataset (", progress.epoch_offset, " > ",
                         train_loader.size(), ")");
  }

  const std::string events_path = (std::filesystem::path(options.out) / "events.jsonl").string();
  const bool append = ckpt.has_value() && file_exists(events_path);
  EventLog events(events_path, append);
  const auto now = [&]() { return progress.elapsed_s + (time_since_start_s() - t_start); };
  const int64_t params = model->parameter_count();
  Json unit_names = Json::array();
  for (const auto& u : model->units()) unit_names.push_back(u.name);
  const Json resolved{{"options", options.to_json()},
                      {"device", device_long_name(device)},
                      {"params", params},
                      {"units", unit_names},
                      {"train_samples", train_loader.size()},
                      {"test_samples", test_loader.size()},
                      {"steps_per_epoch", steps_per_epoch},
                      {"total_steps", sched.total_steps},
                      {"warmup_steps", sched.warmup_steps},
                      {"augment", train_lo.augment},
                      {"dataset_resident_gb", static_cast<double>(train_loader.resident_bytes() +
                                                                  test_loader.resident_bytes()) / kGB},
                      {"torch_version", TORCH_VERSION}};
  if (append) {
    events.write("resume", progress.step, now(), Json{{"from", ckpt_file}, {"config", resolved}});
  } else {
    events.write("config", progress.step, now(), resolved);
  }
  ProgressPrinter printer(options.progress);
  printer.line(c10::str("triaccel: ", options.model, " on ", options.dataset, " (", train_loader.size(),
                        " train / ", test_loader.size(), " test), ", params, " params, ",
                        precision_mode_name(options.precision), ", batch ", options.batch_size, ", ",
                        device_long_name(device), append ? ", resumed at step " + std::to_string(progress.step) : ""));

  StepOptions step_opts;
  step_opts.precision = options.precision;
  step_opts.cuda_graphs = options.cuda_graphs;
  step_opts.graph_batch_size = options.batch_size;
  step_opts.label_smoothing = options.label_smoothing;
  const FaultPlan faults(options.inject_faults);
  step_opts.fault_injection = !faults.empty();
  TrainStep step(*model, optimizer, scaler, step_opts, device);
  std::unique_ptr<TriAccelDriver> tri_accel;
  if (tri) {
    // The fixed curvature batch: the first b_curv samples of epoch 0's (seeded) order.
    train_loader.epoch_begin(0);
    auto [probe_images, probe_labels] =
        train_loader.batch(0, std::min(options.curv_batch, train_loader.size()));
    tri_accel = std::make_unique<TriAccelDriver>(options, *model, optimizer, step, probe_images, probe_labels);
    if (!progress.tri_accel.is_null()) tri_accel->state_from_json(progress.tri_accel);
  }
  std::unique_ptr<BaocDriver> baoc;
  if (options.optimizer == "baoc") {
    baoc = std::make_unique<BaocDriver>(options, *model, *baoc_optimizer, [&step]() { step.invalidate_graph(); },
                                        progress.step + 1);
    if (!progress.baoc.is_null()) baoc->state_from_json(progress.baoc);
  }

  // Peak VRAM: allocator peak since here, resident dataset included (it stays allocated for the whole run).
  memory_stats_reset_peak(device);

  const auto save_checkpoint = [&]() {
    Checkpoint c;
    c.config = options.to_json();
    c.model_arch = options.model;
    c.model = model_state(*model);
    c.optimizer = optimizer.state_tensors();
    c.scaler = scaler_state(scaler);
    c.rng = rng_state(device);
    Progress p = progress;
    p.elapsed_s = now();
    if (tri_accel) p.tri_accel = tri_accel->state_to_json();
    if (baoc) p.baoc = baoc->state_to_json();
    c.progress = p.to_json();
    const std::string path = (std::filesystem::path(options.out) / kCheckpointFile).string();
    checkpoint_write(path, c);
    events.write("checkpoint", progress.step, now(), Json{{"path", path}, {"epoch", progress.epoch},
                                                          {"epoch_offset", progress.epoch_offset}});
  };

  if (progress.batch <= 0) progress.batch = options.batch_size;
  // Batch sizes: bucketed halving after out of memory; under --vram-budget, Tri-Accel's elastic batch (the paper's
  // rule on the measured peak) every control window. The lr follows the batch by --lr-batch-rule.
  const int64_t budget = options.vram_budget_bytes();
  BatchControllerOptions batch_rules;
  batch_rules.min_batch = std::min<int64_t>(batch_rules.min_batch, options.batch_size);
  batch_rules.max_batch = std::max<int64_t>(options.batch_size, std::min<int64_t>(4096, train_loader.size()));
  batch_rules.budget_bytes = budget;
  batch_rules.lr_rule = lr_batch_rule_parse(options.lr_batch_rule);
  const bool elastic = tri && options.ta_batch && budget > 0 && (device.is_cuda() || hooks.memory_signal);
  std::map<int64_t, int64_t> peak_at_batch;  // the highest window peak measured at each batch size (CUDA)
  std::optional<MemoryCapScope> memory_cap;   // lifted again when the run ends
  if (budget > 0) {
    if (device.is_cuda()) {
      const MemoryStats m = memory_stats(device);
      TRIACCEL_CHECK_INPUT(m.allocated_bytes < budget, "--vram-budget ", options.vram_budget,
                           " is below this run's minimum: the resident dataset and the weights alone take ",
                           static_cast<double>(m.allocated_bytes) / kGB,
                           " GB before gradients, optimizer state and activations; raise the budget");
      memory_cap.emplace(device, budget);
    } else if (!hooks.memory_signal) {
      printer.line("note: --vram-budget applies to CUDA devices; this run is on the CPU and ignores it");
    }
  }
  step.set_graph_batch_size(progress.batch);
  at::Tensor batch_images = train_loader.batch_images_empty(std::max(options.batch_size, progress.batch));
  at::Tensor batch_labels = train_loader.batch_labels_empty(batch_images.size(0));
  const auto batch_set = [&](int64_t batch) {
    progress.batch = batch;
    step.set_graph_batch_size(batch);
    if (batch > batch_images.size(0)) {  // grow the input buffers (the old graph, which used them, is gone)
      batch_images = at::Tensor();
      batch_labels = at::Tensor();
      batch_images = train_loader.batch_images_empty(batch);
      batch_labels = train_loader.batch_labels_empty(batch);
    }
  };
  // The schedule's position in units of the initial batch: equal to the step count while the batch is unchanged,
  // and it still ends with the data when the batch changes.
  const auto schedule_position = [&]() {
    return static_cast<double>(progress.epoch * steps_per_epoch) +
           static_cast<double>(progress.epoch_offset) / static_cast<double>(options.batch_size);
  };
  double last_lr = schedule_lr(sched, schedule_position());
  bool retried_at_min = false;  // an out-of-memory retry at the minimum batch is allowed once in a row
  int64_t attempt = 0;          // attempts at the current step (out-of-memory and skipped ones retry its samples)
  int64_t skips_in_a_row = 0;   // skipped attempts at the current samples
  bool stopped = false;
  while (progress.epoch < options.epochs && !stopped) {
    train_loader.epoch_begin(progress.epoch);
    step.metrics_reset();
    int64_t samples_this_session = 0;
    device_synchronize(device);
    double t_epoch = time_since_start_s();
    double t_log = t_epoch;
    int64_t samples_since_log = 0;
    while (progress.epoch_offset < train_loader.size()) {
      const int64_t count = std::min(progress.batch, train_loader.size() - progress.epoch_offset);
      // A shorter batch (the epoch's last, or after an out-of-memory retry) uses the front of the full-size buffers:
      // dim 0 is outermost in NCHW and channels_last alike, so the view stays dense and nothing is allocated.
      at::Tensor images = count == batch_images.size(0) ? batch_images : batch_images.narrow(0, 0, count);
      at::Tensor labels = count == batch_labels.size(0) ? batch_labels : batch_labels.narrow(0, 0, count);
      const double lr = schedule_lr(sched, schedule_position()) *
                        lr_scale_for_batch(batch_rules.lr_rule, progress.batch, options.batch_size);
      last_lr = lr;
      FaultKind fault = FaultKind::kNone;
      try {  // loading the batch allocates too (resize, augmentation): under a budget it can run out of memory
        train_loader.batch_into(progress.epoch_offset, count, images, labels);
        if (hooks.before_step) hooks.before_step(progress.step, count);
        if (!faults.empty()) {
          fault = faults.fault_at(progress.step, attempt);
          if (fault != FaultKind::kNone) progress.injected_faults += 1;
          if (fault == FaultKind::kOom) fault_raise_oom(device);
          step.set_fault(fault);
        }
        attempt += 1;
        step.run(images, labels, lr);
      } catch (const c10::OutOfMemoryError&) {
        attempt += fault == FaultKind::kOom ? 1 : 0;  // the injected error came before the increment
        progress.oom_retries += 1;
        // Retry the same samples at a smaller batch: nothing is skipped or repeated. At the minimum batch, one retry
        // at the same size after releasing the cache and the graph (a transient peak: a re-capture, a probe), and
        // only a second failure in a row is the budget's fault (batch_after_oom throws then).
        if (progress.batch <= batch_rules.min_batch && !retried_at_min) {
          retried_at_min = true;
          step.set_graph_batch_size(0);
          memory_cache_release(device);
          events.write("oom", progress.step, now(), Json{{"batch", progress.batch}, {"retry_batch", progress.batch},
                                                         {"epoch", progress.epoch}, {"epoch_offset", progress.epoch_offset},
                                                         {"injected", fault == FaultKind::kOom}});
          step.set_graph_batch_size(progress.batch);
          continue;
        }
        const int64_t smaller = batch_after_oom(batch_rules, progress.batch);
        events.write("oom", progress.step, now(), Json{{"batch", progress.batch}, {"retry_batch", smaller},
                                                       {"epoch", progress.epoch}, {"epoch_offset", progress.epoch_offset},
                                                       {"injected", fault == FaultKind::kOom}});
        // The elastic batch never grows back to a size that ran out of memory.
        batch_rules.max_batch = std::max(batch_rules.min_batch, std::min(batch_rules.max_batch, progress.batch - 1));
        batch_set(smaller);
#ifdef TRIACCEL_WITH_CUDA
        if (device.is_cuda()) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
        continue;
      }
      retried_at_min = false;
      // Only under --inject-faults: reading found_inf is a host sync after every step. Without injected faults a
      // non-finite step is skipped on the device as GradScaler does (counted in skipped_steps, samples not retried).
      if (!faults.empty() && step.last_step_skipped()) {
        // An inf/NaN gradient or loss: parameters and optimizer state did not change (the optimizer's found_inf rule),
        // the buffers are put back, and the same samples are tried again — up to kSkipRetryLimit times in a row.
        step.skipped_step_restore();
        skips_in_a_row += 1;
        const bool drop = skips_in_a_row >= kSkipRetryLimit;
        const bool injected = fault == FaultKind::kNanGrad || fault == FaultKind::kInfGrad || fault == FaultKind::kNanLoss;
        std::string reason = fault_kind_name(fault);
        if (!injected) reason = std::isfinite(step.last_loss().item<double>()) ? "non-finite-grad" : "non-finite-loss";
        events.write("skip", progress.step, now(),
                     Json{{"reason", reason}, {"injected", injected}, {"action", drop ? "drop" : "retry"},
                          {"attempt", skips_in_a_row}, {"batch", count}, {"epoch", progress.epoch},
                          {"epoch_offset", progress.epoch_offset}, {"loss_scale", scaler.scale_tensor().item<double>()}});
        if (!drop) {
          progress.skip_retries += 1;
          continue;
        }
        printer.line(c10::str("warning: samples ", progress.epoch_offset, "..", progress.epoch_offset + count - 1,
                              " of epoch ", progress.epoch + 1, " gave inf/NaN ", kSkipRetryLimit,
                              " times in a row; dropped for this epoch"));
        progress.dropped_samples += count;
        progress.epoch_offset += count;
        skips_in_a_row = 0;  // attempt keeps counting: the step count did not advance (--inject-faults xN spans it)
        continue;
      }
      attempt = 0;
      skips_in_a_row = 0;
      if (hooks.on_batch) hooks.on_batch(progress.epoch, progress.epoch_offset, count);
      progress.epoch_offset += count;
      progress.step += 1;
      samples_this_session += count;
      samples_since_log += count;
      if (hooks.after_step) hooks.after_step(progress.step);
      if (tri_accel) {
        for (const auto& [name, fields] : tri_accel->after_step(progress.step)) {
          events.write(name, progress.step, now(), fields);
        }
      }
      if (baoc) {
        for (const auto& [name, fields] : baoc->after_step(progress.step)) events.write(name, progress.step, now(), fields);
      }
      if (options.optimizer != "sgd" && progress.step == options.plan_warmup) {
        // AdamW and BAOC alike: the peak of the warm-up (fp32 AdamW state in both) is kept apart, and the summary's
        // peak covers the steps after it, where BAOC runs its plan (docs/baoc.md). Both then run one step eagerly
        // and capture a new graph (BAOC's plan drops its graph; AdamW's is dropped here), so the peak after the
        // reset holds a whole step's activations for both: replays of a graph captured before the reset would
        // allocate nothing and show only the static bytes.
        progress.peak_vram_warmup_gb = std::max(progress.peak_vram_gb,
                                                static_cast<double>(memory_stats(device).peak_allocated_bytes) / kGB);
        progress.peak_vram_gb = 0;
        step.invalidate_graph();
        memory_stats_reset_peak(device);
      }
      if (elastic && progress.step % options.ctrl_every == 0) {
        // Memory signal: the window's allocator peak. A replayed CUDA graph allocates nothing, so a window of replays
        // shows only the static bytes: the peak measured when this batch size ran eagerly and was captured stands in.
        MemorySignal signal;
        double reserved_gb = 0;
        if (hooks.memory_signal) {
          signal = hooks.memory_signal(progress.step, progress.batch);
        } else {
          const MemoryStats m = memory_stats(device);
          progress.peak_vram_gb = std::max(progress.peak_vram_gb, static_cast<double>(m.peak_allocated_bytes) / kGB);
          int64_t& seen = peak_at_batch[progress.batch];
          seen = std::max(seen, m.peak_allocated_bytes);
          signal.peak_bytes = seen;
          signal.static_bytes = m.allocated_bytes;
          reserved_gb = static_cast<double>(m.reserved_bytes) / kGB;
          memory_stats_reset_peak(device);
        }
        const int64_t before = progress.batch;
        const BatchDecision d = batch_controller_step(batch_rules, before, signal);
        if (d.changed) batch_set(d.batch);
        events.write("batch", progress.step, now(),
                     Json{{"batch", progress.batch}, {"previous", before}, {"changed", d.changed}, {"reason", d.reason},
                          {"peak_gb", static_cast<double>(signal.peak_bytes) / kGB},
                          {"static_gb", static_cast<double>(signal.static_bytes) / kGB},
                          {"predicted_peak_gb", d.predicted_peak_bytes / kGB}, {"reserved_gb", reserved_gb},
                          {"budget_gb", static_cast<double>(budget) / kGB},
                          {"lr_scale", lr_scale_for_batch(batch_rules.lr_rule, progress.batch, options.batch_size)}});
      }
      const bool last_in_epoch = progress.epoch_offset >= train_loader.size();
      if (progress.step % options.log_every == 0 || last_in_epoch) {
        const double loss = step.last_loss().item<double>();  // syncs
        const double t = time_since_start_s();
        printer.step(progress.epoch, options.epochs, (progress.epoch_offset + options.batch_size - 1) / options.batch_size,
                     steps_per_epoch, loss, lr, static_cast<double>(samples_since_log) / std::max(t - t_log, 1e-9));
        t_log = t;
        samples_since_log = 0;
      }
      if (options.max_steps > 0 && progress.step >= options.max_steps) {
        stopped = true;
        if (!last_in_epoch) break;
      }
      if (options.checkpoint_every > 0 && progress.step % options.checkpoint_every == 0 && !last_in_epoch) {
        device_synchronize(device);
        progress.epoch_train_s += time_since_start_s() - t_epoch;
        if (tri_accel) tri_accel->clock_pause();
        save_checkpoint();
        t_epoch = time_since_start_s();
      }
    }
    device_synchronize(device);
    progress.epoch_train_s += time_since_start_s() - t_epoch;
    if (tri_accel) tri_accel->clock_pause();
    if (stopped && progress.epoch_offset < train_loader.size()) break;  // mid-epoch stop

    // Epoch done: evaluate and log. Train metrics cover this session's part of the epoch.
    const double train_s = progress.epoch_train_s;
    // Peak VRAM is the training peak (DESIGN.md: the measured period); evaluation's own peak is reported beside it.
    progress.peak_vram_gb =
        std::max(progress.peak_vram_gb, static_cast<double>(memory_stats(device).peak_allocated_bytes) / kGB);
    memory_stats_reset_peak(device);
    const double t_eval = time_since_start_s();
    EvalResult test;
    for (int64_t eval_batch = options.eval_batch_size;; eval_batch = (eval_batch + 1) / 2) {
      try {  // under a --vram-budget, an evaluation batch that does not fit is halved, not fatal
        test = evaluate(*model, test_loader, device, eval_precision, eval_batch, options.tta == "flip");
        break;
      } catch (const c10::OutOfMemoryError&) {
        TRIACCEL_CHECK_INPUT(eval_batch > 1, "out of memory evaluating one sample: raise --vram-budget");
        events.write("oom", progress.step, now(), Json{{"phase", "eval"}, {"batch", eval_batch},
                                                       {"retry_batch", (eval_batch + 1) / 2}});
#ifdef TRIACCEL_WITH_CUDA
        if (device.is_cuda()) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
      }
    }
    const double eval_s = time_since_start_s() - t_eval;
    const double eval_peak_gb = static_cast<double>(memory_stats(device).peak_allocated_bytes) / kGB;
    memory_stats_reset_peak(device);
    const double seen = static_cast<double>(std::max<int64_t>(samples_this_session, 1));
    progress.epoch_times.push_back(train_s);
    progress.last_epoch = Json{{"epoch", progress.epoch + 1},
                               {"train_loss", step.loss_sum().item<double>() / seen},
                               {"train_acc", 100.0 * step.correct_sum().item<double>() / seen},
                               {"test_loss", test.loss},
                               {"val_loss", data.test.kind == DatasetKind::kTokens ? Json(test.loss) : Json(nullptr)},
                               {"test_acc", test.acc},
                               {"test_acc_tta", test.acc_tta >= 0 ? Json(test.acc_tta) : Json(nullptr)},
                               {"epoch_s", train_s},
                               {"eval_s", eval_s},
                               {"images_per_s", static_cast<double>(samples_this_session) / std::max(train_s, 1e-9)},
                               {"tokens_per_s", data.train.kind == DatasetKind::kTokens
                                                    ? Json(static_cast<double>(samples_this_session * data.train.images.size(1)) /
                                                           std::max(train_s, 1e-9))
                                                    : Json(nullptr)},
                               {"samples", samples_this_session},  // trained this epoch in this session
                               {"lr", last_lr},
                               {"batch", progress.batch},
                               {"peak_vram_gb", progress.peak_vram_gb},
                               {"eval_peak_vram_gb", eval_peak_gb},
                               {"alloc_retries", memory_stats(device).alloc_retries},  // since the start (core/device.h)
                               {"skipped_steps", scaler.skipped_steps().item<double>()},
                               {"faults", progress.fault_counters()},
                               {"loss_scale", scaler.scale_tensor().item<double>()},
                               {"cuda_graph", step.graph_captured()},
                               {"graph_captures", step.graph_captures()},
                               {"graph_capture_ooms", step.graph_capture_ooms()},
                               {"graph_capture_error", step.graph_capture_error().empty()
                                                           ? Json(nullptr) : Json(step.graph_capture_error())},
                               {"probe_s_total", tri_accel ? Json(tri_accel->probe_seconds()) : Json(nullptr)}};
    events.write("epoch", progress.step, now(), progress.last_epoch);
    printer.line(c10::str("epoch ", progress.epoch + 1, "/", options.epochs, ": train loss ",
                          progress.last_epoch["train_loss"].get<double>(), ", test acc ", test.acc, " %, ", train_s,
                          " s"));
    progress.epoch += 1;
    progress.epoch_offset = 0;
    progress.epoch_train_s = 0;
    if (options.checkpoint_every == 0 || progress.epoch == options.epochs) save_checkpoint();
  }

  if (stopped && progress.epoch < options.epochs) {
    save_checkpoint();
    const Json fields{{"reason", "max_steps"}, {"epoch", progress.epoch}, {"epoch_offset", progress.epoch_offset}};
    events.write("stop", progress.step, now(), fields);
    printer.line(c10::str("stopped at step ", progress.step, " (--max-steps); continue with --resume ", options.out));
    return fields;
  }

  const std::string model_path = (std::filesystem::path(options.out) / "model.pt").string();
  model_export_state_dict(*model, model_path);
  const double epoch_s = mean_of_last(progress.epoch_times, 5);
  const double acc = progress.last_epoch.value("test_acc", 0.0);
  Json summary{{"test_acc", acc},
               {"test_acc_tta", progress.last_epoch.value("test_acc_tta", Json(nullptr))},
               {"test_loss", progress.last_epoch.value("test_loss", 0.0)},
               {"epoch_s", epoch_s},
               {"peak_vram_gb", progress.peak_vram_gb},
               {"peak_vram_includes_dataset", true},
               {"peak_vram_phase", "training steps (evaluation's peak is in each epoch event)"},
               {"eff_score", (epoch_s > 0 && progress.peak_vram_gb > 0)
                                 ? Json(acc / (epoch_s * progress.peak_vram_gb))
                                 : Json(nullptr)},
               {"params", params},
               {"method", options.method},
               {"optimizer", options.optimizer},
               {"optim_state_bytes", baoc_optimizer ? baoc_optimizer->state_bytes() : 4 * params},
               {"adamw_fp32_state_bytes", 8 * params},
               {"peak_vram_warmup_gb", progress.peak_vram_warmup_gb >= 0 ? Json(progress.peak_vram_warmup_gb) : Json(nullptr)},
               {"peak_vram_from_step", options.optimizer != "sgd" ? options.plan_warmup : 0},
               {"model", options.model},
               {"dataset", options.dataset},
               {"precision", tri ? std::string("adaptive") : precision_mode_name(options.precision)},
               {"probe_share", tri_accel ? Json(tri_accel->probe_seconds() /
                                                std::max(1e-9, std::accumulate(progress.epoch_times.begin(),
                                                                               progress.epoch_times.end(), 0.0)))
                                         : Json(nullptr)},
               {"batch_size", options.batch_size},
               {"epochs", options.epochs},
               {"steps", progress.step},
               {"skipped_steps", scaler.skipped_steps().item<double>()},
               {"oom_retries", progress.oom_retries},
               {"skip_retries", progress.skip_retries},
               {"dropped_samples", progress.dropped_samples},
               {"injected_faults", progress.injected_faults},
               {"total_s", now()},
               {"device", device_long_name(device)},
               {"model_path", model_path}};
  events.write("summary", progress.step, now(), summary);
  printer.line(c10::str("done: test acc ", acc, " %, ", epoch_s, " s/epoch, peak ", progress.peak_vram_gb,
                        " GB; events in ", events_path));
  return summary;
}

}  // namespace triaccel
