// TrainOptions: everything a training run is configured by, with its defaults in one place. The CLI fills it,
// validate() names any bad value, and to_json()/from_json() store it in events.jsonl and in every checkpoint.
#pragma once

#include "triaccel/core/json.h"

#include <cstdint>
#include <string>
#include <vector>

namespace triaccel {

enum class PrecisionMode { kFP32, kAmpBF16, kAmpFP16 };

std::string precision_mode_name(PrecisionMode mode);   // "fp32", "amp-bf16", "amp-fp16"
PrecisionMode precision_mode_parse(const std::string& name);  // UserError for unknown names

struct TrainOptions {
  // What to train.
  std::string method = "backprop";
  std::string model = "small-cnn";
  std::string dataset = "fashion-mnist";
  std::string data_dir;             // empty: the dataset's default location
  int64_t block_size = 256;         // text datasets: characters per sample (the GPT's context length)

  // How long. The schedule always spans `epochs`; max_steps only stops this run early (with a checkpoint).
  int64_t epochs = 1;
  int64_t max_steps = 0;            // 0: no limit

  // Optimization: SGD with momentum, linear warm-up then cosine (or linear) decay.
  int64_t batch_size = 128;
  double lr = 0.1;
  double momentum = 0.9;
  bool nesterov = true;
  double weight_decay = 5e-4;       // not applied to norms and biases
  double warmup_epochs = -1.0;      // < 0: auto = min(1, 0.1 × epochs)
  std::string lr_decay = "cosine";  // after the warm-up, to 0 at the end: cosine | linear
  double label_smoothing = 0.0;
  PrecisionMode precision = PrecisionMode::kFP32;

  // Execution.
  std::string device = "auto";      // auto | cpu | cuda
  bool channels_last = true;        // CUDA only
  bool cuda_graphs = true;          // CUDA only: capture the whole step where the batch shape is static
  std::string augment = "auto";     // auto (on for CIFAR) | on | off: random crop (pad 4) + horizontal flip
  int64_t cutout = 0;               // side of one square per training image set to the mean (0: off; LoaderOptions)
  int64_t image_size = 0;           // 0: native; else resize inputs (e.g. 224 for EfficientNet-B0 as in the paper)
  int64_t eval_batch_size = 1000;
  std::string tta = "off";          // off | flip: also report accuracy on logits(x) + logits(flipped x)

  // Tri-Accel (--method tri-accel; docs/tri-accel.md). Thresholds < 0 calibrate themselves.
  int64_t ctrl_every = 50;          // T_ctrl: steps per control window
  int64_t curv_every = 200;         // T_curv: steps between curvature probes
  int64_t curv_batch = 32;          // b_curv
  int64_t curv_top_k = 5;
  int64_t curv_max_iters = 20;
  double curv_budget = 0.05;        // probes are spaced so they take at most this share of training time (0: every T_curv)
  double curv_alpha = -1;           // α in η_l = η0 / (1 + α·λ_max); < 0: 1 / (0.9-quantile of the first probe's λ)
  double tau_low = -1;
  double tau_high = -1;
  double tau_curv = -1;
  bool ta_precision = true;         // ablation switches
  bool ta_curvature = true;
  bool ta_batch = true;             // memory-elastic batch (active when vram_budget is set)

  // Memory budget (Tri-Accel, NeuroFlux): "" = none, else a size like "2GB" (core/bytes.h). Peak allocation is kept
  // under it: the caching allocator is capped at it, and Tri-Accel's batch controller sizes the batch by it.
  std::string vram_budget;
  // NeuroFlux (--method neuroflux; docs/neuroflux.md). Without --vram-budget the budget is what backprop needs at
  // --batch-size (modelled or measured), so NeuroFlux trains in the memory backprop would use.
  int64_t nf_max_batch = 512;       // cap on a block's batch size
  int64_t nf_holdout = 5000;        // training samples held out to choose the exit (at most 10% of the split)
  double nf_exit_tolerance = 1.0;   // exit = fewest parameters within this many points of the full network (held out)
  std::string nf_profile = "auto";  // auto (measured on CUDA, modelled on the CPU) | model | measured
  // Out of memory: the step is retried on the same samples at a smaller batch; the lr follows the batch.
  std::string lr_batch_rule = "sqrt"; // none | linear | sqrt
  // cuDNN algorithm choice: on = autotune (benchmark every shape once), off = heuristics, auto = on without a
  // --vram-budget, off under one (autotuning's workspace tries fill a budget), and off for tri-accel (every precision
  // change re-tunes each new dtype mix: 1-16 s and up to 0.07 GB of trial workspace above the run's peak each time on
  // the H100, with the same steady speed, docs/tri-accel.md). On the H100 heuristics made EfficientNet-B0's depthwise
  // convolutions on 2x2 maps several times slower (bench/probe_depthwise.py).
  std::string cudnn_autotune = "auto"; // auto | on | off

  // Optimizer (docs/baoc.md): sgd (SGD with momentum, above) | adamw (AdamW, fp32 states) | baoc (AdamW warm-up,
  // then per-unit state formats planned under the budgets). --lr and --weight-decay apply to all three.
  std::string optimizer = "sgd";
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.999;
  double adam_eps = 1e-8;
  std::string optim_memory_budget = "25%";  // baoc: bytes ("200MB") or a percentage of fp32 AdamW's state
  std::string optim_time_budget;            // baoc: "" = none, or "1.1x" of fp32 AdamW's step time (time model)
  std::string optim_formats;                // baoc: comma-separated menu of formats; "" = all
  std::string optim_time_table;             // baoc: bench_optim_step JSON with measured step times ("" = model)
  int64_t plan_warmup = 50;                 // baoc: steps of fp32 AdamW gathering statistics before the first plan
  int64_t replan_every = 0;                 // baoc: steps between re-plans (0: plan once)
  double optim_risk_floor = 1.0;            // baoc: RiskOptions::unit_floor (the share of a unit's risk weight not by size)

  // Output and reproducibility.
  std::string out = "runs/latest";
  uint64_t seed = 0;
  std::string resume;               // a run folder (or checkpoint file) to continue from
  int64_t checkpoint_every = 0;     // steps; 0: at the end of every epoch (and always when stopping)
  int64_t log_every = 50;           // steps between progress lines
  std::string progress = "auto";    // auto (bar on a terminal, lines otherwise) | bar | lines | off
  // Fault injection for reliability tests (train/faults.h, docs/reliability.md): "" = none, else e.g.
  // "oom@5,nan-grad@9,nan-loss@20x3" or "random:seed=1,oom=0.01,nan-grad=0.01,nan-loss=0.005,burst=3".
  std::string inject_faults;

  void validate() const;
  void validate_model_data() const;  // the model reads what the dataset holds; image-only flags on text
  bool augment_enabled() const;       // resolves "auto" from the dataset
  int64_t vram_budget_bytes() const;  // 0 when no budget
  bool cudnn_autotune_enabled() const;  // resolves "auto": on without a --vram-budget, except for tri-accel
  double warmup_epochs_resolved() const;
  Json to_json() const;
  static TrainOptions from_json(const Json& json);  // UserError naming a missing or mistyped key
};

const std::vector<std::string>& method_names();

}  // namespace triaccel
