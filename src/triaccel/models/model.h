// Models as ordered, named units (docs/architecture.md, "Units").
// A Model is a torch::nn::Module whose parameter and buffer names equal torchvision's for the same
// architecture (so model.pt loads into torchvision), and whose forward is the composition of its units in order:
// forward(x) = units[n-1](... units[0](x)). Every parameter belongs to exactly one unit.
#pragma once

#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace triaccel {

struct Unit {
  std::string name;                                      // "layer1.0", "features.3.1", "fc"
  std::vector<std::shared_ptr<torch::nn::Module>> modules;  // the modules that own this unit's parameters
  std::function<at::Tensor(const at::Tensor&)> forward;  // this unit's part of the forward pass

  std::vector<at::Tensor> parameters() const;
  int64_t parameter_count() const;
};

struct ModelOptions {
  std::string name = "small-cnn";  // resnet18 | efficientnet-b0 | small-cnn | vit-tiny | gpt-char
  int64_t num_classes = 10;        // gpt-char: the vocabulary size

  int64_t in_channels = 3;
  int64_t image_size = 32;         // input height = width after any resize
  double stochastic_depth = 0.0;   // EfficientNet-B0 only; 0 = off (default)
  double dropout = 0.2;            // EfficientNet-B0 classifier dropout (torchvision default)
  // gpt-char only: context length (position embeddings) and width; the defaults are nanoGPT's shakespeare_char.
  int64_t block_size = 256;
  int64_t gpt_layers = 6;
  int64_t gpt_heads = 6;
  int64_t gpt_embed = 384;

  // reads_tokens: the model reads token ids (no image size).
  void validate(bool reads_tokens) const;
};

class Model : public torch::nn::Module {
 public:
  explicit Model(std::string arch) : arch_(std::move(arch)) {}

  const std::string& arch() const { return arch_; }
  const std::vector<Unit>& units() const { return units_; }

  // Runs the units in order. before_unit (if set) is called with the unit index before each unit runs;
  // the Tri-Accel precision policy uses it to switch autocast state per unit.
  at::Tensor forward(const at::Tensor& x, const std::function<void(size_t)>& before_unit = nullptr);

  int64_t parameter_count() const;

 protected:
  void unit_add(std::string name, std::vector<std::shared_ptr<torch::nn::Module>> modules,
                std::function<at::Tensor(const at::Tensor&)> forward);

 private:
  std::string arch_;
  std::vector<Unit> units_;
};

// The unit of each tensor of `params` (matched to the model's units by identity); an internal error for a tensor
// that belongs to no unit.
std::vector<int64_t> model_unit_of_params(const Model& model, const std::vector<at::Tensor>& params);

// Puts `buffers` (BatchNorm's running statistics and counts) back as they were when it was made, when it goes out of
// scope, also on an exception: for the passes that run a model in train mode without training it (memory profiles
// and models, NeuroFlux's calibration step).
class BuffersKept {
 public:
  explicit BuffersKept(std::vector<at::Tensor> buffers);
  ~BuffersKept();
  BuffersKept(const BuffersKept&) = delete;
  BuffersKept& operator=(const BuffersKept&) = delete;

 private:
  std::vector<at::Tensor> buffers_, saved_;
};

// torchvision's ResNet initialization: kaiming-normal (fan-out, relu) for every Conv2d, BatchNorm weight 1 and
// bias 0; other modules keep their defaults. Uses the global torch RNG.
void model_init_conv_bn(torch::nn::Module& model);

// The model's parameters and buffers as an ordered name → tensor map, torchvision names
// ("conv1.weight", "bn1.running_mean", "bn1.num_batches_tracked", "layer2.0.downsample.0.weight", ...).
std::vector<std::pair<std::string, at::Tensor>> model_state(const Model& model);

// Writes model_state as a file that Python's torch.load (weights_only=True) reads as a dict of tensors
// (a state_dict): torchvision.models.resnet18(num_classes=10) with the CIFAR stem loads it with strict=True.
// Tensors are written contiguous, on the CPU, in float32 (buffers keep their dtype). Atomic (io.h).
void model_export_state_dict(const Model& model, const std::string& path);

// Writes (name, tensor) entries in the same format (e.g. a model's prefix plus an exit head, local/neuroflux.cpp):
// entries that are in `parameters` are written as float32, the others keep their dtype.
void state_dict_write(const std::vector<std::pair<std::string, at::Tensor>>& state,
                      const std::vector<at::Tensor>& parameters, const std::string& path);

}  // namespace triaccel
