// ResNet-18 with the CIFAR stem (3x3 stride-1 conv1, no max-pool), parameter- and buffer-compatible with
// torchvision.models.resnet18(num_classes=C) after `conv1 = Conv2d(in, 64, 3, 1, 1, bias=False)` and
// `maxpool = Identity()`. Invariants: every module is registered under its torchvision name and in torchvision's
// order (so model_state matches state_dict() entry for entry); initialization follows torchvision (convs
// kaiming-normal fan-out, BatchNorm weight 1 / bias 0, Linear default); units are "stem", "layer1.0" ...
// "layer4.1", "fc", and each parameter is in exactly one of them.
#include "triaccel/models/batch_norm.h"
#include "triaccel/models/model.h"

#include <torch/nn/init.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>

namespace triaccel {

namespace {

constexpr double kBatchNormEps = 1e-5;
constexpr double kBatchNormMomentum = 0.1;

torch::nn::BatchNorm2d batch_norm_make(int64_t channels) {
  return torch::nn::BatchNorm2d(
      torch::nn::BatchNorm2dOptions(channels).eps(kBatchNormEps).momentum(kBatchNormMomentum));
}

torch::nn::Conv2d conv_make(int64_t in, int64_t out, int64_t kernel, int64_t stride) {
  return torch::nn::Conv2d(
      torch::nn::Conv2dOptions(in, out, kernel).stride(stride).padding((kernel - 1) / 2).bias(false));
}

// torchvision's downsample: Sequential(conv1x1(in, out, stride), BatchNorm2d(out)) → children "0" and "1".
class DownsampleImpl : public torch::nn::Module {
 public:
  DownsampleImpl(int64_t in, int64_t out, int64_t stride)
      : conv_(register_module("0", conv_make(in, out, 1, stride))),
        bn_(register_module("1", batch_norm_make(out))) {}

  at::Tensor forward(const at::Tensor& x) { return batch_norm_forward(bn_, conv_(x), /*relu=*/false); }

 private:
  torch::nn::Conv2d conv_;
  torch::nn::BatchNorm2d bn_;
};
TORCH_MODULE(Downsample);

// torchvision's BasicBlock (expansion 1): conv3x3-bn-relu-conv3x3-bn, plus the (downsampled) input, relu.
class BasicBlockImpl : public torch::nn::Module {
 public:
  BasicBlockImpl(int64_t in, int64_t out, int64_t stride)
      : conv1_(register_module("conv1", conv_make(in, out, 3, stride))),
        bn1_(register_module("bn1", batch_norm_make(out))),
        conv2_(register_module("conv2", conv_make(out, out, 3, 1))),
        bn2_(register_module("bn2", batch_norm_make(out))) {
    if (stride != 1 || in != out) downsample_ = register_module("downsample", Downsample(in, out, stride));
  }

  // (N, in, H, W) → (N, out, H / stride, W / stride)
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = batch_norm_forward(bn1_, conv1_(x), /*relu=*/true);
    const at::Tensor identity = downsample_ ? downsample_(x) : x;
    return batch_norm_add_relu(bn2_, conv2_(h), identity);  // relu(bn2(conv2(h)) + identity)
  }

 private:
  torch::nn::Conv2d conv1_;
  torch::nn::BatchNorm2d bn1_;
  torch::nn::Conv2d conv2_;
  torch::nn::BatchNorm2d bn2_;
  Downsample downsample_{nullptr};
};

class ResNet18 final : public Model {
 public:
  explicit ResNet18(const ModelOptions& options) : Model("resnet18") {
    const int64_t in_channels = options.in_channels;
    auto conv1 = register_module("conv1", conv_make(in_channels, 64, 3, 1));
    auto bn1 = register_module("bn1", batch_norm_make(64));
    unit_add("stem", {conv1, bn1}, [conv1, bn1, in_channels](const at::Tensor& x) {
      TORCH_CHECK(x.dim() == 4 && x.size(1) == in_channels, "resnet18 expects input (N, ", in_channels,
                  ", H, W), got ", x.sizes());
      return batch_norm_forward(bn1, conv1->forward(x), /*relu=*/true);  // (N, 64, H, W)
    });

    // (layer name, output channels, stride of its first block); two BasicBlocks per layer.
    const struct {
      const char* name;
      int64_t channels;
      int64_t stride;
    } kLayers[] = {{"layer1", 64, 1}, {"layer2", 128, 2}, {"layer3", 256, 2}, {"layer4", 512, 2}};
    int64_t in = 64;
    for (const auto& layer_config : kLayers) {
      auto layer = register_module(layer_config.name, torch::nn::ModuleList());
      for (int64_t i = 0; i < 2; ++i) {
        auto block = std::make_shared<BasicBlockImpl>(in, layer_config.channels, i == 0 ? layer_config.stride : 1);
        layer->push_back(block);
        unit_add(std::string(layer_config.name) + "." + std::to_string(i), {block},
                 [block](const at::Tensor& x) { return block->forward(x); });
        in = layer_config.channels;
      }
    }

    auto fc = register_module("fc", torch::nn::Linear(512, options.num_classes));
    unit_add("fc", {fc}, [fc](const at::Tensor& x) {
      const at::Tensor pooled = torch::adaptive_avg_pool2d(x, {1, 1}).flatten(1);  // (N, 512)
      return fc->forward(pooled);                                                   // (N, classes)
    });

    model_init_conv_bn(*this);  // as torchvision's ResNet.__init__; Linear keeps its default
  }
};

}  // namespace

std::shared_ptr<Model> resnet18_create(const ModelOptions& options) {
  return std::make_shared<ResNet18>(options);
}

}  // namespace triaccel
