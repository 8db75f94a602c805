#include "triaccel/train/options.h"

#include "triaccel/core/bytes.h"
#include "triaccel/core/errors.h"
#include "triaccel/data/dataset.h"
#include "triaccel/memory/batch_controller.h"
#include "triaccel/models/model.h"
#include "triaccel/optim/baoc_driver.h"
#include "triaccel/optim/planner.h"
#include "triaccel/train/faults.h"
#include "triaccel/train/schedule.h"

#include <algorithm>
#include <cmath>

namespace triaccel {
namespace {

template <typename T>
bool contains(const std::vector<T>& v, const T& x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : ", ") + s;
  return out;
}

}  // namespace

std::string precision_mode_name(PrecisionMode mode) {
  switch (mode) {
    case PrecisionMode::kFP32: return "fp32";
    case PrecisionMode::kAmpBF16: return "amp-bf16";
    case PrecisionMode::kAmpFP16: return "amp-fp16";
  }
  return "?";
}

PrecisionMode precision_mode_parse(const std::string& name) {
  if (name == "fp32") return PrecisionMode::kFP32;
  if (name == "amp-bf16" || name == "bf16") return PrecisionMode::kAmpBF16;
  if (name == "amp-fp16" || name == "fp16") return PrecisionMode::kAmpFP16;
  throw UserError("--precision must be fp32, amp-bf16 or amp-fp16, got '" + name + "'");
}

const std::vector<std::string>& method_names() {
  static const std::vector<std::string> names = {"backprop", "tri-accel", "neuroflux"};
  return names;
}

