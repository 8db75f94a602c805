// A character-level GPT (nanoGPT's shakespeare_char shape): token + position embedding, n_layer pre-norm causal
// blocks (n_head heads, width n_embd, GELU MLP of 4 · n_embd), final LayerNorm, and an untied linear LM head
// without bias. Input (B, T) int64 tokens with T <= block_size → logits (B, T, V).
// Names: tok_embed.weight, pos_embed (1, block_size, n_embd), blocks.i.{norm1, attn.qkv, attn.proj, norm2,
// mlp.fc1, mlp.fc2}, norm, head.weight. Defaults (6 layers, 6 heads, 384 wide, block 256, V = 65) give
// 10,795,776 parameters (tests/test_models.cpp spells out the sum).
// Units: "embed" (token + position embedding), "blocks.0" ... "blocks.{n-1}", "head" (final norm + LM head); the
// head is untied so that every parameter belongs to exactly one unit. Causality: attention runs with
// is_causal = true, so logits at position t depend only on tokens 0..t. Initialization: trunc-normal std 0.02 for
// embeddings and Linear weights, zero biases, LayerNorm 1 / 0.
#include "triaccel/models/linear.h"
#include "triaccel/models/model.h"
#include "triaccel/models/transformer.h"

#include "triaccel/core/errors.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>

namespace triaccel {

namespace {

constexpr double kNormEps = 1e-5;

class GptChar final : public Model {
 public:
  explicit GptChar(const ModelOptions& options) : Model("gpt-char") {
    const int64_t vocab = options.num_classes;
    const int64_t dim = options.gpt_embed;
    const int64_t block_size = options.block_size;

    auto pos_embed = register_parameter("pos_embed", at::zeros({1, block_size, dim}));
    auto tok_embed = register_module("tok_embed", torch::nn::Embedding(vocab, dim));
    auto blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < options.gpt_layers; ++i) {
      blocks->push_back(TransformerBlock(dim, options.gpt_heads, 4 * dim, AttentionMask::kCausal, kNormEps));
    }
    auto norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim}).eps(kNormEps)));
    auto head = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(dim, vocab).bias(false)));

    transformer_init(*this);
    trunc_normal_init(pos_embed, 0.02);

    auto embed_params = std::make_shared<ParameterHolderImpl>();
    embed_params->hold("pos_embed", pos_embed);
    unit_add("embed", {tok_embed, embed_params},
             [tok_embed, pos_embed, block_size](const at::Tensor& tokens) {
               TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == at::kLong && tokens.size(1) <= block_size,
                           "gpt-char expects int64 tokens (B, T) with T <= ", block_size, ", got ", tokens.toString(),
                           " ", tokens.sizes());
               const int64_t t = tokens.size(1);
               return tok_embed->forward(tokens) + pos_embed.narrow(1, 0, t);  // (B, T, D)
             });
    for (int64_t i = 0; i < options.gpt_layers; ++i) {
      auto block = blocks->ptr<TransformerBlockImpl>(i);
      unit_add("blocks." + std::to_string(i), {block}, [block](const at::Tensor& x) { return block->forward(x); });
    }
    unit_add("head", {norm, head},
             [norm, head](const at::Tensor& x) { return linear_forward(*head, norm->forward(x)); });  // (B, T, V)
  }
};

}  // namespace

std::shared_ptr<Model> gpt_char_create(const ModelOptions& options) {
  return std::make_shared<GptChar>(options);
}

}  // namespace triaccel
