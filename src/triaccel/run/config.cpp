#include "triaccel/run/config.h"

#include "triaccel/control/optimizer_state/baoc_controller.h"
#include "triaccel/core/bytes.h"
#include "triaccel/core/errors.h"
#include "triaccel/core/profile.h"
#include "triaccel/control/optimizer_state/format_plan.h"
#include "triaccel/train/faults.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <type_traits>

namespace triaccel {
namespace {

template <typename T, typename = void>
struct IsEnumOption : std::false_type {};
template <typename T>
struct IsEnumOption<T, std::void_t<decltype(EnumNames<T>::kNames)>> : std::true_type {};

// --- one field's value: text, JSON, and back ---

std::string value_text(const std::string& v) { return v; }
std::string value_text(bool v) { return v ? "true" : "false"; }
std::string value_text(int64_t v) { return std::to_string(v); }
std::string value_text(uint64_t v) { return std::to_string(v); }
std::string value_text(double v) {
  Json j = v;  // the shortest text that reads back as the same double
  return j.dump();
}
template <typename E, std::enable_if_t<IsEnumOption<E>::value, int> = 0>
std::string value_text(E v) {
  return enum_name(v);
}

void value_parse(const std::string& key, const std::string& text, std::string& out) { out = text; }

void value_parse(const std::string& key, const std::string& text, bool& out) {
  std::string t;
  for (char c : text) t += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (t == "true" || t == "1" || t == "yes" || t == "on") {
    out = true;
  } else if (t == "false" || t == "0" || t == "no" || t == "off") {
    out = false;
  } else {
    throw UserError(str_cat(option_ref(key), " must be true or false, got '", text, "'"));
  }
}

void value_parse(const std::string& key, const std::string& text, int64_t& out) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  TRIACCEL_CHECK_INPUT(!text.empty() && end && *end == '\0' && errno == 0, option_ref(key),
                       " must be an integer, got '", text, "'");
  out = v;
}

void value_parse(const std::string& key, const std::string& text, uint64_t& out) {
  errno = 0;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(text.c_str(), &end, 10);
  TRIACCEL_CHECK_INPUT(!text.empty() && text[0] != '-' && end && *end == '\0' && errno == 0, option_ref(key),
                       " must be a non-negative integer, got '", text, "'");
  out = v;
}

void value_parse(const std::string& key, const std::string& text, double& out) {
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  TRIACCEL_CHECK_INPUT(!text.empty() && end && *end == '\0' && errno == 0, option_ref(key), " must be a number, got '",
                       text, "'");
  out = v;
}

template <typename E, std::enable_if_t<IsEnumOption<E>::value, int> = 0>
void value_parse(const std::string& key, const std::string& text, E& out) {
  out = enum_parse<E>(text, key);
}

template <typename T>
Json value_json(const T& v) {
  if constexpr (IsEnumOption<T>::value) {
    return enum_name(v);
  } else {
    return v;
  }
}

// A JSON value of the field's type (numbers: integers for integer fields; enums: their names).
template <typename T>
void value_from_json(const std::string& key, const Json& j, T& out) {
  if constexpr (IsEnumOption<T>::value) {
    TRIACCEL_CHECK_INPUT(j.is_string(), option_ref(key), " must be one of ", enum_choices<T>(), ", got ", j.dump());
    out = enum_parse<T>(j.get<std::string>(), key);
  } else if constexpr (std::is_same_v<T, std::string>) {
    TRIACCEL_CHECK_INPUT(j.is_string(), option_ref(key), " must be a string, got ", j.dump());
    out = j.get<std::string>();
  } else if constexpr (std::is_same_v<T, bool>) {
    TRIACCEL_CHECK_INPUT(j.is_boolean(), option_ref(key), " must be true or false, got ", j.dump());
    out = j.get<bool>();
  } else if constexpr (std::is_same_v<T, double>) {
    TRIACCEL_CHECK_INPUT(j.is_number(), option_ref(key), " must be a number, got ", j.dump());
    out = j.get<double>();
  } else if constexpr (std::is_same_v<T, uint64_t>) {
    TRIACCEL_CHECK_INPUT(j.is_number_unsigned() || (j.is_number_integer() && j.get<int64_t>() >= 0), option_ref(key),
                         " must be a non-negative integer, got ", j.dump());
    out = j.get<uint64_t>();
  } else {
    static_assert(std::is_same_v<T, int64_t>, "option fields are string, bool, double, int64_t, uint64_t or enums");
    TRIACCEL_CHECK_INPUT(j.is_number_integer(), option_ref(key), " must be an integer, got ", j.dump());
    out = j.get<int64_t>();
  }
}

// Calls fn(field, info, section_title) for every field of every section.
template <typename C, typename Fn>
void config_fields(C& config, Fn&& fn) {
  C::sections(config, [&](auto& section) {
    using Section = std::remove_const_t<std::remove_reference_t<decltype(section)>>;
    Section::fields(section, [&](auto& field, const FieldInfo& info) { fn(field, info, Section::kTitle); });
  });
}

bool key_known(const std::string& key) {
  const auto& keys = Config::keys();
  return std::find(keys.begin(), keys.end(), key) != keys.end();
}

void check_known(const std::string& key) {
  TRIACCEL_CHECK_INPUT(key_known(key), "unknown option '", key, "'");
}

bool is_text_dataset(const std::string& dataset) { return dataset_kind(dataset) == DatasetKind::kTokens; }

}  // namespace

