#include "triaccel/models/registry.h"

#include "triaccel/core/enum_names.h"
#include "triaccel/core/errors.h"

#include <deque>

namespace triaccel {

// Each architecture's builder (models/<arch>.cpp).
std::shared_ptr<Model> resnet18_create(const ModelOptions& options);
std::shared_ptr<Model> efficientnet_b0_create(const ModelOptions& options);
std::shared_ptr<Model> small_cnn_create(const ModelOptions& options);
std::shared_ptr<Model> vit_tiny_create(const ModelOptions& options);
std::shared_ptr<Model> gpt_char_create(const ModelOptions& options);

namespace {

std::vector<ModelEntry>& registry_entries() {
  static std::vector<ModelEntry> entries = {
      {"resnet18", "ResNet-18 with the CIFAR stem (11.2 M parameters)", ModelInput::kImage, true, true,
       &resnet18_create},
      {"efficientnet-b0", "EfficientNet-B0 (4.0 M)", ModelInput::kImage, true, true, &efficientnet_b0_create},
      {"small-cnn", "a small CNN for 28×28 and 32×32 images (94 k)", ModelInput::kImage, true, true,
       &small_cnn_create},
      {"vit-tiny", "ViT-Tiny, patch 4 (5.4 M)", ModelInput::kImage, false, false, &vit_tiny_create},
      {"gpt-char", "a character-level GPT (10.8 M; text datasets)", ModelInput::kTokens, false, false,
       &gpt_char_create},
  };
  return entries;
}

std::vector<std::string>& registry_names() {
  static std::vector<std::string> names = [] {
    std::vector<std::string> all;
    for (const auto& e : registry_entries()) all.emplace_back(e.name);
    return all;
  }();
  return names;
}

}  // namespace

const std::vector<ModelEntry>& model_registry() { return registry_entries(); }

const std::vector<std::string>& model_names() { return registry_names(); }

void model_register(const ModelEntry& entry) {
  TRIACCEL_CHECK_INPUT(entry.name != nullptr && entry.name[0] != '\0', "model_register: the model needs a name");
  TRIACCEL_CHECK_INPUT(entry.create != nullptr, "model_register: model '", entry.name, "' needs a create function");
  for (const auto& e : registry_entries()) {
    TRIACCEL_CHECK_INPUT(std::string(e.name) != entry.name, "model_register: a model named '", entry.name,
                         "' is already registered");
  }
  static std::deque<std::string> texts;  // the copied names and descriptions (a deque never moves its elements)
  ModelEntry copy = entry;
  copy.name = texts.emplace_back(entry.name).c_str();
  copy.description = texts.emplace_back(entry.description != nullptr ? entry.description : "").c_str();
  registry_entries().push_back(copy);
  registry_names().emplace_back(copy.name);
}

const ModelEntry& model_entry(const std::string& name) {
  for (const auto& e : model_registry()) {
    if (name == e.name) return e;
  }
  throw UserError(str_cat(option_ref("model"), " must be one of ", choices_text(model_names()), ", got '", name,
                          "'"));
}

std::shared_ptr<Model> model_create(const ModelOptions& options) {
  const ModelEntry& entry = model_entry(options.name);
  options.validate(entry.input == ModelInput::kTokens);
  return entry.create(options);
}

}  // namespace triaccel
