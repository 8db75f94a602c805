// The dispatch between the fused BatchNorm kernel and BatchNorm2d::forward, and the autograd Functions around the
// kernels (models/batch_norm.h). BatchNormFunction saves x, weight and the (4, C) batch statistics; the backward
// recomputes the ReLU mask from them, so the output y is not kept. BatchNormAddReluFunction (a block's end) keeps
// y instead of the residual: the mask needs both, and y is the next layer's input, kept anyway.
#include "triaccel/models/batch_norm.h"

#ifdef TRIACCEL_WITH_CUDA
#include "triaccel/kernels/batch_norm.h"
#endif

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <atomic>
#include <cstdlib>
#include <string>

namespace triaccel {

namespace {

std::atomic<bool> g_kernel_enabled{true};
// TRIACCEL_BN_TAIL=off: the block-end fusion off from the start (A/B runs of the CLI, docs/measuring.md).
bool add_relu_fused_default() {
  const char* v = std::getenv("TRIACCEL_BN_TAIL");
  return v == nullptr || std::string(v) != "off";
}
std::atomic<bool> g_add_relu_fused{add_relu_fused_default()};
thread_local int t_kernel_off = 0;  // BatchNormKernelOff scopes alive on this thread

thread_local std::shared_ptr<const BatchNormSync> t_sync;

// Synchronized BatchNorm in float32 (models/batch_norm.h). Inputs: x (N, C, H, W), weight, bias (C); the reducer by
// address (it lives in its scope, which outlives the step). Saves x, the global mean and inverse std, the global count.
class SyncBatchNormFunction : public torch::autograd::Function<SyncBatchNormFunction> {
 public:
  static std::vector<at::Tensor> forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                         const at::Tensor& weight, const at::Tensor& bias, int64_t sync_address,
                                         double eps) {
    const auto* sync = reinterpret_cast<const BatchNormSync*>(sync_address);
    const at::Tensor xf = x.to(at::kFloat);
    const int64_t c = x.size(1);
    const double local = static_cast<double>(x.numel() / c);
    at::Tensor sums = at::cat({xf.sum({0, 2, 3}), xf.square().sum({0, 2, 3}), at::full({1}, local, xf.options())});
    sync->sum(sums);
    const at::Tensor count = sums.narrow(0, 2 * c, 1);
    const at::Tensor mean = sums.narrow(0, 0, c) / count;
    const at::Tensor var = (sums.narrow(0, c, c) / count - mean.square()).clamp_min(0);
    const at::Tensor invstd = (var + eps).rsqrt();
    const at::Tensor xhat = (xf - mean.view({1, c, 1, 1})) * invstd.view({1, c, 1, 1});
    const at::Tensor y = xhat * weight.view({1, c, 1, 1}) + bias.view({1, c, 1, 1});
    ctx->mark_non_differentiable({mean, var, count});
    ctx->save_for_backward({x, weight, mean, invstd, count});
    ctx->saved_data["sync"] = sync_address;
    return {y.to(x.scalar_type()), mean, var, count};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const int64_t c = x.size(1);
    const at::Tensor mean = saved[2].view({1, c, 1, 1});
    const at::Tensor invstd = saved[3].view({1, c, 1, 1});
    const auto* sync = reinterpret_cast<const BatchNormSync*>(ctx->saved_data["sync"].toInt());
    const at::Tensor dy = grad_outputs[0].to(at::kFloat);
    const at::Tensor xhat = (x.to(at::kFloat) - mean) * invstd;
    const at::Tensor dbias = dy.sum({0, 2, 3});
    const at::Tensor dweight = (dy * xhat).sum({0, 2, 3});
    // dy is the global loss's gradient of this rank's y (the data-parallel step weights each rank's loss by its share
    // of the global batch): the sums of dy and dy·xhat over every rank are the global ones.
    at::Tensor sums = at::cat({dbias, dweight});
    sync->sum(sums);
    const at::Tensor& count = saved[4];  // the global batch's count per channel
    const at::Tensor mean_dy = (sums.narrow(0, 0, c) / count).view({1, c, 1, 1});
    const at::Tensor mean_dy_xhat = (sums.narrow(0, c, c) / count).view({1, c, 1, 1});
    const at::Tensor dx = (dy - mean_dy - xhat * mean_dy_xhat) * invstd * saved[1].view({1, c, 1, 1});
    return {dx.to(x.scalar_type()), dweight, dbias, at::Tensor(), at::Tensor()};
  }
};

at::Tensor sync_batch_norm(torch::nn::BatchNorm2dImpl& bn, const at::Tensor& x,
                           const BatchNormSync& sync) {
  const auto& o = bn.options;
  TORCH_CHECK(o.affine() && o.track_running_stats(), "synchronized BatchNorm needs an affine BatchNorm that tracks "
              "running statistics");
  const auto out = SyncBatchNormFunction::apply(x, bn.weight, bn.bias, reinterpret_cast<int64_t>(&sync), o.eps());
  const at::NoGradGuard no_grad;
  bn.num_batches_tracked.add_(1);
  const double m = o.momentum().has_value() ? *o.momentum() : 1.0 / bn.num_batches_tracked.item<double>();
  const at::Tensor n = out[3];
  bn.running_mean.mul_(1 - m).add_(out[1] * m);
  bn.running_var.mul_(1 - m).add_(out[2] * (n / (n - 1).clamp_min(1)) * m);
  return out[0];
}

#ifdef TRIACCEL_WITH_CUDA
// The kernels' backward is not differentiable: a backward with create_graph = true through them is refused.
void first_order_only() {
  TORCH_CHECK(!at::GradMode::is_enabled(),
              "the fused BatchNorm kernel is not twice differentiable (backward with create_graph=true); switch "
              "it off with batch_norm_kernel_set_enabled(false) or run this part in fp32");
}

// As BatchNorm2d::forward in training, on the kernel paths.
void batches_count(torch::nn::BatchNorm2dImpl& bn) {
  if (!bn.num_batches_tracked.defined()) return;
  at::NoGradGuard no_grad;
  bn.num_batches_tracked.add_(1);
}

// Inputs: x (N, C, H, W) bf16 or fp16 channels_last, weight, bias, running_mean, running_var (C) float32; the running
// stats are updated in place. Output: y (N, C, H, W) channels_last in x's dtype.
class BatchNormFunction : public torch::autograd::Function<BatchNormFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias, const at::Tensor& running_mean, const at::Tensor& running_var,
                            double momentum, double eps, bool relu) {
    auto [y, stats] = batch_norm_forward_cuda(x, weight, bias, running_mean, running_var, momentum, eps, relu);
    ctx->save_for_backward({x, weight, stats});
    ctx->saved_data["relu"] = relu;
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    first_order_only();
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& dy = grad_outputs[0];
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& stats = saved[2];
    auto [dx, dweight, dbias] =
        batch_norm_backward_cuda(dy.to(x.scalar_type()), x, weight, stats, ctx->saved_data["relu"].toBool());
    // One entry per forward argument: x, weight, bias, running_mean, running_var, momentum, eps, relu.
    return {dx, dweight, dbias, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// max(bn(x) + residual, 0) in one pass. Inputs as BatchNormFunction (no relu flag) plus the residual (x's shape,
// dtype, channels_last). Saves x, weight, the statistics and the output y (the mask; the residual is not kept).
class BatchNormAddReluFunction : public torch::autograd::Function<BatchNormAddReluFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& residual,
                            const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& running_mean,
                            const at::Tensor& running_var, double momentum, double eps) {
    auto [y, stats] =
        batch_norm_add_relu_forward_cuda(x, residual, weight, bias, running_mean, running_var, momentum, eps);
    ctx->save_for_backward({x, weight, stats, y});
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    first_order_only();
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    auto [dx, dweight, dbias, dresidual] =
        batch_norm_add_relu_backward_cuda(grad_outputs[0].to(x.scalar_type()), x, saved[3], saved[1], saved[2]);
    // One entry per forward argument: x, residual, weight, bias, running_mean, running_var, momentum, eps.
    return {dx, dresidual, dweight, dbias, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
#endif

bool on_device_float(const at::Tensor& t, const at::Tensor& x) {
  return t.defined() && t.device() == x.device() && t.scalar_type() == at::kFloat;
}

// The kernel's conditions on x and the module's tensors (models/batch_norm.h).
bool kernel_applies_to(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                       const at::Tensor& running_mean, const at::Tensor& running_var) {
#ifdef TRIACCEL_WITH_CUDA
  const bool sixteen_bit = x.defined() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf);
  if (!batch_norm_kernel_enabled() || !sixteen_bit || !x.is_cuda() || x.dim() != 4 || !weight.defined() ||
      x.size(1) != weight.numel() || x.size(0) * x.size(2) * x.size(3) < 2 ||
      !x.is_contiguous(at::MemoryFormat::ChannelsLast)) {
    return false;
  }
  return on_device_float(weight, x) && on_device_float(bias, x) && on_device_float(running_mean, x) &&
         on_device_float(running_var, x) && weight.is_contiguous() && bias.is_contiguous() &&
         running_mean.is_contiguous() && running_var.is_contiguous();
#else
  return false;
#endif
}

}  // namespace

void batch_norm_kernel_set_enabled(bool enabled) { g_kernel_enabled.store(enabled); }

void batch_norm_add_relu_set_fused(bool fused) { g_add_relu_fused.store(fused); }

bool batch_norm_add_relu_fused() { return g_add_relu_fused.load(); }

bool batch_norm_kernel_enabled() { return g_kernel_enabled.load() && t_kernel_off == 0; }

BatchNormKernelOff::BatchNormKernelOff() { ++t_kernel_off; }

BatchNormKernelOff::~BatchNormKernelOff() { --t_kernel_off; }

bool batch_norm_kernel_applies(const torch::nn::BatchNorm2dImpl& bn, const at::Tensor& x) {
  const auto& options = bn.options;
  return bn.is_training() && options.track_running_stats() && options.affine() && options.momentum().has_value() &&
         x.defined() && x.dim() == 4 && x.size(1) == options.num_features() &&
         kernel_applies_to(x, bn.weight, bn.bias, bn.running_mean, bn.running_var);
}

at::Tensor batch_norm_kernel_try(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                 const at::Tensor& running_mean, const at::Tensor& running_var, double momentum,
                                 double eps, bool relu) {
#ifdef TRIACCEL_WITH_CUDA
  if (!t_sync && kernel_applies_to(x, weight, bias, running_mean, running_var)) {
    return BatchNormFunction::apply(x, weight, bias, running_mean, running_var, momentum, eps, relu);
  }
#endif
  return at::Tensor();
}

BatchNormSyncScope::BatchNormSyncScope(BatchNormSync sync)
    : sync_(std::make_shared<const BatchNormSync>(std::move(sync))), previous_(t_sync) {
  t_sync = sync_;
}

BatchNormSyncScope::~BatchNormSyncScope() { t_sync = previous_; }

at::Tensor batch_norm_forward(torch::nn::BatchNorm2dImpl& bn, const at::Tensor& x, bool relu) {
  if (t_sync && bn.is_training()) {
    at::Tensor y = sync_batch_norm(bn, x, *t_sync);
    return relu ? torch::relu(y) : y;
  }
#ifdef TRIACCEL_WITH_CUDA
  if (batch_norm_kernel_applies(bn, x)) {
    batches_count(bn);
    return BatchNormFunction::apply(x, bn.weight, bn.bias, bn.running_mean, bn.running_var,
                                    *bn.options.momentum(), bn.options.eps(), relu);
  }
#endif
  at::Tensor y = bn.forward(x);
  return relu ? torch::relu(y) : y;
}

at::Tensor batch_norm_add_relu(torch::nn::BatchNorm2dImpl& bn, const at::Tensor& x, const at::Tensor& residual) {
#ifdef TRIACCEL_WITH_CUDA
  const bool residual_fits = residual.defined() && residual.sizes() == x.sizes() &&
                             residual.scalar_type() == x.scalar_type() && residual.device() == x.device() &&
                             residual.is_contiguous(at::MemoryFormat::ChannelsLast);
  if (!t_sync && batch_norm_add_relu_fused() && residual_fits && batch_norm_kernel_applies(bn, x)) {
    batches_count(bn);
    return BatchNormAddReluFunction::apply(x, residual, bn.weight, bn.bias, bn.running_mean, bn.running_var,
                                           *bn.options.momentum(), bn.options.eps());
  }
#endif
  return torch::relu(batch_norm_forward(bn, x, /*relu=*/false) + residual);
}

}  // namespace triaccel
