// Tests for the transformer models (models/vit.cpp, models/gpt.cpp): exact parameter counts (summed by hand below),
// timm-style state_dict names and order, units that partition the parameters, output shapes, determinism for a
// seed, causality of the GPT, the initialization, and the model.pt export.
// Tolerances: forward comparisons run the same float32 CPU kernels on the same inputs, so equality is exact;
// the causality test allows 1e-6 for BLAS blocking that could differ with the sequence contents (it does not
// here, but a broken mask changes earlier logits by ~1e-2).
#include "test_util.h"
#include "triaccel/core/errors.h"
#include "triaccel/core/autograd_walk.h"
#include "triaccel/core/io.h"
#include "triaccel/models/transformer.h"
#include "triaccel/models/model.h"

#include <gtest/gtest.h>
#include <torch/serialize.h>
#include <torch/torch.h>

#include <unistd.h>

#include <cstdio>
#include <set>
#include <string>
#include <vector>

namespace triaccel {
namespace {

std::shared_ptr<Model> vit_make(uint64_t seed = 0, int64_t in_channels = 3, int64_t image_size = 32) {
  torch::manual_seed(seed);
  ModelOptions options;
  options.name = "vit-tiny";
  options.in_channels = in_channels;
  options.image_size = image_size;
  return model_create(options);
}

using test::gpt_tiny_options;

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

std::vector<std::string> block_unit_names(const std::string& first, int64_t blocks, const std::string& last) {
  std::vector<std::string> names{first};
  for (int64_t i = 0; i < blocks; ++i) names.push_back("blocks." + std::to_string(i));
  names.push_back(last);
  return names;
}

// Every parameter is in exactly one unit (by tensor identity), and units hold nothing else.
void expect_units_partition_parameters(const Model& model) {
  std::set<const c10::TensorImpl*> model_parameters;
  for (const auto& p : model.parameters()) model_parameters.insert(p.unsafeGetTensorImpl());
  std::set<const c10::TensorImpl*> seen;
  int64_t unit_total = 0;
  for (const auto& unit : model.units()) {
    for (const auto& p : unit.parameters()) {
      EXPECT_TRUE(model_parameters.count(p.unsafeGetTensorImpl())) << unit.name << " holds a foreign tensor";
      EXPECT_TRUE(seen.insert(p.unsafeGetTensorImpl()).second) << unit.name << " shares a tensor with another unit";
    }
    unit_total += unit.parameter_count();
  }
  EXPECT_EQ(seen.size(), model_parameters.size());
  EXPECT_EQ(unit_total, model.parameter_count());
}

// One pre-norm block of width d with MLP ratio 4: norm1 2d, qkv d·3d + 3d, proj d·d + d, norm2 2d,
// fc1 d·4d + 4d, fc2 4d·d + d = 12d² + 13d.
int64_t block_parameters(int64_t d) { return 12 * d * d + 13 * d; }

TEST(VitTiny, ParameterCountIsExact) {
  // patch_embed.proj: 192·3·4·4 + 192 = 9,408; cls_token 192; pos_embed 65·192 = 12,480;
  // 12 blocks · (12·192² + 13·192 = 444,864) = 5,338,368; norm 384; head 192·10 + 10 = 1,930.
  // Total 9,408 + 192 + 12,480 + 5,338,368 + 384 + 1,930 = 5,362,762 (timm's vit_tiny at patch 4 / 32 px agrees).
  EXPECT_EQ(block_parameters(192), 444864);
  auto model = vit_make();
  EXPECT_EQ(model->parameter_count(), 5362762);
}

TEST(VitTiny, NamesFollowTimm) {
  auto model = vit_make();
  const auto names = state_names(*model);
  ASSERT_EQ(names.size(), 4u + 12u * 12u + 2u + 2u);  // no buffers: LayerNorm has none
  EXPECT_EQ(names[0], "cls_token");
  EXPECT_EQ(names[1], "pos_embed");
  EXPECT_EQ(names[2], "patch_embed.proj.weight");
  EXPECT_EQ(names[3], "patch_embed.proj.bias");
  const std::vector<std::string> block0 = {
      "blocks.0.norm1.weight",    "blocks.0.norm1.bias",    "blocks.0.attn.qkv.weight", "blocks.0.attn.qkv.bias",
      "blocks.0.attn.proj.weight", "blocks.0.attn.proj.bias", "blocks.0.norm2.weight",    "blocks.0.norm2.bias",
      "blocks.0.mlp.fc1.weight",  "blocks.0.mlp.fc1.bias",  "blocks.0.mlp.fc2.weight",  "blocks.0.mlp.fc2.bias"};
  for (size_t i = 0; i < block0.size(); ++i) EXPECT_EQ(names[4 + i], block0[i]);
  EXPECT_EQ(names[names.size() - 4], "norm.weight");
  EXPECT_EQ(names[names.size() - 2], "head.weight");
  EXPECT_EQ(names.back(), "head.bias");
}

TEST(VitTiny, UnitsPartitionParametersAndComposeToForward) {
  auto model = vit_make();
  EXPECT_EQ(unit_names(*model), block_unit_names("patch_embed", 12, "head"));
  expect_units_partition_parameters(*model);
  EXPECT_EQ(model->units().front().parameter_count(), 9408 + 192 + 12480);  // conv + cls_token + pos_embed
  EXPECT_EQ(model->units().back().parameter_count(), 384 + 1930);
}

TEST(VitTiny, ForwardShapeAndDeterministicForASeed) {
  torch::manual_seed(123);
  const at::Tensor x = torch::randn({2, 3, 32, 32});
  auto a = vit_make(0);
  auto b = vit_make(0);
  auto c = vit_make(1);
  torch::NoGradGuard no_grad;
  const at::Tensor ya = a->forward(x);
  EXPECT_EQ(ya.sizes(), (std::vector<int64_t>{2, 10}));
  EXPECT_TRUE(torch::equal(ya, b->forward(x)));
  EXPECT_FALSE(torch::allclose(ya, c->forward(x)));
  // The two samples get different logits (the class token does attend to the patches).
  EXPECT_FALSE(torch::allclose(ya[0], ya[1]));
}

TEST(VitTiny, OtherImageSizesAndChannels) {
  auto model = vit_make(0, 1, 28);  // Fashion-MNIST: 7 × 7 patches
  torch::NoGradGuard no_grad;
  EXPECT_EQ(model->forward(torch::randn({3, 1, 28, 28})).sizes(), (std::vector<int64_t>{3, 10}));
  EXPECT_THROW(vit_make(0, 3, 30), UserError);  // not a multiple of the patch size
}

TEST(VitTiny, InitializationIsTruncNormalAndLayerNormIdentity) {
  auto model = vit_make();
  for (const auto& item : model->named_parameters()) {
    const std::string& name = item.key();
    const at::Tensor& p = item.value();
    if (name.find("norm") != std::string::npos && name.find(".weight") != std::string::npos) {
      EXPECT_TRUE(torch::equal(p, torch::ones_like(p))) << name;
    } else if (name.find(".bias") != std::string::npos && name.find("patch_embed") == std::string::npos) {
      EXPECT_TRUE(torch::equal(p, torch::zeros_like(p))) << name;
    } else if (name.find("blocks.0.attn.qkv.weight") != std::string::npos || name == "cls_token" ||
               name == "pos_embed" || name == "head.weight") {
      EXPECT_LE(p.abs().max().item<double>(), 0.04 + 1e-7) << name;  // truncated at 2 std
      if (p.numel() > 1000) EXPECT_NEAR(p.std().item<double>(), 0.0176, 0.002) << name;  // std of N(0,.02²) cut at ±2σ
    }
  }
}

// The attention splits its q, k, v product by unbind: the values and every gradient equal those of the permute and
// three selects it replaces bit for bit, and backward stacks the three gradients (no select's zero-filled copy of
// the product, no sum of three).
TEST(Attention, SplitsTheProductByUnbindAsThePermutedSelectsDid) {
  torch::manual_seed(4);
  SelfAttention attn(32, 4, AttentionMask::kCausal);
  const at::Tensor x = torch::randn({2, 8, 32}, torch::requires_grad());
  const at::Tensor g = torch::randn({2, 8, 32});
  const at::Tensor out = attn->forward(x);
  int selects = 0, unbinds = 0;
  autograd_graph_visit(out, [&](torch::autograd::Node& node) {
    selects += node.name().find("SelectBackward") != std::string::npos ? 1 : 0;
    unbinds += node.name().find("UnbindBackward") != std::string::npos ? 1 : 0;
  });
  EXPECT_EQ(selects, 0);
  EXPECT_EQ(unbinds, 1);
  const std::vector<at::Tensor> wrt{x, attn->qkv->weight, attn->qkv->bias, attn->proj->weight};
  const auto grads = torch::autograd::grad({out}, wrt, {g});
  // The replaced formulation, from the same weights.
  const at::Tensor heads = attn->qkv->forward(x).view({2, 8, 3, 4, 8}).permute({2, 0, 3, 1, 4});
  const at::Tensor o = at::scaled_dot_product_attention(heads[0], heads[1], heads[2], {}, 0.0, true);
  const at::Tensor ref = attn->proj->forward(o.transpose(1, 2).reshape({2, 8, 32}));
  const auto ref_grads = torch::autograd::grad({ref}, wrt, {g});
  EXPECT_TRUE(torch::equal(out, ref));
  for (size_t i = 0; i < wrt.size(); ++i) EXPECT_TRUE(torch::equal(grads[i], ref_grads[i])) << i;
}

TEST(GptChar, ParameterCountIsExact) {
  // tok_embed 65·384 = 24,960; pos_embed 256·384 = 98,304; 6 blocks · (12·384² + 13·384 = 1,774,464) = 10,646,784;
  // norm 768; head (no bias) 384·65 = 24,960. Total 10,795,776.
  EXPECT_EQ(block_parameters(384), 1774464);
  torch::manual_seed(0);
  ModelOptions options;
  options.name = "gpt-char";
  options.num_classes = 65;
  auto model = model_create(options);
  EXPECT_EQ(model->parameter_count(), 10795776);
  EXPECT_EQ(unit_names(*model), block_unit_names("embed", 6, "head"));
  expect_units_partition_parameters(*model);
  const auto names = state_names(*model);
  ASSERT_EQ(names.size(), 2u + 6u * 12u + 2u + 1u);
  EXPECT_EQ(names[0], "pos_embed");
  EXPECT_EQ(names[1], "tok_embed.weight");
  EXPECT_EQ(names[2], "blocks.0.norm1.weight");
  EXPECT_EQ(names[4], "blocks.0.attn.qkv.weight");
  EXPECT_EQ(names.back(), "head.weight");
}

TEST(GptChar, LogitsShapeAndCausality) {
  torch::manual_seed(0);
  auto model = model_create(gpt_tiny_options());
  model->eval();
  torch::NoGradGuard no_grad;
  const at::Tensor tokens = torch::randint(0, 11, {2, 16}, torch::kLong);
  const at::Tensor logits = model->forward(tokens);
  EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{2, 16, 11}));

