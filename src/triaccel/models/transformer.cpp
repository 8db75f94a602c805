// Pre-norm transformer block, attention, MLP and initialization shared by vit.cpp and gpt.cpp (transformer.h).
#include "triaccel/models/transformer.h"

#include "triaccel/models/linear.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/nn/init.h>
#include <torch/nn/modules/embedding.h>

#include <cmath>
#include <vector>

namespace triaccel {

SelfAttentionImpl::SelfAttentionImpl(int64_t dim, int64_t heads, AttentionMask mask) : heads_(heads), mask_(mask) {
  TORCH_CHECK(heads > 0 && dim % heads == 0, "attention: dim ", dim, " is not divisible by heads ", heads);
  qkv = register_module("qkv", torch::nn::Linear(dim, 3 * dim));
  proj = register_module("proj", torch::nn::Linear(dim, dim));
}

at::Tensor SelfAttentionImpl::forward(const at::Tensor& x) {
  const int64_t b = x.size(0), n = x.size(1), d = x.size(2);
  // (B, N, 3D) → q, k, v, each (B, N, H, D / H) seen as (B, H, N, D / H): the same views of the product as a permute
  // to (3, B, H, N, D / H) and three selects, but backward stacks the three gradients into the product's layout in
  // one pass, where each select's backward fills a zero tensor of the product's size, copies its part in, and the
  // three are then summed and copied contiguous (three more passes): at the 85 M GPT's batch, ~10 GB a step more.
  const std::vector<at::Tensor> parts = linear_forward(*qkv, x).view({b, n, 3, heads_, d / heads_}).unbind(2);
  const at::Tensor out =
      at::scaled_dot_product_attention(parts[0].transpose(1, 2), parts[1].transpose(1, 2), parts[2].transpose(1, 2),
                                       {}, 0.0, mask_ == AttentionMask::kCausal);  // (B, H, N, D / H)
  return linear_forward(*proj, out.transpose(1, 2).reshape({b, n, d}));
}

MlpImpl::MlpImpl(int64_t dim, int64_t hidden) {
  fc1 = register_module("fc1", torch::nn::Linear(dim, hidden));
  fc2 = register_module("fc2", torch::nn::Linear(hidden, dim));
}

at::Tensor MlpImpl::forward(const at::Tensor& x) {
  return linear_forward(*fc2, at::gelu(linear_forward(*fc1, x)));
}

TransformerBlockImpl::TransformerBlockImpl(int64_t dim, int64_t heads, int64_t mlp_hidden, AttentionMask mask,
                                           double norm_eps) {
  norm1 = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim}).eps(norm_eps)));
  attn = register_module("attn", SelfAttention(dim, heads, mask));
  norm2 = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim}).eps(norm_eps)));
  mlp = register_module("mlp", Mlp(dim, mlp_hidden));
}

at::Tensor TransformerBlockImpl::forward(const at::Tensor& x) {
  const at::Tensor h = x + attn->forward(norm1->forward(x));
  return h + mlp->forward(norm2->forward(h));
}

void trunc_normal_init(at::Tensor t, double std) {
  const torch::NoGradGuard no_grad;
  // u uniform in [Φ(-2), Φ(2)] mapped through Φ⁻¹: x = √2 · erfinv(2u - 1), which lies in [-2, 2].
  const double lo = std::erf(-2.0 / std::sqrt(2.0));
  const double hi = std::erf(2.0 / std::sqrt(2.0));
  t.uniform_(lo, hi).erfinv_().mul_(std * std::sqrt(2.0)).clamp_(-2.0 * std, 2.0 * std);
}

void transformer_init(torch::nn::Module& model) {
  const torch::NoGradGuard no_grad;
  for (const auto& module : model.modules(/*include_self=*/false)) {
    if (auto* linear = module->as<torch::nn::LinearImpl>()) {
      trunc_normal_init(linear->weight, 0.02);
      if (linear->bias.defined()) torch::nn::init::zeros_(linear->bias);
    } else if (auto* embedding = module->as<torch::nn::EmbeddingImpl>()) {
      trunc_normal_init(embedding->weight, 0.02);
    } else if (auto* norm = module->as<torch::nn::LayerNormImpl>()) {
      torch::nn::init::ones_(norm->weight);
      torch::nn::init::zeros_(norm->bias);
    }
  }
}

}  // namespace triaccel
