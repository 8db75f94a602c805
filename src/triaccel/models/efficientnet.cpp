// EfficientNet-B0, parameter- and buffer-compatible with torchvision.models.efficientnet_b0(num_classes=C):
// features.0 (stem conv-bn-SiLU), features.1..7 (stages of MBConv blocks), features.8 (1x1 conv-bn-SiLU to 1280),
// average pool, classifier = (Dropout, Linear). Invariants: modules carry torchvision's names in torchvision's
// order ("features.2.0.block.3.1.running_var"), initialization follows torchvision, there is no resize inside
// the model (any input of at least 1x1 works; the data loader resizes), stochastic depth is active only in
// training mode with a probability > 0. Units: "features.0", each MBConv block "features.S.I", "features.8",
// "classifier"; every parameter is in exactly one of them.
#include "triaccel/models/batch_norm.h"
#include "triaccel/models/conv.h"
#include "triaccel/models/model.h"

#include <torch/nn/init.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>

#include <algorithm>
#include <cmath>
#include <iterator>

namespace triaccel {

namespace {

constexpr double kBatchNormEps = 1e-5;
constexpr double kBatchNormMomentum = 0.1;
constexpr int64_t kStemChannels = 32;
constexpr int64_t kHeadChannels = 1280;  // 4 x the last stage's 320

enum class Activation { None, SiLU };

// torchvision's Conv2dNormActivation: conv (no bias, "same" padding) → BatchNorm2d → optional SiLU;
// children "0" (conv) and "1" (bn), the activation has no state.
class ConvNormActImpl : public torch::nn::Module {
 public:
  ConvNormActImpl(int64_t in, int64_t out, int64_t kernel, int64_t stride, int64_t groups, Activation activation)
      : conv_(register_module("0", torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, kernel)
                                                         .stride(stride)
                                                         .padding((kernel - 1) / 2)
                                                         .groups(groups)
                                                         .bias(false)))),
        bn_(register_module("1", torch::nn::BatchNorm2d(torch::nn::BatchNorm2dOptions(out)
                                                            .eps(kBatchNormEps)
                                                            .momentum(kBatchNormMomentum)))),
        activation_(activation) {}

  // (N, in, H, W) → (N, out, ceil(H / stride), ceil(W / stride))
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = batch_norm_forward(bn_, conv2d_forward(*conv_, x), /*relu=*/false);  // SiLU: an op of its own
    return activation_ == Activation::SiLU ? torch::silu(h) : h;
  }

 private:
  torch::nn::Conv2d conv_;
  torch::nn::BatchNorm2d bn_;
  Activation activation_;
};
TORCH_MODULE(ConvNormAct);

// torchvision's SqueezeExcitation: x * sigmoid(fc2(silu(fc1(avgpool(x))))), fc1/fc2 are 1x1 convs with bias.
class SqueezeExcitationImpl : public torch::nn::Module {
 public:
  SqueezeExcitationImpl(int64_t channels, int64_t squeeze_channels)
      : fc1_(register_module("fc1", torch::nn::Conv2d(torch::nn::Conv2dOptions(channels, squeeze_channels, 1)))),
        fc2_(register_module("fc2", torch::nn::Conv2d(torch::nn::Conv2dOptions(squeeze_channels, channels, 1)))) {}

  // (N, C, H, W) → (N, C, H, W)
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor scale = torch::adaptive_avg_pool2d(x, {1, 1});  // (N, C, 1, 1)
    scale = torch::sigmoid(fc2_(torch::silu(fc1_(scale))));
    return x * scale;
  }

 private:
  torch::nn::Conv2d fc1_;
  torch::nn::Conv2d fc2_;
};
TORCH_MODULE(SqueezeExcitation);

struct MBConvConfig {
  int64_t expand_ratio;
  int64_t kernel;
  int64_t stride;
  int64_t in_channels;
  int64_t out_channels;
  int64_t layers;
};

// The seven B0 stages (width and depth multipliers 1.0, so every channel count is already a multiple of 8).
constexpr MBConvConfig kStages[] = {
    {1, 3, 1, 32, 16, 1},  {6, 3, 2, 16, 24, 2},  {6, 5, 2, 24, 40, 2},   {6, 3, 2, 40, 80, 3},
    {6, 5, 1, 80, 112, 3}, {6, 5, 2, 112, 192, 4}, {6, 3, 1, 192, 320, 1},
};

// torchvision's MBConv: "block" = [expand ConvNormAct (if expand != 1)], depthwise ConvNormAct,
// SqueezeExcitation, project ConvNormAct (no activation); residual with row-wise stochastic depth when the
// block keeps its shape (stride 1, in == out).
class MBConvImpl : public torch::nn::Module {
 public:
  MBConvImpl(const MBConvConfig& config, double stochastic_depth_prob)
      : block_(register_module("block", torch::nn::ModuleList())),
        residual_(config.stride == 1 && config.in_channels == config.out_channels),
        stochastic_depth_prob_(stochastic_depth_prob) {
    const int64_t expanded = config.in_channels * config.expand_ratio;
    if (expanded != config.in_channels) {
      expand_ = ConvNormAct(config.in_channels, expanded, 1, 1, 1, Activation::SiLU);
      block_->push_back(expand_);
    }
    depthwise_ = ConvNormAct(expanded, expanded, config.kernel, config.stride, expanded, Activation::SiLU);
    block_->push_back(depthwise_);
    se_ = SqueezeExcitation(expanded, std::max<int64_t>(1, config.in_channels / 4));
    block_->push_back(se_);
    project_ = ConvNormAct(expanded, config.out_channels, 1, 1, 1, Activation::None);
    block_->push_back(project_);
  }

