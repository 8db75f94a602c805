#include "triaccel/run/memory_setup.h"

#include "triaccel/run/block_memory_setup.h"

#include "triaccel/control/memory/partitioner.h"
#include "triaccel/control/optimizer_state/baoc_controller.h"
#include "triaccel/optim/quant8.h"
#include "triaccel/optim/signals.h"
#include "triaccel/core/bytes.h"
#include "triaccel/core/device.h"
#include "triaccel/core/errors.h"
#include "triaccel/models/model.h"
#include "triaccel/models/registry.h"
#include "triaccel/optim/state_format.h"
#include "triaccel/run/component_options.h"
#include "triaccel/train/fp8_saved.h"
#include "triaccel/train/grad_buckets.h"
#include "triaccel/train/precision.h"
#include "triaccel/train/step.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace triaccel {
namespace {

// The share of the vram_budget a plan may fill: the cap limits what the caching allocator reserves, which exceeds
// what is allocated by its rounding and by blocks cached in one pool (the CUDA graph's, the eager steps') while
// another needs them.
constexpr double kPlanShareOfCap = 0.9;

// The recompute option as per-unit flags: empty for auto (the planner chooses), all false for none.
std::vector<bool> recompute_parse(const std::string& text, const Model& model) {
  if (text == "auto") return {};
  const auto& units = model.units();
  std::vector<bool> flags(units.size(), false);
  if (text == "none") return flags;
  std::string names;
  for (const Unit& u : units) names += (names.empty() ? "" : ", ") + u.name;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    const std::string name = text.substr(start, comma - start);
    size_t i = 0;
    while (i < units.size() && units[i].name != name) ++i;
    TRIACCEL_CHECK_INPUT(i < units.size(), option_ref("recompute"), ": model ", model.arch(), " has no unit '", name,
                         "'; use auto, none, or some of: ", names);
    flags[i] = true;
    start = comma + 1;
  }
  return flags;
}

// Each parameter's element count, in the optimizer's order (the model's named parameters).
std::vector<int64_t> parameter_numels(Model& model) {
  std::vector<int64_t> out;
  for (const auto& item : model.named_parameters()) out.push_back(item.value().numel());
  return out;
}

// Whether the configuration allows sharding the optimizer state over `world` ranks (ZeRO stage 1): several ranks,
// an optimizer that keeps state, and not shard_optimizer off.
bool shard_possible(const Config& config, int64_t world) {
  const OptimConfig& o = config.optim;
  const bool stateful = o.optimizer != OptimizerKind::kSgd || o.momentum > 0;
  return world > 1 && stateful && config.execution.shard_optimizer != Toggle::kOff;
}

// The optimizer's state bytes per parameter element: SGD's momentum 4 (0 without momentum), AdamW's two moments 8
// (and BAOC's warm-up, which runs AdamW).
int64_t state_bytes_per_element(const OptimConfig& o) {
  return o.optimizer == OptimizerKind::kSgd ? (o.momentum > 0 ? 4 : 0) : 8;
}

// Why this run cannot update each parameter in backward (TrainStep::update_in_backward_possible, known before the
// step exists), as the end of a sentence; "" when it can.
std::string update_in_backward_refusal(const Config& config, int64_t world, Model& model) {
  const ExecutionConfig& ex = config.execution;
  if (config.optim.optimizer == OptimizerKind::kBaoc) {
    return "is not for --optimizer baoc (its plan reads every gradient of a step together): use sgd or adamw";
  }
  if (world > 1) return "runs in one process (data parallelism sums the gradients first)";
  if (ex.method == Method::kTriAccel) return "is not for tri-accel (its gradient statistics read every gradient)";
  if (loss_scaler_options(config).enabled) return "needs a precision without loss scaling (not amp-fp16)";
  if (!ex.inject_faults.empty()) return "does not run with --inject-faults";
  std::vector<at::Tensor> params;
  for (const auto& item : model.named_parameters()) params.push_back(item.value());
  if (!post_accumulate_grad_hooks_free(params)) {
    return "found a parameter with a post-accumulate-grad hook of its own (or one that needs no gradient)";
  }
  return "";
}

}  // namespace

