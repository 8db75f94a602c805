// The architecture-independent half of models/: units, options, the unit-by-unit forward, the builder registry
// and the torchvision-ordered state. Invariants: units run in registration order and their composition is the
// model's forward; model_state lists entries in the order torchvision's state_dict() would (each module in
// pre-order, its own parameters first, then its own buffers).
#include "triaccel/models/model.h"

#include "triaccel/core/errors.h"

#include <c10/util/StringUtil.h>
#include <torch/nn/init.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>

#include <utility>

namespace triaccel {

namespace {

std::string names_joined(const std::vector<std::string>& names) {
  std::string joined;
  for (const auto& name : names) {
    if (!joined.empty()) joined += ", ";
    joined += name;
  }
  return joined;
}

}  // namespace

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

void ModelOptions::validate() const {
  const auto& names = model_names();
  bool known = false;
  for (const auto& known_name : names) known = known || known_name == name;
  TRIACCEL_CHECK_INPUT(known, "unknown model '", name, "'; known models: ", names_joined(names));
  TRIACCEL_CHECK_INPUT(num_classes >= 1, "num_classes must be >= 1, got ", num_classes);
  TRIACCEL_CHECK_INPUT(in_channels >= 1, "in_channels must be >= 1, got ", in_channels);
  TRIACCEL_CHECK_INPUT(image_size >= 1 || model_input(name) == ModelInput::kTokens, "image_size must be >= 1, got ",
                       image_size);
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

std::shared_ptr<Model> model_create(const ModelOptions& options) {
  options.validate();
  if (options.name == "resnet18") return resnet18_create(options);
  if (options.name == "efficientnet-b0") return efficientnet_b0_create(options);
  if (options.name == "small-cnn") return small_cnn_create(options);
  if (options.name == "vit-tiny") return vit_tiny_create(options);
  if (options.name == "gpt-char") return gpt_char_create(options);
  throw UserError(c10::str("unknown model '", options.name, "'; known models: ", names_joined(model_names())));
}

const std::vector<std::string>& model_names() {
  static const std::vector<std::string> kNames = {"resnet18", "efficientnet-b0", "small-cnn", "vit-tiny", "gpt-char"};
  return kNames;
}

ModelInput model_input(const std::string& name) {
  return name == "gpt-char" ? ModelInput::kTokens : ModelInput::kImage;
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
