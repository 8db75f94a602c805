// A model defined outside triaccel, trained by it: "tiny-convnet" (two conv units and a linear head, 1,442 parameters)
// is registered by name, then api::run trains it on Fashion-MNIST on the CPU like any built-in model.
// Usage: custom_model [OUT_DIR] [MIN_TEST_ACC]; exits 1 when the test accuracy (%) stays below MIN_TEST_ACC (default
// 50; chance is 10; one epoch reaches about 63), 2 on a user error (e.g. the dataset is missing).
#include <triaccel/triaccel.h>

#include <torch/nn/functional/pooling.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

// conv3x3 stride 2 (no bias) → BatchNorm → ReLU, as one Sequential: children "0", "1", "2".
torch::nn::Sequential conv_bn_relu(int64_t in, int64_t out) {
  return torch::nn::Sequential(
      torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).stride(2).padding(1).bias(false)),
      torch::nn::BatchNorm2d(out), torch::nn::ReLU());
}

// Units "conv1", "conv2", "head"; every parameter is in exactly one of them.
class TinyConvNet final : public triaccel::Model {
 public:
  explicit TinyConvNet(const triaccel::ModelOptions& options) : Model("tiny-convnet") {
    auto conv1 = register_module("conv1", conv_bn_relu(options.in_channels, 8));
    auto conv2 = register_module("conv2", conv_bn_relu(8, 16));
    auto fc = register_module("fc", torch::nn::Linear(16, options.num_classes));
    unit_add("conv1", {conv1}, [conv1](const at::Tensor& x) { return conv1->forward(x); });  // (N, 8, H/2, W/2)
    unit_add("conv2", {conv2}, [conv2](const at::Tensor& x) { return conv2->forward(x); });  // (N, 16, H/4, W/4)
    unit_add("head", {fc}, [fc](const at::Tensor& x) {
      return fc->forward(torch::adaptive_avg_pool2d(x, {1, 1}).flatten(1));  // (N, classes)
    });
    triaccel::model_init_conv_bn(*this);
  }
};

std::shared_ptr<triaccel::Model> tiny_convnet_create(const triaccel::ModelOptions& options) {
  return std::make_shared<TinyConvNet>(options);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string out = argc > 1 ? argv[1] : "runs/custom_model";
  const double min_acc = argc > 2 ? std::atof(argv[2]) : 50.0;
  try {
    triaccel::model_register({"tiny-convnet", "two conv units and a linear head (examples/custom_model)",
                              triaccel::ModelInput::kImage, /*double_backward=*/true, /*local_learning=*/true,
                              &tiny_convnet_create});
    triaccel::Config config;  // every option by its key, as `triaccel train --help` lists them
    config.set("model", "tiny-convnet");
    config.set("dataset", "fashion-mnist");  // /usr/share/datasets/fashion-mnist unless data_dir is set
    config.set("device", "cpu");
    config.set("epochs", "1");
    config.set("batch_size", "500");
    config.set("lr", "0.2");
    config.set("progress", "off");
    config.set("out", out);
    const triaccel::Json summary = triaccel::api::run(config);
    const double acc = summary.value("test_acc", 0.0);
    std::printf("custom_model: %lld steps, test_acc %.2f%%, test_loss %.4f\n",
                static_cast<long long>(summary.value("steps", int64_t{0})), acc, summary.value("test_loss", 0.0));
    if (acc < min_acc) {
      std::fprintf(stderr, "custom_model: test_acc %.2f%% is below %.2f%%: the model did not train\n", acc, min_acc);
      return 1;
    }
    return 0;
  } catch (const triaccel::UserError& e) {
    std::fprintf(stderr, "custom_model: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "custom_model: internal error: %s\n", e.what());
    return 1;
  }
}