// Data parallelism: each number's largest value over the ranks (what the memory planner's ranks agree through);
// null with one process.
MemoryPlanController::Agree memory_agree_over_ranks(Session& session) {
  if (!session.dist().active()) return nullptr;
  return [&dist = session.dist()](std::vector<double> values) { return dist.all_reduce_max(std::move(values)); };
}

namespace {

// The memory model's inputs that do not come from the model's trace: precision, the optimizer state, the dataset on
// the device or streamed, one sample's bytes (and the sample the trace runs on), the gradient buckets of several ranks.
void memory_inputs_set(Session& session, int64_t world, bool gpu, bool budgeted, MemorySetup* setup) {
  const Config& config = session.config();
  const ExecutionConfig& ex = config.execution;
  const c10::Device device = session.device();
  Model& model = session.model();
  const DatasetSplits& data = session.data();
  const int64_t n = model.parameter_count();
  MemoryModelInputs& in = setup->inputs;
  // Tri-Accel starts every unit in bf16 (its precision controller's default); its step records per-unit precisions.
  in.precision = ex.method == Method::kTriAccel ? PrecisionMode::kAmpBF16 : ex.precision;
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& item : model.named_parameters()) shapes.push_back(item.value().sizes().vec());
  const OptimizerBytes optimizer = optimizer_priced(config, shapes);
  in.optimizer_state_bytes = optimizer.state;
  in.optimizer_transient_bytes = optimizer.transient;
  const auto bytes = [](const at::Tensor& t) { return t.defined() ? t.numel() * t.element_size() : int64_t{0}; };
  const bool as_stored = data.train.kind != DatasetKind::kImage;  // token ids or a program's tensors
  const int64_t samples = data.train.size() + data.test.size();
  // Labels as the loader holds them (int64); images as stored (uint8), or inputs and targets as stored.
  in.dataset_device_bytes = bytes(data.train.images) + bytes(data.test.images) +
                            (as_stored ? bytes(data.train.labels) + bytes(data.test.labels) : 8 * samples);
  // Streamed: image labels, the order and the augmentation draws stay on the device.
  in.dataset_stream_bytes = (as_stored ? 0 : 8 * samples) + 41 * data.train.size();
  const int64_t side = session.image_size();
  if (as_stored) {  // one sample's input of its shape and dtype; its input and target bytes
    const at::Tensor& x = data.train.images;
    const at::Tensor& y = data.train.labels;
    setup->sample = at::zeros(x.sizes().slice(1), x.options().device(device));
    const int64_t per_sample = (x.numel() * x.element_size() + y.numel() * y.element_size()) / x.size(0);
    in.sample_input_bytes = per_sample;
    in.sample_staging_bytes = 2 * per_sample;
  } else {
    const int64_t c = data.train.images.size(1);
    setup->sample = at::zeros({c, side, side}, at::TensorOptions().dtype(at::kFloat).device(device));
    in.sample_input_bytes = 4 * c * side * side + 8;
    in.sample_staging_bytes = 2 * c * data.train.images.size(2) * data.train.images.size(3);
  }
  in.allow_host_data = gpu;
  in.fp8_saved = ex.saved_activations != SavedActivations::kKeep;
  in.update_in_backward = ex.update_in_backward != Toggle::kOff &&
                          update_in_backward_refusal(config, world, session.model()).empty();
  in.for_gpu = gpu;
  in.budgeted = budgeted;
  // Several ranks: the gradient buckets hold a copy of every fp32 gradient (and a bf16 one to send, compressed).
  if (world > 1) in.grad_reduce_bytes = grad_buckets_bytes(n, grad_buckets_options(config));
}

}  // namespace