// --- sections ---

void DataConfig::validate() const {
  TRIACCEL_CHECK_INPUT(std::find(dataset_names().begin(), dataset_names().end(), dataset) != dataset_names().end(),
                       option_ref("dataset"), " must be one of ", choices_text(dataset_names()), ", got '", dataset,
                       "'");
  TRIACCEL_CHECK_INPUT(block_size >= 1 && block_size <= 8192, option_ref("block_size"), " must be in [1, 8192], got ",
                       block_size);
  TRIACCEL_CHECK_INPUT(image_size >= 0 && image_size <= 1024, option_ref("image_size"), " must be in [0, 1024], got ",
                       image_size);
  // The upper bound (the image's side) is checked where the images are known (Loader).
  TRIACCEL_CHECK_INPUT(cutout >= 0, option_ref("cutout"), " must be >= 0 (0: off), got ", cutout);
}

void ModelConfig::validate() const {
  model_entry(model);
  TRIACCEL_CHECK_INPUT(gpt_layers >= 1 && gpt_layers <= 1024, option_ref("gpt_layers"), " must be in [1, 1024], got ",
                       gpt_layers);
  TRIACCEL_CHECK_INPUT(gpt_heads >= 1, option_ref("gpt_heads"), " must be >= 1, got ", gpt_heads);
  TRIACCEL_CHECK_INPUT(gpt_embed >= 1 && gpt_embed % gpt_heads == 0, option_ref("gpt_embed"), " must be a positive "
                       "multiple of ", option_ref("gpt_heads"), " ", gpt_heads, ", got ", gpt_embed);
}

void OptimConfig::validate() const {
  TRIACCEL_CHECK_INPUT(lr > 0 && std::isfinite(lr), option_ref("lr"), " must be a positive number, got ", lr);
  TRIACCEL_CHECK_INPUT(momentum >= 0 && momentum < 1, option_ref("momentum"), " must be in [0, 1), got ", momentum);
  TRIACCEL_CHECK_INPUT(weight_decay >= 0, option_ref("weight_decay"), " must be >= 0, got ", weight_decay);
  TRIACCEL_CHECK_INPUT(label_smoothing >= 0 && label_smoothing < 1, option_ref("label_smoothing"),
                       " must be in [0, 1), got ", label_smoothing);
  TRIACCEL_CHECK_INPUT(adam_beta1 >= 0 && adam_beta1 < 1, option_ref("adam_beta1"), " must be in [0, 1), got ",
                       adam_beta1);
  TRIACCEL_CHECK_INPUT(adam_beta2 > 0 && adam_beta2 < 1, option_ref("adam_beta2"), " must be in (0, 1), got ",
                       adam_beta2);
  TRIACCEL_CHECK_INPUT(adam_eps > 0, option_ref("adam_eps"), " must be > 0, got ", adam_eps);
}

OptimizerOptions OptimConfig::optimizer_options() const {
  OptimizerOptions o;
  o.weight_decay = weight_decay;
  o.momentum = momentum;
  o.nesterov = nesterov;
  o.beta1 = adam_beta1;
  o.beta2 = adam_beta2;
  o.eps = adam_eps;
  return o;
}