void TrainOptions::validate() const {
  TRIACCEL_CHECK_INPUT(contains(method_names(), method), "--method must be one of ", join(method_names()),
                       ", got '", method, "'");
  TRIACCEL_CHECK_INPUT(contains(model_names(), model), "--model must be one of ", join(model_names()), ", got '",
                       model, "'");
  TRIACCEL_CHECK_INPUT(contains(dataset_names(), dataset), "--dataset must be one of ", join(dataset_names()),
                       ", got '", dataset, "'");
  TRIACCEL_CHECK_INPUT(epochs > 0, "--epochs must be > 0, got ", epochs);
  TRIACCEL_CHECK_INPUT(max_steps >= 0, "--max-steps must be >= 0 (0 = no limit), got ", max_steps);
  TRIACCEL_CHECK_INPUT(batch_size > 0, "--batch-size must be > 0, got ", batch_size);
  TRIACCEL_CHECK_INPUT(batch_size <= 1 << 20, "--batch-size is too large: ", batch_size);
  TRIACCEL_CHECK_INPUT(lr > 0 && std::isfinite(lr), "--lr must be a positive number, got ", lr);
  TRIACCEL_CHECK_INPUT(momentum >= 0 && momentum < 1, "--momentum must be in [0, 1), got ", momentum);
  TRIACCEL_CHECK_INPUT(weight_decay >= 0, "--weight-decay must be >= 0, got ", weight_decay);
  TRIACCEL_CHECK_INPUT(warmup_epochs < 0 || warmup_epochs <= static_cast<double>(epochs),
                       "--warmup-epochs must be -1 (auto) or in [0, --epochs = ", epochs, "], got ", warmup_epochs);
  lr_decay_parse(lr_decay);  // throws with the flag's name
  TRIACCEL_CHECK_INPUT(label_smoothing >= 0 && label_smoothing < 1, "--label-smoothing must be in [0, 1), got ",
                       label_smoothing);
  TRIACCEL_CHECK_INPUT(device == "auto" || device == "cpu" || device == "cuda",
                       "--device must be auto, cpu or cuda, got '", device, "'");
  TRIACCEL_CHECK_INPUT(augment == "auto" || augment == "on" || augment == "off",
                       "--augment must be auto, on or off, got '", augment, "'");
  TRIACCEL_CHECK_INPUT(image_size >= 0 && image_size <= 1024, "--image-size must be in [0, 1024], got ", image_size);
  // The upper bound (the image's side) is checked where the images are known (Loader).
  TRIACCEL_CHECK_INPUT(cutout >= 0, "--cutout must be >= 0 (0: off), got ", cutout);
  TRIACCEL_CHECK_INPUT(ctrl_every > 0, "--ctrl-every must be > 0, got ", ctrl_every);
  TRIACCEL_CHECK_INPUT(curv_every > 0, "--curv-every must be > 0, got ", curv_every);
  TRIACCEL_CHECK_INPUT(curv_batch > 0, "--curv-batch must be > 0, got ", curv_batch);
  TRIACCEL_CHECK_INPUT(curv_top_k > 0 && curv_top_k <= 64, "--curv-top-k must be in [1, 64], got ", curv_top_k);
  TRIACCEL_CHECK_INPUT(curv_budget >= 0 && curv_budget <= 1, "--curv-budget must be in [0, 1], got ", curv_budget);
  TRIACCEL_CHECK_INPUT(curv_max_iters > 0, "--curv-max-iters must be > 0, got ", curv_max_iters);
  TRIACCEL_CHECK_INPUT(tau_low < 0 || tau_high < 0 || tau_low <= tau_high, "--tau-low (", tau_low,
                       ") must not exceed --tau-high (", tau_high, ")");
  vram_budget_bytes();                 // throws with the flag's name
  lr_batch_rule_parse(lr_batch_rule);  // throws with the flag's name
  TRIACCEL_CHECK_INPUT(cudnn_autotune == "auto" || cudnn_autotune == "on" || cudnn_autotune == "off",
                       "--cudnn-autotune must be auto, on or off, got '", cudnn_autotune, "'");
  TRIACCEL_CHECK_INPUT(nf_max_batch >= 2, "--nf-max-batch must be >= 2, got ", nf_max_batch);
  TRIACCEL_CHECK_INPUT(nf_holdout >= 0, "--nf-holdout must be >= 0, got ", nf_holdout);
  TRIACCEL_CHECK_INPUT(nf_exit_tolerance >= 0 && nf_exit_tolerance <= 100,
                       "--nf-exit-tolerance must be in [0, 100] (accuracy points), got ", nf_exit_tolerance);
  TRIACCEL_CHECK_INPUT(nf_profile == "auto" || nf_profile == "model" || nf_profile == "measured",
                       "--nf-profile must be auto, model or measured, got '", nf_profile, "'");
  TRIACCEL_CHECK_INPUT(method != "neuroflux" || optimizer == "sgd",
                       "--method neuroflux trains every block with the fused SGD; use --optimizer sgd, got '", optimizer, "'");
  TRIACCEL_CHECK_INPUT(optimizer == "sgd" || optimizer == "adamw" || optimizer == "baoc",
                       "--optimizer must be sgd, adamw or baoc, got '", optimizer, "'");
  TRIACCEL_CHECK_INPUT(adam_beta1 >= 0 && adam_beta1 < 1, "--adam-beta1 must be in [0, 1), got ", adam_beta1);
  TRIACCEL_CHECK_INPUT(adam_beta2 > 0 && adam_beta2 < 1, "--adam-beta2 must be in (0, 1), got ", adam_beta2);
  TRIACCEL_CHECK_INPUT(adam_eps > 0, "--adam-eps must be > 0, got ", adam_eps);
  TRIACCEL_CHECK_INPUT(plan_warmup >= 2, "--plan-warmup must be >= 2 steps (statistics compare successive gradients), got ",
                       plan_warmup);
  TRIACCEL_CHECK_INPUT(replan_every >= 0, "--replan-every must be >= 0 (0: plan once), got ", replan_every);
  TRIACCEL_CHECK_INPUT(optim_risk_floor >= 0 && optim_risk_floor <= 1, "--optim-risk-floor must be in [0, 1], got ",
                       optim_risk_floor);
  TRIACCEL_CHECK_INPUT(optimizer != "baoc" || method == "backprop", "--optimizer baoc needs --method backprop");
  if (optimizer == "baoc") {  // syntax now; feasibility once the model is known
    optim_memory_budget_parse(optim_memory_budget, 1);
    optim_time_budget_parse(optim_time_budget, 1.0);
    optim_formats_parse(optim_formats);
  }
  TRIACCEL_CHECK_INPUT(tta == "off" || tta == "flip", "--tta must be off or flip, got '", tta, "'");
  TRIACCEL_CHECK_INPUT(eval_batch_size > 0, "--eval-batch-size must be > 0, got ", eval_batch_size);
  TRIACCEL_CHECK_INPUT(!out.empty(), "--out must name a folder");
  TRIACCEL_CHECK_INPUT(checkpoint_every >= 0, "--checkpoint-every must be >= 0, got ", checkpoint_every);
  TRIACCEL_CHECK_INPUT(log_every > 0, "--log-every must be > 0, got ", log_every);
  const FaultPlan faults(inject_faults);  // throws naming the bad item
  TRIACCEL_CHECK_INPUT(inject_faults.empty() || method != "neuroflux",
                       "--inject-faults applies to --method backprop and tri-accel, not neuroflux");
  TRIACCEL_CHECK_INPUT(progress == "auto" || progress == "bar" || progress == "lines" || progress == "off",
                       "--progress must be auto, bar, lines or off, got '", progress, "'");
  validate_model_data();
}

