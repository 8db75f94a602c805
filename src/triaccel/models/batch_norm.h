// BatchNorm2d (+ optional ReLU) for the models: one call that runs our fused CUDA kernel (kernels/batch_norm.cu)
// where it applies and the module's own forward everywhere else. Both paths do what BatchNorm2d::forward does to
// the module's state (running stats updated, num_batches_tracked incremented), so state dicts stay identical.
//
// The kernel path is first-order only: its backward is not differentiable, and a backward with create_graph = true
// through it throws (the curvature probe runs in fp32 with autocast off and always takes the module path).
#pragma once

#include <ATen/Tensor.h>
#include <torch/nn/modules/batchnorm.h>

#include <functional>
#include <memory>

namespace triaccel {

// Process-wide switch for A/B runs (default on). Off: every call takes the module path.
void batch_norm_kernel_set_enabled(bool enabled);
// The switch, and no BatchNormKernelOff alive on the calling thread.
bool batch_norm_kernel_enabled();

// The kernel off on the calling thread while this lives, whatever the switch (the curvature probe: the kernel has no
// second derivative). Per thread, so that data-parallel ranks run as threads of one process (the tests) do not undo
// each other's setting; the forward, which picks the path, runs on the thread that holds it. Nests.
class BatchNormKernelOff {
 public:
  BatchNormKernelOff();
  ~BatchNormKernelOff();
  BatchNormKernelOff(const BatchNormKernelOff&) = delete;
  BatchNormKernelOff& operator=(const BatchNormKernelOff&) = delete;
};

// True when batch_norm_forward(bn, x, ·) runs the kernel: the kernel is compiled in and enabled; bn is training,
// tracks running stats, is affine, has a fixed momentum; its weight, bias, running_mean and running_var are
// float32 on x's device; x is a 4-D CUDA bfloat16 or float16 channels_last-contiguous tensor with C = num_features and
// N·H·W ≥ 2. (The module path handles everything else, including its own errors for bad shapes.)
bool batch_norm_kernel_applies(const torch::nn::BatchNorm2dImpl& bn, const at::Tensor& x);

// The kernel for a BatchNorm2d given as its tensors (the Python module's units, python/src/module.cpp): the
// kernel path of batch_norm_forward, or an undefined tensor where the kernel does not apply (the same conditions on
// x and the tensors, and no BatchNormSyncScope alive), the caller then running its own BatchNorm. The caller has
// checked that its module trains, is affine and tracks running statistics with a fixed momentum, and increments
// num_batches_tracked itself.
at::Tensor batch_norm_kernel_try(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                 const at::Tensor& running_mean, const at::Tensor& running_var, double momentum,
                                 double eps, bool relu);

// bn(x), then ReLU when relu is true. (N, C, H, W) → (N, C, H, W), same dtype and memory format as x.
at::Tensor batch_norm_forward(torch::nn::BatchNorm2dImpl& bn, const at::Tensor& x, bool relu);
inline at::Tensor batch_norm_forward(const torch::nn::BatchNorm2d& bn, const at::Tensor& x, bool relu) {
  return batch_norm_forward(*bn.ptr(), x, relu);
}

// max(bn(x) + residual, 0): a residual block's end. On the kernel path (batch_norm_kernel_applies, the block-end
// fusion enabled, residual of x's shape, dtype and device and channels_last-contiguous, no BatchNormSyncScope) one
// pass (kernels/batch_norm.h, batch_norm_add_relu_forward_cuda) whose backward reads the output for the mask; else
// torch::relu(batch_norm_forward(bn, x, false) + residual). Both paths update the module's state alike.
at::Tensor batch_norm_add_relu(torch::nn::BatchNorm2dImpl& bn, const at::Tensor& x, const at::Tensor& residual);
inline at::Tensor batch_norm_add_relu(const torch::nn::BatchNorm2d& bn, const at::Tensor& x,
                                      const at::Tensor& residual) {
  return batch_norm_add_relu(*bn.ptr(), x, residual);
}

// Process-wide switch of the block-end fusion alone (default on, off when the environment sets TRIACCEL_BN_TAIL=off;
// A/B runs: bench_train_throughput --bn-tail off).
// Off, batch_norm_add_relu takes the three-pass composition (the BatchNorm kernel still runs where it applies).
void batch_norm_add_relu_set_fused(bool fused);
bool batch_norm_add_relu_fused();

// Synchronized BatchNorm (data parallelism's --sync-bn): while a BatchNormSyncScope lives on a thread, every
// training-mode batch_norm_forward there normalizes with the statistics of the whole global batch. In forward each
// channel's sum and sum of squares (and the sample count) are summed over the ranks; in backward the two per-channel
// sums of the incoming gradient, which already is the global loss's (the data-parallel step weights each rank's loss
// by its share of the batch), so the input gradients are the global loss's too. The running statistics take the
// global mean and unbiased variance, identical on every rank. The fused kernel is not used; first-order only.
struct BatchNormSync {
  std::function<void(at::Tensor&)> sum;  // sums a tensor over the ranks, in place
};

class BatchNormSyncScope {
 public:
  explicit BatchNormSyncScope(BatchNormSync sync);
  ~BatchNormSyncScope();
  BatchNormSyncScope(const BatchNormSyncScope&) = delete;
  BatchNormSyncScope& operator=(const BatchNormSyncScope&) = delete;

 private:
  std::shared_ptr<const BatchNormSync> sync_;
  std::shared_ptr<const BatchNormSync> previous_;
};

}  // namespace triaccel
