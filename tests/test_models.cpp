// Tests for models/: exact parameter counts and state_dict names against torchvision (the counts and entry
// numbers were taken from torchvision 0.26: resnet18 with the CIFAR stem 11,173,962 parameters / 122 entries,
// efficientnet_b0 4,020,358 / 360), unit coverage and order, the unit-by-unit forward, and the export file.
// Tolerances: forward comparisons run the same float32 CPU kernels in the same order, so they are exact.
#include "test_util.h"
#include "triaccel/models/conv.h"
#include "triaccel/models/model.h"

#include "triaccel/core/errors.h"
#include "triaccel/core/io.h"

#include <gtest/gtest.h>
#include <torch/serialize.h>
#include <torch/torch.h>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <set>
#include <string>
#include <vector>

namespace triaccel {
namespace {

std::shared_ptr<Model> model_make(const std::string& name, int64_t in_channels = 3) {
  torch::manual_seed(0);
  ModelOptions options;
  options.name = name;
  options.in_channels = in_channels;
  return model_create(options);
}

std::vector<std::string> unit_names(const Model& model) {
  std::vector<std::string> names;
  for (const auto& unit : model.units()) names.push_back(unit.name);
  return names;
}

std::vector<std::string> state_names(const Model& model) {
  std::vector<std::string> names;
  for (const auto& entry : model_state(model)) names.push_back(entry.first);
  return names;
}

bool contains(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

// Every parameter of the model is in exactly one unit, and units hold nothing else.
void expect_units_partition_parameters(const Model& model) {
  std::set<const c10::TensorImpl*> model_parameters;
  for (const auto& p : model.parameters()) model_parameters.insert(p.unsafeGetTensorImpl());

  std::set<const c10::TensorImpl*> seen;
  int64_t unit_total = 0;
  for (const auto& unit : model.units()) {
    EXPECT_FALSE(unit.modules.empty()) << unit.name;
    for (const auto& p : unit.parameters()) {
      EXPECT_TRUE(model_parameters.count(p.unsafeGetTensorImpl())) << unit.name << " holds a foreign tensor";
      EXPECT_TRUE(seen.insert(p.unsafeGetTensorImpl()).second) << unit.name << " shares a tensor with another unit";
    }
    unit_total += unit.parameter_count();
  }
  EXPECT_EQ(seen.size(), model_parameters.size());
  EXPECT_EQ(unit_total, model.parameter_count());
}

// Runs the units one after another by hand and compares with Model::forward.
void expect_units_compose_to_forward(Model& model, const at::Tensor& x) {
  torch::NoGradGuard no_grad;
  model.eval();
  at::Tensor h = x;
  for (const auto& unit : model.units()) h = unit.forward(h);
  const at::Tensor y = model.forward(x);
  ASSERT_EQ(h.sizes(), y.sizes());
  EXPECT_TRUE(torch::equal(h, y));
}

TEST(ResNet, ParameterCountMatchesTorchvision) {
  auto model = model_make("resnet18");
  EXPECT_EQ(model->arch(), "resnet18");
  EXPECT_EQ(model->parameter_count(), 11173962);
  // One input channel removes 2 * 64 * 9 weights from conv1.
  EXPECT_EQ(model_make("resnet18", 1)->parameter_count(), 11173962 - 2 * 64 * 9);
}

TEST(ResNet, UnitsInOrderAndPartitionParameters) {
  auto model = model_make("resnet18");
  const std::vector<std::string> expected = {"stem",     "layer1.0", "layer1.1", "layer2.0", "layer2.1", "layer3.0",
                                             "layer3.1", "layer4.0", "layer4.1", "fc"};
  EXPECT_EQ(unit_names(*model), expected);
  expect_units_partition_parameters(*model);
}

TEST(ResNet, StateNamesMatchTorchvision) {
  auto model = model_make("resnet18");
  const auto names = state_names(*model);
  ASSERT_EQ(names.size(), 122u);
  const std::vector<std::string> head = {"conv1.weight",      "bn1.weight",        "bn1.bias",
                                         "bn1.running_mean",  "bn1.running_var",   "bn1.num_batches_tracked",
                                         "layer1.0.conv1.weight", "layer1.0.bn1.weight"};
  EXPECT_EQ(std::vector<std::string>(names.begin(), names.begin() + head.size()), head);
  EXPECT_TRUE(contains(names, "layer2.0.downsample.0.weight"));
  EXPECT_TRUE(contains(names, "layer2.0.downsample.1.running_var"));
  EXPECT_FALSE(contains(names, "layer1.0.downsample.0.weight"));
  EXPECT_FALSE(contains(names, "conv1.bias"));
  EXPECT_EQ(names[names.size() - 2], "fc.weight");
  EXPECT_EQ(names.back(), "fc.bias");
  EXPECT_EQ(std::set<std::string>(names.begin(), names.end()).size(), names.size());

  for (const auto& [name, tensor] : model_state(*model)) {
    if (name == "bn1.num_batches_tracked") EXPECT_EQ(tensor.scalar_type(), at::kLong);
    if (name == "layer2.0.downsample.0.weight") EXPECT_EQ(tensor.sizes(), at::IntArrayRef({128, 64, 1, 1}));
  }
}

TEST(ResNet, ForwardShapeAndUnitComposition) {
  auto model = model_make("resnet18");
  const at::Tensor x = torch::randn({2, 3, 32, 32});  // (N, C, H, W)
  model->train();
  EXPECT_EQ(model->forward(x).sizes(), at::IntArrayRef({2, 10}));
  expect_units_compose_to_forward(*model, x);
}

TEST(ResNet, RejectsWrongInputChannels) {
  auto model = model_make("resnet18", 1);
  EXPECT_THROW(model->forward(torch::randn({1, 3, 32, 32})), c10::Error);
}

TEST(EfficientNet, ParameterCountMatchesTorchvision) {
  auto model = model_make("efficientnet-b0");
  EXPECT_EQ(model->arch(), "efficientnet-b0");
  EXPECT_EQ(model->parameter_count(), 4020358);
}

TEST(EfficientNet, UnitsInOrderAndPartitionParameters) {
  auto model = model_make("efficientnet-b0");
  const std::vector<std::string> expected = {
      "features.0",   "features.1.0", "features.2.0", "features.2.1", "features.3.0", "features.3.1",
      "features.4.0", "features.4.1", "features.4.2", "features.5.0", "features.5.1", "features.5.2",
      "features.6.0", "features.6.1", "features.6.2", "features.6.3", "features.7.0", "features.8",
      "classifier"};
  EXPECT_EQ(unit_names(*model), expected);
  expect_units_partition_parameters(*model);
}

TEST(EfficientNet, StateNamesMatchTorchvision) {
  auto model = model_make("efficientnet-b0");
  const auto names = state_names(*model);
  ASSERT_EQ(names.size(), 360u);
  const std::vector<std::string> head = {"features.0.0.weight",
                                         "features.0.1.weight",
                                         "features.0.1.bias",
                                         "features.0.1.running_mean",
                                         "features.0.1.running_var",
                                         "features.0.1.num_batches_tracked",
                                         "features.1.0.block.0.0.weight",
                                         "features.1.0.block.0.1.weight"};
  EXPECT_EQ(std::vector<std::string>(names.begin(), names.begin() + head.size()), head);
  for (const char* name : {"features.1.0.block.1.fc1.weight", "features.1.0.block.1.fc2.bias",
                           "features.1.0.block.2.1.running_mean", "features.2.0.block.0.0.weight",
                           "features.2.0.block.2.fc1.weight", "features.2.0.block.3.1.running_var",
                           "features.7.0.block.3.0.weight", "features.8.0.weight", "features.8.1.num_batches_tracked"}) {
    EXPECT_TRUE(contains(names, name)) << name;
  }
  // Stage 1 has no expand conv, so its block has only three children.
  EXPECT_FALSE(contains(names, "features.1.0.block.3.0.weight"));
  EXPECT_EQ(names[names.size() - 2], "classifier.1.weight");
  EXPECT_EQ(names.back(), "classifier.1.bias");

  for (const auto& [name, tensor] : model_state(*model)) {
    // Depthwise 5x5 conv of stage 3's first block: 144 groups of one channel.
    if (name == "features.3.0.block.1.0.weight") EXPECT_EQ(tensor.sizes(), at::IntArrayRef({144, 1, 5, 5}));
    // Squeeze channels are in / 4 = 40 / 4 for stage 4's first block.
    if (name == "features.4.0.block.2.fc1.weight") EXPECT_EQ(tensor.sizes(), at::IntArrayRef({10, 240, 1, 1}));
  }
}

TEST(EfficientNet, ForwardShapeAt32And224) {
  auto model = model_make("efficientnet-b0");
  const at::Tensor x = torch::randn({2, 3, 32, 32});  // (N, C, H, W)
  model->train();
  EXPECT_EQ(model->forward(x).sizes(), at::IntArrayRef({2, 10}));
  expect_units_compose_to_forward(*model, x);

  torch::NoGradGuard no_grad;
  model->eval();
  EXPECT_EQ(model->forward(torch::randn({1, 3, 224, 224})).sizes(), at::IntArrayRef({1, 10}));
}

TEST(EfficientNet, StochasticDepthOnlyInTraining) {
  ModelOptions options;
  options.name = "efficientnet-b0";
  options.dropout = 0.0;
  torch::manual_seed(0);
  auto plain = model_create(options);
  options.stochastic_depth = 0.9;
  torch::manual_seed(0);
  auto dropping = model_create(options);

  torch::NoGradGuard no_grad;
  const at::Tensor x = torch::randn({4, 3, 32, 32});
  plain->eval();
  dropping->eval();
  EXPECT_TRUE(torch::equal(plain->forward(x), dropping->forward(x)));

  plain->train();
  dropping->train();
  torch::manual_seed(1);
  const at::Tensor y_plain = plain->forward(x);
  torch::manual_seed(1);
  EXPECT_FALSE(torch::allclose(y_plain, dropping->forward(x)));
}

// The rule measured on the H100 (models/conv.h): NCHW only for depthwise convolutions on maps of at most 2x2 with a
// kernel over 3, channels_last CUDA input, cuDNN on heuristics.
TEST(DepthwiseConv, NchwOnlyWhereHeuristicsPickSlowChannelsLastKernels) {
  EXPECT_TRUE(depthwise_nchw_wins(672, 672, 5, 2, 2, /*cuda_channels_last=*/true, /*cudnn_autotune=*/false));
  EXPECT_TRUE(depthwise_nchw_wins(480, 480, 5, 2, 1, true, false));
  EXPECT_FALSE(depthwise_nchw_wins(480, 480, 3, 2, 2, true, false));   // k3 on 2x2: channels_last is faster
  EXPECT_FALSE(depthwise_nchw_wins(240, 240, 5, 4, 4, true, false));   // 4x4: as fast
  EXPECT_FALSE(depthwise_nchw_wins(1152, 1152, 5, 1, 1, true, false)); // 1x1: the same memory
  EXPECT_FALSE(depthwise_nchw_wins(672, 672, 5, 2, 2, true, true));    // autotuned: fast in channels_last
  EXPECT_FALSE(depthwise_nchw_wins(672, 672, 5, 2, 2, false, false));  // CPU or NCHW input
  EXPECT_FALSE(depthwise_nchw_wins(672, 1, 5, 2, 2, true, false));     // not depthwise
}

// On CUDA under heuristics a 2x2 k5 depthwise convolution goes through the NCHW copies: the same values and gradients
// as the module's own channels_last call, and a channels_last output for the layers after it.
TEST(DepthwiseConv, CudaNchwCopiesGiveTheModulesValuesAndGradients) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU";
  const bool autotune = at::globalContext().benchmarkCuDNN();
  at::globalContext().setBenchmarkCuDNN(false);
  torch::manual_seed(0);
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(64, 64, 5).stride(1).padding(2).groups(64).bias(false));
  conv->to(torch::kCUDA, at::kFloat);
  conv->weight.set_data(conv->weight.contiguous(at::MemoryFormat::ChannelsLast));
  const at::Tensor x0 = torch::randn({8, 64, 2, 2}, torch::kCUDA).contiguous(at::MemoryFormat::ChannelsLast);
  const at::Tensor g = torch::randn({8, 64, 2, 2}, torch::kCUDA);
  std::vector<at::Tensor> outs, grads_x, grads_w;
  for (bool ours : {true, false}) {
    const at::Tensor x = x0.clone().requires_grad_(true);
    conv->zero_grad();
    const at::Tensor y = ours ? conv2d_forward(*conv, x) : conv->forward(x);
    y.backward(g);
    if (ours) {
      EXPECT_TRUE(y.is_contiguous(at::MemoryFormat::ChannelsLast));
    }
    outs.push_back(y.detach());
    grads_x.push_back(x.grad());
    grads_w.push_back(conv->weight.grad().clone());
  }
  at::globalContext().setBenchmarkCuDNN(autotune);
  EXPECT_TRUE(torch::allclose(outs[0], outs[1], 1e-4, 1e-5));
  EXPECT_TRUE(torch::allclose(grads_x[0], grads_x[1], 1e-4, 1e-5));
  EXPECT_TRUE(torch::allclose(grads_w[0], grads_w[1], 1e-4, 1e-4));
}

TEST(SmallCnn, ParameterCountUnitsAndForward) {
  auto model = model_make("small-cnn", 1);
  EXPECT_EQ(model->parameter_count(), 94186);
  EXPECT_EQ(model_make("small-cnn", 3)->parameter_count(), 94762);
  const std::vector<std::string> expected = {"block1", "block2", "block3", "fc"};
  EXPECT_EQ(unit_names(*model), expected);
  expect_units_partition_parameters(*model);

  const auto names = state_names(*model);
  EXPECT_EQ(names.size(), 3u * 6u + 2u);
  EXPECT_EQ(names.front(), "block1.0.weight");
  EXPECT_TRUE(contains(names, "block2.1.running_var"));
  EXPECT_EQ(names.back(), "fc.bias");

  const at::Tensor x = torch::randn({2, 1, 28, 28});
  model->train();
  EXPECT_EQ(model->forward(x).sizes(), at::IntArrayRef({2, 10}));
  EXPECT_EQ(model_make("small-cnn", 3)->forward(torch::randn({2, 3, 32, 32})).sizes(), at::IntArrayRef({2, 10}));
  expect_units_compose_to_forward(*model, x);
}

TEST(Model, BeforeUnitCalledOncePerUnitInOrder) {
  for (const auto& name : model_names()) {
    auto model = model_make(name);
    std::vector<size_t> calls;
    torch::NoGradGuard no_grad;
    model->eval();
    const at::Tensor input = model_entry(name).input == ModelInput::kTokens ? torch::zeros({1, 8}, torch::kLong)
                                                                       : torch::randn({1, 3, 32, 32});
    model->forward(input, [&calls](size_t i) { calls.push_back(i); });
    ASSERT_EQ(calls.size(), model->units().size()) << name;
    for (size_t i = 0; i < calls.size(); ++i) EXPECT_EQ(calls[i], i) << name;
  }
}

TEST(Model, UnknownNameListsKnownModels) {
  ModelOptions options;
  options.name = "nope";
  try {
    model_create(options);
    FAIL() << "model_create accepted an unknown name";
  } catch (const UserError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("nope"), std::string::npos) << message;
    EXPECT_NE(message.find("resnet18"), std::string::npos) << message;
    EXPECT_NE(message.find("efficientnet-b0"), std::string::npos) << message;
    EXPECT_NE(message.find("small-cnn"), std::string::npos) << message;
  }
}

