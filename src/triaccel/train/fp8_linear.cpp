#include "triaccel/train/fp8_linear.h"

#include "triaccel/core/errors.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/autograd.h>

#include <cstdint>
#include <map>
#include <vector>

namespace triaccel {
namespace {

constexpr int64_t kScaledMmMultiple = kFp8ScaledMmMultiple;

// a (M, K) fp8 row-major times bᵀ, where b_rows (N, K) is fp8 row-major: (M, N) in `dtype`, plus bias (N) when
// defined. _scaled_mm takes its second operand column-major, which b_rows viewed transposed is. fast: Hopper's
// faster FP8 accumulation (the forward product; the gradients' products accumulate in full precision).
at::Tensor fp8_matmul_nt(const at::Tensor& a, const at::Tensor& a_inverse, const at::Tensor& b_rows,
                         const at::Tensor& b_inverse, at::ScalarType dtype, const at::Tensor& bias = at::Tensor(),
                         bool fast = false) {
  // _scaled_mm adds a bias of the output's 16-bit dtype in its epilogue; another is added after it.
  const bool fused_bias = bias.defined() && (dtype == at::kBFloat16 || dtype == at::kHalf);
  at::Tensor y = at::_scaled_mm(a.contiguous(), b_rows.contiguous().t(), a_inverse, b_inverse,
                                fused_bias ? std::optional<at::Tensor>(bias.to(dtype)) : std::nullopt, std::nullopt,
                                dtype, fast);
  if (bias.defined() && !fused_bias) y = y + bias.to(dtype);
  return y;
}

class Fp8LinearFunction : public torch::autograd::Function<Fp8LinearFunction> {
 public:
  // x2 (M, K), weight (N, K), bias (N) or empty → (M, N) in out_dtype.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x2, const at::Tensor& weight,
                            const at::Tensor& bias, int64_t state_address, at::ScalarType out_dtype) {
    auto& state = *reinterpret_cast<Fp8LinearState*>(state_address);
    const bool has_bias = bias.numel() > 0;  // empty: none (fp8_linear)
    const Fp8ScaledTensor xq = state.input.quantize_transposed(x2);      // (M, K) e4m3, and (K, M)
    const Fp8ScaledTensor wq = state.weight.quantize_transposed(weight);  // (N, K) e4m3, and (K, N)
    at::Tensor y = fp8_matmul_nt(xq.data, xq.inverse, wq.data, wq.inverse, out_dtype,
                                 has_bias ? bias : at::Tensor(), /*fast=*/true);
    // Backward's operands: the transposes (the FP8 product takes row-major operands only).
    ctx->save_for_backward({xq.data_t, wq.data_t, xq.inverse, wq.inverse});
    ctx->saved_data["state"] = state_address;
    ctx->saved_data["x_dtype"] = x2.scalar_type();
    ctx->saved_data["w_dtype"] = weight.scalar_type();
    ctx->saved_data["bias"] = has_bias;
    ctx->saved_data["bias_dtype"] = bias.scalar_type();
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto& state = *reinterpret_cast<Fp8LinearState*>(ctx->saved_data["state"].toInt());
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &xq_t = saved[0], &wq_t = saved[1], &x_inverse = saved[2], &w_inverse = saved[3];
    const at::Tensor g = grads[0].contiguous();  // (M, N)
    const Fp8ScaledTensor gq = state.grad.quantize_transposed(g);  // (M, N) e5m2, and (N, M)
    // dx = g·W: (M, N) times the (K, N) rows of Wᵀ.
    const at::Tensor dx =
        fp8_matmul_nt(gq.data, gq.inverse, wq_t, w_inverse, ctx->saved_data["x_dtype"].toScalarType());
    // dW = gᵀ·x: (N, M) rows of gᵀ times the (K, M) rows of xᵀ.
    const at::Tensor dw = fp8_matmul_nt(gq.data_t, gq.inverse, xq_t, x_inverse, at::kFloat)
                              .to(ctx->saved_data["w_dtype"].toScalarType());
    at::Tensor db;
    if (ctx->saved_data["bias"].toBool()) {
      db = g.sum(0, /*keepdim=*/false, at::kFloat).to(ctx->saved_data["bias_dtype"].toScalarType());
    }
    return {dx, dw, db, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

Fp8LinearState::Fp8LinearState(const Fp8ScaleOptions& options, const c10::Device& device)
    : input(Fp8Format::kE4M3, options, device),
      weight(Fp8Format::kE4M3, options, device),
      grad(Fp8Format::kE5M2, options, device) {}

bool fp8_linear_applies(const at::Tensor& x, const at::Tensor& weight) {
  if (!fp8_quantizable(x.scalar_type()) || weight.dim() != 2 || x.dim() < 1 ||
      x.size(-1) != weight.size(1) || x.device() != weight.device() || !weight.is_floating_point()) {
    return false;
  }
  if (!x.is_cuda()) return true;
  const int64_t rows = x.numel() / x.size(-1);
  return rows % kScaledMmMultiple == 0 && weight.size(0) % kScaledMmMultiple == 0 &&
         weight.size(1) % kScaledMmMultiple == 0;
}

at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, Fp8LinearState& state,
                      std::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK(fp8_linear_applies(x, weight), "fp8_linear: x ", x.sizes(), " (", x.scalar_type(), ", ", x.device(),
              ") and weight ", weight.sizes(), " (", weight.device(), ") are not an FP8 linear layer's "
              "(fp8_linear_applies)");
  TORCH_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == weight.size(0)), "fp8_linear: bias ",
              bias.sizes(), " for weight ", weight.sizes());
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = weight.size(0);
  const at::Tensor x2 = x.reshape({-1, x.size(-1)});
  const auto address = reinterpret_cast<int64_t>(&state);
  // No bias: an empty tensor in its place (a custom Function takes no undefined tensor input).
  const at::Tensor b = bias.defined() ? bias : at::empty({0}, weight.options());
  return Fp8LinearFunction::apply(x2, weight, b, address, out_dtype.value_or(x.scalar_type())).view(out_shape);
}

at::Tensor Fp8Linears::forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  const c10::DeviceType type = x.device().type();
  const bool autocast = at::autocast::is_autocast_enabled(type) && x.is_floating_point();
  if (!fp8_linear_applies(x, weight)) return at::Tensor();
  Fp8LinearState& state = state_for(weight.unsafeGetTensorImpl(), x.device());
  // The quantization reads x in its own dtype (a float32 LayerNorm output is not cast first); the output has
  // autocast's dtype, and x's gradient x's dtype.
  return fp8_linear(x, weight, bias, state,
                    autocast ? std::optional<at::ScalarType>(at::autocast::get_autocast_dtype(type)) : std::nullopt);
}

