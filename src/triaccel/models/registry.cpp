#include "triaccel/models/registry.h"

#include "triaccel/core/enum_names.h"
#include "triaccel/core/errors.h"

namespace triaccel {

// Each architecture's builder (models/<arch>.cpp).
std::shared_ptr<Model> resnet18_create(const ModelOptions& options);
std::shared_ptr<Model> efficientnet_b0_create(const ModelOptions& options);
std::shared_ptr<Model> small_cnn_create(const ModelOptions& options);
std::shared_ptr<Model> vit_tiny_create(const ModelOptions& options);
std::shared_ptr<Model> gpt_char_create(const ModelOptions& options);

const std::vector<ModelEntry>& model_registry() {
  static const std::vector<ModelEntry> kEntries = {
      {"resnet18", "ResNet-18 with the CIFAR stem (11.2 M parameters)", ModelInput::kImage, true, true,
       &resnet18_create},
      {"efficientnet-b0", "EfficientNet-B0 (4.0 M)", ModelInput::kImage, true, true, &efficientnet_b0_create},
      {"small-cnn", "a small CNN for 28×28 and 32×32 images (94 k)", ModelInput::kImage, true, true,
       &small_cnn_create},
      {"vit-tiny", "ViT-Tiny, patch 4 (5.4 M)", ModelInput::kImage, false, false, &vit_tiny_create},
      {"gpt-char", "a character-level GPT (10.8 M; text datasets)", ModelInput::kTokens, false, false,
       &gpt_char_create},
  };
  return kEntries;
}

const std::vector<std::string>& model_names() {
  static const std::vector<std::string> kNames = [] {
    std::vector<std::string> names;
    for (const auto& e : model_registry()) names.emplace_back(e.name);
    return names;
  }();
  return kNames;
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
