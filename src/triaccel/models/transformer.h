// Pre-norm transformer pieces shared by ViT-Tiny (vit.cpp) and the character GPT (gpt.cpp), with timm's module
// names so state_dict keys read like timm's: Block = {norm1, attn{qkv, proj}, norm2, mlp{fc1, fc2}}.
// Invariants: attention runs through at::scaled_dot_product_attention (flash / memory-efficient kernels on CUDA,
// the math kernel on the CPU); Block::forward maps (B, N, D) to (B, N, D); causal blocks let position i attend
// only to positions <= i.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <cstdint>
#include <string>

namespace triaccel {

enum class AttentionMask { kNone, kCausal };

// Multi-head self-attention: qkv = Linear(D, 3D), proj = Linear(D, D).
class SelfAttentionImpl : public torch::nn::Module {
 public:
  SelfAttentionImpl(int64_t dim, int64_t heads, AttentionMask mask);
  at::Tensor forward(const at::Tensor& x);  // (B, N, D) → (B, N, D)

  torch::nn::Linear qkv{nullptr};
  torch::nn::Linear proj{nullptr};

 private:
  int64_t heads_;
  AttentionMask mask_;
};
TORCH_MODULE(SelfAttention);

// fc1 = Linear(D, hidden), GELU (exact erf form), fc2 = Linear(hidden, D).
class MlpImpl : public torch::nn::Module {
 public:
  MlpImpl(int64_t dim, int64_t hidden);
  at::Tensor forward(const at::Tensor& x);

  torch::nn::Linear fc1{nullptr};
  torch::nn::Linear fc2{nullptr};
};
TORCH_MODULE(Mlp);

// Pre-norm block: x + attn(norm1(x)), then + mlp(norm2(x)). LayerNorm eps 1e-6 (timm's ViT) or 1e-5 (GPT).
class TransformerBlockImpl : public torch::nn::Module {
 public:
  TransformerBlockImpl(int64_t dim, int64_t heads, int64_t mlp_hidden, AttentionMask mask, double norm_eps);
  at::Tensor forward(const at::Tensor& x);  // (B, N, D) → (B, N, D)

  torch::nn::LayerNorm norm1{nullptr};
  SelfAttention attn{nullptr};
  torch::nn::LayerNorm norm2{nullptr};
  Mlp mlp{nullptr};
};
TORCH_MODULE(TransformerBlock);

// A module that is not registered in the model but lists tensors the model owns directly (cls_token,
// pos_embed), so that a Unit (which groups modules) can hold them. The tensors are shared, not copied: moving the
// model (set_data) moves them too.
class ParameterHolderImpl : public torch::nn::Module {
 public:
  void hold(const std::string& name, const at::Tensor& tensor) { register_parameter(name, tensor); }
};
TORCH_MODULE(ParameterHolder);

// Fills t in place from N(0, std²) truncated to [-2 std, 2 std] (inverse-CDF sampling; global torch RNG).
void trunc_normal_init(at::Tensor t, double std);

// The transformer initialization of timm's ViT and nanoGPT: every Linear weight (and Embedding weight)
// trunc-normal std 0.02, every Linear bias 0, every LayerNorm weight 1 / bias 0. Convolutions are left alone.
void transformer_init(torch::nn::Module& model);

}  // namespace triaccel
