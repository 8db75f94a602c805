// The run's configuration: one section per component, each with its defaults (here), its validate() and its field
// table. The field table lists every option once — its key (the name in JSON, in Python and in library errors), its
// help text — and everything else is generated from it: JSON for events.jsonl and checkpoints (flat: keys are unique
// across sections), the CLI's flags (`--` + the key with dashes; tools/triaccel.cpp), the Python module's keyword
// arguments, `--help` and parsing from text. Adding an option: one field line in its section (+ its check in the
// section's validate(), + a line in the README where users need it). Past parsing every choice is an enum.
//
// An option that a component reads has its default in the component's options struct (CurvatureOptions::top_k for
// curv_top_k); the section's field is initialized from it, and run/component_options.h builds each component's options
// from a Config. tests/test_option_defaults.cpp checks that a default Config builds every component's default options.
//
// Options whose default depends on another option (AdamW's lr and weight decay) are resolved by resolve(), which
// knows which keys the user set (`given`).
#pragma once

#include "triaccel/control/optimizer_state/baoc_controller.h"
#include "triaccel/control/batch/batch_policy.h"
#include "triaccel/control/curvature/curvature_controller.h"
#include "triaccel/control/curvature/curvature_probe.h"
#include "triaccel/control/memory/partitioner.h"
#include "triaccel/control/precision/precision_policy.h"
#include "triaccel/core/device.h"
#include "triaccel/core/enum_names.h"
#include "triaccel/core/json.h"
#include "triaccel/data/dataset.h"
#include "triaccel/models/registry.h"
#include "triaccel/optim/optimizer.h"
#include "triaccel/train/grad_buckets.h"
#include "triaccel/train/precision.h"
#include "triaccel/train/schedule.h"

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace triaccel {

// The `method` option. kAuto is resolved before a run starts (api::run): backprop when the memory planner fits the
// vram_budget, else neuroflux.
enum class Method { kBackprop, kTriAccel, kNeuroFlux, kAuto };
template <>
struct EnumNames<Method> {
  static constexpr EnumName<Method> kNames[] = {{Method::kBackprop, "backprop"},
                                                {Method::kTriAccel, "tri-accel"},
                                                {Method::kNeuroFlux, "neuroflux"},
                                                {Method::kAuto, "auto"}};
};

// auto | on | off options (augment, cudnn_autotune): auto is resolved from the rest of the configuration.
enum class Toggle { kAuto, kOn, kOff };
template <>
struct EnumNames<Toggle> {
  static constexpr EnumName<Toggle> kNames[] = {{Toggle::kAuto, "auto"}, {Toggle::kOn, "on"}, {Toggle::kOff, "off"}};
};

// The `tta` option: test-time augmentation of the reported accuracy.
enum class Tta { kOff, kFlip };
template <>
struct EnumNames<Tta> {
  static constexpr EnumName<Tta> kNames[] = {{Tta::kOff, "off"}, {Tta::kFlip, "flip"}};
};

// The `progress` option: a bar on a terminal (auto), a bar, plain lines, or nothing.
enum class ProgressMode { kAuto, kBar, kLines, kOff };
template <>
struct EnumNames<ProgressMode> {
  static constexpr EnumName<ProgressMode> kNames[] = {{ProgressMode::kAuto, "auto"},
                                                      {ProgressMode::kBar, "bar"},
                                                      {ProgressMode::kLines, "lines"},
                                                      {ProgressMode::kOff, "off"}};
};

// The `nf_profile` option: NeuroFlux's per-unit memory profile, measured on CUDA (auto) or modelled from shapes.
enum class ProfileChoice { kAuto, kModel, kMeasured };
template <>
struct EnumNames<ProfileChoice> {
  static constexpr EnumName<ProfileChoice> kNames[] = {
      {ProfileChoice::kAuto, "auto"}, {ProfileChoice::kModel, "model"}, {ProfileChoice::kMeasured, "measured"}};
};

// The `batch_policy` option: under a vram_budget the batch stays as asked and the memory planner splits it into
// micro-batches (fixed), or Tri-Accel's elastic rule changes the batch itself and the lr follows (elastic, the paper).
enum class BatchPolicy { kFixed, kElastic };
template <>
struct EnumNames<BatchPolicy> {
  static constexpr EnumName<BatchPolicy> kNames[] = {{BatchPolicy::kFixed, "fixed"}, {BatchPolicy::kElastic, "elastic"}};
};

// The `data_placement` option: where the dataset lives on a GPU (auto: the memory planner's choice).
enum class PlacementChoice { kAuto, kDevice, kHost };
template <>
struct EnumNames<PlacementChoice> {
  static constexpr EnumName<PlacementChoice> kNames[] = {
      {PlacementChoice::kAuto, "auto"}, {PlacementChoice::kDevice, "device"}, {PlacementChoice::kHost, "host"}};
};

// The `saved_activations` option: how the units' activations saved for backward are held (keep: as computed; auto:
// the memory planner's choice under a vram_budget, kept without one; fp8: every unit's stored in FP8 where it is not
// recomputed). keep by default: on ResNet-18 b96 under 0.25-0.3 GB the planner's FP8 plans gained nothing and their
// out-of-memory trials cost (bench/results/h200/fp8_saved_plan_10b67e9).
enum class SavedActivations { kAuto, kKeep, kFp8 };
template <>
struct EnumNames<SavedActivations> {
  static constexpr EnumName<SavedActivations> kNames[] = {
      {SavedActivations::kAuto, "auto"}, {SavedActivations::kKeep, "keep"}, {SavedActivations::kFp8, "fp8"}};
};

// The `dist_backend` option: the collectives of data parallelism (auto: NCCL on CUDA, Gloo on the CPU).
enum class DistBackend { kAuto, kNccl, kGloo };
template <>
struct EnumNames<DistBackend> {
  static constexpr EnumName<DistBackend> kNames[] = {
      {DistBackend::kAuto, "auto"}, {DistBackend::kNccl, "nccl"}, {DistBackend::kGloo, "gloo"}};
};

// The `grad_compression` option: the format gradients cross the ranks in (bf16: half the bytes, summed in bf16).
enum class GradCompression { kNone, kBf16 };
template <>
struct EnumNames<GradCompression> {
  static constexpr EnumName<GradCompression> kNames[] = {{GradCompression::kNone, "none"},
                                                         {GradCompression::kBf16, "bf16"}};
};

// One option in a field table: its key, help, (rarely) a CLI flag other than `--` + the key with dashes, and for a
// name looked up in a registry, the registry's names.
struct FieldInfo {
  const char* key;
  std::string help;
  const char* flag = nullptr;
  const std::vector<std::string>& (*choices)() = nullptr;
};

// What to train on.
struct DataConfig {
  static constexpr const char* kTitle = "Data";
  std::string dataset = "fashion-mnist";
  std::string data_dir;          // "": the dataset's standard location
  int64_t block_size = 256;      // text datasets: characters per sample (the GPT's context length)
  Toggle augment = Toggle::kAuto;
  int64_t cutout = 0;
  int64_t image_size = 0;        // 0: native

  template <typename S, typename V>
  static void fields(S& s, V&& v);
  void validate() const;
};

struct ModelConfig {
  static constexpr const char* kTitle = "Model";
  std::string model = "small-cnn";
  // gpt-char's shape (the model's own defaults: models/model.h).
  int64_t gpt_layers = ModelOptions{}.gpt_layers;
  int64_t gpt_heads = ModelOptions{}.gpt_heads;
  int64_t gpt_embed = ModelOptions{}.gpt_embed;

  template <typename S, typename V>
  static void fields(S& s, V&& v);
  void validate() const;
};

// The optimizer and the loss.
struct OptimConfig {
  static constexpr const char* kTitle = "Optimizer";
  OptimizerKind optimizer = OptimizerKind::kSgd;
  double lr = ScheduleOptions{}.base_lr;  // adamw/baoc: 1e-3 unless given (resolve)
  double momentum = OptimizerOptions{}.momentum;
  bool nesterov = OptimizerOptions{}.nesterov;
  // adamw/baoc: 1e-2 unless given (resolve); never on norms and biases
  double weight_decay = OptimizerOptions{}.weight_decay;
  double adam_beta1 = OptimizerOptions{}.beta1;
  double adam_beta2 = OptimizerOptions{}.beta2;
  double adam_eps = OptimizerOptions{}.eps;
  double label_smoothing = 0.0;

  template <typename S, typename V>
  static void fields(S& s, V&& v);
  void validate() const;
  OptimizerOptions optimizer_options() const;
};

// How long, in what batches, at what learning rate.
struct ScheduleConfig {
  static constexpr const char* kTitle = "Schedule";
  int64_t epochs = 1;
  int64_t max_steps = 0;         // 0: no limit; the schedule always spans `epochs`
  int64_t batch_size = 128;
  double warmup_epochs = -1.0;   // < 0: auto = min(1, 0.1 × epochs)
  LrDecay lr_decay = ScheduleOptions{}.decay;
  LrBatchRule lr_batch_rule = BatchPolicyOptions{}.lr_rule;

  template <typename S, typename V>
  static void fields(S& s, V&& v);
  void validate() const;
  double warmup_epochs_resolved() const;
};

// How the run executes: the method, precision, device, memory budget.
struct ExecutionConfig {
  static constexpr const char* kTitle = "Execution";
  Method method = Method::kBackprop;
  PrecisionMode precision = PrecisionMode::kFP32;
  DeviceKind device = DeviceKind::kAuto;
  bool channels_last = true;
  bool cuda_graphs = true;
  std::string vram_budget;       // "": none, else a size ("2GB", core/bytes.h)
  // The memory planner's levers (docs/memory-planner.md); by default it chooses them under a vram_budget.
  int64_t micro_batch = 0;       // 0: the planner's (the whole batch without a budget)
  std::string recompute = "auto";  // auto: the planner's; none; or unit names, comma-separated
  PlacementChoice data_placement = PlacementChoice::kAuto;
  SavedActivations saved_activations = SavedActivations::kKeep;
  Toggle update_in_backward = Toggle::kAuto;  // auto: the planner's choice under a vram_budget
  BatchPolicy batch_policy = BatchPolicy::kFixed;
  Toggle cudnn_autotune = Toggle::kAuto;
  int64_t eval_batch_size = 1000;
  Tta tta = Tta::kOff;
  uint64_t seed = 0;
  std::string inject_faults;     // "": none (train/faults.h)
  int64_t nproc = 1;             // data-parallel processes on this host (docs/distributed.md)
  DistBackend dist_backend = DistBackend::kAuto;
  GradCompression grad_compression = GradCompression::kNone;
  // data parallelism's gradient buckets (MiB; 0: one collective after backward)
  double grad_bucket_mb = static_cast<double>(GradBucketsOptions{}.bucket_bytes) / (1 << 20);
  Toggle shard_optimizer = Toggle::kAuto;  // ZeRO stage 1 (auto: when a vram_budget on several ranks binds)
  bool sync_bn = false;

  template <typename S, typename V>
  static void fields(S& s, V&& v);
  void validate() const;
  int64_t vram_budget_bytes() const;  // 0 when no budget
  // auto: on without a budget, except for tri-accel (every precision change would re-tune each new dtype mix).
  bool cudnn_autotune_enabled() const;
};

// Where results go and how often.
struct OutputConfig {
  static constexpr const char* kTitle = "Output";
  std::string out = "runs/latest";
  std::string resume;            // a run folder (or checkpoint file) to continue from
  int64_t checkpoint_every = 0;  // steps; 0: at every epoch's end (and always when stopping)
  double checkpoint_minutes = 10;  // also every this many minutes of the run's clock; 0: never by time
  int64_t log_every = 50;
  ProgressMode progress = ProgressMode::kAuto;
  std::string profile_steps;     // "FIRST:END": a timeline of those steps (core/profile.h); "": none

  template <typename S, typename V>
  static void fields(S& s, V&& v);
  void validate() const;
};

// Tri-Accel (--method tri-accel; docs/tri-accel.md). Thresholds < 0 calibrate themselves. The defaults are the
// curvature controller's (control/curvature/curvature_controller.h), its probe's (control/curvature/curvature_probe.h)
// and the precision policy's (control/precision/precision_policy.h).
struct TriAccelConfig {
  static constexpr const char* kTitle = "Tri-Accel (method tri-accel)";
  int64_t ctrl_every = CurvatureControllerOptions{}.ctrl_every;  // T_ctrl: steps per control window
  int64_t curv_every = CurvatureOptions{}.every_steps;           // T_curv: steps between curvature probes
  int64_t curv_batch = CurvatureOptions{}.batch;                 // b_curv
  int64_t curv_top_k = CurvatureOptions{}.top_k;
  int64_t curv_max_iters = CurvatureOptions{}.max_iters;
  double curv_tol = CurvatureOptions{}.tol;
  double curv_budget = CurvatureControllerOptions{}.budget;       // share of training time (0: every T_curv)
  bool curv_lockstep = CurvatureControllerOptions{}.lockstep;    // every unit each round, one captured pass a step
  // fisher: lockstep rounds on the MC Fisher; unless given, fisher when curv_top_k is 1, else hessian (resolve)
  CurvatureEstimator curv_estimator = CurvatureOptions{}.estimator;
  int64_t curv_chunk = CurvatureOptions{}.chunk;  // lockstep: samples per pass; 0: curv_batch; -1: the estimator's
  Toggle curv_cudnn = Toggle::kAuto;  // the probes' convolutions through cuDNN; auto: probe_cudnn_auto
  double curv_alpha = CurvatureControllerOptions{}.alpha;         // α in η_l = η0 / (1 + α·λ_max); < 0: calibrated
  bool curv_lr_mean = CurvatureControllerOptions{}.lr_mean_one;   // false: the paper's rule
  bool curv_checkpoint = false;  // a checkpoint at each probe's step (the weights it probed)
  double tau_low = PrecisionPolicyOptions{}.tau_low;
  double tau_high = PrecisionPolicyOptions{}.tau_high;
  double tau_curv = PrecisionPolicyOptions{}.tau_curv;
  bool ta_precision = true;      // ablation switches
  bool ta_curvature = CurvatureControllerOptions{}.lr_scaling;
  bool ta_batch = true;          // the memory-elastic batch (under a vram_budget)

  template <typename S, typename V>
  static void fields(S& s, V&& v);
  void validate() const;
};

// BAOC (--optimizer baoc; docs/baoc.md). The defaults are BaocControllerOptions'
// (control/optimizer_state/baoc_controller.h).
struct BaocConfig {
  static constexpr const char* kTitle = "BAOC (optimizer baoc)";
  // bytes ("200MB") or a percentage of fp32 AdamW's state
  std::string optim_memory_budget = BaocControllerOptions{}.memory_budget;
  // "": none, or "1.1x" of fp32 AdamW's step time (time model)
  std::string optim_time_budget = BaocControllerOptions{}.time_budget;
  std::string optim_formats = BaocControllerOptions{}.formats;  // "": all; else a comma-separated menu
  // bench_optim_step JSON with measured step times ("": the model)
  std::string optim_time_table = BaocControllerOptions{}.time_table;
  // steps of fp32 AdamW gathering statistics before the first plan
  int64_t plan_warmup = BaocControllerOptions{}.plan_warmup;
  int64_t replan_every = BaocControllerOptions{}.replan_every;  // steps between re-plans (0: plan once)
  double optim_risk_floor = BaocControllerOptions{}.risk_floor;  // RiskOptions::unit_floor

  template <typename S, typename V>
  static void fields(S& s, V&& v);
  void validate(OptimizerKind optimizer) const;
};

// NeuroFlux (--method neuroflux; docs/neuroflux.md).
struct NeuroFluxConfig {
  static constexpr const char* kTitle = "NeuroFlux (method neuroflux)";
  int64_t nf_max_batch = PartitionOptions{}.max_batch;
  int64_t nf_holdout = 5000;
  double nf_exit_tolerance = 1.0;
  ProfileChoice nf_profile = ProfileChoice::kAuto;

  template <typename S, typename V>
  static void fields(S& s, V&& v);
  void validate() const;
};

// One option as the front ends show it.
struct OptionDoc {
  std::string key;
  std::string flag;      // "--batch-size"
  std::string section;   // its section's title
  std::string help;
  std::string default_text;  // the current value as text
  std::string type;          // INT, NUMBER, BOOL, TEXT, or the choices ("auto|on|off")
};

struct Config {
  DataConfig data;
  ModelConfig model;
  OptimConfig optim;
  ScheduleConfig schedule;
  ExecutionConfig execution;
  OutputConfig output;
  TriAccelConfig tri_accel;
  BaocConfig baoc;
  NeuroFluxConfig neuroflux;
  std::set<std::string> given;   // keys set explicitly (set(), set_json()); resolve() and resume read it

  template <typename S, typename V>
  static void sections(S& c, V&& v) {
    v(c.data);
    v(c.model);
    v(c.optim);
    v(c.schedule);
    v(c.execution);
    v(c.output);
    v(c.tri_accel);
    v(c.baoc);
    v(c.neuroflux);
  }

  // Sets one option from text (the CLI, Python) and marks it given. UserError naming the option for an unknown key
  // or a value of the wrong form; ranges are checked by validate().
  void set(const std::string& key, const std::string& text);
  // Sets one option from a JSON value of its type (Python's int, float, bool, str; enums as their names).
  void set_json(const std::string& key, const Json& value);
  bool was_given(const std::string& key) const { return given.count(key) != 0; }
  // What a run of `world` data-parallel processes supports (validate() checks it for nproc; a run launched by
  // torchrun checks its WORLD_SIZE). UserError naming the option that is not supported yet.
  void validate_world(int64_t world) const;

  // Applies the defaults that depend on other options (adamw/baoc: lr 1e-3 and weight decay 1e-2 unless given).
  void resolve();
  // Every section's checks, then the checks across sections (the model reads what the dataset holds, the method
  // supports the model, ...). UserError naming the option.
  void validate() const;

  Json to_json() const;                      // flat: {"dataset": ..., "model": ..., ...}
  // A stored configuration (events.jsonl, a checkpoint). Keys it lacks keep their defaults (it was written before
  // they existed) and keys it has that this version does not know are ignored; a mistyped value is a UserError.
  static Config from_json(const Json& json);

  std::vector<OptionDoc> options() const;    // in table order, with this configuration's values as defaults
  static std::vector<std::string> keys();
  static std::string flag_of(const std::string& key);  // "--batch-size"; "--data" for data_dir
  bool augment_enabled() const;               // resolves augment auto: on for CIFAR
};

// Why NeuroFlux cannot train this configuration: a model that is not a CNN, an optimizer other than its fused SGD,
// amp-fp16, fault injection or one of backprop's levers given by hand. One rule for both uses, so they cannot
// disagree: Config::validate refuses --method neuroflux with `message`; method auto leaves NeuroFlux out with `reason`
// (run/memory_setup.cpp). Nothing where NeuroFlux can train it.
struct NeuroFluxRefusal {
  std::string reason;   // a phrase after "neuroflux": "trains with its fused SGD, not adamw"
  std::string message;  // the user's line, with option references
};
std::optional<NeuroFluxRefusal> neuroflux_refusal(const Config& config);

// The keys that say what is being trained: a resumed run may not change them.
const std::vector<std::string>& config_identity_keys();

// --- field tables ---

template <typename S, typename V>
void DataConfig::fields(S& s, V&& v) {
  v(s.dataset, FieldInfo{"dataset", "dataset", nullptr, &dataset_names});
  v(s.data_dir, FieldInfo{"data_dir",
                          "dataset folder (CIFAR binary files, IDX files, input.txt for text, or train/<class>/ "
                          "and test/<class>/ image folders for --dataset folder); default: the "
                          "dataset's standard location (fashion-mnist: /usr/share/datasets/fashion-mnist)",
                          "--data"});
  v(s.block_size, FieldInfo{"block_size", "text datasets: characters per sample = the GPT's context length"});
  v(s.augment, FieldInfo{"augment", "random crop (4-pixel padding) + horizontal flip; auto = on for CIFAR"});
  v(s.cutout, FieldInfo{"cutout",
                        "training images: set one random N×N square per image (after crop and flip; clipped at the "
                        "borders) to the dataset mean, i.e. 0 after normalization; 0: off; at most the image side"});
  v(s.image_size, FieldInfo{"image_size", "resize inputs to N×N (0: native size)"});
}

template <typename S, typename V>
void ModelConfig::fields(S& s, V&& v) {
  v(s.model, FieldInfo{"model", "model", nullptr, &model_names});
  v(s.gpt_layers, FieldInfo{"gpt_layers", "gpt-char: transformer blocks"});
  v(s.gpt_heads, FieldInfo{"gpt_heads", "gpt-char: attention heads per block"});
  v(s.gpt_embed, FieldInfo{"gpt_embed", "gpt-char: width (a multiple of gpt_heads)"});
}

template <typename S, typename V>
void OptimConfig::fields(S& s, V&& v) {
  v(s.optimizer, FieldInfo{"optimizer",
                           "sgd: SGD with momentum; adamw: AdamW (fp32 states); baoc: AdamW warm-up, then per-unit "
                           "state formats under the budgets. adamw/baoc default to lr 1e-3 and weight decay 0.01"});
  v(s.lr, FieldInfo{"lr", "peak learning rate (after warm-up)"});
  v(s.momentum, FieldInfo{"momentum", "SGD momentum"});
  v(s.nesterov, FieldInfo{"nesterov", "Nesterov momentum (true|false)"});
  v(s.weight_decay, FieldInfo{"weight_decay", "weight decay (not applied to norms and biases)"});
  v(s.adam_beta1, FieldInfo{"adam_beta1", "AdamW beta1"});
  v(s.adam_beta2, FieldInfo{"adam_beta2", "AdamW beta2"});
  v(s.adam_eps, FieldInfo{"adam_eps", "AdamW epsilon"});
  v(s.label_smoothing, FieldInfo{"label_smoothing", "label smoothing for the loss"});
}

template <typename S, typename V>
void ScheduleConfig::fields(S& s, V&& v) {
  v(s.epochs, FieldInfo{"epochs", "epochs (the schedule spans all of them)"});
  v(s.max_steps, FieldInfo{"max_steps", "stop this run after N optimizer steps with a checkpoint (0: no limit)"});
  v(s.batch_size, FieldInfo{"batch_size", "training batch size"});
  v(s.warmup_epochs, FieldInfo{"warmup_epochs",
                               "linear warm-up in epochs, then the lr decay to 0 (-1: auto = min(1, 0.1 × epochs))"});
  v(s.lr_decay, FieldInfo{"lr_decay", "the lr's decay from its peak (after the warm-up) to 0 at the end"});
  v(s.lr_batch_rule, FieldInfo{"lr_batch_rule",
                               "how the lr follows a batch change (elastic batch, out-of-memory retry)"});
}

template <typename S, typename V>
void ExecutionConfig::fields(S& s, V&& v) {
  v(s.method, FieldInfo{"method",
                        "backprop; tri-accel (adaptive per-unit precision, curvature-scaled lr, elastic batch under "
                        "a budget); neuroflux (local learning in blocks that fit the budget; CNNs); auto (backprop "
                        "when the memory planner fits the vram_budget, else neuroflux)"});
  v(s.precision, FieldInfo{"precision", "fp16 uses dynamic loss scaling; fp8: bf16 with the linear layers in FP8 "
                                        "(Hopper and later; backprop)"});
  v(s.device, FieldInfo{"device", "auto: CUDA when a GPU is visible"});
  v(s.channels_last, FieldInfo{"channels_last", "channels_last layout on CUDA (true|false)"});
  v(s.cuda_graphs, FieldInfo{"cuda_graphs", "capture the training step in a CUDA graph (true|false)"});
  v(s.vram_budget, FieldInfo{"vram_budget",
                             "GPU memory budget, e.g. 2GB or 1.5GiB: the allocator is capped at it and the run is "
                             "plans the run to fit it: micro-batches with gradient accumulation, recomputed units, "
                             "the dataset streamed from host memory (default: none)"});
  v(s.micro_batch, FieldInfo{"micro_batch",
                             "samples per forward/backward pass; the batch's gradients accumulate over its "
                             "micro-batches before one optimizer step (0: the memory planner's choice)"});
  v(s.recompute, FieldInfo{"recompute",
                           "units whose activations are recomputed in backward instead of kept: auto (the memory "
                           "planner's choice), none, or unit names, comma-separated"});
  v(s.data_placement, FieldInfo{"data_placement",
                                "the dataset on the GPU (device) or streamed from pinned host memory a batch at a "
                                "time (host); auto: the memory planner's choice"});
  v(s.saved_activations, FieldInfo{"saved_activations",
                                   "the activations backward reads: keep (as computed), fp8 (stored in block-scaled "
                                   "FP8 where not recomputed: about half their 16-bit bytes, a quantize and a "
                                   "dequantize pass; C++ runs only), auto (the memory planner stores a unit's in FP8 "
                                   "under a vram_budget where its price says that is the fastest way to fit; kept "
                                   "without one)"});
  v(s.update_in_backward, FieldInfo{"update_in_backward",
                                    "each parameter updated as soon as backward has made its gradient, which is "
                                    "then freed (the step holds a gradient or two, not all of them; one micro-batch; "
                                    "sgd or adamw, one process, no loss scaling): auto (the memory planner's choice under a "
                                    "vram_budget), on, off"});
  v(s.batch_policy, FieldInfo{"batch_policy",
                              "under a vram_budget: fixed (the batch as asked, split into micro-batches to fit) or "
                              "elastic (tri-accel: the paper's rule changes the batch and the lr follows)"});
  v(s.cudnn_autotune, FieldInfo{"cudnn_autotune",
                                "cuDNN algorithms: on (autotune each shape), off (heuristics), auto (on without a "
                                "budget, off under one: autotuning's workspace tries fill a budget; off for "
                                "tri-accel, whose precision changes would re-tune every new dtype mix)"});
  v(s.eval_batch_size, FieldInfo{"eval_batch_size", "batch size for evaluation"});
  v(s.tta, FieldInfo{"tta", "also report test accuracy with horizontal-flip test-time augmentation"});
  v(s.seed, FieldInfo{"seed", "random seed (initialization, data order, augmentation)"});
  v(s.inject_faults, FieldInfo{"inject_faults",
                               "test faults: KIND@STEP[xN],... (KIND: oom, nan-grad, inf-grad, nan-loss) or "
                               "random:seed=S,oom=P,nan-grad=P,inf-grad=P,nan-loss=P,burst=N (docs/reliability.md)"});
  v(s.nproc, FieldInfo{"nproc",
                       "data-parallel processes on this host, one per GPU (the command line starts them; under "
                       "torchrun leave it 1): batch_size is the global batch, split across them"});
  v(s.dist_backend, FieldInfo{"dist_backend",
                              "data parallelism's collectives: nccl (CUDA), gloo (CPU, or CUDA through host "
                              "memory), auto (nccl on CUDA, gloo on the CPU)"});
  v(s.grad_compression, FieldInfo{"grad_compression",
                                  "data parallelism's gradients cross the ranks as: none (their own format), bf16 "
                                  "(half the bytes; each rank's share is scaled first, then cast and summed in bf16, "
                                  "as DDP's bf16 hook; no effect with one process)"});
  v(s.grad_bucket_mb, FieldInfo{"grad_bucket_mb",
                                "data parallelism: the gradients are summed over the ranks in buckets of about this "
                                "many MiB, each started as soon as backward has produced its gradients, so the "
                                "communication overlaps the rest of backward (as DDP's bucket_cap_mb); 0: one "
                                "collective after backward"});
  v(s.shard_optimizer, FieldInfo{"shard_optimizer",
                                 "data parallelism: each process keeps and updates the optimizer state of 1/N of the "
                                 "parameters and broadcasts them after the step (ZeRO stage 1: the state's memory "
                                 "divided by the processes, one more collective per step); auto: on when a "
                                 "vram_budget would otherwise need micro-batches, recompute or streamed data; no "
                                 "effect with one process"});
  v(s.sync_bn, FieldInfo{"sync_bn",
                         "data parallelism: BatchNorm normalizes with the whole global batch's statistics (summed "
                         "over the ranks in forward and backward) instead of each rank's own; no effect with one "
                         "process"});
}

template <typename S, typename V>
void OutputConfig::fields(S& s, V&& v) {
  v(s.out, FieldInfo{"out", "output folder (events.jsonl, checkpoint.pt, model.pt)"});
  v(s.resume, FieldInfo{"resume", "continue the run in this folder (or checkpoint file)"});
  v(s.checkpoint_every, FieldInfo{"checkpoint_every", "checkpoint every N steps (0: at the end of every epoch)"});
  v(s.checkpoint_minutes, FieldInfo{"checkpoint_minutes", "also checkpoint every M minutes, so an interruption loses "
                                                          "at most that much work (0: not by time)"});
  v(s.log_every, FieldInfo{"log_every", "steps between progress lines"});
  v(s.progress, FieldInfo{"progress", "progress output on stderr (auto: a bar on a terminal, lines otherwise)"});
  v(s.profile_steps, FieldInfo{"profile_steps",
                               "FIRST:END: a timeline of the training steps FIRST to END-1 (host operators, GPU "
                               "kernels, copies and collectives, by PyTorch's profiler) written as a Chrome trace, "
                               "OUT/profile.json (OUT/profile_rankR.json per process with several)"});
}

template <typename S, typename V>
void TriAccelConfig::fields(S& s, V&& v) {
  v(s.ctrl_every, FieldInfo{"ctrl_every", "steps per control window (T_ctrl)"});
  v(s.curv_every, FieldInfo{"curv_every", "steps between curvature probes (T_curv)"});
  v(s.curv_batch, FieldInfo{"curv_batch", "samples in the curvature batch (b_curv)"});
  v(s.curv_top_k, FieldInfo{"curv_top_k", "Hessian eigenvalues per unit (the paper: 5)"});
  v(s.curv_max_iters, FieldInfo{"curv_max_iters", "power-iteration steps per eigenvalue"});
  v(s.curv_tol, FieldInfo{"curv_tol", "power iteration stops when the eigenvalue moves less than this, relative"});
  v(s.curv_budget, FieldInfo{"curv_budget",
                             "max share of training time for curvature probes; they are spaced to stay within it "
                             "(0: every curv_every steps)"});
  v(s.curv_lockstep, FieldInfo{"curv_lockstep",
                               "probe every unit each round in lockstep, a CUDA graph replayed per power-iteration "
                               "step; needs curv_top_k 1 (true|false)"});
  v(s.curv_estimator, FieldInfo{"curv_estimator",
                                "what a unit's curvature is the top eigenvalue of: hessian (the paper's, by "
                                "Hessian-vector products) or fisher (the Monte-Carlo Fisher = Gauss-Newton block, by "
                                "one-sample gradients; every unit each round, like curv_lockstep; needs curv_top_k 1). "
                                "Default: fisher, or hessian when curv_top_k is above 1"});
  v(s.curv_chunk, FieldInfo{"curv_chunk",
                            "lockstep rounds: samples per forward/backward within a pass, which sets the Hessian's "
                            "memory (BatchNorm statistics per chunk) and the Fisher's cost and rank (0: the whole "
                            "curv_batch; -1: hessian 16, fisher 4)"});
  v(s.curv_cudnn, FieldInfo{"curv_cudnn",
                            "the curvature probes' convolutions through cuDNN (on) or PyTorch's own kernels (off: "
                            "no cuDNN plans to build for the probes' shapes, seconds on EfficientNet-B0); auto: off "
                            "for fisher on a model with grouped convolutions, else on"});
  v(s.curv_alpha, FieldInfo{"curv_alpha", "alpha in lr / (1 + alpha * lambda_max); -1: calibrate"});
  v(s.curv_lr_mean, FieldInfo{"curv_lr_mean",
                              "divide the curvature lr scales by their parameter-weighted mean, so the network's mean "
                              "lr stays the schedule's and curvature moves rate from sharp units to flat ones "
                              "(true|false; false: the paper's scales, all <= 1)"});
  v(s.curv_checkpoint, FieldInfo{"curv_checkpoint",
                                 "write curvature-step-N.pt at each probe's step: the weights it probed (true|false)"});
  v(s.tau_low, FieldInfo{"tau_low", "fp16 below this gradient variance; -1: calibrate"});
  v(s.tau_high, FieldInfo{"tau_high", "fp32 at or above this variance; -1: calibrate"});
  v(s.tau_curv, FieldInfo{"tau_curv", "promote precision above this lambda_max; -1: calibrate"});
  v(s.ta_precision, FieldInfo{"ta_precision", "adaptive per-unit precision (true|false)"});
  v(s.ta_curvature, FieldInfo{"ta_curvature", "curvature-scaled per-unit learning rates (true|false)"});
  v(s.ta_batch, FieldInfo{"ta_batch", "memory-elastic batch size under a vram_budget (true|false)"});
}

template <typename S, typename V>
void BaocConfig::fields(S& s, V&& v) {
  v(s.optim_memory_budget, FieldInfo{"optim_memory_budget",
                                     "optimizer-state memory budget, a percentage of fp32 AdamW's state (15%) or a "
                                     "size (200MB)"});
  v(s.optim_time_budget, FieldInfo{"optim_time_budget",
                                   "optimizer step-time budget as a multiple of fp32 AdamW's (1.1x; default: none)"});
  v(s.optim_formats, FieldInfo{"optim_formats",
                               "comma-separated formats to choose from (default: all of adamw-fp32, adamw-bf16, "
                               "adamw-8bit, factored, no-momentum, sgd-momentum, sgd)"});
  v(s.optim_time_table, FieldInfo{"optim_time_table",
                                  "step times per format measured by bench_optim_step (its --out JSON); default: a "
                                  "bytes-moved model"});
  v(s.plan_warmup, FieldInfo{"plan_warmup", "fp32 AdamW steps gathering statistics before the first plan"});
  v(s.replan_every, FieldInfo{"replan_every", "steps between re-plans (0: plan once)"});
  v(s.optim_risk_floor, FieldInfo{"optim_risk_floor",
                                  "share of a unit's risk weight that is the same for every unit; the rest is by its "
                                  "share of the parameters (docs/baoc.md)"});
}

template <typename S, typename V>
void NeuroFluxConfig::fields(S& s, V&& v) {
  v(s.nf_max_batch, FieldInfo{"nf_max_batch", "cap on a block's batch size"});
  v(s.nf_holdout, FieldInfo{"nf_holdout", "training samples held out to choose the exit (at most 10%)"});
  v(s.nf_exit_tolerance, FieldInfo{"nf_exit_tolerance",
                                   "exported exit = fewest parameters whose held-out accuracy is within this many "
                                   "points of the full network's"});
  v(s.nf_profile, FieldInfo{"nf_profile", "memory profile (auto: measured on CUDA, modelled on the CPU)"});
}

}  // namespace triaccel
