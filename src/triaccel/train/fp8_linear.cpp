#include "triaccel/train/fp8_linear.h"

#include "triaccel/core/errors.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/autograd.h>

#include <cstdint>
#include <vector>

namespace triaccel {
namespace {

constexpr int64_t kScaledMmMultiple = 16;  // CUDA's _scaled_mm: every dimension of both operands

// q quantized under `scale`, with |x|'s amax recorded after it (delayed scaling).
at::Tensor fp8_quantize_recorded(const at::Tensor& x, Fp8DeviceScale& scale) {
  const at::Tensor q = fp8_quantize_scaled(x, scale.scale(), scale.format());
  scale.update(x.numel() == 0 ? at::zeros({}, x.options().dtype(at::kFloat)) : at::amax(at::abs(x)));
  return q;
}

// a (M, K) fp8 row-major times bᵀ, where b_rows (N, K) is fp8 row-major: (M, N) in `dtype`. _scaled_mm takes its
// second operand column-major, which b_rows viewed transposed is.
at::Tensor fp8_matmul_nt(const at::Tensor& a, const at::Tensor& a_inverse, const at::Tensor& b_rows,
                         const at::Tensor& b_inverse, at::ScalarType dtype) {
  return at::_scaled_mm(a.contiguous(), b_rows.contiguous().t(), a_inverse, b_inverse, std::nullopt, std::nullopt,
                        dtype);
}

class Fp8LinearFunction : public torch::autograd::Function<Fp8LinearFunction> {
 public:
  // x2 (M, K), weight (N, K), bias (N) or undefined → (M, N) in x2's dtype.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x2, const at::Tensor& weight,
                            const at::Tensor& bias, int64_t state_address) {
    auto& state = *reinterpret_cast<Fp8LinearState*>(state_address);
    const at::Tensor x_inverse = state.input.inverse();  // before the updates: the scales these bytes were made with
    const at::Tensor w_inverse = state.weight.inverse();
    const at::Tensor xq = fp8_quantize_recorded(x2, state.input);      // (M, K) e4m3
    const at::Tensor wq = fp8_quantize_recorded(weight, state.weight);  // (N, K) e4m3
    at::Tensor y = fp8_matmul_nt(xq, x_inverse, wq, w_inverse, x2.scalar_type());
    if (bias.defined()) y = y + bias.to(y.scalar_type());
    ctx->save_for_backward({xq, wq, x_inverse, w_inverse});
    ctx->saved_data["state"] = state_address;
    ctx->saved_data["x_dtype"] = x2.scalar_type();
    ctx->saved_data["w_dtype"] = weight.scalar_type();
    ctx->saved_data["bias"] = bias.defined();
    ctx->saved_data["bias_dtype"] = bias.defined() ? bias.scalar_type() : at::kFloat;
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto& state = *reinterpret_cast<Fp8LinearState*>(ctx->saved_data["state"].toInt());
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &xq = saved[0], &wq = saved[1], &x_inverse = saved[2], &w_inverse = saved[3];
    const at::Tensor g = grads[0].contiguous();  // (M, N)
    const at::Tensor g_inverse = state.grad.inverse();
    const at::Tensor gq = fp8_quantize_recorded(g, state.grad);  // (M, N) e5m2
    // dx = g·W: W's rows are its columns here, so the transposed copy (K, N) is the row-major second operand.
    const at::Tensor dx = fp8_matmul_nt(gq, g_inverse, wq.t(), w_inverse, ctx->saved_data["x_dtype"].toScalarType());
    // dW = gᵀ·x: (N, M) times the (K, M) rows of xᵀ.
    const at::Tensor dw = fp8_matmul_nt(gq.t(), g_inverse, xq.t(), x_inverse, at::kFloat)
                              .to(ctx->saved_data["w_dtype"].toScalarType());
    at::Tensor db;
    if (ctx->saved_data["bias"].toBool()) {
      db = g.to(at::kFloat).sum(0).to(ctx->saved_data["bias_dtype"].toScalarType());
    }
    return {dx, dw, db, at::Tensor()};
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

at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, Fp8LinearState& state) {
  TORCH_CHECK(fp8_linear_applies(x, weight), "fp8_linear: x ", x.sizes(), " (", x.scalar_type(), ", ", x.device(),
              ") and weight ", weight.sizes(), " (", weight.device(), ") are not an FP8 linear layer's "
              "(fp8_linear_applies)");
  TORCH_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == weight.size(0)), "fp8_linear: bias ",
              bias.sizes(), " for weight ", weight.sizes());
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = weight.size(0);
  const at::Tensor x2 = x.reshape({-1, x.size(-1)});
  const auto address = reinterpret_cast<int64_t>(&state);
  return Fp8LinearFunction::apply(x2, weight, bias, address).view(out_shape);
}

at::Tensor Fp8Linears::forward(torch::nn::LinearImpl& layer, const at::Tensor& x) {
  const c10::DeviceType type = x.device().type();
  const at::Tensor input = at::autocast::is_autocast_enabled(type) && x.is_floating_point()
                               ? x.to(at::autocast::get_autocast_dtype(type))
                               : x;
  if (!fp8_linear_applies(input, layer.weight)) return at::Tensor();
  auto& state = states_[&layer];
  if (!state) state = std::make_unique<Fp8LinearState>(options_, input.device());
  return fp8_linear(input, layer.weight, layer.bias, *state);
}

const Fp8LinearState* Fp8Linears::state_of(const torch::nn::LinearImpl& layer) const {
  const auto it = states_.find(&layer);
  return it == states_.end() ? nullptr : it->second.get();
}

}  // namespace triaccel