std::string memory_levers_given(const Config& config) {
  const ExecutionConfig& ex = config.execution;
  std::vector<std::string> given;
  if (ex.micro_batch > 0) given.push_back(str_cat(option_ref("micro_batch"), " ", ex.micro_batch));
  if (ex.recompute != "auto") given.push_back(str_cat(option_ref("recompute"), " ", ex.recompute));
  if (ex.data_placement != PlacementChoice::kAuto) {
    given.push_back(str_cat(option_ref("data_placement"), " ", enum_name(ex.data_placement)));
  }
  if (ex.saved_activations == SavedActivations::kFp8) {  // (auto is the planner's; keep, the default, plans nothing)
    given.push_back(str_cat(option_ref("saved_activations"), " ", enum_name(ex.saved_activations)));
  }
  if (ex.update_in_backward == Toggle::kOn) given.push_back(str_cat(option_ref("update_in_backward"), " on"));
  if (given.empty()) return "";
  std::string list;
  for (const auto& g : given) list += (list.empty() ? "" : ", ") + g;
  return str_cat("with ", list, " as given (less with ", given.size() == 1 ? "it" : "them", " left to the planner)");
}

std::unique_ptr<MemorySetup> memory_setup_make(Session& session, bool preview) {
  auto setup = std::make_unique<MemorySetup>();
  const Config& config = session.config();
  const ExecutionConfig& ex = config.execution;
  const c10::Device device = session.device();
  const bool gpu = device.is_cuda() || preview;  // planning for a GPU
  const int64_t budget = gpu ? ex.vram_budget_bytes() : 0;
  // Before the first cuBLAS call, which is the model's trace below.
  if (budget > 0 && device.is_cuda()) cublas_workspace_small();
  const std::string levers_given = memory_levers_given(config);  // "" when the planner holds every lever
  const bool levers = !levers_given.empty();
  const bool elastic = ex.method == Method::kTriAccel && ex.batch_policy == BatchPolicy::kElastic;
  // Tri-Accel's precision promotions, without a budget, may not raise the peak above its 16-bit start's. Not with
  // several ranks yet: the ranks' agreement on the planner's readings has not run on GPUs, the only place this does
  // (docs/distributed.md).
  const bool precision_limited = budget == 0 && gpu && !preview && ex.method == Method::kTriAccel &&
                                 config.tri_accel.ta_precision && !elastic && session.dist().world_size() == 1;
  setup->planned = levers || (budget > 0 && !elastic) || precision_limited;
  const int64_t world = std::max<int64_t>(session.dist().world_size(), ex.nproc);
  const bool shard_possible_here = shard_possible(config, world);
  setup->shard_optimizer = shard_possible_here && ex.shard_optimizer == Toggle::kOn;
  Model& model = session.model();
  if (shard_possible_here) {
    setup->shards = shard_layout(parameter_numels(model), static_cast<int>(world), state_bytes_per_element(config.optim));
  }
  if (!setup->planned) return setup;
  TRIACCEL_CHECK_INPUT(ex.saved_activations != SavedActivations::kFp8 || fp8_saved_available(),
                       option_ref("saved_activations"), " fp8 runs in the C++ runtime (the triaccel command, "
                       "LibTorch programs), not inside Python, whose autograd engine is its own; use ",
                       option_ref("saved_activations"), " keep or auto");

  if (ex.update_in_backward == Toggle::kOn) {
    const std::string why = update_in_backward_refusal(config, world, model);
    TRIACCEL_CHECK_INPUT(why.empty(), option_ref("update_in_backward"), " on ", why, "; leave it auto or off");
    TRIACCEL_CHECK_INPUT(ex.micro_batch <= 0 || ex.micro_batch >= config.schedule.batch_size,
                         option_ref("update_in_backward"), " on updates after one micro-batch, and ",
                         option_ref("micro_batch"), " ", ex.micro_batch, " splits batch ", config.schedule.batch_size,
                         "; leave one of them to the planner");
  }
  memory_inputs_set(session, world, gpu, budget > 0, setup.get());
  MemoryModelInputs first = setup->inputs;
  first.measure_scale = true;  // on CUDA, before the loaders exist (rebuilds while training do not measure)
  setup->model = memory_model_build(model, setup->sample, first, device);
  if (const auto agree = memory_agree_over_ranks(session)) memory_model_agree(setup->model, agree);

  PlanConstraints& c = setup->limits.constraints;
  c.micro_batch = ex.micro_batch;
  c.recompute = recompute_parse(ex.recompute, model);
  if (ex.saved_activations != SavedActivations::kAuto) {
    c.fp8_saved.assign(setup->model.units.size(), ex.saved_activations == SavedActivations::kFp8);
  }
  if (ex.update_in_backward != Toggle::kAuto) c.update_in_backward = ex.update_in_backward == Toggle::kOn;
  c.placement_fixed = ex.data_placement != PlacementChoice::kAuto || !gpu;
  c.placement = ex.data_placement == PlacementChoice::kHost && gpu ? DataPlacement::kHost : DataPlacement::kDevice;
  // Each rank plans for its share of the global batch (the larger one where they differ); `plan` previews --nproc.
  setup->limits.batch = (config.schedule.batch_size + world - 1) / world;
  setup->limits.samples.train = (session.data().train.size() + world - 1) / world;
  setup->limits.samples.eval = (session.data().test.size() + world - 1) / world;
  setup->limits.cap_bytes = budget;
  setup->limits.cap_share = kPlanShareOfCap;
  setup->limits.initial_share = kPlanShareOfCap;
  setup->limits.budget_bytes = static_cast<int64_t>(kPlanShareOfCap * static_cast<double>(budget));
  if (precision_limited && !levers) {
    setup->limits.limit_from_first_model = true;
    setup->limits.budget_bytes = static_cast<int64_t>(std::ceil(memory_plan_solve(setup->model, setup->limits.batch, 0)
                                                                     .predicted_peak_bytes));
  }
  setup->plan = memory_plan_solve(setup->model, setup->limits.batch, setup->limits.budget_bytes, c);
  // Sharded optimizer state, a lever of its own: asked for, or (auto) when the plan with the whole state on every
  // rank needs another lever or fits nowhere and the plan with the rank's shard is faster or fits where that does
  // not. Every rank decides alike (the same agreed model).
  const MemoryPlan& whole = setup->plan;
  const auto any = [](const std::vector<bool>& v) { return std::find(v.begin(), v.end(), true) != v.end(); };
  const bool lever_used = !whole.feasible || whole.accumulation > 1 || whole.update_in_backward ||
                          whole.data_placement == DataPlacement::kHost || any(whole.recompute) ||
                          (ex.saved_activations == SavedActivations::kAuto && any(whole.fp8_saved));
  if (shard_possible_here && (setup->shard_optimizer || (ex.shard_optimizer == Toggle::kAuto && lever_used))) {
    const ShardLayout& layout = setup->shards;
    MemorySetup sharded = *setup;
    sharded.model.optimizer_bytes =
        static_cast<double>(layout.sizes.state_bytes + setup->inputs.optimizer_transient_bytes);
    sharded.model.fixed_bytes += static_cast<double>(layout.staging_bytes);
    sharded.inputs.optimizer_state_bytes = layout.sizes.state_bytes;
    sharded.inputs.grad_reduce_bytes += layout.staging_bytes;
    sharded.plan = memory_plan_solve(sharded.model, setup->limits.batch, setup->limits.budget_bytes, c);
    const bool better = sharded.plan.feasible &&
                        (!whole.feasible || sharded.plan.predicted_step_s < whole.predicted_step_s);
    if (setup->shard_optimizer || better) {
      *setup = std::move(sharded);
      setup->shard_optimizer = true;
    }
  }
  TRIACCEL_CHECK_INPUT(preview || setup->plan.feasible, option_ref("vram_budget"), " ", ex.vram_budget,
                       " is below this run's floor: batch ", setup->limits.batch,
                       world > 1 ? c10::str(" (a process's share of ", config.schedule.batch_size, ")") : "", " of ",
                       config.model.model,
                       " needs at least ", static_cast<int64_t>(std::ceil(setup->plan.floor_bytes / kPlanShareOfCap)),
                       " bytes (", setup->plan.floor_bytes / kPlanShareOfCap / kGB, " GB) ",
                       levers ? levers_given
                              : std::string("with micro-batches of 1, every unit recomputed and the data streamed"),
                       "; raise the budget, or train in blocks with ", option_ref("method"), " neuroflux");
  setup->placement = setup->plan.data_placement;
  return setup;
}

