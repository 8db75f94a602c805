// ViT-Tiny for small images (CIFAR 32×32): patch 4 (64 patches), embed dim 192, depth 12, 3 heads, MLP ratio 4,
// pre-norm blocks, learnable class token and position embedding, final LayerNorm, linear head on the class token.
// Parameter names are timm's VisionTransformer names: cls_token, pos_embed, patch_embed.proj.{weight,bias},
// blocks.i.{norm1, attn.qkv, attn.proj, norm2, mlp.fc1, mlp.fc2}.{weight,bias}, norm.{weight,bias}, head.{weight,bias}.
// 5,362,762 parameters for 3×32×32 inputs and 10 classes (tests/test_models.cpp spells out the sum).
// Units: "patch_embed" (conv + class token + position embedding), "blocks.0" ... "blocks.11", "head" (final norm +
// linear); every parameter is in exactly one unit. Initialization as timm: trunc-normal std 0.02 for Linear
// weights, cls_token and pos_embed; zero biases; LayerNorm 1 / 0; the patch convolution keeps PyTorch's default.
#include "triaccel/models/linear.h"
#include "triaccel/models/model.h"
#include "triaccel/models/transformer.h"

#include "triaccel/core/errors.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>

namespace triaccel {

namespace {

constexpr int64_t kPatch = 4;
constexpr int64_t kDim = 192;
constexpr int64_t kDepth = 12;
constexpr int64_t kHeads = 3;
constexpr int64_t kMlpRatio = 4;
constexpr double kNormEps = 1e-6;  // timm's ViT LayerNorm

// timm's PatchEmbed: proj = Conv2d(C, D, patch, stride patch); (N, C, H, W) → (N, H/p · W/p, D).
class PatchEmbedImpl : public torch::nn::Module {
 public:
  PatchEmbedImpl(int64_t in_channels, int64_t dim)
      : proj(register_module("proj", torch::nn::Conv2d(torch::nn::Conv2dOptions(in_channels, dim, kPatch).stride(kPatch)))) {}
  at::Tensor forward(const at::Tensor& x) { return proj->forward(x).flatten(2).transpose(1, 2); }

  torch::nn::Conv2d proj;
};
TORCH_MODULE(PatchEmbed);

class VitTiny final : public Model {
 public:
  explicit VitTiny(const ModelOptions& options) : Model("vit-tiny") {
    const int64_t in_channels = options.in_channels;
    const int64_t size = options.image_size;
    TRIACCEL_CHECK_INPUT(size % kPatch == 0, "vit-tiny needs an image size divisible by the patch size ", kPatch,
                         ", got ", size, "; pass " + option_ref("image_size") + " with a multiple of ", kPatch);
    const int64_t patches = (size / kPatch) * (size / kPatch);

    auto cls_token = register_parameter("cls_token", at::zeros({1, 1, kDim}));
    auto pos_embed = register_parameter("pos_embed", at::zeros({1, patches + 1, kDim}));
    auto patch_embed = register_module("patch_embed", PatchEmbed(in_channels, kDim));
    auto blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < kDepth; ++i) {
      blocks->push_back(TransformerBlock(kDim, kHeads, kMlpRatio * kDim, AttentionMask::kNone, kNormEps));
    }
    auto norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim}).eps(kNormEps)));
    auto head = register_module("head", torch::nn::Linear(kDim, options.num_classes));

    transformer_init(*this);
    trunc_normal_init(cls_token, 0.02);
    trunc_normal_init(pos_embed, 0.02);

    auto embed_params = std::make_shared<ParameterHolderImpl>();
    embed_params->hold("cls_token", cls_token);
    embed_params->hold("pos_embed", pos_embed);
    unit_add("patch_embed", {patch_embed, embed_params},
             [patch_embed, cls_token, pos_embed, in_channels, size](const at::Tensor& x) {
               TORCH_CHECK(x.dim() == 4 && x.size(1) == in_channels && x.size(2) == size && x.size(3) == size,
                           "vit-tiny expects input (N, ", in_channels, ", ", size, ", ", size, "), got ", x.sizes());
               const at::Tensor tokens = patch_embed->forward(x);  // (N, P, D)
               const at::Tensor cls = cls_token.expand({x.size(0), 1, kDim}).to(tokens.scalar_type());
               return at::cat({cls, tokens}, 1) + pos_embed;  // (N, 1 + P, D)
             });
    for (int64_t i = 0; i < kDepth; ++i) {
      auto block = blocks->ptr<TransformerBlockImpl>(i);
      unit_add("blocks." + std::to_string(i), {block}, [block](const at::Tensor& x) { return block->forward(x); });
    }
    unit_add("head", {norm, head}, [norm, head](const at::Tensor& x) {
      // LayerNorm is per token, so normalising only the class token equals timm's norm-then-select.
      return linear_forward(*head, norm->forward(x.select(1, 0)));  // (N, classes)
    });
  }
};

}  // namespace

std::shared_ptr<Model> vit_tiny_create(const ModelOptions& options) {
  return std::make_shared<VitTiny>(options);
}

}  // namespace triaccel