void TrainOptions::validate_model_data() const {
  TRIACCEL_CHECK_INPUT(block_size >= 1 && block_size <= 8192, "--block-size must be in [1, 8192], got ", block_size);
  // The curvature probe differentiates twice; the fused attention kernels (flash, memory-efficient, CPU flash)
  // have no double backward, and the probe reads image batches.
  TRIACCEL_CHECK_INPUT(method != "tri-accel" || (model != "vit-tiny" && model != "gpt-char"),
                       "--method tri-accel does not support --model ", model,
                       " yet (its curvature probe needs double backward through attention); use --method backprop");
  // NeuroFlux's aux heads, cache and exits are built for CNN feature maps (docs/neuroflux.md).
  TRIACCEL_CHECK_INPUT(method != "neuroflux" || model == "resnet18" || model == "efficientnet-b0" || model == "small-cnn",
                       "--method neuroflux trains CNNs (resnet18, efficientnet-b0, small-cnn), got --model ", model);
  const bool text = dataset_kind(dataset) == DatasetKind::kTokens;
  const bool language_model = model_input(model) == ModelInput::kTokens;
  TRIACCEL_CHECK_INPUT(!language_model || text, "--model ", model, " reads text but --dataset ", dataset,
                       " holds images; use --dataset tinyshakespeare, or an image model");
  TRIACCEL_CHECK_INPUT(language_model || !text, "--model ", model, " reads images but --dataset ", dataset,
                       " is text; use --model gpt-char");
  if (!text) return;
  TRIACCEL_CHECK_INPUT(augment != "on", "--augment on applies to images only; --dataset ", dataset,
                       " is text: drop the flag or use --augment off");
  TRIACCEL_CHECK_INPUT(cutout == 0, "--cutout applies to images only; --dataset ", dataset,
                       " is text: drop the flag");
  TRIACCEL_CHECK_INPUT(image_size == 0, "--image-size applies to images only; --dataset ", dataset,
                       " is text: drop the flag (use --block-size for the context length)");
  TRIACCEL_CHECK_INPUT(tta == "off", "--tta flip applies to images only; --dataset ", dataset,
                       " is text: drop the flag");
}

double TrainOptions::warmup_epochs_resolved() const {
  return warmup_epochs < 0 ? std::min(1.0, 0.1 * static_cast<double>(epochs)) : warmup_epochs;
}

int64_t TrainOptions::vram_budget_bytes() const {
  return vram_budget.empty() ? 0 : bytes_parse(vram_budget, "--vram-budget");
}

bool TrainOptions::cudnn_autotune_enabled() const {
  return cudnn_autotune == "auto" ? vram_budget.empty() && method != "tri-accel" : cudnn_autotune == "on";
}

bool TrainOptions::augment_enabled() const {
  if (augment == "auto") return dataset == "cifar10" || dataset == "cifar100";
  return augment == "on";
}

Json TrainOptions::to_json() const {
  return Json{{"method", method},
              {"model", model},
              {"dataset", dataset},
              {"data_dir", data_dir},
              {"block_size", block_size},
              {"epochs", epochs},
              {"max_steps", max_steps},
              {"batch_size", batch_size},
              {"lr", lr},
              {"momentum", momentum},
              {"nesterov", nesterov},
              {"weight_decay", weight_decay},
              {"warmup_epochs", warmup_epochs},
              {"lr_decay", lr_decay},
              {"label_smoothing", label_smoothing},
              {"precision", precision_mode_name(precision)},
              {"device", device},
              {"channels_last", channels_last},
              {"cuda_graphs", cuda_graphs},
              {"augment", augment},
              {"cutout", cutout},
              {"image_size", image_size},
              {"eval_batch_size", eval_batch_size},
              {"tta", tta},
              {"ctrl_every", ctrl_every},
              {"curv_every", curv_every},
              {"curv_batch", curv_batch},
              {"curv_top_k", curv_top_k},
              {"curv_max_iters", curv_max_iters},
              {"curv_budget", curv_budget},
              {"curv_alpha", curv_alpha},
              {"tau_low", tau_low},
              {"tau_high", tau_high},
              {"tau_curv", tau_curv},
              {"ta_precision", ta_precision},
              {"ta_curvature", ta_curvature},
              {"ta_batch", ta_batch},
              {"vram_budget", vram_budget},
              {"nf_max_batch", nf_max_batch},
              {"nf_holdout", nf_holdout},
              {"nf_exit_tolerance", nf_exit_tolerance},
              {"nf_profile", nf_profile},
              {"lr_batch_rule", lr_batch_rule},
              {"cudnn_autotune", cudnn_autotune},
              {"optimizer", optimizer},
              {"adam_beta1", adam_beta1},
              {"adam_beta2", adam_beta2},
              {"adam_eps", adam_eps},
              {"optim_memory_budget", optim_memory_budget},
              {"optim_time_budget", optim_time_budget},
              {"optim_formats", optim_formats},
              {"optim_time_table", optim_time_table},
              {"plan_warmup", plan_warmup},
              {"replan_every", replan_every},
              {"optim_risk_floor", optim_risk_floor},
              {"out", out},
              {"seed", seed},
              {"resume", resume},
              {"checkpoint_every", checkpoint_every},
              {"log_every", log_every},
              {"progress", progress},
              {"inject_faults", inject_faults}};
}