Json memory_plan_preview(Session& session) {
  const std::unique_ptr<MemorySetup> m = memory_setup_make(session, /*preview=*/true);
  if (!m->planned) return Json(nullptr);
  Json j = m->plan.to_json(m->model);
  j["budget_bytes"] = m->limits.cap_bytes > 0 ? Json(m->limits.cap_bytes) : Json();
  j["method"] = "backprop";
  j["predicted_epoch_s"] = m->plan.feasible ? Json(memory_plan_epoch_s(m->model, m->plan, m->limits.samples)) : Json();
  j["profile"] = "modelled";
  j["shard_optimizer"] = m->shard_optimizer;
  Json units = Json::array();
  for (size_t u = 0; u < m->model.units.size(); ++u) {
    const UnitCost& c = m->model.units[u];
    units.push_back(Json{{"unit", c.name}, {"saved_bytes_per_sample", c.saved_bytes},
                         {"input_bytes_per_sample", c.input_bytes}, {"flops_per_sample", c.flops},
                         {"recomputable", c.recomputable},
                         {"fp8_bytes_per_sample", c.fp8_bytes > 0 ? Json(c.fp8_bytes) : Json()},
                         {"recompute", u < m->plan.recompute.size() && m->plan.recompute[u]},
                         {"fp8_saved", u < m->plan.fp8_saved.size() && m->plan.fp8_saved[u] &&
                                           !(u < m->plan.recompute.size() && m->plan.recompute[u])}});
  }
  j["units"] = units;
  return j;
}