  // (N, in, H, W) → (N, out, ceil(H / stride), ceil(W / stride))
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = expand_ ? expand_(x) : x;
    h = project_(se_(depthwise_(h)));
    if (!residual_) return h;
    return stochastic_depth(h) + x;
  }

 private:
  // torchvision.ops.stochastic_depth, mode "row": drops whole samples with probability p, rescales the rest.
  at::Tensor stochastic_depth(const at::Tensor& h) {
    if (!is_training() || stochastic_depth_prob_ == 0.0) return h;
    const double survival = 1.0 - stochastic_depth_prob_;
    at::Tensor keep = torch::empty({h.size(0), 1, 1, 1}, h.options()).bernoulli_(survival);  // (N, 1, 1, 1)
    if (survival > 0.0) keep.div_(survival);
    return h * keep;
  }

  torch::nn::ModuleList block_;
  ConvNormAct expand_{nullptr};
  ConvNormAct depthwise_{nullptr};
  SqueezeExcitation se_{nullptr};
  ConvNormAct project_{nullptr};
  bool residual_;
  double stochastic_depth_prob_;
};

class EfficientNetB0 final : public Model {
 public:
  explicit EfficientNetB0(const ModelOptions& options) : Model("efficientnet-b0") {
    auto features = register_module("features", torch::nn::ModuleList());

    const int64_t in_channels = options.in_channels;
    auto stem = std::make_shared<ConvNormActImpl>(in_channels, kStemChannels, 3, 2, 1, Activation::SiLU);
    features->push_back(stem);
    unit_add("features.0", {stem}, [stem, in_channels](const at::Tensor& x) {
      TORCH_CHECK(x.dim() == 4 && x.size(1) == in_channels, "efficientnet-b0 expects input (N, ", in_channels,
                  ", H, W), got ", x.sizes());
      return stem->forward(x);  // (N, 32, H / 2, W / 2)
    });

    int64_t total_blocks = 0;
    for (const auto& stage : kStages) total_blocks += stage.layers;
    int64_t block_id = 0;
    for (size_t s = 0; s < std::size(kStages); ++s) {
      auto stage_list = torch::nn::ModuleList();
      features->push_back(stage_list);
      for (int64_t i = 0; i < kStages[s].layers; ++i) {
        MBConvConfig config = kStages[s];
        if (i > 0) {
          config.in_channels = config.out_channels;
          config.stride = 1;
        }
        const double prob = options.stochastic_depth * static_cast<double>(block_id) / total_blocks;
        auto block = std::make_shared<MBConvImpl>(config, prob);
        stage_list->push_back(block);
        unit_add("features." + std::to_string(s + 1) + "." + std::to_string(i), {block},
                 [block](const at::Tensor& x) { return block->forward(x); });
        ++block_id;
      }
    }

    const int64_t last_channels = kStages[std::size(kStages) - 1].out_channels;
    auto head = std::make_shared<ConvNormActImpl>(last_channels, kHeadChannels, 1, 1, 1, Activation::SiLU);
    features->push_back(head);
    unit_add("features.8", {head}, [head](const at::Tensor& x) { return head->forward(x); });

    auto classifier = register_module("classifier", torch::nn::ModuleList());
    auto dropout = std::make_shared<torch::nn::DropoutImpl>(torch::nn::DropoutOptions(options.dropout));
    auto linear = std::make_shared<torch::nn::LinearImpl>(kHeadChannels, options.num_classes);
    classifier->push_back(dropout);
    classifier->push_back(linear);
    unit_add("classifier", {classifier}, [dropout, linear](const at::Tensor& x) {
      const at::Tensor pooled = torch::adaptive_avg_pool2d(x, {1, 1}).flatten(1);  // (N, 1280)
      return linear->forward(dropout->forward(pooled));                             // (N, classes)
    });

    init_weights();
  }

 private:
  // torchvision EfficientNet.__init__: convs kaiming-normal fan-out with zero bias, BatchNorm 1 / 0,
  // Linear uniform(±1/sqrt(out_features)) with zero bias.
  void init_weights() {
    torch::NoGradGuard no_grad;
    for (const auto& module : modules(/*include_self=*/false)) {
      if (auto* conv = module->as<torch::nn::Conv2dImpl>()) {
        torch::nn::init::kaiming_normal_(conv->weight, 0.0, torch::kFanOut);
        if (conv->bias.defined()) torch::nn::init::zeros_(conv->bias);
      } else if (auto* bn = module->as<torch::nn::BatchNorm2dImpl>()) {
        torch::nn::init::ones_(bn->weight);
        torch::nn::init::zeros_(bn->bias);
      } else if (auto* linear = module->as<torch::nn::LinearImpl>()) {
        const double range = 1.0 / std::sqrt(static_cast<double>(linear->options.out_features()));
        torch::nn::init::uniform_(linear->weight, -range, range);
        torch::nn::init::zeros_(linear->bias);
      }
    }
  }
};

}  // namespace

std::shared_ptr<Model> efficientnet_b0_create(const ModelOptions& options) {
  return std::make_shared<EfficientNetB0>(options);
}

}  // namespace triaccel