TrainOptions TrainOptions::from_json(const Json& j) {
  TrainOptions o;
  auto get = [&](const char* key, auto& field) {
    TRIACCEL_CHECK_INPUT(j.contains(key), "stored configuration lacks '", key, "'");
    try {
      j.at(key).get_to(field);
    } catch (const std::exception&) {
      throw UserError(std::string("stored configuration has a mistyped '") + key + "'");
    }
  };
  std::string precision;
  get("method", o.method);
  get("model", o.model);
  get("dataset", o.dataset);
  get("data_dir", o.data_dir);
  if (j.contains("block_size")) get("block_size", o.block_size);  // absent in checkpoints before the flag
  get("epochs", o.epochs);
  get("max_steps", o.max_steps);
  get("batch_size", o.batch_size);
  get("lr", o.lr);
  get("momentum", o.momentum);
  get("nesterov", o.nesterov);
  get("weight_decay", o.weight_decay);
  get("warmup_epochs", o.warmup_epochs);
  if (j.contains("lr_decay")) get("lr_decay", o.lr_decay);  // absent in checkpoints before the flag (cosine)
  get("label_smoothing", o.label_smoothing);
  get("precision", precision);
  o.precision = precision_mode_parse(precision);
  get("device", o.device);
  get("channels_last", o.channels_last);
  get("cuda_graphs", o.cuda_graphs);
  get("augment", o.augment);
  if (j.contains("cutout")) get("cutout", o.cutout);  // absent in checkpoints before the flag (it was off)
  get("image_size", o.image_size);
  get("eval_batch_size", o.eval_batch_size);
  get("tta", o.tta);
  get("ctrl_every", o.ctrl_every);
  get("curv_every", o.curv_every);
  get("curv_batch", o.curv_batch);
  get("curv_top_k", o.curv_top_k);
  get("curv_max_iters", o.curv_max_iters);
  get("curv_budget", o.curv_budget);
  get("curv_alpha", o.curv_alpha);
  get("tau_low", o.tau_low);
  get("tau_high", o.tau_high);
  get("tau_curv", o.tau_curv);
  get("ta_precision", o.ta_precision);
  get("ta_curvature", o.ta_curvature);
  if (j.contains("ta_batch")) get("ta_batch", o.ta_batch);
  if (j.contains("vram_budget")) get("vram_budget", o.vram_budget);  // absent in checkpoints before the flag
  if (j.contains("nf_max_batch")) {  // absent in configurations written before NeuroFlux
    get("nf_max_batch", o.nf_max_batch);
    get("nf_holdout", o.nf_holdout);
    get("nf_exit_tolerance", o.nf_exit_tolerance);
    get("nf_profile", o.nf_profile);
  }
  get("lr_batch_rule", o.lr_batch_rule);
  if (j.contains("cudnn_autotune")) get("cudnn_autotune", o.cudnn_autotune);  // absent before the flag (auto)
  if (j.contains("optimizer")) {  // absent in checkpoints from before --optimizer (they used SGD)
    get("optimizer", o.optimizer);
    get("adam_beta1", o.adam_beta1);
    get("adam_beta2", o.adam_beta2);
    get("adam_eps", o.adam_eps);
    get("optim_memory_budget", o.optim_memory_budget);
    get("optim_time_budget", o.optim_time_budget);
    get("optim_formats", o.optim_formats);
    get("optim_time_table", o.optim_time_table);
    get("plan_warmup", o.plan_warmup);
    get("replan_every", o.replan_every);
    if (j.contains("optim_risk_floor")) get("optim_risk_floor", o.optim_risk_floor);  // absent before the flag
  }
  get("out", o.out);
  get("seed", o.seed);
  get("resume", o.resume);
  get("checkpoint_every", o.checkpoint_every);
  get("log_every", o.log_every);
  get("progress", o.progress);
  if (j.contains("inject_faults")) get("inject_faults", o.inject_faults);  // absent in checkpoints before the flag
  return o;
}

}  // namespace triaccel