OptimizerBytes optimizer_priced(const Config& config, const std::vector<std::vector<int64_t>>& param_shapes) {
  OptimizerBytes out;
  int64_t elements = 0;
  for (const auto& shape : param_shapes) {
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    elements += numel;
  }
  if (config.optim.optimizer != OptimizerKind::kBaoc) {
    out.state = state_bytes_per_element(config.optim) * elements;
    return out;
  }
  std::vector<StateFormat> menu = optim_formats_parse(config.baoc.optim_formats);
  menu.push_back(StateFormat::kAdamW32);  // the warm-up's
  int64_t conversion = 0, largest = 0;
  for (const auto& shape : param_shapes) {
    int64_t most = 0, numel = 1;
    for (StateFormat f : menu) most = std::max(most, state_format_bytes(f, shape));
    for (int64_t d : shape) numel *= d;
    out.state += most;
    conversion = std::max(conversion, 8 * numel + most);  // m and v decoded to float32, the new state beside the old
    largest = std::max(largest, numel);
  }
  conversion += std::min(largest, kQuant8ChunkElements) * kQuant8ChunkBytesPerElement;  // a chunk of the 8-bit codec
  const auto tensors = static_cast<int64_t>(param_shapes.size());
  constexpr int64_t kMaps = 4 * 256 * 4;  // the 8-bit codec's signed and unsigned maps and their midpoints
  const int64_t bookkeeping = tensors * (2 + kStreamColumns) * 8 + kMaps;  // step counts and window sums, float64
  // A plan's signals (optim/signals.h: a chunk's float64 temporaries) and its conversion come one after the other.
  const int64_t signals = std::min(elements, kSignalChunkElements) * kSignalChunkBytesPerElement;
  out.transient = 4 * elements + bookkeeping + std::max(conversion, signals);
  return out;
}

MethodChoice method_choose(const std::vector<MethodCandidate>& candidates) {
  MethodChoice out;
  const MethodCandidate* best = nullptr;
  for (const MethodCandidate& c : candidates) {
    if (c.fits && c.not_why.empty() && (best == nullptr || c.epoch_s < best->epoch_s)) best = &c;
  }
  const MethodCandidate* closest = nullptr;  // when none fits: the one that needs the least budget
  for (const MethodCandidate& c : candidates) {
    if (c.not_why.empty() && (closest == nullptr || c.need_bytes < closest->need_bytes)) closest = &c;
  }
  const auto said = [](const MethodCandidate& c) {
    if (!c.not_why.empty()) return c10::str(enum_name(c.method), " cannot run (", c.not_why, ")");
    if (!c.fits) return c10::str(enum_name(c.method), " does not fit (it needs ", c.need_bytes / 1e9, " GB)");
    return c10::str(enum_name(c.method), " ", c.epoch_s, " s");
  };
  std::string others;
  for (const MethodCandidate& c : candidates) {
    if (&c != best) others += c10::str(others.empty() ? "" : ", ", said(c));
  }
  if (best != nullptr) {
    out.method = best->method;
    out.fits = true;
    out.reason = c10::str("predicted ", best->epoch_s, " s per epoch, the fastest that fits",
                          others.empty() ? "" : "; ", others);
    return out;
  }
  if (closest != nullptr) out.method = closest->method;
  out.reason = c10::str("no method fits: ", others,
                        closest != nullptr ? c10::str("; ", enum_name(closest->method), " needs the least") : "");
  return out;
}