  at::Tensor changed = tokens.clone();
  changed.select(1, 10).copy_((tokens.select(1, 10) + 1) % 11);  // a later token, different in both rows
  const at::Tensor logits_changed = model->forward(changed);
  EXPECT_TRUE(torch::allclose(logits.narrow(1, 0, 10), logits_changed.narrow(1, 0, 10), 0.0, 1e-6))
      << "positions before the change must not see it";
  // From the changed position on, the logits do change (so the check above is not vacuous).
  for (int64_t t = 10; t < 16; ++t) {
    EXPECT_GT((logits.select(1, t) - logits_changed.select(1, t)).abs().max().item<double>(), 1e-4) << t;
  }
  // Shorter sequences are the prefix of the longer one.
  EXPECT_TRUE(torch::allclose(model->forward(tokens.narrow(1, 0, 5)), logits.narrow(1, 0, 5), 0.0, 1e-6));
}

TEST(GptChar, RejectsBadInput) {
  torch::manual_seed(0);
  auto model = model_create(gpt_tiny_options());
  torch::NoGradGuard no_grad;
  EXPECT_THROW(model->forward(torch::zeros({1, 17}, torch::kLong)), c10::Error);  // longer than block_size
  EXPECT_THROW(model->forward(torch::zeros({1, 8})), c10::Error);                  // not int64 tokens
  ModelOptions bad = gpt_tiny_options();
  bad.gpt_heads = 3;  // 32 is not divisible by 3
  EXPECT_THROW(model_create(bad), UserError);
}

TEST(GptChar, ExportRoundTrip) {
  torch::manual_seed(0);
  auto model = model_create(gpt_tiny_options());
  const std::string path = ::testing::TempDir() + "triaccel_gpt_export_" + std::to_string(::getpid()) + ".pt";
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
  for (const auto& entry : dict) {
    const auto& [name, tensor] = state[i++];
    EXPECT_EQ(entry.key().toStringRef(), name);
    EXPECT_TRUE(torch::equal(entry.value().toTensor(), tensor)) << name;
  }
}

}  // namespace
}  // namespace triaccel