void ScheduleConfig::validate() const {
  TRIACCEL_CHECK_INPUT(epochs > 0, option_ref("epochs"), " must be > 0, got ", epochs);
  TRIACCEL_CHECK_INPUT(max_steps >= 0, option_ref("max_steps"), " must be >= 0 (0 = no limit), got ", max_steps);
  TRIACCEL_CHECK_INPUT(batch_size > 0, option_ref("batch_size"), " must be > 0, got ", batch_size);
  TRIACCEL_CHECK_INPUT(batch_size <= 1 << 20, option_ref("batch_size"), " is too large: ", batch_size);
  TRIACCEL_CHECK_INPUT(warmup_epochs < 0 || warmup_epochs <= static_cast<double>(epochs), option_ref("warmup_epochs"),
                       " must be -1 (auto) or in [0, ", option_ref("epochs"), " = ", epochs, "], got ", warmup_epochs);
}

double ScheduleConfig::warmup_epochs_resolved() const {
  return warmup_epochs < 0 ? std::min(1.0, 0.1 * static_cast<double>(epochs)) : warmup_epochs;
}

void ExecutionConfig::validate() const {
  vram_budget_bytes();  // throws naming the option
  TRIACCEL_CHECK_INPUT(eval_batch_size > 0, option_ref("eval_batch_size"), " must be > 0, got ", eval_batch_size);
  TRIACCEL_CHECK_INPUT(micro_batch >= 0, option_ref("micro_batch"), " must be >= 0 (0: planned), got ", micro_batch);
  TRIACCEL_CHECK_INPUT(!recompute.empty(), option_ref("recompute"), " must be auto, none or unit names");
  const FaultPlan faults(inject_faults);  // throws naming the bad item
  TRIACCEL_CHECK_INPUT(nproc >= 1 && nproc <= 1024, option_ref("nproc"), " must be in [1, 1024], got ", nproc);
  TRIACCEL_CHECK_INPUT(std::isfinite(grad_bucket_mb) && grad_bucket_mb >= 0 && grad_bucket_mb <= 4096,
                       option_ref("grad_bucket_mb"), " must be in [0, 4096] MiB (0: one collective after backward), "
                       "got ", grad_bucket_mb);
}

int64_t ExecutionConfig::vram_budget_bytes() const {
  return vram_budget.empty() ? 0 : bytes_parse(vram_budget, "vram_budget");
}

bool ExecutionConfig::cudnn_autotune_enabled() const {
  if (cudnn_autotune == Toggle::kAuto) return vram_budget.empty() && method != Method::kTriAccel;
  return cudnn_autotune == Toggle::kOn;
}

void OutputConfig::validate() const {
  TRIACCEL_CHECK_INPUT(!out.empty(), option_ref("out"), " must name a folder");
  TRIACCEL_CHECK_INPUT(checkpoint_every >= 0, option_ref("checkpoint_every"), " must be >= 0, got ", checkpoint_every);
  TRIACCEL_CHECK_INPUT(checkpoint_minutes >= 0, option_ref("checkpoint_minutes"), " must be >= 0, got ",
                       checkpoint_minutes);
  TRIACCEL_CHECK_INPUT(log_every > 0, option_ref("log_every"), " must be > 0, got ", log_every);
  profile_steps_parse(profile_steps, option_ref("profile_steps"));
}