Json method_candidates_json(const std::vector<MethodCandidate>& candidates) {
  Json out = Json::array();
  for (const MethodCandidate& c : candidates) {
    out.push_back(Json{{"method", enum_name(c.method)},
                       {"fits", c.fits && c.not_why.empty()},
                       {"predicted_epoch_s", c.fits && c.not_why.empty() ? Json(c.epoch_s) : Json()},
                       {"need_bytes", c.need_bytes > 0 ? Json(static_cast<int64_t>(std::ceil(c.need_bytes))) : Json()},
                       {"not_why", c.not_why.empty() ? Json() : Json(c.not_why)}});
  }
  return out;
}

MethodCandidate method_candidate_backprop(const Json& preview) {
  MethodCandidate c;
  c.method = Method::kBackprop;
  if (preview.is_null()) return c;
  c.fits = preview.value("feasible", false) && preview.contains("predicted_epoch_s") &&
           preview["predicted_epoch_s"].is_number();
  c.epoch_s = c.fits ? preview["predicted_epoch_s"].get<double>() : 0;
  c.need_bytes = static_cast<double>(preview.value("floor_bytes", int64_t{0})) / kPlanShareOfCap;
  return c;
}

MethodCandidate method_candidate_neuroflux(Session& session) {
  MethodCandidate c;
  c.method = Method::kNeuroFlux;
  const Config& config = session.config();
  if (const auto refusal = neuroflux_refusal(config)) {  // what its run would refuse (run/config.h)
    c.not_why = refusal->reason;
    return c;
  }
  const double budget = static_cast<double>(config.execution.vram_budget_bytes());
  if (budget <= 0) return c;
  const DatasetSplits& data = session.data();
  const int64_t rows = data.train.size();
  const NeuroFluxData kept =
      neuroflux_data(rows, data.test.size(), data.train.images.numel() / std::max<int64_t>(1, rows),
                     config.neuroflux.nf_holdout, config.neuroflux.nf_max_batch, budget, /*gpu=*/true);
  const c10::Device device = session.device();
  const bool measured = device.is_cuda() && config.neuroflux.nf_profile != ProfileChoice::kModel;
  const int64_t side = session.image_size();
  MemoryProfile profile;
  {
    const AutocastScope autocast(device, config.execution.precision);
    profile = memory_profile(session.model(), {data.train.channels(), side, side}, session.model_options().num_classes,
                             measured ? ProfileSource::kMeasured : ProfileSource::kModel, device);
  }
  if (device.is_cuda()) memory_cache_release(device);  // the profile's cached blocks
  // The partitioner's options as NeuroFlux sets them on a GPU (run/block_memory_setup.h), as its data placement above.
  const PartitionOptions po =
      block_memory_setup(config, /*for_gpu=*/true, profile, kept.resident_bytes(), kept.train).options;
  try {
    Partition partition = partition_plan(profile, po);
    PartitionEpochInputs in;
    in.train_samples = kept.train;
    in.holdout_samples = kept.holdout;
    in.test_samples = kept.test;
    in.epochs = config.schedule.epochs;
    in.flops_per_s = kGpuTrainFlopsPerS;
    in.overhead_samples = kGpuOverheadSamples;
    in.host_bytes_per_s = po.host_bytes_per_s;
    partition_epoch_s(profile, in, &partition);
    c.fits = true;
    c.epoch_s = partition.epoch_s;
  } catch (const UserError&) {
    c.need_bytes = partition_min_budget(profile, po);
  }
  return c;
}

}  // namespace triaccel
