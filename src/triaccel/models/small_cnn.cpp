// A small, fast CNN for CPU runs and tests: three conv3x3-BN-ReLU blocks (in→32 stride 2, 32→64 stride 2,
// 64→128), global average pool, linear. 94,186 parameters for 1 input channel and 10 classes
// (94,762 for 3 channels). Invariants: modules are named "block1.0" (conv) / "block1.1" (bn) ... "fc",
// units are "block1", "block2", "block3", "fc" and every parameter is in exactly one of them; initialization
// as in torchvision's ResNet (kaiming-normal fan-out convs, BatchNorm 1 / 0, Linear default).
#include "triaccel/models/batch_norm.h"
#include "triaccel/models/model.h"

#include <torch/nn/init.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>

namespace triaccel {

namespace {

// conv3x3 (no bias) → BatchNorm2d → ReLU; children "0" (conv) and "1" (bn).
class ConvBlockImpl : public torch::nn::Module {
 public:
  ConvBlockImpl(int64_t in, int64_t out, int64_t stride)
      : conv_(register_module(
            "0", torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).stride(stride).padding(1).bias(false)))),
        bn_(register_module("1", torch::nn::BatchNorm2d(torch::nn::BatchNorm2dOptions(out).eps(1e-5).momentum(0.1)))) {
  }

  // (N, in, H, W) → (N, out, ceil(H / stride), ceil(W / stride))
  at::Tensor forward(const at::Tensor& x) { return batch_norm_forward(bn_, conv_(x), /*relu=*/true); }

 private:
  torch::nn::Conv2d conv_;
  torch::nn::BatchNorm2d bn_;
};
TORCH_MODULE(ConvBlock);

class SmallCnn final : public Model {
 public:
  explicit SmallCnn(const ModelOptions& options) : Model("small-cnn") {
    const int64_t in_channels = options.in_channels;
    auto block1 = register_module("block1", ConvBlock(in_channels, 32, 2));
    auto block2 = register_module("block2", ConvBlock(32, 64, 2));
    auto block3 = register_module("block3", ConvBlock(64, 128, 1));
    auto fc = register_module("fc", torch::nn::Linear(128, options.num_classes));

    unit_add("block1", {block1}, [block1, in_channels](const at::Tensor& x) {
      TORCH_CHECK(x.dim() == 4 && x.size(1) == in_channels, "small-cnn expects input (N, ", in_channels,
                  ", H, W), got ", x.sizes());
      return block1->forward(x);  // (N, 32, H / 2, W / 2)
    });
    unit_add("block2", {block2}, [block2](const at::Tensor& x) { return block2->forward(x); });
    unit_add("block3", {block3}, [block3](const at::Tensor& x) { return block3->forward(x); });
    unit_add("fc", {fc}, [fc](const at::Tensor& x) {
      const at::Tensor pooled = torch::adaptive_avg_pool2d(x, {1, 1}).flatten(1);  // (N, 128)
      return fc->forward(pooled);                                                   // (N, classes)
    });

    model_init_conv_bn(*this);
  }
};

}  // namespace

std::shared_ptr<Model> small_cnn_create(const ModelOptions& options) {
  return std::make_shared<SmallCnn>(options);
}

}  // namespace triaccel