void TriAccelConfig::validate() const {
  TRIACCEL_CHECK_INPUT(ctrl_every > 0, option_ref("ctrl_every"), " must be > 0, got ", ctrl_every);
  TRIACCEL_CHECK_INPUT(curv_every > 0, option_ref("curv_every"), " must be > 0, got ", curv_every);
  TRIACCEL_CHECK_INPUT(curv_batch > 0, option_ref("curv_batch"), " must be > 0, got ", curv_batch);
  TRIACCEL_CHECK_INPUT(curv_top_k > 0 && curv_top_k <= 64, option_ref("curv_top_k"), " must be in [1, 64], got ",
                       curv_top_k);
  TRIACCEL_CHECK_INPUT(curv_chunk >= -1, option_ref("curv_chunk"), " must be >= -1 (0: the whole ",
                       option_ref("curv_batch"), "; -1: the estimator's), got ", curv_chunk);
  TRIACCEL_CHECK_INPUT(!curv_lockstep || curv_top_k == 1, option_ref("curv_lockstep"),
                       " true needs ", option_ref("curv_top_k"), " 1 (lockstep power iteration finds the top eigenvalue "
                       "only), got ", curv_top_k);
  TRIACCEL_CHECK_INPUT(curv_estimator != CurvatureEstimator::kFisher || curv_top_k == 1, option_ref("curv_estimator"),
                       " fisher needs ", option_ref("curv_top_k"), " 1 (its lockstep rounds find the top eigenvalue "
                       "only), got ", curv_top_k);
  TRIACCEL_CHECK_INPUT(curv_budget >= 0 && curv_budget <= 1, option_ref("curv_budget"), " must be in [0, 1], got ",
                       curv_budget);
  TRIACCEL_CHECK_INPUT(curv_max_iters > 0, option_ref("curv_max_iters"), " must be > 0, got ", curv_max_iters);
  TRIACCEL_CHECK_INPUT(curv_tol >= 0 && curv_tol < 1, option_ref("curv_tol"), " must be in [0, 1), got ", curv_tol);
  TRIACCEL_CHECK_INPUT(tau_low < 0 || tau_high < 0 || tau_low <= tau_high, option_ref("tau_low"), " (", tau_low,
                       ") must not exceed ", option_ref("tau_high"), " (", tau_high, ")");
}

void BaocConfig::validate(OptimizerKind optimizer) const {
  TRIACCEL_CHECK_INPUT(plan_warmup >= 2, option_ref("plan_warmup"),
                       " must be >= 2 steps (statistics compare successive gradients), got ", plan_warmup);
  TRIACCEL_CHECK_INPUT(replan_every >= 0, option_ref("replan_every"), " must be >= 0 (0: plan once), got ",
                       replan_every);
  TRIACCEL_CHECK_INPUT(optim_risk_floor >= 0 && optim_risk_floor <= 1, option_ref("optim_risk_floor"),
                       " must be in [0, 1], got ", optim_risk_floor);
  if (optimizer == OptimizerKind::kBaoc) {  // syntax now; feasibility once the model is known
    optim_memory_budget_parse(optim_memory_budget, 1);
    optim_time_budget_parse(optim_time_budget, 1.0);
    optim_formats_parse(optim_formats);
  }
}

void NeuroFluxConfig::validate() const {
  TRIACCEL_CHECK_INPUT(nf_max_batch >= 2, option_ref("nf_max_batch"), " must be >= 2, got ", nf_max_batch);
  TRIACCEL_CHECK_INPUT(nf_holdout >= 0, option_ref("nf_holdout"), " must be >= 0, got ", nf_holdout);
  TRIACCEL_CHECK_INPUT(nf_exit_tolerance >= 0 && nf_exit_tolerance <= 100, option_ref("nf_exit_tolerance"),
                       " must be in [0, 100] (accuracy points), got ", nf_exit_tolerance);
}

// --- the whole configuration ---

std::vector<std::string> Config::keys() {
  static const std::vector<std::string> kKeys = [] {
    std::vector<std::string> keys;
    Config c;
    config_fields(c, [&](auto&, const FieldInfo& info, const char*) { keys.emplace_back(info.key); });
    return keys;
  }();
  return kKeys;
}

std::string Config::flag_of(const std::string& key) {
  std::string flag;
  Config c;
  config_fields(c, [&](auto&, const FieldInfo& info, const char*) {
    if (key == info.key && info.flag) flag = info.flag;
  });
  if (!flag.empty()) return flag;
  std::string dashed = key;
  std::replace(dashed.begin(), dashed.end(), '_', '-');
  return "--" + dashed;
}

void Config::set(const std::string& key, const std::string& text) {
  check_known(key);
  config_fields(*this, [&](auto& field, const FieldInfo& info, const char*) {
    if (key == info.key) value_parse(key, text, field);
  });
  given.insert(key);
}

void Config::set_json(const std::string& key, const Json& value) {
  check_known(key);
  config_fields(*this, [&](auto& field, const FieldInfo& info, const char*) {
    if (key != info.key) return;
    using T = std::remove_reference_t<decltype(field)>;
    if constexpr (std::is_same_v<T, double>) {  // a Python int where a float is expected
      TRIACCEL_CHECK_INPUT(value.is_number(), option_ref(key), " must be a number, got ", value.dump());
      field = value.get<double>();
    } else {
      value_from_json(key, value, field);
    }
  });
  given.insert(key);
}

