// The architecture-independent half of models/: units, options, the unit-by-unit forward and the
// torchvision-ordered state (the builders by name: models/registry.cpp). Invariants: units run in registration order and their composition is the
// model's forward; model_state lists entries in the order torchvision's state_dict() would (each module in
// pre-order, its own parameters first, then its own buffers).
#include "triaccel/models/model.h"

#include "triaccel/core/errors.h"

#include <c10/util/StringUtil.h>
#include <torch/nn/init.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>

#include <unordered_map>
#include <utility>

namespace triaccel {

std::vector<at::Tensor> Unit::parameters() const {
  std::vector<at::Tensor> result;
  for (const auto& module : modules) {
    for (const auto& parameter : module->parameters(/*recurse=*/true)) result.push_back(parameter);
  }
  return result;
}

int64_t Unit::parameter_count() const {
  int64_t count = 0;
  for (const auto& parameter : parameters()) count += parameter.numel();
  return count;
}

BuffersKept::BuffersKept(std::vector<at::Tensor> buffers) : buffers_(std::move(buffers)) {
  const torch::NoGradGuard no_grad;
  saved_.reserve(buffers_.size());
  for (const auto& b : buffers_) saved_.push_back(b.clone());
}

BuffersKept::~BuffersKept() {
  const torch::NoGradGuard no_grad;
  for (size_t i = 0; i < buffers_.size(); ++i) buffers_[i].copy_(saved_[i]);
}

void ModelOptions::validate(bool reads_tokens) const {
  TRIACCEL_CHECK_INPUT(num_classes >= 1, "num_classes must be >= 1, got ", num_classes);
  TRIACCEL_CHECK_INPUT(in_channels >= 1, "in_channels must be >= 1, got ", in_channels);
  TRIACCEL_CHECK_INPUT(image_size >= 1 || reads_tokens, "image_size must be >= 1, got ", image_size);
  TRIACCEL_CHECK_INPUT(stochastic_depth >= 0.0 && stochastic_depth < 1.0,
                       "stochastic_depth must be in [0, 1), got ", stochastic_depth);
  TRIACCEL_CHECK_INPUT(dropout >= 0.0 && dropout < 1.0, "dropout must be in [0, 1), got ", dropout);
  TRIACCEL_CHECK_INPUT(block_size >= 1, "block_size must be >= 1, got ", block_size);
  TRIACCEL_CHECK_INPUT(gpt_layers >= 1 && gpt_heads >= 1 && gpt_embed >= 1 && gpt_embed % gpt_heads == 0,
                       "gpt-char needs layers, heads, width >= 1 with width divisible by heads, got ", gpt_layers,
                       ", ", gpt_heads, ", ", gpt_embed);
}

at::Tensor Model::forward(const at::Tensor& x, const std::function<void(size_t)>& before_unit) {
  at::Tensor h = x;
  for (size_t i = 0; i < units_.size(); ++i) {
    if (before_unit) before_unit(i);
    h = units_[i].forward(h);
  }
  return h;
}

int64_t Model::parameter_count() const {
  int64_t count = 0;
  for (const auto& parameter : parameters(/*recurse=*/true)) count += parameter.numel();
  return count;
}

void Model::unit_add(std::string name, std::vector<std::shared_ptr<torch::nn::Module>> modules,
                     std::function<at::Tensor(const at::Tensor&)> forward) {
  TORCH_CHECK(forward, "unit '", name, "' has no forward function");
  units_.push_back(Unit{std::move(name), std::move(modules), std::move(forward)});
}

std::vector<int64_t> model_unit_of_params(const Model& model, const std::vector<at::Tensor>& params) {
  std::unordered_map<const c10::TensorImpl*, int64_t> owner;
  const auto& units = model.units();
  for (size_t u = 0; u < units.size(); ++u) {
    for (const auto& p : units[u].parameters()) owner[p.unsafeGetTensorImpl()] = static_cast<int64_t>(u);
  }
  std::vector<int64_t> out;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto it = owner.find(params[i].unsafeGetTensorImpl());
    TORCH_CHECK(it != owner.end(), "tensor ", i, " of ", params.size(), " belongs to no unit of the model");
    out.push_back(it->second);
  }
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> model_state(const Model& model) {
  std::vector<std::pair<std::string, at::Tensor>> state;
  // named_modules lists the model itself first (key ""), then every submodule in pre-order, which is the order
  // in which torch.nn.Module.state_dict() visits modules.
  for (const auto& module_item : model.named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    const std::string prefix = module_item.key().empty() ? "" : module_item.key() + ".";
    const auto& module = module_item.value();
    for (const auto& item : module->named_parameters(/*recurse=*/false)) {
      state.emplace_back(prefix + item.key(), item.value());
    }
    for (const auto& item : module->named_buffers(/*recurse=*/false)) {
      state.emplace_back(prefix + item.key(), item.value());
    }
  }
  return state;
}

void model_init_conv_bn(torch::nn::Module& model) {
  const torch::NoGradGuard no_grad;
  for (const auto& module : model.modules(/*include_self=*/false)) {
    if (auto* conv = module->as<torch::nn::Conv2dImpl>()) {
      torch::nn::init::kaiming_normal_(conv->weight, 0.0, torch::kFanOut, torch::kReLU);
    } else if (auto* bn = module->as<torch::nn::BatchNorm2dImpl>()) {
      torch::nn::init::ones_(bn->weight);
      torch::nn::init::zeros_(bn->bias);
    }
  }
}

}  // namespace triaccel