TEST(Model, ValidateNamesTheBadValue) {
  ModelOptions options;
  options.num_classes = 0;
  try {
    options.validate(false);
    FAIL() << "validate accepted num_classes = 0";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("num_classes must be >= 1, got 0"), std::string::npos) << e.what();
  }
  options = ModelOptions();
  options.stochastic_depth = 1.5;
  EXPECT_THROW(options.validate(false), UserError);
  options = ModelOptions();
  options.dropout = -0.1;
  EXPECT_THROW(options.validate(false), UserError);
  options = ModelOptions();
  options.in_channels = 0;
  EXPECT_THROW(options.validate(false), UserError);
  EXPECT_NO_THROW(ModelOptions().validate(false));
}

TEST(Export, RoundTripRestoresIdenticalTensors) {
  auto model = model_make("small-cnn", 1);
  // Move the BatchNorm running statistics away from their initial values so that buffers are checked too.
  model->train();
  {
    torch::NoGradGuard no_grad;
    model->forward(torch::randn({4, 1, 28, 28}));
  }
  // A single scratch file (not test::TempDir: std::filesystem::remove_all resolves to the copy that libtorch.so
  // exports, which crashes).
  const std::string path = ::testing::TempDir() + "triaccel_models_export_" + std::to_string(::getpid()) + ".pt";
  model_export_state_dict(*model, path);
  struct FileRemover {
    std::string path;
    ~FileRemover() { std::remove(path.c_str()); }
  } remover{path};

  const at::IValue loaded = test::pickle_file_read(path);
  ASSERT_TRUE(loaded.isGenericDict());
  const auto dict = loaded.toGenericDict();
  const auto state = model_state(*model);
  ASSERT_EQ(dict.size(), state.size());
  size_t i = 0;
  for (const auto& entry : dict) {  // insertion order is kept
    const auto& [name, tensor] = state[i++];
    EXPECT_EQ(entry.key().toStringRef(), name);
    const at::Tensor restored = entry.value().toTensor();
    EXPECT_EQ(restored.scalar_type(), tensor.scalar_type()) << name;
    EXPECT_TRUE(torch::equal(restored, tensor)) << name;
  }
  for (const auto& entry : dict) {
    if (entry.key().toStringRef() == "block1.1.num_batches_tracked") {
      EXPECT_EQ(entry.value().toTensor().item<int64_t>(), 1);
    }
  }
}

}  // namespace
}  // namespace triaccel