void Config::resolve() {
  // AdamW's usual scale: SGD's defaults (lr 0.1, weight decay 5e-4) would diverge or barely regularize.
  if (optim.optimizer != OptimizerKind::kSgd) {
    if (!was_given("lr")) optim.lr = 1e-3;
    if (!was_given("weight_decay")) optim.weight_decay = 1e-2;
  }
  // The Fisher's rounds find each unit's top eigenvalue only; k > 1 needs the Hessian's deflated power iteration.
  // The Fisher is the default because it is the estimator whose curvature stays alive inside the 5 % budget
  // (docs/tri-accel.md: every unit within 0.8-2.7 epochs on ResNet-18 and EfficientNet-B0; the Hessian 6 of 10).
  if (!was_given("curv_estimator")) {
    tri_accel.curv_estimator = tri_accel.curv_top_k == 1 ? CurvatureEstimator::kFisher : CurvatureEstimator::kHessian;
  }
}

std::optional<NeuroFluxRefusal> neuroflux_refusal(const Config& config) {
  const std::string nf = str_cat(option_ref("method"), " neuroflux");
  // Its aux heads, cache and exits are built for CNN feature maps (docs/neuroflux.md).
  if (!model_entry(config.model.model).local_learning) {
    std::string cnns;
    for (const auto& e : model_registry()) {
      if (e.local_learning) cnns += (cnns.empty() ? "" : ", ") + std::string(e.name);
    }
    return NeuroFluxRefusal{"trains CNNs only",
                            str_cat(nf, " trains CNNs (", cnns, "), got ", option_ref("model"), " ", config.model.model)};
  }
  const OptimizerKind optimizer = config.optim.optimizer;
  if (optimizer != OptimizerKind::kSgd) {
    return NeuroFluxRefusal{str_cat("trains with its fused SGD, not ", enum_name(optimizer)),
                            str_cat(nf, " trains every block with the fused SGD; use ", option_ref("optimizer"),
                                    " sgd, got '", enum_name(optimizer), "'")};
  }
  const PrecisionMode precision = config.execution.precision;
  if (precision == PrecisionMode::kAmpFP16 || precision == PrecisionMode::kAmpFP8) {
    const std::string name = enum_name(precision);
    return NeuroFluxRefusal{str_cat("takes fp32 or amp-bf16, not ", name),
                            str_cat(nf, " supports ", option_ref("precision"), " fp32 or amp-bf16, got ", name)};
  }
  if (!config.execution.inject_faults.empty()) {
    return NeuroFluxRefusal{"refuses inject_faults, a lever of backprop's",
                            str_cat(option_ref("inject_faults"), " applies to ", option_ref("method"),
                                    " backprop and tri-accel, not neuroflux")};
  }
  for (const char* key :
       {"micro_batch", "recompute", "data_placement", "saved_activations", "update_in_backward", "batch_policy"}) {
    if (config.was_given(key)) {
      return NeuroFluxRefusal{str_cat("refuses ", key, ", a lever of backprop's"),
                              str_cat(option_ref(key), " applies to ", option_ref("method"),
                                      " backprop and tri-accel; neuroflux plans its blocks' batches itself")};
    }
  }
  return std::nullopt;
}

