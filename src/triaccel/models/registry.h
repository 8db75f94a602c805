// The models by name, each with what it supports. Adding a model: its builder in models/<name>.cpp, one entry in
// registry.cpp, and the file in CMakeLists.txt (docs/architecture.md, "Add a model").
#pragma once

#include "triaccel/models/model.h"

#include <memory>
#include <string>
#include <vector>

namespace triaccel {

// What a model reads: images (N, C, H, W) float, tokens (B, T) int64, or whatever the dataset holds (kAny: a
// torch.nn.Module from Python, whose input only its own forward knows).
enum class ModelInput { kImage, kTokens, kAny };

struct ModelEntry {
  const char* name;
  const char* description;
  ModelInput input;
  // The Hessian's curvature probe (Tri-Accel's curv_estimator hessian) differentiates twice through the model: false
  // where a kernel it uses has no double backward (the fused attention kernels); the Fisher's needs no such thing.
  bool double_backward;
  // NeuroFlux can train it block by block: its units end in feature maps that an auxiliary conv head reads (CNNs).
  bool local_learning;
  std::shared_ptr<Model> (*create)(const ModelOptions& options);
};

// Every model, in the order --help lists them: the built-in ones, then those added by model_register.
const std::vector<ModelEntry>& model_registry();
// The named entry; UserError naming the `model` option and listing the names for an unknown one.
const ModelEntry& model_entry(const std::string& name);
const std::vector<std::string>& model_names();

// Adds a model defined outside the library (a C++ user's own; docs/cpp-package.md): from then on the `model` option
// accepts entry.name. The name and description are copied. Call it before any run starts (it is not thread-safe).
// UserError for an empty or already registered name or a null `create`.
void model_register(const ModelEntry& entry);

// Builds the named model with fresh initialization (uses the global torch RNG; seed it first).
std::shared_ptr<Model> model_create(const ModelOptions& options);

}  // namespace triaccel