const Fp8LinearState* Fp8Linears::state_of(const at::Tensor& weight) const {
  const auto it = states_.find(weight.unsafeGetTensorImpl());
  return it == states_.end() ? nullptr : it->second.get();
}

Fp8LinearState& Fp8Linears::state_for(Key weight, const c10::Device& device) {
  auto& state = states_[weight];
  if (!state) state = std::make_unique<Fp8LinearState>(options_, device);
  return *state;
}

namespace {

// A layer's three scales by their part names.
std::vector<std::pair<const char*, const Fp8DeviceScale*>> fp8_parts(const Fp8LinearState& s) {
  return {{"input", &s.input}, {"weight", &s.weight}, {"grad", &s.grad}};
}

}  // namespace

void Fp8Linears::layers_name(torch::nn::Module& model) {
  names_.clear();
  const std::string suffix = ".weight";
  for (const auto& item : model.named_parameters()) {
    const std::string& key = item.key();
    const at::Tensor& w = item.value();
    if (w.dim() != 2 || key.size() <= suffix.size() || key.compare(key.size() - suffix.size(), suffix.size(), suffix)) {
      continue;
    }
    names_.emplace_back(w, key.substr(0, key.size() - suffix.size()));
  }
}

NamedTensors Fp8Linears::state() const {
  NamedTensors out;
  for (const auto& [weight, name] : names_) {
    const auto it = states_.find(weight.unsafeGetTensorImpl());
    if (it == states_.end()) continue;
    for (const auto& [part, scale] : fp8_parts(*it->second)) {
      for (const auto& [key, t] : scale->tensors()) out.emplace_back(str_cat("fp8.", name, ".", part, ".", key), t);
    }
  }
  return out;
}

void Fp8Linears::restore(const NamedTensors& stored, const std::string& path) {
  // Each entry by its layer: the name state() gave, less "fp8." and its last two parts (<part>.<key>).
  std::map<std::string, NamedTensors> by_layer;
  for (const auto& entry : stored) {
    const std::string& key = entry.first;
    const size_t part = key.rfind('.', key.rfind('.') - 1);
    TRIACCEL_CHECK_INPUT(key.rfind("fp8.", 0) == 0 && part != std::string::npos && part > 4, "checkpoint ", path,
                         " holds an fp8 scale named '", key, "', not fp8.<layer>.<part>.<tensor>");
    by_layer[key.substr(4, part - 4)].push_back(entry);
  }
  size_t matched = 0;
  for (const auto& [weight, name] : names_) {
    const auto it = by_layer.find(name);
    if (it == by_layer.end()) continue;
    NamedTensors live;
    for (const auto& [part, scale] : fp8_parts(state_for(weight.unsafeGetTensorImpl(), weight.device()))) {
      for (const auto& [key, t] : scale->tensors()) live.emplace_back(str_cat("fp8.", name, ".", part, ".", key), t);
    }
    named_tensors_load(live, it->second, "fp8 scales", path);
    matched += it->second.size();
  }
  TRIACCEL_CHECK_INPUT(matched == stored.size(), "checkpoint ", path, " holds fp8 scales of ", stored.size() - matched,
                       " tensors no linear layer of this model has (another model's checkpoint); resume from this "
                       "model's own run");
}

}  // namespace triaccel