void Config::validate() const {
  sections(*this, [&](const auto& section) {
    using Section = std::remove_const_t<std::remove_reference_t<decltype(section)>>;
    if constexpr (std::is_same_v<Section, BaocConfig>) {
      section.validate(optim.optimizer);
    } else {
      section.validate();
    }
  });
  const ModelEntry& entry = model_entry(model.model);
  const Method method = execution.method;
  const std::string& name = model.model;
  // The Hessian's products differentiate twice; the fused attention kernels (flash, memory-efficient, CPU flash)
  // have no double backward. The Fisher's rounds (first-order gradients only) run on every model.
  const bool hessian = tri_accel.curv_estimator == CurvatureEstimator::kHessian &&
                       (tri_accel.ta_curvature || tri_accel.ta_precision);
  TRIACCEL_CHECK_INPUT(method != Method::kTriAccel || entry.double_backward || !hessian, option_ref("method"),
                       " tri-accel with ", option_ref("curv_estimator"), " hessian needs double backward, which ",
                       option_ref("model"), " ", name, " (its fused attention) has not; use ",
                       option_ref("curv_estimator"), " fisher (with ", option_ref("curv_top_k"), " 1)");
  if (method == Method::kNeuroFlux) {
    const auto refusal = neuroflux_refusal(*this);
    TRIACCEL_CHECK_INPUT(!refusal, refusal->message);
  }
  TRIACCEL_CHECK_INPUT(optim.optimizer != OptimizerKind::kBaoc || method == Method::kBackprop, option_ref("optimizer"),
                       " baoc needs ", option_ref("method"), " backprop");
  validate_world(execution.nproc);
  TRIACCEL_CHECK_INPUT(execution.micro_batch <= schedule.batch_size, option_ref("micro_batch"), " ",
                       execution.micro_batch, " is larger than ", option_ref("batch_size"), " ", schedule.batch_size,
                       "; use at most the batch size (or 0 for the planner's choice)");
  TRIACCEL_CHECK_INPUT(execution.batch_policy == BatchPolicy::kFixed || method == Method::kTriAccel,
                       option_ref("batch_policy"), " elastic is tri-accel's rule; use ", option_ref("method"),
                       " tri-accel, or batch_policy fixed");
  // The model reads what the dataset holds (a model of ModelInput::kAny reads either); image-only options on text.
  const bool text = is_text_dataset(data.dataset);
  TRIACCEL_CHECK_INPUT(entry.input != ModelInput::kTokens || text, option_ref("model"), " ", name,
                       " reads text but ", option_ref("dataset"), " ", data.dataset, " holds images; use ",
                       option_ref("dataset"), " tinyshakespeare, or an image model");
  TRIACCEL_CHECK_INPUT(entry.input != ModelInput::kImage || !text, option_ref("model"), " ", name,
                       " reads images but ", option_ref("dataset"), " ", data.dataset, " is text; use ",
                       option_ref("model"), " gpt-char");
  if (!text) return;
  TRIACCEL_CHECK_INPUT(data.augment != Toggle::kOn, option_ref("augment"), " on applies to images only; ",
                       option_ref("dataset"), " ", data.dataset, " is text: drop it or use off");
  TRIACCEL_CHECK_INPUT(data.cutout == 0, option_ref("cutout"), " applies to images only; ", option_ref("dataset"), " ",
                       data.dataset, " is text: drop it");
  TRIACCEL_CHECK_INPUT(data.image_size == 0, option_ref("image_size"), " applies to images only; ",
                       option_ref("dataset"), " ", data.dataset, " is text: drop it (use ", option_ref("block_size"),
                       " for the context length)");
  TRIACCEL_CHECK_INPUT(execution.tta == Tta::kOff, option_ref("tta"), " flip applies to images only; ",
                       option_ref("dataset"), " ", data.dataset, " is text: drop it");
}

bool Config::augment_enabled() const {
  if (data.augment == Toggle::kAuto) return data.dataset == "cifar10" || data.dataset == "cifar100";
  return data.augment == Toggle::kOn;
}

Json Config::to_json() const {
  Json j = Json::object();
  config_fields(*this, [&](const auto& field, const FieldInfo& info, const char*) { j[info.key] = value_json(field); });
  return j;
}

Config Config::from_json(const Json& j) {
  TRIACCEL_CHECK_INPUT(j.is_object(), "a stored configuration must be a JSON object");
  Config c;
  config_fields(c, [&](auto& field, const FieldInfo& info, const char*) {
    if (j.contains(info.key)) value_from_json(info.key, j.at(info.key), field);
  });
  // Written before curv_tol existed, with the tolerance of that time: resumes take the same probes. (curv_top_k was
  // always written, so an older configuration keeps its own k.)
  if (!j.contains("curv_tol")) c.tri_accel.curv_tol = 1e-3;
  // Written before curv_estimator existed: the Hessian, the only estimator of that time.
  if (!j.contains("curv_estimator")) c.tri_accel.curv_estimator = CurvatureEstimator::kHessian;
  // Written before curv_lr_mean existed: the paper's scales, the only rule of that time.
  if (!j.contains("curv_lr_mean")) c.tri_accel.curv_lr_mean = false;
  return c;
}

