#include "triaccel/methods/loop_optimizer.h"

#include "triaccel/core/cuda_graph.h"
#include "triaccel/core/errors.h"

#include <ATen/ops/zeros_like.h>
#include <torch/nn/module.h>

#include <mutex>
#include <unordered_map>
#include <unordered_set>

namespace triaccel {

namespace {

// The units of a LoopOptimizer as a Model: one module per unit holding its parameters (the same tensors), so that
// BAOC's controller sees units as it does in the engine.
class UnitsModel final : public Model {
 public:
  explicit UnitsModel(const std::vector<LoopUnit>& units) : Model("loop") {
    for (size_t u = 0; u < units.size(); ++u) {
      auto holder = std::make_shared<torch::nn::Module>("unit");
      for (size_t i = 0; i < units[u].second.size(); ++i) {
        holder->register_parameter("p" + std::to_string(i), units[u].second[i].second, /*requires_grad=*/true);
      }
      register_module("u" + std::to_string(u), holder);
      unit_add(units[u].first, {holder}, [](const at::Tensor&) -> at::Tensor {
        TORCH_CHECK(false, "the units of a loop optimizer have no forward");
      });
    }
  }
};

std::vector<std::pair<std::string, at::Tensor>> checked_params(const std::vector<LoopUnit>& units) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& [unit, params] : units) {
    TRIACCEL_CHECK_INPUT(!params.empty(), "unit '", unit, "' has no parameters");
    for (const auto& [name, p] : params) {
      TRIACCEL_CHECK_INPUT(p.defined() && p.scalar_type() == at::kFloat, "parameter '", name,
                           "' must be a float32 tensor (the master weights), got ",
                           p.defined() ? c10::toString(p.scalar_type()) : "none");
      TRIACCEL_CHECK_INPUT(seen.insert(p.unsafeGetTensorImpl()).second, "parameter '", name,
                           "' is given twice (tied weights): give each tensor once");
      TRIACCEL_CHECK_INPUT(out.empty() || p.device() == out.front().second.device(), "parameter '", name, "' is on ",
                           p.device().str(), " but '", out.front().first, "' is on ",
                           out.front().second.device().str(), "; put every parameter on one device");
      out.emplace_back(name, p);
    }
  }
  TRIACCEL_CHECK_INPUT(!out.empty(), "the optimizer got no parameters");
  return out;
}

// The live optimizers by handle (what the torch op is given: an integer, as an op's schema cannot hold an object).
struct Registry {
  std::mutex mutex;
  std::unordered_map<int64_t, LoopOptimizer*> live;
  int64_t next = 1;
};

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

LoopOptimizer* LoopOptimizer::find(int64_t handle) {
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mutex);
  const auto it = r.live.find(handle);
  return it == r.live.end() ? nullptr : it->second;
}

LoopOptimizer::LoopOptimizer(const std::vector<LoopUnit>& units, LoopOptimizerOptions options)
    : options_(std::move(options)) {
  const auto params = checked_params(units);
  options_.adam.validate();
  const bool baoc = options_.format == "baoc";
  const StateFormat initial = baoc ? StateFormat::kAdamW32 : state_format_parse(options_.format);
  units_model_ = std::make_shared<UnitsModel>(units);
  optimizer_ = std::make_unique<BaocOptimizer>(params, options_.adam, initial);
  const at::TensorOptions f32 = at::TensorOptions().dtype(at::kFloat).device(params.front().second.device());
  lr_ = at::zeros({1}, f32);
  found_inf_ = at::zeros({1}, f32);
  if (baoc) controller_make(1);
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mutex);
  handle_ = r.next++;
  r.live[handle_] = this;
}

LoopOptimizer::~LoopOptimizer() {
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mutex);
  r.live.erase(handle_);
}

void LoopOptimizer::controller_make(int64_t next_step) {
  TRIACCEL_CHECK_INPUT(options_.baoc.plan_warmup >= 1, "plan_warmup must be >= 1, got ", options_.baoc.plan_warmup);
  controller_ = std::make_unique<BaocController>(options_.baoc, *units_model_, *optimizer_, nullptr, next_step);
}

void LoopOptimizer::step(double lr) {
  TRIACCEL_CHECK_INPUT(std::isfinite(lr) && lr >= 0, "lr must be a finite number >= 0, got ", lr);
  for (const auto& p : optimizer_->params()) {
    if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
  }
  lr_.fill_(lr);
  update();
}