std::vector<OptionDoc> Config::options() const {
  std::vector<OptionDoc> out;
  config_fields(*this, [&](const auto& field, const FieldInfo& info, const char* section) {
    using T = std::remove_const_t<std::remove_reference_t<decltype(field)>>;
    OptionDoc d;
    d.key = info.key;
    d.flag = flag_of(info.key);
    d.section = section;
    d.help = info.help;
    if (info.choices) d.help += (d.help.empty() ? "" : ": ") + choices_text(info.choices());
    d.default_text = value_text(field);
    if constexpr (IsEnumOption<T>::value) {
      for (const auto& n : enum_names<T>()) d.type += (d.type.empty() ? "" : "|") + n;
    } else if constexpr (std::is_same_v<T, bool>) {
      d.type = "BOOL";
    } else if constexpr (std::is_same_v<T, double>) {
      d.type = "NUMBER";
    } else if constexpr (std::is_integral_v<T>) {
      d.type = "INT";
    } else {
      d.type = "TEXT";
    }
    out.push_back(std::move(d));
  });
  return out;
}

void Config::validate_world(int64_t world) const {
  if (world <= 1) return;
  // What data parallelism supports so far (docs/distributed.md).
  const Method method = execution.method;
  const std::string world_ref = str_cat(option_ref("nproc"), " ", world);
  // (method auto is fine: each rank looks at its own GPU's plan, and the ranks must agree: run/session.h.)
  // NeuroFlux trains each block data parallel, its BatchNorms per rank (rank 0's running statistics at each block's
  // end); synchronized BatchNorm is the backprop trainer's.
  TRIACCEL_CHECK_INPUT(method != Method::kNeuroFlux || !execution.sync_bn, option_ref("sync_bn"), " applies to ",
                       option_ref("method"), " backprop and tri-accel; drop it with neuroflux");
  // (optimizer baoc is fine: its statistics come from the reduced gradient and its plan from them and from tables,
  // so every rank makes the same plans.)
  const ExecutionConfig& ex = execution;
  // (micro_batch and recompute are fine: a rank's micro-batches accumulate before the one reduction. So is a
  // vram_budget: each rank plans its share of the batch, and the ranks agree on the worst rank's readings.)
  // (inject_faults is fine: every rank draws the same faults at the same steps, and retries or skips them alike.)
  TRIACCEL_CHECK_INPUT(ex.batch_policy == BatchPolicy::kFixed, option_ref("batch_policy"), " elastic follows one "
                       "process's memory; with ", world_ref, " use ", option_ref("batch_policy"), " fixed (the memory "
                       "planner splits each process's share into micro-batches instead)");
  TRIACCEL_CHECK_INPUT(schedule.batch_size >= world, option_ref("batch_size"), " ", schedule.batch_size,
                       " is smaller than ", world_ref, " (the global batch is split across the processes); raise it");
  // Synchronized BatchNorm sums each BatchNorm's statistics once per forward on every rank, in lockstep: micro-batches
  // (their number may differ between ranks) and recomputed units (a second forward) would break it.
  if (!ex.sync_bn) return;
  TRIACCEL_CHECK_INPUT(ex.vram_budget.empty(), option_ref("sync_bn"), " runs each process's share in one forward, "
                       "which a ", option_ref("vram_budget"), " may split into micro-batches; drop one of them");
  TRIACCEL_CHECK_INPUT(ex.micro_batch == 0, option_ref("sync_bn"), " runs each process's share in one forward; drop ",
                       option_ref("micro_batch"), " ", ex.micro_batch);
  TRIACCEL_CHECK_INPUT(ex.recompute == "auto" || ex.recompute == "none", option_ref("sync_bn"),
                       " runs each unit's forward once; drop ", option_ref("recompute"), " ", ex.recompute);
}

const std::vector<std::string>& config_identity_keys() {
  static const std::vector<std::string> kKeys = {
      "method",          "model",     "dataset",    "batch_size",  "lr",         "momentum",  "nesterov",
      "weight_decay",    "warmup_epochs", "lr_decay", "label_smoothing", "precision", "augment", "cutout",
      "image_size",      "seed",      "block_size", "optimizer",   "adam_beta1", "adam_beta2", "adam_eps",
      "gpt_layers",      "gpt_heads", "gpt_embed"};
  return kKeys;
}

}  // namespace triaccel