void LoopOptimizer::step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                         const at::Tensor& lr) {
  const std::vector<at::Tensor>& held = optimizer_->params();
  TRIACCEL_CHECK_INPUT(params.size() == held.size() && grads.size() == held.size(), "the optimizer step got ",
                       params.size(), " parameters and ", grads.size(), " gradients; it was built over ", held.size(),
                       ": pass the parameters it was built over, in their order");
  TRIACCEL_CHECK_INPUT(lr.defined() && lr.numel() == 1 && lr.is_floating_point(),
                       "lr must be a number or a one-element floating-point tensor");
  TRIACCEL_CHECK_INPUT(!host_decision_ahead() || !cuda_capture_underway(), "BAOC plans at step ",
                       options_.baoc.plan_warmup,
                       " from its gradient statistics, a host decision a CUDA graph cannot hold: run the steps up to "
                       "the plan eagerly and capture after it, with replan_every 0");
  const torch::NoGradGuard no_grad;
  std::vector<at::Tensor> saved(held.size());
  for (size_t i = 0; i < held.size(); ++i) {
    at::Tensor p = held[i];
    TRIACCEL_CHECK_INPUT(params[i].sizes() == p.sizes() && params[i].scalar_type() == p.scalar_type() &&
                             params[i].device() == p.device(),
                         "tensor ", i, " given for parameter '", names()[i], "' is not like it (", params[i].sizes(),
                         " ", c10::toString(params[i].scalar_type()), " on ", params[i].device().str(), ", expected ",
                         p.sizes(), " ", c10::toString(p.scalar_type()), " on ", p.device().str(), ")");
    if (!params[i].is_same(p)) p.copy_(params[i]);
    saved[i] = p.grad();
    p.mutable_grad() = grads[i].defined() ? grads[i] : at::zeros_like(p);
  }
  lr_.copy_(lr.reshape({1}));
  update();
  for (size_t i = 0; i < held.size(); ++i) {
    at::Tensor p = held[i];
    p.mutable_grad() = saved[i];
    if (!params[i].is_same(p)) params[i].copy_(p);
  }
}

bool LoopOptimizer::host_decision_ahead() const {
  return controller_ && (steps_ < options_.baoc.plan_warmup || options_.baoc.replan_every > 0);
}

void LoopOptimizer::update() {
  optimizer_->step(lr_, found_inf_);
  ++steps_;
  if (!controller_) return;
  StepContext ctx;
  ctx.step = steps_;
  for (auto& e : controller_->after_step(ctx)) last_plan_ = e.fields;
}

int64_t LoopOptimizer::adamw_fp32_bytes() const {
  int64_t n = 0;
  for (const auto& p : optimizer_->params()) n += p.numel();
  return 8 * n;
}

std::vector<std::string> LoopOptimizer::formats() const {
  std::vector<std::string> out;
  for (const StateFormat f : optimizer_->formats()) out.push_back(state_format_name(f));
  return out;
}

NamedTensors LoopOptimizer::state_tensors() { return optimizer_->state_tensors(); }

Json LoopOptimizer::state_record() const {
  return Json{{"steps", steps_},
              {"format", options_.format},
              {"controller", controller_ ? controller_->state() : Json(nullptr)},
              {"last_plan", last_plan_}};
}

void LoopOptimizer::load(const NamedTensors& tensors, const Json& record) {
  TRIACCEL_CHECK_INPUT(record.is_object() && record.contains("steps") && record.contains("format"),
                       "the optimizer state has no step count or format: pass what state_dict() returned");
  const std::string format = record["format"].get<std::string>();
  TRIACCEL_CHECK_INPUT(format == options_.format, "the optimizer state is of format '", format, "', this optimizer's is '",
                       options_.format, "'");
  optimizer_->state_load(tensors, "the optimizer state");
  steps_ = record["steps"].get<int64_t>();
  last_plan_ = record.contains("last_plan") ? record["last_plan"] : Json(nullptr);
  if (controller_) {
    controller_make(steps_ + 1);
    if (record.contains("controller") && record["controller"].is_object()) controller_->restore(record["controller"]);
  }
}

}  // namespace triaccel
